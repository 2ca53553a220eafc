import subprocess
import sys

import pytest

from configurator import ConfigError, config_defaults, configure, update_config

DEFAULTS = dict(out_dir='out', learning_rate=6e-4, max_iters=100, compile=False, pos='rope',
                dape_width=32, betas=(0.9, 0.95), note=None, wandb_run_name='run')


def test_defaults_untouched():
    cfg = configure(DEFAULTS, [])
    assert cfg == DEFAULTS and cfg is not DEFAULTS


def test_key_value_overrides_and_types():
    cfg = configure(DEFAULTS, ['--pos=kerple', '--max_iters=7', '--learning_rate=1e-3',
                               '--compile=True', '--betas=(0.8, 0.9)', '--note=[1, 2]'])
    assert cfg['pos'] == 'kerple' and cfg['max_iters'] == 7 and cfg['learning_rate'] == 1e-3
    assert cfg['compile'] is True and cfg['betas'] == (0.8, 0.9) and cfg['note'] == [1, 2]


def test_int_accepted_for_float_and_str_takes_raw_text():
    cfg = configure(DEFAULTS, ['--learning_rate=1', '--wandb_run_name=123', "--out_dir='a b'"])
    assert cfg['learning_rate'] == 1.0 and isinstance(cfg['learning_rate'], float)
    assert cfg['wandb_run_name'] == '123' and cfg['out_dir'] == 'a b'


def test_text_that_literal_eval_cannot_take_is_raw_text_or_a_type_error():
    # not only ValueError/SyntaxError: an unhashable dict key is a TypeError, deep nesting a MemoryError
    for text in ('{[1]: 2}', '-' * 10000 + '1'):
        assert configure(DEFAULTS, [f'--wandb_run_name={text}'])['wandb_run_name'] == text
        with pytest.raises(ConfigError, match="'max_iters'.*must be int"):
            configure(DEFAULTS, [f'--max_iters={text}'])


def test_bool_spellings():
    assert configure(DEFAULTS, ['--compile'])['compile'] is True
    assert configure(DEFAULTS, ['--compile=true'])['compile'] is True
    assert configure(DEFAULTS, ['--compile=False'])['compile'] is False


@pytest.mark.parametrize('arg,words', [
    ('--max_iters=1.5', ["'max_iters'", 'int']),
    ('--max_iters=True', ["'max_iters'", 'int']),
    ('--compile=1', ["'compile'", 'bool']),
    ('--learning_rate=fast', ["'learning_rate'", 'float']),
    ('--dape_width=None', ["'dape_width'", 'int']),
    ('--max_iters', ["'--max_iters' needs a value", '--max_iters=VALUE']),  # `--max_iters 5`
])
def test_wrong_type_is_an_error_naming_the_key(arg, words):
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [arg])
    for w in words:
        assert w in str(e.value)


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'lerning_rate'.*'learning_rate'"):
        configure(DEFAULTS, ['--lerning_rate=1e-3'])
    with pytest.raises(ConfigError, match="unknown config key 'zzz'"):
        configure(DEFAULTS, ['--zzz=1'])


def test_config_file_applied_in_order_and_sees_defaults(tmp_path):
    f = tmp_path / 'c.py'
    f.write_text("import math\n_tmp = 3\npos = 'alibi'\nmax_iters = max_iters * 2\n"
                 "learning_rate = 1\n")
    cfg = configure(DEFAULTS, [str(f), '--max_iters=5'])
    assert cfg['pos'] == 'alibi' and cfg['max_iters'] == 5 and cfg['learning_rate'] == 1.0
    assert configure(DEFAULTS, [str(f)])['max_iters'] == 200


def test_config_file_may_import_builtin_functions(tmp_path):
    # `from math import sqrt` leaves a builtin function, not a types.FunctionType, behind: not a key either
    f = tmp_path / 'c.py'
    f.write_text("from math import sqrt\nimport os.path\nfrom functools import partial\n"
                 "learning_rate = sqrt(4) * 1e-3\n_half = partial(max, 0)\n")
    assert configure(DEFAULTS, [str(f)])['learning_rate'] == 2e-3


def test_config_file_errors(tmp_path):
    bad_key = tmp_path / 'bad_key.py'
    bad_key.write_text("max_iter = 5\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'max_iter'.*bad_key.py.*'max_iters'"):
        configure(DEFAULTS, [str(bad_key)])
    bad_type = tmp_path / 'bad_type.py'
    bad_type.write_text("compile = 'yes'\n")
    with pytest.raises(ConfigError, match="'compile'.*bool"):
        configure(DEFAULTS, [str(bad_type)])
    with pytest.raises(ConfigError, match="not found"):
        configure(DEFAULTS, [str(tmp_path / 'missing.py')])
    broken = tmp_path / 'broken.py'
    broken.write_text("x = = 1\n")
    with pytest.raises(ConfigError, match="broken.py"):
        configure(DEFAULTS, [str(broken)])


def test_update_config_and_config_defaults():
    g = {'a': 1, '_private': 2, 'os': sys, 'f': lambda: 0, 'b': 'x'}
    assert config_defaults(g) == {'a': 1, 'b': 'x'}
    assert update_config({'a': 1.0}, {'a': 2}) == {'a': 2.0}
    with pytest.raises(ConfigError, match="unknown config key 'c'"):
        update_config({'a': 1}, {'c': 2})


def test_cli_error_exits_with_one_line_and_help_lists_keys(tmp_path):
    script = tmp_path / 's.py'
    import configurator
    root = __import__('os').path.dirname(configurator.__file__)
    script.write_text(f"import sys\nsys.path.insert(0, {root!r})\nfrom configurator import configure\n"
                      "print(configure({'alpha': 1, 'beta': 'x'}))\n")
    r = subprocess.run([sys.executable, str(script), '--alpah=2'], capture_output=True, text=True)
    assert r.returncode == 2 and 'Traceback' not in r.stderr and "'alpha'" in r.stderr
    r = subprocess.run([sys.executable, str(script), '--help'], capture_output=True, text=True)
    assert r.returncode == 0 and '--alpha' in r.stdout and '--beta' in r.stdout
    r = subprocess.run([sys.executable, str(script), '--alpha=3'], capture_output=True, text=True)
    assert r.returncode == 0 and "'alpha': 3" in r.stdout
