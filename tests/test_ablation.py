"""An ablation of f and its baseline in one table: train.py records the dape.py each checkpoint was trained with
(common.dape_record), loading builds each model with its own (common.dape_module), labels tell an edited dape.py
apart (common.dape_of_run) and eval_extrapolate.py compares the two. The whole loop runs in a copy of the
repository, a git checkout of its own: train the baseline, edit dape.py, train the ablation, evaluate both in
the edited tree and in the restored one, then resume the ablation there."""
import glob
import inspect
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import common
import dape
import eval_extrapolate as E
import train
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTIVATION = "nn.LeakyReLU(SLOPE),"  # V1's, in dape.py; the ablation swaps it (same shapes: only f differs)
TRAIN = dict(dataset='tiny', block_size=16, n_layer=1, n_head=2, n_embd=16, pos='kerple', dape='v1',
             dape_width=8, batch_size=4, gradient_accumulation_steps=1, max_iters=4, eval_interval=4, eval_iters=1,
             log_interval=100, learning_rate=3e-3, warmup_iters=0, lr_decay_iters=4, device='cpu')
EVAL = ['--lengths=16,32', '--eval_tokens=8', '--num_windows=4', '--plot=False', '--device=cpu']


def make_data(root):
    """A repeated random pattern as root/tiny/, in the format of data/*/prepare.py."""
    (root / 'tiny').mkdir(parents=True)
    ids = np.resize(np.random.default_rng(0).integers(0, 64, size=37), 3000).astype(np.uint8)
    ids.tofile(root / 'tiny' / 'train.bin')
    ids[:1200].tofile(root / 'tiny' / 'val.bin')
    (root / 'tiny' / 'meta.json').write_text(json.dumps(
        {'vocab_size': 64, 'tokenizer': 'byte', 'dtype': 'uint8', 'eot_token': 0, 'train_tokens': 3000,
         'val_tokens': 1200}))


def python(cwd, *args):
    """A script of the copy, in a process of its own (the dape.py it imports is the copy's), on one thread."""
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def git(cwd, *args):
    subprocess.run(['git', '-c', 'user.name=test', '-c', 'user.email=test@example.com', *args], cwd=cwd, check=True,
                   capture_output=True)


def train_seeds(repo, name, seeds=(0, 1)):
    """Train the tiny model with each seed into repo/out/<name>_s<seed>, all in one process."""
    runs = [dict(TRAIN, seed=s, data_root=str(repo / 'data'), out_dir=str(repo / 'out' / f"{name}_s{s}"))
            for s in seeds]
    python(repo, '-c', f"import train\nfor run in {runs!r}:\n    train.train(run)")
    return [r['out_dir'] for r in runs]


def evaluate(repo, runs, out):
    text = python(repo, 'eval_extrapolate.py', *runs, *EVAL, f'--out_dir={out}')
    with open(os.path.join(out, 'results.json')) as f:
        return json.load(f), text


@pytest.mark.recorded_dape  # the copy starts from the dape.py that the fast paths implement
def test_an_ablation_and_its_baseline_in_one_table(tmp_path):
    repo = tmp_path / 'repo'
    repo.mkdir()
    for path in glob.glob(os.path.join(ROOT, '*.py')):
        shutil.copy(path, repo)
    make_data(repo / 'data')
    git(repo, 'init', '-q')
    git(repo, 'add', 'dape.py')
    git(repo, 'commit', '-q', '-m', 'dape.py')

    baseline = train_seeds(repo, 'base')
    source = (repo / 'dape.py').read_text()
    assert source.count(ACTIVATION) == 1
    edited = source.replace(ACTIVATION, "nn.SiLU(),")
    (repo / 'dape.py').write_text(edited)
    ablation = train_seeds(repo, 'silu')

    record = torch.load(os.path.join(ablation[0], 'ckpt.pt'), weights_only=True)['dape_py']
    assert record['source'] == edited and record['edited'] is True
    assert record['sha256'] == common.sha256(edited)
    assert torch.load(os.path.join(baseline[0], 'ckpt.pt'), weights_only=True)['dape_py']['edited'] is False

    # one call on both, in the edited tree, then in the committed one: each model runs its own f
    tag = common.sha256(edited)[:7]
    tables = {}
    for tree in ('edited', 'committed'):
        if tree == 'committed':
            (repo / 'dape.py').write_text(source)
        res, text = evaluate(repo, baseline + ablation, str(tmp_path / tree))
        other = 'an uncommitted edit' if tree == 'committed' else 'committed when it was trained'
        assert f"was trained with another dape.py than this one ({other}, sha256 " in text, text
        assert [g['label'] for g in res['groups']] == ['dape-kerple-D8', f'dape-kerple-D8[dape.py={tag}]']
        assert [g['n'] for g in res['groups']] == [2, 2]
        (c,) = res['comparisons']
        assert (c['label'], c['baseline']) == (f'dape-kerple-D8[dape.py={tag}]', 'dape-kerple-D8')
        assert all(c['p_value'][L]['status'] == 'ok' for L in ('16', '32'))
        md = open(os.path.join(tmp_path, tree, 'results.md')).read()
        assert f"dape-kerple-D8[dape.py={tag}] vs dape-kerple-D8 |" in md
        assert [r['dape_py']['tag'] for r in res['runs']] == [None, None, tag, tag]
        tables[tree] = [[r['results'][L]['ppl'] for L in ('16', '32')] for r in res['runs']]
    # the same figures in both trees, to rounding: no checkpoint ran the other's f
    np.testing.assert_allclose(tables["edited"], tables["committed"], rtol=1e-6)

    # resumed in the committed tree, the ablation continues with its own f, and its saves keep recording it
    run = dict(TRAIN, seed=0, data_root=str(repo / 'data'), out_dir=ablation[0], init_from='resume', max_iters=6)
    text = python(repo, '-c', f"import train\ntrain.train({run!r})")
    assert "was trained with another dape.py than this one (an uncommitted edit" in text, text
    ckpt = torch.load(os.path.join(ablation[0], 'ckpt.pt'), weights_only=True)
    assert ckpt['iter_num'] == 6 and ckpt['dape_py'] == record


def test_a_recorded_dape_py_builds_the_model_and_its_code_is_readable(tmp_path, capsys):
    """A checkpoint's recorded dape.py, other than the one here, builds its model (once per definition, said
    once); inspect reads that module's source (what fingerprint.py and dape_paths.py decide by); a checkpoint
    older than the record, or one whose record is the dape.py here or differs from it in comments alone, builds
    with dape.py."""
    here = common.dape_here()
    edited = here.replace(ACTIVATION, "nn.SiLU(),")
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, pos='kerple', dape='v1')
    path = str(tmp_path / 'ckpt.pt')
    torch.save({'model': GPT(config).state_dict(), 'model_args': vars(config).copy(),
                'dape_py': {'sha256': common.sha256(edited), 'edited': True, 'source': edited}}, path)
    model, _ = common.load_checkpoint(path)
    f = model.transformer.h[0].attn.dape
    assert isinstance(f.mlp[1], torch.nn.SiLU) and type(f).__module__ != 'dape'
    assert inspect.getsource(type(f)) in edited
    assert "was trained with another dape.py than this one (an uncommitted edit" in capsys.readouterr().out
    again, _ = common.load_checkpoint(path)
    assert type(again.transformer.h[0].attn.dape) is type(f) and capsys.readouterr().out == ''
    commented = here + "\n# a comment\n"  # the same code: dape.py's module, and no note
    for record in (None, {'sha256': common.sha256(here), 'edited': False, 'source': here},
                   {'sha256': common.sha256(commented), 'edited': True, 'source': commented}):
        torch.save({'model': GPT(config).state_dict(), 'model_args': vars(config).copy(), 'dape_py': record}, path)
        assert type(common.load_checkpoint(path)[0].transformer.h[0].attn.dape) is dape.DAPEV1
    assert capsys.readouterr().out == ''


def test_a_damaged_record_is_refused(tmp_path):
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, pos='kerple', dape='v1')
    path = str(tmp_path / 'ckpt.pt')
    torch.save({'model': GPT(config).state_dict(), 'model_args': vars(config).copy(),
                'dape_py': {'sha256': '0' * 64, 'edited': True, 'source': common.dape_here()}}, path)
    with pytest.raises(ValueError, match="record of dape.py is damaged"):
        common.load_checkpoint(path)


def test_which_runs_are_labelled_by_their_dape_py():
    """The short hash labels a DAPE model trained with an edited dape.py, or outside git with code other than the
    dape.py here; not the committed dape.py, nor one edited in a comment alone, nor a model without DAPE, nor a
    checkpoint older than the record."""
    here = common.dape_here()
    edited, commented = here.replace(ACTIVATION, "nn.SiLU(),"), here + "\n# a comment\n"

    def tag(was_edited, source, dape='v1'):
        record = {'sha256': common.sha256(source), 'edited': was_edited, 'source': source}
        return common.dape_of_run({'model_args': {'dape': dape}, 'dape_py': record})['tag']
    assert tag(True, edited) == tag(None, edited) == common.sha256(edited)[:7]
    assert tag(False, edited) is None and tag(None, here) is None and tag(None, commented) is None
    assert tag(True, edited, dape='none') is None
    assert common.dape_of_run({'model_args': {'dape': 'v1'}}) is None


def test_an_ablation_is_compared_with_its_baseline_and_with_x():
    def group(label, dape='v1', tag=None):
        return {'label': label, 'model_args': dict(pos='kerple', dape=dape, block_size=16), 'training': {'lr': 1},
                'data_dir': 'd', 'dape_py': {'tag': tag} if tag else None}
    x, base, ablation = group('kerple', 'none'), group('dape-kerple'), group('dape-kerple[dape.py=abc]', tag='abc')
    assert common.base_label(common.setting_of(ablation)['model']) == 'dape-kerple[dape.py=abc]'
    pairs = [(a['label'], b['label']) for a, b in E.comparison_pairs([x, base, ablation])]
    assert sorted(pairs) == [('dape-kerple', 'kerple'), ('dape-kerple[dape.py=abc]', 'dape-kerple'),
                             ('dape-kerple[dape.py=abc]', 'kerple')]


def test_the_record_says_whether_the_code_differs_from_the_commit(monkeypatch):
    """'edited' compares the code with the committed dape.py's: a comment is no edit, an activation swapped is."""
    out = subprocess.run(['git', 'show', 'HEAD:./dape.py'], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: there is no committed dape.py to compare with")
    for text, edited in ((out.stdout + "\n# a comment\n", False), (out.stdout.replace(ACTIVATION, "nn.SiLU(),"), True)):
        monkeypatch.setattr(common, 'dape_here', lambda: text)
        assert common.dape_record() == {'sha256': common.sha256(text), 'edited': edited, 'source': text}


def test_a_resume_with_a_damaged_record_is_refused(tmp_path):
    make_data(tmp_path / 'data')
    run = dict(TRAIN, seed=0, data_root=str(tmp_path / 'data'), out_dir=str(tmp_path / 'out'), max_iters=1,
               eval_interval=1)
    train.train(run)
    path = tmp_path / 'out' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    ckpt['dape_py']['sha256'] = '0' * 64
    torch.save(ckpt, path)
    with pytest.raises(train.CheckpointError, match="record of dape.py is damaged.*It cannot be resumed"):
        train.train(dict(run, init_from='resume', max_iters=2))
