"""train.py on CPU: a few steps on a tiny generated dataset, exact resume, atomic checkpoints,
non-finite losses, data errors, configs, and 2-process DDP / FSDP runs through torchrun (gloo)."""
import dataclasses
import glob
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import common
import train
from configurator import ConfigError, configure
from common import cpu_name, load_checkpoint
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, gradient_accumulation_steps=2,
            eval_interval=100, eval_iters=2, log_interval=100, learning_rate=3e-3, warmup_iters=2,
            lr_decay_iters=20, max_iters=20, device='cpu')


def make_dataset(root, name='tiny', vocab=64, dtype=np.uint8, n_train=6000, n_val=1200):
    """A repeated random pattern (learnable) in data_root/name/, in the format of data/*/prepare.py."""
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    pattern = np.random.default_rng(0).integers(0, vocab, size=37)
    train_ids = np.resize(pattern, n_train).astype(dtype)
    val_ids = np.resize(pattern[5:], n_val).astype(dtype)
    train_ids.tofile(os.path.join(d, 'train.bin'))
    val_ids.tofile(os.path.join(d, 'val.bin'))
    meta = {'vocab_size': vocab, 'tokenizer': 'byte' if dtype == np.uint8 else 'gpt2',
            'dtype': np.dtype(dtype).name, 'eot_token': 0, 'train_tokens': n_train, 'val_tokens': n_val}
    with open(os.path.join(d, 'meta.json'), 'w') as f:
        json.dump(meta, f)
    return d


@pytest.fixture(autouse=True)
def one_thread():
    # these models are tiny: a second thread only adds synchronisation, and on a busy 2-core machine
    # OpenMP threads that wait for each other make a step 10-50x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def data_root(tmp_path):
    make_dataset(str(tmp_path / 'data'))
    return str(tmp_path / 'data')


def run(data_root, out_dir, **kw):
    return train.train(TINY, dataset='tiny', data_root=data_root, out_dir=str(out_dir), **kw)


def test_every_model_option_is_a_config_key():
    for f in dataclasses.fields(GPTConfig):
        assert f.name in train.DEFAULTS
    cfg = configure(train.DEFAULTS, ['--pos=kerple', '--dape=v2', '--dape_kernel=5', '--rand_pos=True'])
    assert (cfg['pos'], cfg['dape'], cfg['dape_kernel'], cfg['rand_pos']) == ('kerple', 'v2', 5, True)
    with pytest.raises(ConfigError, match="'dape_kernel'"):
        configure(train.DEFAULTS, ['--dape_kernel=three'])


def test_lr_schedule():
    C = type('C', (), dict(decay_lr=True, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110))
    assert train.get_lr(0, C) == pytest.approx(1 / 11)
    assert train.get_lr(10, C) == pytest.approx(1.0)
    assert train.get_lr(60, C) == pytest.approx(0.55)
    assert train.get_lr(110, C) == pytest.approx(0.1) and train.get_lr(500, C) == 0.1


@pytest.mark.parametrize('pos,dape', [('learned', 'none'), ('rope', 'none'), ('kerple', 'v1'),
                                      ('alibi', 'v2'), ('fire', 'none')])
def test_loss_goes_down(data_root, tmp_path, pos, dape):
    res = run(data_root, tmp_path / 'out', pos=pos, dape=dape, eval_interval=20)
    first, last = res['evals'][0], res['evals'][-1]
    assert res['iter_num'] == 20 and len(res['losses']) == 20
    assert last[1] < first[1] - 0.3 and last[2] < first[2] - 0.3, res['evals']
    model, ckpt = load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))
    assert ckpt['iter_num'] == 20 and ckpt['model_args']['pos'] == pos and ckpt['dataset'] == 'tiny'
    assert ckpt['model_args']['vocab_size'] == 64  # taken from meta.json


def test_uint16_dataset(tmp_path):
    make_dataset(str(tmp_path / 'data'), 'bpe', vocab=1000, dtype=np.uint16)
    res = train.train(TINY, dataset='bpe', data_root=str(tmp_path / 'data'), out_dir=str(tmp_path / 'o'),
                      max_iters=2, eval_interval=2, vocab_size=1024)
    assert res['model'].config.vocab_size == 1024 and all(math.isfinite(x) for x in res['losses'])


@pytest.mark.parametrize('rand_pos_eval', [False, True])
def test_resume_equals_uninterrupted(data_root, tmp_path, rand_pos_eval):
    # dropout and randomized positions use the torch RNG, batches the data generator: all must resume;
    # with rand_pos_eval the evaluations draw positions too, and must not move the training's RNG
    kw = dict(dropout=0.1, pos='rope', rand_pos=True, rand_pos_eval=rand_pos_eval, eval_interval=5, max_iters=10)
    full = run(data_root, tmp_path / 'a', **kw)
    first = run(data_root, tmp_path / 'b', **{**kw, 'max_iters': 5})
    rest = run(data_root, tmp_path / 'b', **kw, init_from='resume')
    assert len(first['losses']) == 5 and len(rest['losses']) == 5
    np.testing.assert_allclose(first['losses'] + rest['losses'], full['losses'], rtol=0, atol=1e-6)
    a, b = full['model'].state_dict(), rest['model'].state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    # the checkpoint loads with weights_only=True (sample.py / eval_extrapolate.py)
    ck = torch.load(str(tmp_path / 'b' / 'ckpt.pt'), weights_only=True)
    assert ck['iter_num'] == 10 and ck['config']['max_iters'] == 10
    assert not any(k.startswith(('module.', '_orig_mod.')) for k in ck['model'])


def test_resume_past_max_iters_says_so(data_root, tmp_path, capsys):
    out = tmp_path / 'out'
    run(data_root, out, max_iters=4, eval_interval=2)
    res = run(data_root, out, max_iters=3, eval_interval=2, init_from='resume')
    assert res['iter_num'] == 4 and res['losses'] == []
    assert ("note: the checkpoint is already at iteration 4 >= max_iters=3, so nothing is trained; to train "
            "further, resume with a larger --max_iters (above 4)") in capsys.readouterr().out
    run(data_root, out, max_iters=6, eval_interval=2, init_from='resume')
    assert 'note: the checkpoint is already' not in capsys.readouterr().out


def test_log_and_checkpoint_name_the_machine(data_root, tmp_path, capsys, monkeypatch):
    # reruns on another CPU model or kernel set round differently; the log and the checkpoint must say which
    # machine trained a run, and from which step
    out = tmp_path / 'out'
    run(data_root, out, max_iters=2, eval_interval=2)
    here = f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()} kernels, torch {torch.__version__}"
    first = capsys.readouterr().out.splitlines()[0]
    assert f"on cpu ({here})" in first, first
    assert load_checkpoint(str(out / 'ckpt.pt'))[1]['machines'] == [(0, here)]

    run(data_root, out, max_iters=4, eval_interval=2, init_from='resume')  # the same machine: no note
    assert 'note: the checkpoint was trained on' not in capsys.readouterr().out
    assert load_checkpoint(str(out / 'ckpt.pt'))[1]['machines'] == [(0, here)]

    monkeypatch.setattr(common, 'cpu_name', lambda: 'Another CPU')
    run(data_root, out, max_iters=6, eval_interval=2, init_from='resume')
    assert f"note: the checkpoint was trained on {here}; continuing on Another CPU," in capsys.readouterr().out
    assert load_checkpoint(str(out / 'ckpt.pt'))[1]['machines'] == [(0, here), (4, here.replace(cpu_name(), 'Another CPU'))]


def test_checkpoint_records_commit_command_and_date(data_root, tmp_path, monkeypatch):
    """Every start of a run (a resume too) adds the code's commit, the command line and the date to the
    checkpoint: what a published result needs to say where it came from."""
    out = tmp_path / 'out'
    args = [f'--{k}={v}' for k, v in TINY.items()] + ['--dataset=tiny', f'--data_root={data_root}', f'--out_dir={out}',
                                                     '--max_iters=2', '--eval_interval=2']
    train.main(args)
    here = common.code_version()
    monkeypatch.setattr(common, 'code_version', lambda: 'abc1234-dirty')
    train.main(args[:-2] + ['--max_iters=4', '--eval_interval=2', '--init_from=resume'])
    (s0, first), (s1, second) = load_checkpoint(str(out / 'ckpt.pt'))[1]['provenance']
    assert (s0, s1) == (0, 2)
    assert first['commit'] == here != 'unknown'  # this is a git checkout
    assert first['command'] == 'python train.py ' + ' '.join(args)
    assert second['commit'] == 'abc1234-dirty' and second['command'].endswith('--init_from=resume')
    assert first['date'] == second['date'] == __import__('datetime').date.today().isoformat()
    assert first['machine'] == common.machine_text('cpu')


def test_cpu_name_has_family_and_model(monkeypatch):
    # one model name ('AMD EPYC') covers CPUs that round differently; the family and model number tell them apart
    import builtins
    import io
    cpuinfo = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n\n"
               "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 106\nmodel name\t: Other\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, 'open', lambda path, *a, **k: io.StringIO(cpuinfo) if path == '/proc/cpuinfo'
                        else real_open(path, *a, **k))
    assert cpu_name() == 'AMD EPYC (family 25, model 1)'


def test_checkpoint_survives_crash_during_save(data_root, tmp_path, monkeypatch):
    out = tmp_path / 'out'
    run(data_root, out, max_iters=2, eval_interval=2)
    path = out / 'ckpt.pt'
    before = path.read_bytes()

    def crashing_save(obj, f, *a, **k):
        f.write(b'half a checkpoint')
        raise OSError('disk full (simulated)')
    monkeypatch.setattr(torch, 'save', crashing_save)
    with pytest.raises(OSError, match='simulated'):
        run(data_root, out, max_iters=4, eval_interval=2, init_from='resume')
    monkeypatch.undo()
    assert path.read_bytes() == before and not os.path.exists(str(path) + '.tmp')
    model, ck = load_checkpoint(str(path))
    assert ck['iter_num'] == 2


def test_non_finite_loss_stops_and_keeps_checkpoint(data_root, tmp_path, monkeypatch):
    out = tmp_path / 'out'
    run(data_root, out, max_iters=2, eval_interval=2)
    original = GPT.forward

    def nan_forward(self, *a, **k):
        logits, loss = original(self, *a, **k)
        if self.training and loss is not None:
            loss = loss * float('nan')
        return logits, loss
    monkeypatch.setattr(GPT, 'forward', nan_forward)
    with pytest.raises(SystemExit) as e:
        train.main([f'--{k}={v}' for k, v in TINY.items()] +
                   ['--dataset=tiny', f'--data_root={data_root}', f'--out_dir={out}', '--init_from=resume',
                    '--max_iters=4', '--eval_interval=2'])
    msg = str(e.value.code)
    assert 'loss is nan at iteration 2' in msg and 'learning_rate' in msg and 'last good checkpoint' in msg
    monkeypatch.undo()
    model, ck = load_checkpoint(str(out / 'ckpt.pt'))
    assert ck['iter_num'] == 2 and all(torch.isfinite(v).all() for v in ck['model'].values())


@pytest.mark.parametrize('eval_interval, where', [(100, 'loss is'), (1, 'validation loss is')])
def test_non_finite_loss_from_scratch_names_no_checkpoint(data_root, tmp_path, eval_interval, where):
    # diverged before any checkpoint was saved: the message must not send the user to a file that is not there
    out = tmp_path / 'out'
    with pytest.raises(SystemExit) as e:
        train.main([f'--{k}={v}' for k, v in TINY.items()] +
                   ['--dataset=tiny', f'--data_root={data_root}', f'--out_dir={out}', '--learning_rate=1e30',
                    f'--eval_interval={eval_interval}'])
    msg = str(e.value.code)
    assert msg.startswith(f'error: {where} nan at iteration 1') and 'no checkpoint had been saved yet' in msg, msg
    assert 'keeps the last good' not in msg and not os.path.exists(out / 'ckpt.pt')


def test_data_errors_name_the_prepare_command(tmp_path):
    root = str(tmp_path / 'data')
    with pytest.raises(FileNotFoundError, match=r'python data/nope/prepare\.py'):
        train.train(TINY, dataset='nope', data_root=root, out_dir=str(tmp_path / 'o'))
    assert not os.path.exists(tmp_path / 'o')  # a run that cannot start leaves no out_dir behind
    d = make_dataset(root, 'bpe', vocab=1000, dtype=np.uint16)
    with open(os.path.join(d, 'val.bin'), 'ab') as f:
        f.write(b'\x00')  # odd number of bytes: not uint16
    with pytest.raises(ValueError, match=r'not a multiple.*python data/bpe/prepare\.py --force'):
        train.train(TINY, dataset='bpe', data_root=root, out_dir=str(tmp_path / 'o'))
    d = make_dataset(root, 'stale')
    os.remove(os.path.join(d, 'train.bin'))
    with pytest.raises(FileNotFoundError, match=r'train\.bin.*python data/stale/prepare\.py'):
        train.train(TINY, dataset='stale', data_root=root, out_dir=str(tmp_path / 'o'))
    np.zeros(10, dtype=np.uint8).tofile(os.path.join(d, 'train.bin'))
    with pytest.raises(ValueError, match=r'meta\.json says 6000.*prepare\.py --force'):
        train.train(TINY, dataset='stale', data_root=root, out_dir=str(tmp_path / 'o'))
    make_dataset(root, 'tiny')
    with pytest.raises(ValueError, match=r'vocab_size=32 is smaller'):
        train.train(TINY, dataset='tiny', data_root=root, out_dir=str(tmp_path / 'o'), vocab_size=32)
    with pytest.raises(FileNotFoundError, match=r'ckpt\.pt does not exist'):
        train.train(TINY, dataset='tiny', data_root=root, out_dir=str(tmp_path / 'o'), init_from='resume')


def test_data_errors_are_one_line_and_leave_no_out_dir(tmp_path, capsys):
    """Data that cannot serve the run: block_size beyond a split, a meta.json that is not JSON, a stale
    file. main() prints one line naming the file and the fix, and out_dir is not made."""
    root, out = str(tmp_path / 'data'), tmp_path / 'o'
    d = make_dataset(root, 'tiny')  # train 6000 tokens, val 1200
    args = [f'--{k}={v}' for k, v in TINY.items()] + ['--dataset=tiny', f'--data_root={root}', f'--out_dir={out}']
    with pytest.raises(SystemExit) as e:
        train.main(args + ['--block_size=1500'])
    assert e.value.code == 2 and not os.path.exists(out)
    err = capsys.readouterr().err
    assert err == (f"config error: {d}/val.bin has 1200 tokens, fewer than block_size+1 = 1501; lower "
                   f"--block_size or prepare more data\n"), err
    np.zeros(10, dtype=np.uint8).tofile(os.path.join(d, 'val.bin'))  # stale: meta.json says 1200
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert str(e.value.code).startswith(f'error: {d}/val.bin holds 10 tokens but meta.json says 1200')
    with open(os.path.join(d, 'meta.json'), 'w') as f:
        f.write('{"vocab_size": 64,')  # cut short
    with pytest.raises(SystemExit) as e:
        train.main(args)
    msg = str(e.value.code)
    assert msg.startswith(f'error: {d}/meta.json is not valid JSON (') and msg.endswith(
        'rebuild the dataset with `python data/tiny/prepare.py`'), msg
    assert not os.path.exists(out)


def test_resume_on_a_larger_vocabulary_says_what_to_do(data_root, tmp_path):
    out = tmp_path / 'out'
    run(data_root, out, max_iters=2, eval_interval=2)
    make_dataset(data_root, 'big', vocab=200)
    good = (out / 'ckpt.pt').read_bytes()
    with pytest.raises(ConfigError) as e:
        train.train(TINY, dataset='big', data_root=data_root, out_dir=str(out), max_iters=4, init_from='resume')
    assert str(e.value) == ("the checkpoint's vocabulary (64) cannot hold dataset 'big''s 200 tokens (meta.json); "
                            "resume on its own dataset (--dataset=tiny) or train a new model into another --out_dir")
    assert (out / 'ckpt.pt').read_bytes() == good


def test_a_checkpoint_is_never_overwritten_or_misread(data_root, tmp_path):
    """From scratch into an out_dir that holds a checkpoint: refused. Resume from a corrupt file, or
    with model options the checkpoint does not have: clear errors. The file is unchanged each time."""
    out = tmp_path / 'out'
    run(data_root, out, max_iters=2, eval_interval=2)
    path = out / 'ckpt.pt'
    good = path.read_bytes()
    with pytest.raises(train.CheckpointError, match=r"already exists.*--init_from=resume"):
        run(data_root, out, max_iters=1)
    with pytest.raises(ConfigError, match=r"cannot be resumed with n_embd=64 \(the checkpoint has 32\), "
                                          r"pos='alibi' \(the checkpoint has 'kerple'\)"):
        run(data_root, out, max_iters=3, init_from='resume', pos='alibi', n_embd=64)
    assert path.read_bytes() == good
    # options left at their defaults take the checkpoint's; dropout may be set anew
    not_model = {k: v for k, v in TINY.items() if k not in ('n_layer', 'n_head', 'n_embd', 'block_size')}
    res = train.train(not_model, dataset='tiny', data_root=data_root, out_dir=str(out), max_iters=3,
                      init_from='resume', dropout=0.2)
    assert res['iter_num'] == 3 and res['model'].config.dropout == 0.2
    assert torch.load(str(path), weights_only=True)['config']['dropout'] == 0.2
    good = path.read_bytes()
    for bad in (good[:len(good) // 2], b'not a checkpoint'):
        path.write_bytes(bad)
        with pytest.raises(train.CheckpointError, match=r"ckpt\.pt is not a readable checkpoint"):
            run(data_root, out, max_iters=4, init_from='resume')
        assert path.read_bytes() == bad
    torch.save({'model': {}}, str(path))
    with pytest.raises(train.CheckpointError, match=r"not a train.py checkpoint: it lacks \['optimizer'.*cannot be resumed"):
        run(data_root, out, max_iters=4, init_from='resume')


def test_an_option_given_at_its_default_must_match_the_resumed_checkpoint(data_root, tmp_path, capsys):
    """--pos=kerple is the default, yet given on the command line it asks for Kerple: resuming an ALiBi
    checkpoint with it is refused (it was silently resumed as ALiBi), the file unchanged; without it, the
    checkpoint's encoding is kept."""
    out = tmp_path / 'out'
    run(data_root, out, max_iters=2, eval_interval=2, pos='alibi')
    good = (out / 'ckpt.pt').read_bytes()
    args = [f'--{k}={v}' for k, v in TINY.items()] + ['--dataset=tiny', f'--data_root={data_root}',
                                                      f'--out_dir={out}', '--max_iters=3', '--init_from=resume']
    with pytest.raises(SystemExit) as e:
        train.main(args + ['--pos=kerple'])
    assert e.value.code == 2
    assert "cannot be resumed with pos='kerple' (the checkpoint has 'alibi')" in capsys.readouterr().err
    assert (out / 'ckpt.pt').read_bytes() == good
    train.main(args)
    ck = torch.load(str(out / 'ckpt.pt'), weights_only=True)
    assert ck['model_args']['pos'] == 'alibi' and ck['iter_num'] == 3


def _add_future_option(ck):
    ck['model_args']['future_opt'] = 7


def _swap_embedding(ck):
    ck['model']['transformer.wte.weight'] = torch.zeros(3, 5)


@pytest.mark.parametrize('edit, message', [
    # a checkpoint from a newer model.py: resuming without its option would train and save another model
    (_add_future_option, r"has model options this model\.py does not know: \['future_opt'\]; use it with the code "
                         r"that wrote it\. It cannot be resumed"),
    # a file edited by hand or mixed up with another run's: named, not a size-mismatch traceback
    (_swap_embedding, r"does not match its own model_args \(shape: transformer\.wte\.weight is \(3, 5\).*"
                      r"It cannot be resumed"),
])
def test_resume_refuses_a_checkpoint_unlike_its_model_and_leaves_it(data_root, tmp_path, edit, message):
    out = tmp_path / 'out'
    run(data_root, out, max_iters=2, eval_interval=2)
    path = out / 'ckpt.pt'
    ck = torch.load(str(path), weights_only=True)
    edit(ck)
    torch.save(ck, str(path))
    good = path.read_bytes()
    with pytest.raises(train.CheckpointError, match=r"ckpt\.pt " + message):
        run(data_root, out, max_iters=4, eval_interval=2, init_from='resume')
    assert path.read_bytes() == good


@pytest.mark.parametrize('option, message', [
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be >= 1, got 0"),
    (dict(eval_iters=0), "eval_iters must be >= 1"),
    (dict(eval_interval=0), "eval_interval must be >= 1"),
    (dict(batch_size=0), "batch_size must be >= 1"),
    (dict(learning_rate=0.0), "learning_rate must be > 0"),
    (dict(init_from='continue'), "init_from must be one of scratch, resume; got 'continue'"),
    (dict(dtype='float64'), "dtype must be one of auto, float32, bfloat16, float16"),
    (dict(device='tpu'), "--device=tpu is not a device: use auto, cpu, cuda or cuda:N"),
    (dict(backend='nccl'), "backend=nccl needs CUDA GPUs, but --device=cpu; use --backend=gloo (or auto"),
    (dict(pos='rotary'), "unknown pos='rotary'"),
    (dict(dape='v2', dape_kernel=4), "dape_kernel must be odd"),
])
def test_bad_options_fail_before_anything_runs(tmp_path, option, message):
    """No data is needed to reject them (the dataset here does not exist); main() prints one line and
    exits with 2, like the configurator's own errors."""
    with pytest.raises(ConfigError, match=message.replace('(', r'\(')):
        train.train(TINY, dataset='missing', data_root=str(tmp_path), out_dir=str(tmp_path / 'o'), **option)
    if set(option) not in ({'eval_iters'}, {'pos'}):  # the command line: two cases are enough
        return
    args = [f'--{k}={v}' for k, v in option.items()] + ['--dataset=missing', f'--data_root={tmp_path}']
    p = subprocess.run([sys.executable, 'train.py'] + args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith('config error:') and len(p.stderr.splitlines()) == 1, p.stderr
    assert not os.path.exists(tmp_path / 'o')


def test_nccl_backend_needs_cuda(monkeypatch):
    # under torchrun, init_process_group('nccl') without CUDA is a traceback from every process
    cfg = lambda **kw: train.SimpleNamespace(**{**train.DEFAULTS, **kw})
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    with pytest.raises(ConfigError, match=r"backend=nccl needs CUDA GPUs, but no CUDA device is available; "
                                          r"use --backend=gloo"):
        train.check_config(cfg(backend='nccl'))
    train.check_config(cfg(backend='gloo'))
    train.check_config(cfg(backend='auto'))


def test_forcing_the_fused_kernel_where_it_cannot_run_is_one_line(tmp_path):
    """dape_impl=triton on a CPU (the compiled kernels need CUDA): a configuration error before any data is
    read or out_dir made, as a new user running the CPU demo's config would meet it; and an encoding the
    kernel does not cover, wherever it runs."""
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}  # the interpreter would run it
    out = tmp_path / 'o'
    p = subprocess.run([sys.executable, 'train.py', 'config/demo_cpu.py', '--dape=v1', '--dape_impl=triton',
                        f'--out_dir={out}', '--dataset=missing', f'--data_root={tmp_path}'], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith('config error: dape_impl=triton cannot run here: '), p.stderr
    assert 'cpu' in p.stderr or 'Triton is not installed' in p.stderr, p.stderr
    assert not os.path.exists(out)
    with pytest.raises(ConfigError, match=r"dape_impl=triton cannot run here: CoPE, whose logits depend"):
        train.train(TINY, dataset='missing', data_root=str(tmp_path), out_dir=str(out), pos='cope', dape='v1',
                    dape_impl='triton')


def test_config_files_are_valid():
    """Every training config (the rest are che_tasks.py's: che_*.py and <retrieval task>_*.py) makes a model."""
    import retrieval_data
    tasks = ('che_',) + tuple(f'{t}_' for t in retrieval_data.TASKS)
    files = [f for f in glob.glob(os.path.join(ROOT, 'config', '*.py')) if not os.path.basename(f).startswith(tasks)]
    assert len(files) >= 9
    for path in files:
        cfg = configure(train.DEFAULTS, [path])
        GPTConfig(**{f.name: cfg[f.name] for f in dataclasses.fields(GPTConfig)} | {'vocab_size': 50304})
        assert cfg['gradient_accumulation_steps'] * cfg['batch_size'] == 256 or 'cpu' in path, path
    big = configure(train.DEFAULTS, [os.path.join(ROOT, 'config', 'arxiv_512_6.7b.py')])
    assert big['fsdp'] and (big['n_layer'], big['n_head'], big['n_embd']) == (32, 32, 4096)


# --- two processes through torchrun (gloo on CPU) --------------------------------------------------

RANK_SCRIPT = """
import gc, json, os, sys
sys.path.insert(0, {root!r})
import torch
import train
from configurator import configure
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
cfg = configure(train.DEFAULTS, sys.argv[1:])
res = train.train(cfg)
# the full weights as every process holds them (FSDP: gathered from the shards)
sd = get_model_state_dict(res['model'], options=StateDictOptions(full_state_dict=True))
rank = int(os.environ['RANK'])
torch.save({{k: v.detach().cpu().clone() for k, v in sd.items()}}, os.path.join(cfg['out_dir'], f'final{{rank}}.pt'))
with open(os.path.join(cfg['out_dir'], f'losses{{rank}}.json'), 'w') as f:
    json.dump(res['losses'], f)
# exiting with gloo's process group (or the FSDP model's tensors, which refer to it) still alive can
# abort the process at interpreter teardown ("terminate called without an active exception")
del res, sd
gc.collect()
torch.distributed.destroy_process_group()
"""


def torchrun(tmp_path, data_root, out_dir, *args):
    script = tmp_path / 'rank.py'
    script.write_text(RANK_SCRIPT.format(root=ROOT))
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', str(script),
           '--dataset=tiny', f'--data_root={data_root}', f'--out_dir={out_dir}', '--dropout=0.1',
           '--warmup_iters=2', '--lr_decay_iters=6', '--eval_interval=3'] + \
          [f'--{k}={v}' for k, v in TINY.items() if k not in ('warmup_iters', 'lr_decay_iters', 'eval_interval',
                                                             'max_iters')] + list(args)
    env = dict(os.environ, OMP_NUM_THREADS='1')
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def load_final(out_dir):
    w = [torch.load(os.path.join(out_dir, f'final{r}.pt')) for r in (0, 1)]
    losses = [json.load(open(os.path.join(out_dir, f'losses{r}.json'))) for r in (0, 1)]
    return w, losses


@pytest.fixture(scope='module')
def ddp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('ddp')
    make_dataset(str(tmp / 'data'))
    torchrun(tmp, str(tmp / 'data'), str(tmp / 'ddp'), '--max_iters=6')
    return tmp


def test_ddp_two_processes_identical_weights(ddp_run):
    (w0, w1), (l0, l1) = load_final(str(ddp_run / 'ddp'))
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    assert l0 == l1 and len(l0) == 6 and l0[-1] < l0[0]  # the logged loss is the mean over processes
    model, ck = load_checkpoint(str(ddp_run / 'ddp'))
    assert ck['iter_num'] == 6 and ck['rng']['world_size'] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k])


def test_fsdp_two_processes_resume_matches_ddp(ddp_run):
    # FSDP (fully_shard) for 3 steps, then resumed under FSDP to 6: the same losses and weights as the
    # uninterrupted DDP run, identical on both processes, and a checkpoint in the ordinary format
    out = str(ddp_run / 'fsdp')
    torchrun(ddp_run, str(ddp_run / 'data'), out, '--fsdp=True', '--max_iters=3')
    r = torchrun(ddp_run, str(ddp_run / 'data'), out, '--fsdp=True', '--max_iters=6', '--init_from=resume')
    assert 'FSDP' in r.stdout
    (w0, w1), (l0, l1) = load_final(out)
    (d0, _), (dl, _) = load_final(str(ddp_run / 'ddp'))
    np.testing.assert_allclose(l0, dl[3:], rtol=0, atol=1e-5)
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
        torch.testing.assert_close(w0[k], d0[k], rtol=0, atol=1e-5)
    model, ck = load_checkpoint(out)
    assert ck['iter_num'] == 6 and set(ck['model']) == set(torch.load(str(ddp_run / 'ddp' / 'ckpt.pt'))['model'])


# --- configuration errors under torchrun ------------------------------------------------------------

@pytest.mark.parametrize('args, line', [
    (['--gradient_accumulation_steps=1'], "config error: gradient_accumulation_steps=1 must be a multiple of the "
                                          "number of processes (2)"),
    (['--gradient_acumulation_steps=2'], "config error: unknown config key 'gradient_acumulation_steps'"),
    (['--dataset=missing'], "error: "),
])
def test_torchrun_config_error_is_one_line(tmp_path, args, line):
    """Every process finds the error; one prints it, as without torchrun, and all exit non-zero at once
    (none waits in a collective). torchrun's own report of the failed processes follows, as always. The
    time bound only catches a hang: three Python processes importing torch take most of it."""
    make_dataset(str(tmp_path / 'data'))
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
           '--device=cpu', '--dataset=tiny', f'--data_root={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}',
           '--gradient_accumulation_steps=2'] + args
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    out = r.stdout + r.stderr
    assert r.returncode != 0 and time.time() - t0 < 60, out
    errors = [s for s in out.splitlines() if s.startswith(('config error:', 'error:'))]
    assert len(errors) == 1 and errors[0].startswith(line), out
    assert 'train.py", line' not in out, out  # no traceback through train.py from any process
    if 'missing' in args[0]:
        assert 'python data/missing/prepare.py' in errors[0]
    else:
        assert not os.path.exists(tmp_path / 'out')


# --- gradient accumulation: k micro-batches of b sequences are one batch of k x b --------------------

def record_step_grads(setattr_):
    """Make every optimizer step first record the gradients it applies ({name: tensor}, in the returned
    list), by wrapping GPT.configure_optimizers with setattr_ (monkeypatch.setattr, or setattr)."""
    grads = []
    original = GPT.configure_optimizers

    def configure_optimizers(self, *a, **k):
        opt = original(self, *a, **k)
        names = {p: n for n, p in self.named_parameters()}
        opt.register_step_pre_hook(lambda o, args, kwargs: grads.append(
            {names[p]: p.grad.detach().clone() for g in o.param_groups for p in g['params'] if p.grad is not None}))
        return opt
    setattr_(GPT, 'configure_optimizers', configure_optimizers)
    return grads


def assert_same_step(a, b):
    """(grads, params, loss) of two one-step runs: equal up to float32 summation order."""
    (ga, pa, la), (gb, pb, lb) = a, b
    assert ga.keys() == gb.keys() and len(ga) > 10
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-4, atol=1e-6, msg=k)
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-5, atol=1e-6, msg=k)
    assert la == pytest.approx(lb, rel=1e-5)


# no clipping: it would rescale a wrong gradient to the right norm; Adam's first step hides the scale too
ONE_STEP = dict(max_iters=1, grad_clip=0.0, eval_iters=1)


def test_accumulation_equals_one_large_batch(data_root, tmp_path, monkeypatch):
    grads = record_step_grads(monkeypatch.setattr)
    steps = []
    for k, b in ((3, 2), (1, 6)):
        res = run(data_root, tmp_path / f'k{k}', gradient_accumulation_steps=k, batch_size=b, **ONE_STEP)
        steps.append((grads[-1], dict(res['model'].named_parameters()), res['losses'][0]))
    assert len(grads) == 2
    assert_same_step(*steps)


GRAD_SCRIPT = """
import json, os, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import train
from test_train import record_step_grads
grads = record_step_grads(setattr)
config, out = json.loads(sys.argv[1]), sys.argv[2]
steps = []
for k, b in ((4, 2), (2, 4)):  # per process: 2 micro-steps of 2 sequences, or 1 of 4
    res = train.train(config, gradient_accumulation_steps=k, batch_size=b, out_dir=os.path.join(out, f'k{{k}}'))
    steps.append((grads[-1], {{n: p.detach().clone() for n, p in res['model'].named_parameters()}},
                  res['losses'][0]))
if int(os.environ['RANK']) == 0:
    torch.save(steps, os.path.join(out, 'steps.pt'))
torch.distributed.destroy_process_group()
"""


def test_accumulation_equals_one_large_batch_ddp(data_root, tmp_path):
    """The same under 2-process DDP (gloo): gradients averaged over processes and micro-steps alike."""
    script = tmp_path / 'grads.py'
    script.write_text(GRAD_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, 'tests')))
    config = dict(TINY, dataset='tiny', data_root=data_root, **ONE_STEP)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', str(script),
           json.dumps(config), str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_same_step(*torch.load(str(tmp_path / 'steps.pt')))
