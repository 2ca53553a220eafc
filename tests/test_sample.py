"""sample.py on tiny checkpoints (random weights) with byte and GPT-2 BPE datasets made here."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import sample as S
from configurator import ConfigError
from common import InputError
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_data(root, name, tokenizer):
    d = os.path.join(root, 'data', name)
    os.makedirs(d, exist_ok=True)
    vocab, dtype, eot = (256, 'uint8', 30) if tokenizer == 'byte' else (50257, 'uint16', 50256)
    np.zeros(100, dtype=dtype).tofile(os.path.join(d, 'val.bin'))
    with open(os.path.join(d, 'meta.json'), 'w') as f:
        json.dump({'vocab_size': vocab, 'tokenizer': tokenizer, 'dtype': dtype, 'eot_token': eot}, f)
    return d


def make_ckpt(root, run, dataset, vocab_size=256, **kw):
    torch.manual_seed(0)
    args = dict(block_size=16, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=16, pos='kerple', dape='v1')
    args.update(kw)
    model = GPT(GPTConfig(**args))
    out = os.path.join(root, 'out', run)
    os.makedirs(out, exist_ok=True)
    torch.save({'model': model.state_dict(), 'model_args': dataclasses.asdict(model.config), 'iter_num': 0,
                'dataset': dataset, 'config': {'dataset': dataset, 'data_root': os.path.join(root, 'data')}},
               os.path.join(out, 'ckpt.pt'))
    return out


def cfg(**kw):
    c = {k: getattr(S, k) for k in S.config_keys}
    c.update(device='cpu', num_samples=2, max_new_tokens=40)
    c.update(kw)
    return c


def test_byte_samples_past_the_training_length(tmp_path, capsys):
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    ck = make_ckpt(root, 'byte', 'chars')
    out = S.sample(cfg(start='Call me Ishmael.', temperature=1.0, top_k=0), ck)  # 16 + 40 > block_size 16
    assert len(out) == 2 and all(s.startswith('Call me Ishmael.') for s in out)
    assert out[0] != out[1]  # two different samples
    assert out == S.sample(cfg(start='Call me Ishmael.', temperature=1.0, top_k=0), ck)  # seeded
    assert '---------------' in capsys.readouterr().out
    # greedy decoding from a file prompt
    (tmp_path / 'prompt.txt').write_text('It was the best of times')
    g = S.sample(cfg(start=f"FILE:{tmp_path / 'prompt.txt'}", temperature=0.0, num_samples=2), ck)
    assert g[0] == g[1] and g[0].startswith('It was the best of times')
    # an empty prompt starts from the end-of-text token
    assert len(S.sample(cfg(start='', num_samples=1, max_new_tokens=5), ck)) == 1


def test_bpe_samples(tmp_path):
    root = str(tmp_path)
    make_data(root, 'bpe', 'gpt2')
    ck = make_ckpt(root, 'bpe', 'bpe', vocab_size=50304, n_embd=8, dape='none')
    out = S.sample(cfg(start='Hello world', num_samples=1, max_new_tokens=20, top_k=10), ck)
    assert out[0].startswith('Hello world') and len(out[0]) > len('Hello world')
    # a byte dataset's checkpoint cannot read a BPE prompt
    byte_ck = make_ckpt(root, 'byte', 'bpe')
    with pytest.raises(InputError, match='vocabulary'):
        S.sample(cfg(start='Hello world'), byte_ck)


def test_tokenizer_inferred_without_the_dataset(tmp_path):
    ck = make_ckpt(str(tmp_path), 'byte', 'absent')
    assert S.sample(cfg(start='abc', num_samples=1, max_new_tokens=3), ck)[0].startswith('abc')


def test_errors(tmp_path):
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    with pytest.raises(InputError, match='no checkpoint'):
        S.sample(cfg(), str(tmp_path / 'missing'))
    (tmp_path / 'bad.pt').write_bytes(b'garbage')
    with pytest.raises(InputError, match='bad.pt'):
        S.sample(cfg(), str(tmp_path / 'bad.pt'))
    with pytest.raises(InputError, match='causal'):
        S.sample(cfg(), make_ckpt(root, 'enc', 'chars', causal=False))
    with pytest.raises(InputError, match='learned'):
        S.sample(cfg(max_new_tokens=40), make_ckpt(root, 'learned', 'chars', pos='learned', dape='none'))
    with pytest.raises(InputError, match='not found'):
        S.sample(cfg(start='FILE:/nonexistent/prompt.txt'), make_ckpt(root, 'ok', 'chars'))


def test_cli(tmp_path):
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    ck = make_ckpt(root, 'byte', 'chars')
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'sample.py'), ck, '--start=Hi', '--num_samples=1',
                        '--max_new_tokens=5'], capture_output=True, text=True, env=env, cwd=root)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith('Hi') and '---------------' in p.stdout
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'sample.py'), f'--out_dir={tmp_path / "none"}'],
                       capture_output=True, text=True, env=env, cwd=root)
    assert p.returncode == 2 and 'no checkpoint' in p.stderr and 'Traceback' not in p.stderr


def test_tokenizer_must_fit_the_model(tmp_path, capsys):
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    make_data(root, 'bpe', 'gpt2')
    bpe_ck = make_ckpt(root, 'bpe', 'bpe', vocab_size=50304, n_embd=8, dape='none')
    # a BPE model pointed at a byte dataset: an error before generating, not a failed byte decode
    with pytest.raises(InputError, match=r"vocabulary \(50304, the 'gpt2' tokenizer's\) does not match the 'byte'.*"
                                        r"--data_dir=.*the checkpoint says 'bpe'"):
        S.sample(cfg(data_dir=os.path.join(root, 'data', 'chars')), bpe_ck)
    # the same through the checkpoint's own dataset, re-prepared with the other tokenizer
    make_data(root, 'bpe', 'byte')
    with pytest.raises(InputError, match="does not match the 'byte' tokenizer"):
        S.sample(cfg(), bpe_ck)
    # a byte model whose embedding train.py padded (vocab_size=300) still samples; padding ids sampled
    # by its random weights are left out of the text, with a note
    ck = make_ckpt(root, 'padded', 'chars', vocab_size=300)
    out = S.sample(cfg(start='abc', num_samples=1, max_new_tokens=60, temperature=1.0, top_k=0), ck)
    assert out[0].startswith('abc')
    assert 'embedding padding' in capsys.readouterr().err
    # a damaged meta.json is a one-line error too
    with open(os.path.join(root, 'data', 'chars', 'meta.json'), 'w') as f:
        f.write('{')
    with pytest.raises(InputError, match='cannot read the tokenizer'):
        S.sample(cfg(), ck)


@pytest.mark.parametrize('key, value, message', [
    ('temperature', -1.0, r'--temperature must be >= 0 \(0: greedy\), got -1.0'),
    ('temperature', float('nan'), '--temperature must be >= 0'),
    ('top_k', -1, '--top_k must be >= 1, or 0 for no cut, got -1'),
    ('num_samples', 0, '--num_samples must be >= 1, got 0'),
    ('max_new_tokens', -1, '--max_new_tokens must be >= 0, got -1'),
])
def test_options_out_of_range(tmp_path, key, value, message):
    # checked before the checkpoint is read: none is needed
    with pytest.raises(InputError, match=message):
        S.sample(cfg(**{key: value}), str(tmp_path / 'missing'))


def test_zero_new_tokens_returns_the_prompt(tmp_path):
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    assert S.sample(cfg(start='abc', num_samples=1, max_new_tokens=0), make_ckpt(root, 'byte', 'chars')) == ['abc']


def test_unavailable_device(tmp_path, monkeypatch):
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    ck = make_ckpt(root, 'byte', 'chars')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # also on a machine with a GPU
    for dev in ('cuda', 'cuda:1'):
        with pytest.raises(ConfigError, match=r"no CUDA device.*--device=cpu") as e:
            S.sample(cfg(device=dev), ck)
        assert 'checkpoint' not in str(e.value) and 'truncated' not in str(e.value)
    with pytest.raises(ConfigError, match="--device=gpu is not a device"):
        S.sample(cfg(device='gpu'), ck)


def test_cli_option_errors_are_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES='')
    for arg, message in (('--temperature=-1', '--temperature must be >= 0'), ('--top_k=-5', '--top_k must be'),
                         ('--device=cuda', 'no CUDA device')):
        p = subprocess.run([sys.executable, os.path.join(ROOT, 'sample.py'), str(tmp_path), arg],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path))
        assert p.returncode == 2 and p.stderr.startswith('sample.py: error: ') and message in p.stderr, p.stderr
        assert p.stderr.count('\n') == 1  # one line, no traceback


def test_a_checkpoint_that_does_not_fit_its_model_args_is_one_line(tmp_path):
    # a readable file whose weights are not its model_args' model: an InputError naming it, not load_state_dict's
    # "size mismatch" traceback, and the file is left as it was
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    path = os.path.join(make_ckpt(root, 'byte', 'chars'), 'ckpt.pt')
    ck = torch.load(path, weights_only=True)
    ck['model']['transformer.wte.weight'] = torch.zeros(300, 16)
    torch.save(ck, path)
    before = open(path, 'rb').read()
    with pytest.raises(InputError, match=r"ckpt\.pt does not match its own model_args \(shape: transformer\.wte\."
                                         r"weight is \(300, 16\), not \(256, 16\)\): retrain it, or use another "
                                         r"checkpoint") as e:
        S.sample(cfg(), path)
    assert '\n' not in str(e.value) and open(path, 'rb').read() == before
    del ck['model']['transformer.wte.weight']
    ck['model']['transformer.extra'] = torch.zeros(1)
    torch.save(ck, path)
    with pytest.raises(InputError, match=r"missing: transformer\.wte\.weight; unexpected: transformer\.extra\)"):
        S.sample(cfg(), path)


def test_a_prompt_file_that_is_not_utf8(tmp_path):
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    ck = make_ckpt(root, 'byte', 'chars')
    (tmp_path / 'bad.txt').write_bytes(b'ok \xff\xfeh\x00i\x00')  # UTF-16 after an ASCII start
    with pytest.raises(InputError, match=r"prompt file '.*bad\.txt' is not UTF-8 text \(invalid start byte at "
                                         r"byte 3\): save it as UTF-8"):
        S.sample(cfg(start=f"FILE:{tmp_path / 'bad.txt'}"), ck)
    with pytest.raises(InputError, match=r"prompt file '.*' not found"):  # a folder is no prompt file either
        S.sample(cfg(start=f"FILE:{tmp_path}"), ck)


def test_a_model_evaluated_at_random_positions_generates_at_0_1_2(tmp_path, capsys):
    # rand_pos_eval=True draws positions afresh at every forward, which a KV cache cannot continue: sample.py
    # generates as the same weights do with rand_pos_eval=False, and says so
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    fixed = make_ckpt(root, 'fixed', 'chars', rand_pos=True)
    drawn = make_ckpt(root, 'drawn', 'chars', rand_pos=True, rand_pos_eval=True)  # the same weights (seeded)
    want = S.sample(cfg(start='abc', num_samples=1, temperature=0.0), fixed)
    assert 'rand_pos_eval' not in capsys.readouterr().err
    assert S.sample(cfg(start='abc', num_samples=1, temperature=0.0), drawn) == want
    assert 'generating at positions 0, 1, 2, ... as with rand_pos_eval=False' in capsys.readouterr().err


def test_learned_positions_room_counts_the_last_token_unfed(tmp_path):
    # generate never feeds the last sampled token: a prompt of n tokens leaves room for 16 - n + 1 new ones
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    ck = make_ckpt(root, 'learned', 'chars', pos='learned', dape='none')  # 16 positions
    assert S.sample(cfg(start='a', num_samples=1, max_new_tokens=16), ck)[0].startswith('a')
    assert S.sample(cfg(start='abc', num_samples=1, max_new_tokens=14), ck)[0].startswith('abc')
    with pytest.raises(InputError, match=r"a prompt of 3 tokens leaves room for 14 new tokens, not "
                                         r"--max_new_tokens=15"):
        S.sample(cfg(start='abc', max_new_tokens=15), ck)
    assert S.sample(cfg(start='x' * 20, num_samples=1, max_new_tokens=0), ck) == ['x' * 20]  # nothing fed


def test_derived_rope_factor_counts_the_positions_fed(tmp_path, capsys):
    # a prompt of 4 and 28 new tokens feeds 31 positions (the last token is only sampled): s = 31 / 16, not 32 / 16
    root = str(tmp_path)
    make_data(root, 'chars', 'byte')
    ck = make_ckpt(root, 'rope', 'chars', pos='rope', dape='none')
    S.sample(cfg(start='abcd', num_samples=1, max_new_tokens=28, rope_scaling='pi'), ck)
    assert f"(RoPE pi scaling, s={31 / 16:g})" in capsys.readouterr().err
    S.sample(cfg(start='abcd', num_samples=1, max_new_tokens=8, rope_scaling='pi'), ck)  # 11 fed: no scaling
    assert "(RoPE pi scaling, s=1)" in capsys.readouterr().err
