"""
A small configurator in the spirit of nanoGPT's, shared by train.py, che_tasks.py, eval_extrapolate.py
and bench.py. A script keeps its defaults as module globals and asks for the final config:

    # ... defaults as module globals: out_dir = 'out', batch_size = 12, ...
    from configurator import configure, config_defaults
    config = configure(config_defaults(globals()))    # reads sys.argv[1:]
    globals().update(config)                           # optional, nanoGPT style

so that

    $ python train.py config/arxiv_128.py --pos=kerple --dape=v2 --dape_kernel=3

applies, in order: the defaults, then each config file, then each --key=value.

Rules
- A config file is a Python file (a bare argument, any number of them, applied in order). It is exec'd
  with the current config visible as variables, so `max_iters = 2 * warmup_iters` works. Every name it
  leaves behind that does not start with '_' (modules and callables excepted: functions, classes, and
  builtins such as `from math import sqrt`) must be a known key: a config file that sets an unknown key
  is an error, like a mistyped --key.
- --key=value: the value is parsed with ast.literal_eval, and kept as the raw string when that fails
  (`--pos=kerple` is the string 'kerple'). For a str default the raw text is always taken, so
  `--wandb_run_name=123` is '123'. `--flag` alone means `--flag=True`.
- Types are checked against the default: bool takes only True/False (also true/false); int takes int
  (not bool, not float); float takes float or int (converted); tuple/list take a tuple or list;
  a None default accepts any value (used for options that are "unset" until given).
- Errors raise ConfigError (a ValueError) naming the key; an unknown key suggests the closest known
  ones. When configure() reads the real command line (argv=None) an error prints one line and exits
  with status 2 instead of a traceback.
- `--help` (or -h) prints every key with its default and exits.
Programmatic use (tests): configure(defaults, ['--lr=1e-3']) or update_config(config, {'lr': 1e-3}).
"""
import ast
import difflib
import os
import sys
import types

# the value types a config key may have; other module globals (modules, functions, ...) are not keys
CONFIG_TYPES = (bool, int, float, str, tuple, list, type(None))


class ConfigError(ValueError):
    pass


def config_defaults(namespace):
    """The config keys of a script's globals(): public names whose value is a plain config type."""
    return {k: v for k, v in namespace.items()
            if not k.startswith('_') and isinstance(v, CONFIG_TYPES)}


def _unknown(key, known, source):
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else " (see --help for the keys)"
    return ConfigError(f"unknown config key '{key}' from {source}{hint}")


def _check_type(key, value, default, source):
    """Return value converted to the default's type, or raise ConfigError naming the key."""
    if default is None:
        return value
    want = type(default)
    takes = {float: (int, float), tuple: (tuple, list), list: (tuple, list)}.get(want, want)
    if isinstance(value, takes) and (want is bool or not isinstance(value, bool)):  # a bool is an int too
        return want(value) if want in (float, tuple, list) else value
    raise ConfigError(f"config key '{key}' from {source} must be {want.__name__} like its default "
                      f"{default!r}, got {type(value).__name__} {value!r}")


# what ast.literal_eval raises on text that is no literal: also TypeError ({[1]: 2}, an unhashable key) and
# MemoryError/RecursionError (text nested too deep)
NOT_A_LITERAL = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)


def _parse_value(text, default):
    if isinstance(default, bool) and text.lower() in ('true', 'false'):
        return text.lower() == 'true'
    try:
        value = ast.literal_eval(text)
    except NOT_A_LITERAL:
        return text
    # a str key takes the raw text, unless it is quoted
    return text if isinstance(default, str) and not isinstance(value, str) else value


def update_config(config, overrides, source='overrides'):
    """Check `overrides` (dict) against `config`'s keys and types; return a new merged dict."""
    out = dict(config)
    for k, v in overrides.items():
        if k not in config:
            raise _unknown(k, config, source)
        out[k] = _check_type(k, v, config[k], source)
    return out


def _apply_file(config, path):
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found (config files are Python files such as "
                          f"config/arxiv_128.py; options are given as --key=value)")
    with open(path) as f:
        code = f.read()
    namespace = dict(config)
    namespace['__file__'] = path
    try:
        exec(compile(code, path, 'exec'), namespace)
    except Exception as e:
        raise ConfigError(f"error while running config file '{path}': {type(e).__name__}: {e}") from e
    overrides = {}
    for k, v in namespace.items():
        if k.startswith('_') or isinstance(v, types.ModuleType) or callable(v):
            continue
        if k not in config:
            raise _unknown(k, config, f"config file '{path}'")
        if v is not config[k] and v != config[k]:
            overrides[k] = v
    return update_config(config, overrides, f"config file '{path}'")


def check_device(name):
    """A --device this machine has: 'cpu', 'cuda', 'cuda:N' or 'mps' ('auto' is always fine). Checked
    before any work: torch.load onto a missing GPU fails with a message that blames the file."""
    if name == 'auto':
        return
    import torch
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device={name} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type == 'cuda' and not torch.cuda.is_available():
        raise ConfigError(f"--device={name}: no CUDA device available (torch.cuda.is_available() is False); "
                          f"use --device=cpu")
    if dev.type == 'cuda' and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device={name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if dev.type == 'mps' and not torch.backends.mps.is_available():
        raise ConfigError(f"--device={name}: no MPS device available; use --device=cpu")


def format_help(defaults):
    width = max((len(k) for k in defaults), default=0)
    script = os.path.basename(sys.argv[0]) or "SCRIPT.py"
    lines = [f"usage: python {script} [config/FILE.py ...] [--key=value ...]", "config keys (default):"]
    lines += [f"  --{k:<{width}} = {v!r}" for k, v in defaults.items()]
    return '\n'.join(lines)


def configure(defaults, argv=None):
    """defaults: dict of key -> default value. argv: list of arguments (None: sys.argv[1:], and an
    error then exits with a one-line message). Returns the final config as a new dict."""
    from_cli = argv is None
    argv = sys.argv[1:] if from_cli else list(argv)
    config = dict(defaults)
    try:
        for arg in argv:
            if arg in ('-h', '--help'):
                print(format_help(defaults))
                sys.exit(0)
            if not arg.startswith('--'):
                config = _apply_file(config, arg)
                continue
            key, eq, text = arg[2:].partition('=')
            if key not in config:
                raise _unknown(key, config, f"'{arg}'")
            if not eq and not isinstance(config[key], bool):  # e.g. `--max_iters 5`: the 5 would be a file
                raise ConfigError(f"'{arg}' needs a value: write --{key}=VALUE (default {config[key]!r})")
            value = _parse_value(text, config[key]) if eq else True
            config[key] = _check_type(key, value, config[key], f"'{arg}'")
    except ConfigError as e:
        if from_cli:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        raise
    return config
