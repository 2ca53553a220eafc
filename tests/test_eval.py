"""eval_extrapolate.py (protocol, outputs, statistics, timing) and visualize.py, on tiny checkpoints made here."""
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
import results
import eval_extrapolate as E
from common import InputError, pick_device
import visualize as V
from configurator import ConfigError
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=16)


def make_data(root, name='tiny', n=3000, tokenizer='byte', seed=0):
    d = os.path.join(root, 'data', name)
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab, dtype = (256, 'uint8') if tokenizer == 'byte' else (50257, 'uint16')
    rng.integers(0, min(vocab, 200), size=n).astype(dtype).tofile(os.path.join(d, 'val.bin'))
    meta = {'vocab_size': vocab, 'tokenizer': tokenizer, 'dtype': dtype,
            'eot_token': 30 if tokenizer == 'byte' else 50256, 'val_tokens': n}
    with open(os.path.join(d, 'meta.json'), 'w') as f:
        json.dump(meta, f)
    return d


def make_ckpt(root, run, seed=0, dataset='tiny', train=None, iter_num=7, **kw):
    """A checkpoint in train.py's format (random weights) at root/out/run/ckpt.pt. `train` updates its
    training config; train=False saves none (checkpoints older than the config)."""
    torch.manual_seed(seed)
    args = dict(TINY, **kw)
    model = GPT(GPTConfig(**args))
    out = os.path.join(root, 'out', run)
    os.makedirs(out, exist_ok=True)
    ckpt = {'model': model.state_dict(), 'optimizer': {}, 'model_args': dataclasses.asdict(model.config),
            'iter_num': iter_num, 'best_val_loss': 5.0, 'dataset': dataset,
            'config': dict(args, dataset=dataset, data_root=os.path.join(root, 'data'), seed=seed, out_dir=out,
                           learning_rate=6e-4, max_iters=100, batch_size=4)}
    if train is False:
        del ckpt['config']
    else:
        ckpt['config'].update(train or {})
    torch.save(ckpt, os.path.join(out, 'ckpt.pt'))
    return out


def cfg(**kw):
    c = {k: getattr(E, k) for k in E.config_keys}
    c.update(plot=False, device='cpu', eval_tokens=16, num_windows=4, max_length=128)
    c.update(kw)
    return c


# -----------------------------------------------------------------------------
# protocol


def test_window_ends_deterministic_on_a_grid_and_leave_room():
    a = E.window_ends(3000, 512, 256, 5, seed=3)
    assert np.array_equal(a, E.window_ends(3000, 512, 256, 5, seed=3))
    assert not np.array_equal(a, E.window_ends(3000, 512, 256, 5, seed=4))
    assert len(a) == 5 and a.min() >= 512 and a.max() <= 2999
    assert all((2999 - e) % 256 == 0 for e in a)  # grid of step K: scored stretches never overlap
    assert len(set(a.tolist())) == 5
    assert len(E.window_ends(600, 512, 256, 10, seed=0)) == 1  # only room for one
    # the last candidate: a window of exactly `longest` inputs ending at the split's last token
    assert E.window_ends(513, 512, 64, 3, seed=0).tolist() == [512]
    assert E.window_ends(513 + 64, 512, 64, 3, seed=0).tolist() == [512, 576]
    with pytest.raises(InputError):
        E.window_ends(100, 512, 256, 5, seed=0)
    with pytest.raises(InputError, match='a window of 513 tokens'):  # 512 inputs and the target after them
        E.window_ends(512, 512, 256, 10, seed=0)


def test_only_the_last_k_targets_are_scored():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, pos='kerple', dape='v1')).eval()
    L, K = 40, 8
    x = torch.randint(0, 256, (3, L))
    y = torch.randint(0, 256, (3, L))
    y_poisoned = y.clone()
    y_poisoned[:, :-K] = 10 ** 6  # would make cross_entropy fail if any of them were read
    ce = E.score_windows(model, x, y_poisoned, K, batch=2, dev='cpu', ctx=torch.no_grad())
    assert ce.shape == (3, K)
    with torch.no_grad():
        logits, _ = model(x, y)
        manual = F.cross_entropy(logits[:, -K:].reshape(-1, 256), y[:, -K:].reshape(-1), reduction='none')
        masked = y.clone()
        masked[:, :-K] = -1  # the model's own loss with only the last K targets kept
        _, loss = model(x, masked)
    np.testing.assert_allclose(ce.reshape(-1), manual.numpy(), rtol=1e-5, atol=1e-6)
    assert abs(ce.mean() - loss.item()) < 1e-5
    # shorter than K: refused, not scored on fewer targets than the other lengths
    with pytest.raises(ValueError, match='last 8 targets of windows of 5'):
        E.score_windows(model, x[:, :5], y[:, :5], K, 3, 'cpu', torch.no_grad())


def test_same_scored_tokens_at_every_length(tmp_path):
    data = np.arange(1000) % 251
    ends = E.window_ends(len(data), 256, 16, 4, seed=1)
    scored = [E.windows(data, ends, L)[1][:, -16:] for L in (16, 64, 256)]
    assert all(torch.equal(scored[0], s) for s in scored[1:])
    x, y = E.windows(data, ends, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert all(int(y[i, -1]) == data[e] for i, e in enumerate(ends))


def test_every_length_of_a_table_scores_the_same_targets(tmp_path, monkeypatch):
    """Each column averages exactly the same target tokens: by default the last half of the shortest length
    of every window, with windows enough for 4096 scored tokens per cell; a K that would leave the shortest
    column with fewer targets than the others is refused, naming the fix."""
    root = str(tmp_path)
    make_data(root, n=20000)
    run = make_ckpt(root, 'kerple_s1', 1, pos='kerple')
    scored = {}
    real = E.score_windows

    def spy(model, x, y, K, *args, **kw):
        scored[x.shape[1]] = y[:, -K:].clone()
        return real(model, x, y, K, *args, **kw)
    monkeypatch.setattr(E, 'score_windows', spy)
    res = E.evaluate(cfg(out_dir=os.path.join(root, 'res'), eval_tokens=0, num_windows=0, lengths='24,48,96'), [run])
    assert res['protocol']['eval_tokens'] == 12 and res['protocol']['num_windows'] == math.ceil(4096 / 12)
    assert sorted(scored) == [24, 48, 96]
    assert all(torch.equal(scored[24], scored[L]) for L in (48, 96)), "two lengths scored different targets"
    assert all(res['runs'][0]['results'][L]['n_tokens'] == 12 * 342 for L in (24, 48, 96))
    # the targets are the data at the recorded window ends
    ends = list(res['protocol']['data'].values())[0]['window_ends']
    data = np.fromfile(os.path.join(root, 'data', 'tiny', 'val.bin'), dtype=np.uint8)
    assert [int(v) for v in scored[96][:, -1]] == [int(data[e]) for e in ends]
    # the defaults: half the shortest length, at most the paper's 256; at least 16 windows
    assert E.scored_tokens([64, 128]) == (32, 128)
    assert E.scored_tokens([512, 8192]) == (256, 16)
    assert E.scored_tokens([64], 64, 3) == (64, 3)
    with pytest.raises(InputError, match=r'--eval_tokens=100 is more than the shortest evaluation length 24.*'
                                         r'--eval_tokens=<=24'):
        E.evaluate(cfg(out_dir=os.path.join(root, 'r2'), eval_tokens=100, lengths='24,48,96'), [run])


def test_the_captions_count_the_windows_drawn_not_those_asked_for(tmp_path):
    """A validation split with room for fewer windows than --num_windows asks gives fewer: the protocol, results.md
    and every caption state the count drawn (what each cell averages), and the count asked is kept beside it."""
    root = str(tmp_path)
    make_data(root, n=400)
    run = make_ckpt(root, 'k', 1, pos='kerple')
    res = E.evaluate(cfg(out_dir=os.path.join(root, 'r'), num_windows=100, lengths='32'), [run])
    drawn = len(list(res['protocol']['data'].values())[0]['window_ends'])
    assert drawn < 100 and res['protocol']['num_windows'] == drawn and res['protocol']['num_windows_asked'] == 100
    assert res['runs'][0]['results'][32]['n_tokens'] == 16 * drawn
    assert f"{drawn} windows per length" in open(os.path.join(root, 'r', 'results.md')).read()


def test_evaluate_protocol_tables_and_files(tmp_path):
    root = str(tmp_path)
    make_data(root, n=3000)
    runs = [make_ckpt(root, 'kerple_s1', 1, pos='kerple'), make_ckpt(root, 'kerple_s2', 2, pos='kerple'),
            make_ckpt(root, 'dape_kerple_s1', 1, pos='kerple', dape='v1'),
            make_ckpt(root, 'dape_kerple_s2', 2, pos='kerple', dape='v1'),
            make_ckpt(root, 'learned', 0, pos='learned')]
    out = os.path.join(root, 'res')
    res = E.evaluate(cfg(out_dir=out, plot=True, lengths='16,32,64,128,4096'), [os.path.join(root, 'out')])
    assert res['lengths'] == [16, 32, 64, 128, 4096]
    by_name = {r['name']: r for r in res['runs']}
    assert len(by_name) == 5
    for r in res['runs']:
        assert r['results'][4096] == {'status': 'too long'}  # the split holds 3000 tokens
        for L in (16, 32, 64, 128):
            if r['name'] != 'learned':
                assert r['results'][L]['n_tokens'] == 16 * 4  # the same number of scored tokens
    assert by_name['learned']['results'][64] == {'status': 'n/a: learned'}
    assert by_name['learned']['results'][32]['status'] == 'ok'  # up to its training length
    # the labels group seeds; the p-value compares DAPE-Kerple with Kerple
    groups = {g['label']: g for g in res['groups']}
    assert set(groups) == {'kerple', 'dape-kerple', 'learned'}
    assert groups['kerple']['n'] == 2 and groups['kerple']['ppl'][64]['std'] is not None
    vals = [by_name[n]['results'][64]['ppl'] for n in ('kerple_s1', 'kerple_s2')]
    assert groups['kerple']['ppl'][64]['mean'] == pytest.approx(np.mean(vals))
    assert groups['kerple']['ppl'][64]['std'] == pytest.approx(np.std(vals, ddof=1))
    (cmp,) = res['comparisons']
    assert (cmp['label'], cmp['baseline']) == ('dape-kerple', 'kerple')
    assert 0 <= cmp['p_value'][64]['p'] <= 1 and cmp['p_value'][4096] == {'status': 'too long'}
    # beside Welch's p, the exact permutation test (2 seeds a side: 6 splits, p at least 2/6) and its Holm
    # adjustment over the table's tests (the four lengths each model can serve)
    vals = lambda label, L: groups[label]['ppl'][L]['values']
    tests = [cmp['p_value'][L] for L in (16, 32, 64, 128)]
    assert [t['p_exact'] for t in tests] == [results.permutation_test(vals('dape-kerple', L), vals('kerple', L))['p']
                                             for L in (16, 32, 64, 128)]
    assert tests[0]['p_min'] == pytest.approx(1 / 3) and [t['p_holm'] for t in tests] == results.holm(
        [t['p_exact'] for t in tests])
    table = E.pvalue_table(res['comparisons'], res['lengths'])
    assert f"{tests[2]['p']:.3g} (exact {results.p_text(tests[2]['p_exact'])}, Holm {results.p_text(tests[2]['p_holm'])})" \
        in table.splitlines()[2]
    assert 'for the 4 comparisons of this table. Smallest possible exact p: 0.33 with 2 and 2 seeds.' in table
    # ppl and bpb are consistent; byte data gets bits per byte
    r = by_name['kerple_s1']['results'][64]
    assert r['ppl'] == pytest.approx(math.exp(r['loss'])) and r['bpb'] == pytest.approx(r['loss'] / math.log(2))

    # files: JSON without NaN, Markdown and CSV tables with every model and length, a PNG
    def no_nan(x):
        raise AssertionError(f"{x} in results.json")
    with open(os.path.join(out, 'results.json')) as f:
        saved = json.load(f, parse_constant=no_nan)
    assert saved['lengths'] == [16, 32, 64, 128, 4096] and len(saved['runs']) == 5
    ends = list(saved['protocol']['data'].values())[0]['window_ends']
    assert len(ends) == 4 and saved['runs'][0]['results']['64']['window_loss']
    md = open(os.path.join(out, 'results.md')).read()
    for s in ('| model | n | 16 | 32 | 64 | 128 | 4096 |', 'dape-kerple', 'n/a: learned', 'too long', 'Bits per byte',
              "Welch", '±', 'exact permutation test', 'Holm'):
        assert s in md
    rows = open(os.path.join(out, 'results.csv')).read().strip().splitlines()
    assert rows[0] == 'run,model,seed,metric,16,32,64,128,4096' and len(rows) == 1 + 5 * 2  # ppl and bpb
    assert 'nan' not in open(os.path.join(out, 'results.csv')).read().lower()
    with open(os.path.join(out, 'ppl_vs_length.png'), 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'

    # the same windows for another checkpoint evaluated on its own (same data, longest length, seed)
    res2 = E.evaluate(cfg(out_dir=os.path.join(root, 'res2'), lengths='16,32,64,128,4096'), [runs[2]])
    assert res2['protocol']['data'] == res['protocol']['data']
    assert res2['runs'][0]['results'][64]['ppl'] == by_name['dape_kerple_s1']['results'][64]['ppl']


def test_loss_by_position(tmp_path):
    """The buckets cover every position of the longest window once, in order, and their size-weighted
    mean is the mean loss over every target of those windows; the figure is written."""
    root = str(tmp_path)
    make_data(root)
    ck = make_ckpt(root, 'kerple', pos='kerple')
    res = E.evaluate(cfg(lengths='32,64', position_loss=True, plot=True, out_dir=str(tmp_path / 'r')), [ck])
    pl = res['runs'][0]['position_loss']
    assert pl['length'] == 64
    spans = [(a, b) for a, b, _ in pl['buckets']]
    assert spans[0] == (0, 1) and spans[-1][1] == 64 and all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))
    model = GPT(GPTConfig(**TINY, pos='kerple'))
    model.load_state_dict(torch.load(os.path.join(ck, 'ckpt.pt'))['model'])
    data = np.memmap(os.path.join(root, 'data', 'tiny', 'val.bin'), dtype=np.uint8, mode='r')
    x, y = E.windows(data, np.array(res['protocol']['data'][res['runs'][0]['data_dir']]['window_ends']), 64)
    want = E.score_windows(model.eval(), x, y, 64, 4, 'cpu', contextlib.nullcontext()).mean()
    got = sum((b - a) * v for a, b, v in pl['buckets']) / 64
    assert got == pytest.approx(want, abs=1e-5)
    assert json.load(open(tmp_path / 'r' / 'results.json'))['runs'][0]['position_loss']['length'] == 64
    assert open(tmp_path / 'r' / 'loss_by_position.png', 'rb').read(4) == b'\x89PNG'


@pytest.mark.parametrize('kind', ['pi', 'yarn'])
def test_loss_by_position_of_a_scaled_rope_uses_the_longest_lengths_scale(tmp_path, kind):
    """With s derived from the length, the loss by position over the longest windows (64 tokens, twice
    the training length) is read with that length's s = 2, as its own row's figures are: not with the
    s of another length. Checked against the model scaled here by hand and scored position by position."""
    root = str(tmp_path)
    make_data(root)
    ck = make_ckpt(root, 'rope', pos='rope')
    saved = torch.load(os.path.join(ck, 'ckpt.pt'))
    sd = saved['model']  # sharper attention and logits: a random tiny model barely depends on positions
    for k in [k for k in sd if 'c_attn' in k]:
        sd[k] = sd[k] * 20
    sd['transformer.wte.weight'] = sd['lm_head.weight'] = sd['transformer.wte.weight'] * 25  # tied
    torch.save(saved, os.path.join(ck, 'ckpt.pt'))
    res = E.evaluate(cfg(lengths='16,32,64', rope_scaling=kind, position_loss=True, out_dir=str(tmp_path / 'r')), [ck])
    run = res['runs'][0]
    assert run['results'][64]['rope_scale'] == 2.0 and run['position_loss']['length'] == 64
    model = GPT(GPTConfig(**TINY, pos='rope'))
    model.load_state_dict(sd)
    for pe in model.pe:
        pe.set_scaling(kind, 2.0)
    data = np.memmap(os.path.join(root, 'data', 'tiny', 'val.bin'), dtype=np.uint8, mode='r')
    x, y = E.windows(data, np.array(res['protocol']['data'][run['data_dir']]['window_ends']), 64)
    with torch.no_grad():
        logits, _ = model.eval()(x, y)
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction='none').view(x.shape)
    per_position = ce.double().mean(dim=0)
    for a, b, v in run['position_loss']['buckets']:
        assert v == pytest.approx(float(per_position[a:b].mean()), abs=1e-4), (a, b)


def test_rope_context_extension_rows(tmp_path):
    """--rope_scaling evaluates each RoPE checkpoint once per method, labelled; at the training length
    s = 1 and the rows equal the trained RoPE's exactly; past it they differ. Other models are read
    once; a method with no RoPE model is a one-line error."""
    root = str(tmp_path)
    make_data(root)
    runs = [make_ckpt(root, 'kerple', pos='kerple'), make_ckpt(root, 'rope', pos='rope')]
    res = E.evaluate(cfg(lengths='32,64', rope_scaling='none,pi,yarn', out_dir=str(tmp_path / 'r')), runs)
    g = {x['label']: x['ppl'] for x in res['groups']}
    assert list(g) == ['kerple', 'rope', 'rope+pi(s=L/32)', 'rope+yarn(s=L/32)']
    assert g['rope+pi(s=L/32)'][32]['mean'] == g['rope'][32]['mean'] == g['rope+yarn(s=L/32)'][32]['mean']
    assert g['rope+pi(s=L/32)'][64]['mean'] != g['rope'][64]['mean'] != g['rope+yarn(s=L/32)'][64]['mean']
    scaled = next(r for r in res['runs'] if r['label'] == 'rope+yarn(s=L/32)')
    assert scaled['results'][64]['rope_scale'] == 2.0
    fixed = E.evaluate(cfg(lengths='64', rope_scaling='ntk', rope_scale=4.0, out_dir=str(tmp_path / 'r')), runs[1:])
    assert [x['label'] for x in fixed['groups']] == ['rope+ntk(s=4)']
    with pytest.raises(InputError, match='RoPE models only'):
        E.evaluate(cfg(lengths='32', rope_scaling='yarn'), runs[:1])
    with pytest.raises(InputError, match='unknown'):
        E.evaluate(cfg(lengths='32', rope_scaling='linear'), runs)


def test_unequal_training_is_noted_and_marked(tmp_path, capsys):
    """Kerple trained to its max_iters, DAPE-Kerple stopped early at 250 of the same 600: one table and
    one Welch test, but with notes (printed and in results.json) and a marked p-value row."""
    root = str(tmp_path)
    make_data(root)
    six = dict(max_iters=600, gradient_accumulation_steps=1)
    for s in (1, 2):
        make_ckpt(root, f'kerple_s{s}', s, pos='kerple', train=six, iter_num=600)
        make_ckpt(root, f'dape_kerple_s{s}', s, pos='kerple', dape='v1', train=six, iter_num=250)
    out = str(tmp_path / 'r')
    res = E.evaluate(cfg(out_dir=out, lengths='16,32'), [os.path.join(root, 'out')])
    printed = capsys.readouterr().out
    tokens = 4 * 1 * 32  # batch_size x gradient_accumulation_steps x block_size per iteration
    want = ["the compared models were trained for different numbers of iterations: dape-kerple 250, kerple 600",
            f"the compared models were trained for different numbers of tokens: dape-kerple {250 * tokens:,}, "
            f"kerple {600 * tokens:,}",
            "dape_kerple_s1 (dape-kerple) was saved at iteration 250 of its max_iters 600"]
    for w in want:
        assert any(n.startswith(w) for n in res['notes']), (w, res['notes'])
        assert f"note: {w}" in printed
    assert not any('kerple_s1 (kerple)' in n for n in res['notes'])  # finished runs are not flagged
    (c,) = res['comparisons']
    assert c['unequal_training'] == 'different iterations, different tokens seen, stopped before max_iters'
    assert '(!)' in E.pvalue_table(res['comparisons'], res['lengths']).splitlines()[2]
    with open(os.path.join(out, 'results.json')) as f:
        saved = json.load(f)
    assert saved['notes'] == res['notes'] and saved['comparisons'][0]['unequal_training'] == c['unequal_training']
    assert '(!)' in open(os.path.join(out, 'results.md')).read()

    # trained alike, to the end: no note, no marker
    alike = [make_ckpt(root, f'done_{name}_s{s}', s, pos='kerple', dape=dape, train=six, iter_num=600)
             for name, dape in (('k', 'none'), ('dk', 'v1')) for s in (1, 2)]
    res = E.evaluate(cfg(out_dir=out, lengths='16'), alike)
    assert res['notes'] == [] and res['comparisons'][0]['unequal_training'] is None
    assert '(!)' not in E.pvalue_table(res['comparisons'], res['lengths'])


def plot_groups(curves, lengths, block_size=64):
    """A group_runs-like results set for plot_ppl: {(pos, dape): [per-seed perplexities per length]}."""
    groups = []
    for (pos, dape), per_seed in curves.items():
        args = dict(dataclasses.asdict(GPTConfig(**TINY)), pos=pos, dape=dape, block_size=block_size)
        ppl = {}
        for i, L in enumerate(lengths):
            vals = [seed[i] for seed in per_seed]
            m, s = results.mean_std(vals)
            ppl[L] = {'status': 'ok', 'mean': m, 'std': s, 'n': len(vals), 'values': vals}
        groups.append({'label': common.base_label(args), 'n': len(per_seed), 'model_args': args, 'training': None,
                       'data_dir': 'd', 'block_size': block_size, 'ppl': ppl})
    return groups


def cielab(rgb):
    """CIE L*a*b* (D65) of an sRGB colour in [0, 1]: distances in it follow how different colours look."""
    lin = [u / 12.92 if u <= 0.04045 else ((u + 0.055) / 1.055) ** 2.4 for u in rgb[:3]]
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ lin
    fx, fy, fz = (t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116
                  for t in xyz / np.array([0.95047, 1.0, 1.08883]))
    return np.array([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)])


def test_curve_colours_look_different_up_to_twenty_curves():
    # the demo plots 11 models: evenly spaced hues gave two greens 12.8 apart (CIE76), mistaken for each other
    for n in range(1, 21):
        lab = [cielab(c) for c in results.curve_colors(n)]
        gap = min((np.linalg.norm(a - b) for i, a in enumerate(lab) for b in lab[i + 1:]), default=np.inf)
        assert gap > 15, (n, gap)
    assert len({tuple(c) for c in results.curve_colors(30)}) == 30  # beyond twenty: distinct hues


def test_plot_tells_every_curve_apart(tmp_path):
    from matplotlib.colors import to_hex
    lengths = [64, 128, 256, 512, 1024]
    # six models as in the demo: three Kerple curves close together, RoPE far above them; seeds for two
    curves = {('kerple', 'none'): [[5.78, 6.00, 5.98, 6.00, 6.02], [5.80, 5.98, 5.99, 6.01, 6.00]],
              ('kerple', 'v1'): [[5.77, 5.82, 5.76, 5.74, 5.74], [5.75, 5.80, 5.77, 5.75, 5.72]],
              ('kerple', 'v2'): [[5.63, 5.67, 5.60, 5.58, 5.59]],
              ('alibi', 'none'): [[6.27, 6.33, 6.31, 6.28, 6.29]],
              ('alibi', 'v1'): [[6.10, 6.12, 6.08, 6.07, 6.07]],
              ('rope', 'none'): [[5.65, 6.05, 7.77, 15.01, 23.96]]}
    path = str(tmp_path / 'ppl.png')
    fig = results.plot_ppl(plot_groups(curves, lengths), lengths, {'eval_tokens': 256, 'num_windows': 16}, path)
    with open(path, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    full, zoom = fig.axes  # RoPE rises past 2x of the best: a second panel zooms on the others
    lines = {ln.get_label(): to_hex(ln.get_color()) for ln in full.get_lines() if ln.get_label() != 'training length'
             and not ln.get_label().startswith('_')}
    assert len(lines) == 6 and len(set(lines.values())) == 6, lines
    assert set(lines) >= {'kerple (n=2)', 'dape-kerple (n=2)', 'dapev2-kerple', 'rope'}
    zoomed = {ln.get_label(): to_hex(ln.get_color()) for ln in zoom.get_lines() if not ln.get_label().startswith('_')
              and ln.get_label() != 'training length'}
    assert 'rope' not in zoomed and len(zoomed) == 5 and all(lines[k] == v for k, v in zoomed.items())
    assert zoom.get_ylim()[1] < 7  # the zoom spans the close curves, not RoPE's 24
    for ax in (full, zoom):
        assert ax.get_yscale() == 'log' and ax.get_xscale() == 'log'
        assert [t.get_text() for t in ax.get_xticklabels()] == ['64\n1x', '128\n2x', '256\n4x', '512\n8x', '1024\n16x']
    assert full.collections  # bands of one std for the models with two seeds

    # all curves within 2x of the best: one panel, still log, still one colour each
    close = {k: v for k, v in curves.items() if k[0] != 'rope'}
    fig = results.plot_ppl(plot_groups(close, lengths), lengths, {'eval_tokens': 256, 'num_windows': 16}, path)
    assert len(fig.axes) == 1 and fig.axes[0].get_yscale() == 'log'
    assert len({ln.get_color() for ln in fig.axes[0].get_lines() if not ln.get_label().startswith('_')}) == 6


def test_default_lengths_and_labels(tmp_path):
    assert E.default_lengths({512}, 8192) == [512, 1024, 2048, 4096, 8192]
    assert E.default_lengths({128, 512}, 1024) == [128, 256, 512, 1024]
    assert E.default_lengths({16384}, 8192) == [8192]
    base = dict(dataclasses.asdict(GPTConfig(**TINY)))
    runs = [{'model_args': dict(base, pos='kerple'), 'data_dir': 'd'},
            {'model_args': dict(base, pos='kerple', dape='v2', dape_kernel=5), 'data_dir': 'd'},
            {'model_args': dict(base, pos='kerple', n_layer=4), 'data_dir': 'd'},
            {'model_args': dict(base, pos='alibi', dape='v1', dape_variant='add_residual'), 'data_dir': 'd'}]
    assert common.auto_labels(runs) == ['kerple[n_layer=2]', 'dapev2-kerple-k5', 'kerple[n_layer=4]',
                                   'dape-alibi[add_residual]']
    # the attention's options name the run, so that a plain run keeps its label beside them
    runs = [{'model_args': dict(base, pos=p, **kw), 'data_dir': 'd'} for p, kw in [
        ('kerple', {}), ('kerple', dict(logn_scale='learned')), ('kerple', dict(dape='v1', logn_scale='fixed')),
        ('nope', dict(attn='stickbreaking')), ('nope', dict(attn='stickbreaking', sb_current=True, dape='v1'))]]
    assert common.auto_labels(runs) == ['kerple', 'kerple+logn', 'dape-kerple+logn-fixed', 'nope+sb', 'dape-nope+sbc']


def test_labels_override_and_user_errors(tmp_path):
    root = str(tmp_path)
    make_data(root)
    a, b = make_ckpt(root, 'a', 1), make_ckpt(root, 'b', 2)
    res = E.evaluate(cfg(out_dir=str(tmp_path / 'r'), lengths='32', labels='mine,mine'), [a, b])
    assert [g['label'] for g in res['groups']] == ['mine'] and res['groups'][0]['n'] == 2
    with pytest.raises(InputError, match='--labels'):
        E.evaluate(cfg(lengths='32', labels='x'), [a, b])
    with pytest.raises(InputError, match='no checkpoint'):
        E.evaluate(cfg(lengths='32'), [str(tmp_path / 'missing')])
    with open(tmp_path / 'bad.pt', 'wb') as f:
        f.write(b'not a checkpoint')
    with pytest.raises(InputError, match='bad.pt'):
        E.evaluate(cfg(lengths='32'), [str(tmp_path / 'bad.pt')])
    enc = make_ckpt(root, 'encoder', causal=False)
    with pytest.raises(InputError, match='causal'):
        E.evaluate(cfg(lengths='32'), [enc])
    nodata = make_ckpt(root, 'nodata', dataset='absent')
    with pytest.raises(InputError, match='--data_dir'):
        E.evaluate(cfg(lengths='32'), [nodata])
    make_data(root, name='bpe', tokenizer='gpt2')
    with pytest.raises(InputError, match='vocabulary'):
        E.evaluate(cfg(lengths='32', data_dir=os.path.join(root, 'data', 'bpe'), out_dir=str(tmp_path / 'r')), [a])
    with pytest.raises(InputError, match='lengths'):
        E.evaluate(cfg(lengths='32,abc'), [a])


def test_only_seed_replicas_are_grouped(tmp_path):
    root = str(tmp_path)
    make_data(root)
    # differ by seed and by what does not change the training or the function (out_dir, logging, attn_chunk)
    make_ckpt(root, 's1', 1, pos='kerple')
    make_ckpt(root, 's2', 2, pos='kerple', attn_chunk=8, train=dict(eval_interval=5, log_interval=1, compile=True))
    make_ckpt(root, 'lr', 1, pos='kerple', train=dict(learning_rate=3e-3))
    make_ckpt(root, 'dape_lr', 1, pos='kerple', dape='v1', train=dict(learning_rate=3e-3))
    res = E.evaluate(cfg(out_dir=str(tmp_path / 'r'), lengths='16'), [os.path.join(root, 'out')])
    groups = {g['label']: g for g in res['groups']}
    assert set(groups) == {'kerple[learning_rate=0.0006]', 'kerple[learning_rate=0.003]', 'dape-kerple'}
    assert groups['kerple[learning_rate=0.0006]']['seeds'] == [1, 2]
    assert groups['kerple[learning_rate=0.003]']['n'] == 1
    # DAPE-X is compared with the X trained alike only
    assert [(c['label'], c['baseline']) for c in res['comparisons']] == [('dape-kerple', 'kerple[learning_rate=0.003]')]

    # dropout, the number of steps, the batch or the dataset each make another setting
    base = {'model_args': dataclasses.asdict(GPTConfig(**TINY)), 'data_dir': 'd', 'training': {'learning_rate': 1e-3}}
    for other, label in ((dict(base, model_args=dict(base['model_args'], dropout=0.1)), 'kerple[dropout=0.1]'),
                         (dict(base, training={'learning_rate': 1e-3, 'max_iters': 10}), 'kerple[max_iters=10]'),
                         (dict(base, training={'learning_rate': 1e-3, 'batch_size': 8}), 'kerple[batch_size=8]'),
                         (dict(base, training={'learning_rate': 1e-3, 'dataset': 'x'}), 'kerple[dataset=x]'),
                         (dict(base, training=None), 'kerple[no config]')):
        assert common.auto_labels([base, other])[1] == label
    assert common.training_setting({'config': {'seed': 3, 'out_dir': 'o', 'eval_interval': 9, 'learning_rate': 1.0,
                                          'dropout': 0.1}, 'model_args': {'dropout': 0.1}}) == {'learning_rate': 1.0}

    # old checkpoints without a config still group by seed
    make_data(root, name='old')
    old = [make_ckpt(root, f'old{i}', i, dataset='absent', train=False) for i in (1, 2)]
    res = E.evaluate(cfg(out_dir=str(tmp_path / 'r'), lengths='16', data_dir=os.path.join(root, 'data', 'old')), old)
    assert [(g['label'], g['n']) for g in res['groups']] == [('kerple', 2)]


def test_zero_init_is_compared_with_its_encoding_and_with_the_default_init():
    """DAPE-X with f zero at step 0 is set against X and against DAPE-X as the released code initialises it,
    trained alike; never against a default-init DAPE-X trained otherwise, nor one of another DAPE."""
    def group(label, lr=1e-3, **model):
        return {'label': label, 'model_args': dataclasses.asdict(GPTConfig(**TINY, **model)), 'data_dir': 'd',
                'training': {'learning_rate': lr}}
    groups = [group('kerple', pos='kerple'), group('dape-kerple', pos='kerple', dape='v1'),
              group('dape-kerple-zero', pos='kerple', dape='v1', dape_init='zero'),
              group('dapev2-kerple-zero', pos='kerple', dape='v2', dape_init='zero'),
              group('dapev2-kerple', pos='kerple', dape='v2'),
              group('dape-kerple[lr]', lr=3e-3, pos='kerple', dape='v1'),
              group('dape-alibi-zero', pos='alibi', dape='v1', dape_init='zero')]
    pairs = [(a['label'], b['label']) for a, b in E.comparison_pairs(groups)]
    # V2 as V1: its f zero at step 0 against its default init too
    assert pairs == [('dape-kerple', 'kerple'), ('dape-kerple-zero', 'kerple'), ('dape-kerple-zero', 'dape-kerple'),
                     ('dapev2-kerple-zero', 'kerple'), ('dapev2-kerple-zero', 'dapev2-kerple'),
                     ('dapev2-kerple', 'kerple')]


def test_dape_rope_is_compared_with_rope_read_the_same_way():
    """With --rope_scaling every RoPE run is read once per extension: DAPE-RoPE read with PI is set against RoPE
    read with PI, never against another reading (the groups carry how RoPE is read, part of the setting); and two
    labels for one setting are refused rather than one of them taken as the baseline."""
    def run(label, seed, **model):
        return {'label': label, 'path': f'{label}_{seed}', 'seed': seed, 'data_dir': 'd', 'training': {'lr': 1e-3},
                'model_args': dataclasses.asdict(GPTConfig(**dict(TINY, block_size=16), **model)),
                'results': {32: {'status': 'ok', 'ppl': 5.0 + seed, 'bpb': None}}}
    runs = [run('rope', s, pos='rope') for s in (1, 2)] + [run('dape-rope', s, pos='rope', dape='v1') for s in (1, 2)]
    cfg = {'rope_scaling': 'none,pi,yarn', 'rope_scale': 0.0}
    groups = E.group_runs(E.with_rope_scalings(runs, ['none', 'pi', 'yarn'], cfg), [32])
    pairs = [(a['label'], b['label']) for a, b in E.comparison_pairs(groups)]
    assert len(pairs) == 3 and all(a == 'dape-' + b for a, b in pairs), pairs
    twice = [run('kerple', 1, pos='kerple'), run('kerple-again', 2, pos='kerple'), run('dape-kerple', 1, pos='kerple', dape='v1')]
    with pytest.raises(common.InputError, match="'kerple' and 'kerple-again' have the same setting"):
        E.comparison_pairs(E.group_runs(twice, [32]))


def test_pairs_checked_before_evaluation(tmp_path, monkeypatch):
    root = str(tmp_path)
    make_data(root)
    runs = [make_ckpt(root, 'k', 1, pos='kerple'), make_ckpt(root, 'dk', 1, pos='kerple', dape='v1')]

    def no_evaluation(*a, **k):
        raise AssertionError('evaluated before --pairs was checked')
    with monkeypatch.context() as m:
        m.setattr(E, 'evaluate_run', no_evaluation)
        for bad, msg in (('x:y', "no run is labelled \\['x', 'y'\\]"), ('dape-kerple', 'not'),
                         ('dape-kerple:', 'not'), ('kerple:kerple', 'itself')):
            with pytest.raises(InputError, match=msg):
                E.evaluate(cfg(lengths='16', pairs=bad), runs)
    assert results.split_pairs('a[x=1,y=2]:b, c:d,') == ['a[x=1,y=2]:b', 'c:d']
    res = E.evaluate(cfg(out_dir=str(tmp_path / 'r'), lengths='16', pairs='kerple:dape-kerple'), runs)
    assert [(c['label'], c['baseline']) for c in res['comparisons']] == [('kerple', 'dape-kerple')]


def test_tokenizer_mismatch_refused(tmp_path):
    root = str(tmp_path)
    make_data(root, name='chars')
    make_data(root, name='bpe', tokenizer='gpt2')
    byte_data, bpe_data = os.path.join(root, 'data', 'chars'), os.path.join(root, 'data', 'bpe')
    bpe = make_ckpt(root, 'bpe', dataset='bpe', vocab_size=50304)
    lost = make_ckpt(root, 'lost', dataset='absent', vocab_size=50304)  # its training data is not here
    byte = make_ckpt(root, 'byte', dataset='chars')
    with pytest.raises(InputError, match=r"trained on 'gpt2' tokens \(.*bpe/meta.json says so\).*'byte'"):
        E.evaluate(cfg(lengths='16', data_dir=byte_data), [bpe])
    with pytest.raises(InputError, match=r"trained on 'gpt2' tokens \(its vocab_size 50304"):
        E.evaluate(cfg(lengths='16', data_dir=byte_data), [lost])
    with pytest.raises(InputError, match='vocabulary'):  # the other way round: ids past the model's vocabulary
        E.evaluate(cfg(lengths='16', data_dir=bpe_data), [byte])
    # each on its own tokenizer's data is fine
    res = E.evaluate(cfg(out_dir=str(tmp_path / 'r'), lengths='16', data_dir=bpe_data), [lost])
    assert res['runs'][0]['tokenizer'] == 'gpt2' and res['runs'][0]['results'][16]['status'] == 'ok'


def test_missing_gpu_is_reported_as_such(tmp_path, monkeypatch):
    root = str(tmp_path)
    make_data(root)
    a = make_ckpt(root, 'a', 1)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    for dev in ('cuda', 'cuda:1'):
        with pytest.raises(ConfigError, match='no CUDA device available.*--device=cpu'):
            E.evaluate(cfg(lengths='16', device=dev), [a])
    with pytest.raises(ConfigError, match='not a device'):
        E.evaluate(cfg(lengths='16', device='gpu'), [a])
    assert pick_device('auto') == 'cpu'


def test_cli_positional_checkpoints_and_error_exit(tmp_path):
    root = str(tmp_path)
    make_data(root)
    a = make_ckpt(root, 'a', 1)
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'eval_extrapolate.py'), a, '--lengths=16,32',
                        '--eval_tokens=8', '--num_windows=2', '--plot=False', f'--out_dir={tmp_path / "r"}'],
                       capture_output=True, text=True, env=env, cwd=root)
    assert p.returncode == 0, p.stderr
    assert 'L=32' in p.stdout and os.path.exists(tmp_path / 'r' / 'results.md')
    # where the result came from: the evaluation's command, commit, machine and date, and the training's as
    # its checkpoint recorded them ('unknown' for one saved before the record, as this one)
    saved = json.loads((tmp_path / 'r' / 'results.json').read_text())
    evaluated = saved['protocol']['evaluated_by']
    assert evaluated['command'] == f"python eval_extrapolate.py {a} --lengths=16,32 --eval_tokens=8 --num_windows=2 " \
                                   f"--plot=False --out_dir={tmp_path / 'r'}"
    assert evaluated['commit'] == common.code_version() and evaluated['machine'] == common.machine_text('cpu')
    assert evaluated['date'] == __import__('datetime').date.today().isoformat()
    assert saved['runs'][0]['trained_by'] == dict.fromkeys(('commit', 'command', 'machine', 'date'), 'unknown')
    ck = torch.load(os.path.join(a, 'ckpt.pt'), weights_only=True)
    ck['provenance'] = [(0, {'commit': 'c1', 'command': 'python train.py x', 'date': '2026-01-01', 'machine': 'm'}),
                        (5, {'commit': 'c2', 'command': 'python train.py x --init_from=resume', 'date': '2026-01-01',
                             'machine': 'm'})]
    ck['machines'] = [(0, 'CPU A'), (5, 'CPU B')]
    assert common.trained_by(ck) == {'commit': 'c1 ; c2', 'command': 'python train.py x ; python train.py x --init_from=resume',
                                'machine': 'CPU A ; CPU B', 'date': '2026-01-01'}
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'eval_extrapolate.py'), str(tmp_path / 'nope')],
                       capture_output=True, text=True, env=env, cwd=root)
    assert p.returncode == 2 and 'no checkpoint' in p.stderr and 'Traceback' not in p.stderr


# -----------------------------------------------------------------------------
# statistics


def test_holm_is_over_every_test_of_the_pvalue_table():
    """holm_table adjusts the exact p over every pair and length of the table, a length without a test left out."""
    def comparison(label, pairs):
        return {'label': label, 'baseline': 'kerple', 'p_value': {
            L: {'status': 'too long'} if v is None else
            dict(results.compare_means(*v), mean_diff=0.0) for L, v in pairs.items()}}
    apart = ([1.0, 1.1, 1.2, 1.3], [2.0, 2.1, 2.2, 2.3])  # exact p 2/70
    comparisons = [comparison('dape-kerple', {16: apart, 32: None}), comparison('dapev2-kerple', {16: apart, 32: apart})]
    assert E.holm_table(comparisons, [16, 32]) == 3
    assert [c['p_value'][L].get('p_holm') for c in comparisons for L in (16, 32)] == pytest.approx(
        [3 * 2 / 70, None, 3 * 2 / 70, 3 * 2 / 70])


def test_welch_ttest_known_values():
    # scipy.stats.ttest_ind(a, b, equal_var=False), computed once with scipy 1.17
    t, df, p = results.welch_ttest([4.5123, 4.4875, 4.5371], [4.5817, 4.5565, 4.6069])
    assert t == pytest.approx(-3.3997829716686114, rel=1e-10)
    assert df == pytest.approx(3.998976393069252, rel=1e-10)
    assert p == pytest.approx(0.027293651904141195, rel=1e-9)
    t, df, p = results.welch_ttest([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0, 8.0, 10.0, 12.0])
    assert (t, df, p) == pytest.approx((-2.3763541031440183, 6.972255729794934, 0.04928433820673053), rel=1e-9)
    assert results.welch_ttest([1.0, 2.0], [1.0, 2.0])[2] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        results.welch_ttest([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        results.welch_ttest([1.0, 1.0], [2.0, 2.0])


def test_betainc_identities():
    for x in (0.01, 0.3, 0.5, 0.9, 0.999):
        assert results.betainc(1.0, 1.0, x) == pytest.approx(x, rel=1e-12)
        assert results.betainc(3.0, 1.0, x) == pytest.approx(x ** 3, rel=1e-10)
        assert results.betainc(2.0, 5.0, x) == pytest.approx(1 - results.betainc(5.0, 2.0, 1 - x), abs=1e-12)
    assert results.betainc(7.5, 7.5, 0.5) == pytest.approx(0.5, abs=1e-12)
    assert results.betainc(2.5, 0.5, 0.3) == pytest.approx(0.018927124071945658, rel=1e-10)  # scipy.special.betainc


def test_welch_matches_scipy_on_random_inputs():
    stats = pytest.importorskip('scipy.stats')
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(rng.uniform(-1, 1), rng.uniform(0.1, 3), size=rng.integers(2, 9))
        b = rng.normal(rng.uniform(-1, 1), rng.uniform(0.1, 3), size=rng.integers(2, 9))
        ref = stats.ttest_ind(a, b, equal_var=False)
        t, df, p = results.welch_ttest(a, b)
        assert t == pytest.approx(ref.statistic, rel=1e-9) and p == pytest.approx(ref.pvalue, rel=1e-7, abs=1e-14)


# -----------------------------------------------------------------------------
# visualize.py


@pytest.mark.parametrize('kw', [
    dict(pos='kerple', dape='v1'),
    dict(pos='alibi', dape='v2', dape_variant='concat'),
    dict(pos='t5', dape='v1', dape_variant='bias_only'),
    dict(pos='fire', dape='v1', dape_variant='add_residual'),
    dict(pos='rope', dape='v1'),
    dict(pos='cope', dape='v2'),
    dict(pos='xl', dape='none'),
    dict(pos='kerple', dape='none'),
    dict(pos='fox', dape='v1'),
    dict(pos='fox', dape='none'),
    dict(pos='kerple', dape='v1', attn='stickbreaking'),
    dict(pos='nope', dape='none', attn='stickbreaking', sb_current=True, logn_scale='learned'),
    dict(pos='alibi', dape='v2', logn_scale='fixed'),
    dict(pos='kerple', dape='v1', dape_variant='concat'),
])
def test_visualized_terms_reproduce_the_layer(kw):
    """A, B and f recomputed for chosen query rows give back the layer's actual output, and the terms
    add up to the logits as the variant says."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(TINY, **kw))).eval()
    idx = torch.randint(0, 256, (1, 50))  # longer than block_size = 32
    caps = V.capture_layers(model, idx, [0, 1])
    for layer in (0, 1):
        c = caps[layer]
        rows = [0, 17, 49]
        t = V.layer_terms(model.transformer.h[layer].attn, c['x'], c['pe'], c['pos_q'], rows)
        torch.testing.assert_close(t['out'], c['out'][0, rows], rtol=1e-4, atol=1e-6)
        if kw.get('attn') == 'stickbreaking':  # the weights of a broken stick sum to at most 1
            assert (t['att'].sum(-1) <= 1 + 1e-6).all() and (t['att'][:, 0, 1:] == 0).all()
            if not kw.get('sb_current'):  # keys before the query only: row 0 sees none
                assert (t['att'][:, 0] == 0).all()
        else:
            torch.testing.assert_close(t['att'].sum(-1), torch.ones(2, 3))
            assert (t['att'][:, 0, 1:] == 0).all()  # causal: row 0 sees key 0 only
        if kw['dape'] == 'none':
            assert t['f'] is None
        if kw.get('dape_variant', 'concat_residual') == 'concat_residual' and kw['pos'] in ('kerple', 'fox') and \
                t['f'] is not None:
            torch.testing.assert_close(t['logits'], t['A'] + t['B'] + t['f'])
        if kw.get('dape_variant') == 'concat':  # A + f: the bias is f's input only
            torch.testing.assert_close(t['logits'], t['A'] + t['f'])
        if kw['pos'] == 'rope':
            assert t['B'] is None


def test_visualize_writes_figures(tmp_path):
    root = str(tmp_path)
    make_data(root)
    ck = make_ckpt(root, 'dape_kerple', pos='kerple', dape='v1')
    c = {k: getattr(V, k) for k in V.config_keys}
    c.update(length=100, heatmap_len=12, layers='all', out_dir=str(tmp_path / 'vis'), device='cpu')
    written = V.visualize(c, ck)
    names = sorted(os.path.basename(w) for w in written)
    assert names == ['dape_kerple_layer0_heatmap12.png', 'dape_kerple_layer0_q99_rows.png',
                     'dape_kerple_layer1_heatmap12.png', 'dape_kerple_layer1_q99_rows.png', 'dape_kerple_terms.npz']
    arr = np.load(tmp_path / 'vis' / 'dape_kerple_terms.npz')
    assert arr['layer0_q99_f'].shape == (2, 100) and arr['layer1_heatmap_B'].shape == (2, 12, 12)
    for w in written[:-1]:
        assert open(w, 'rb').read(4) == b'\x89PNG'
    # random tokens (no data), a chosen query, learned capped at its table
    ck2 = make_ckpt(root, 'learned', pos='learned')
    c.update(random=True, query=10, layers='-1', heatmap_len=0, length=8192)
    written = V.visualize(c, ck2)
    assert [os.path.basename(w) for w in written] == ['learned_layer1_q10_rows.png', 'learned_terms.npz']
    with pytest.raises(InputError, match='layers'):
        V.visualize(dict(c, layers='5'), ck2)


def test_far_mass_is_the_attention_beyond_the_training_length():
    """probe.far_mass against attention computed by hand for one ALiBi layer (slopes 2^-4 and 2^-8 for two
    heads): the mass of the last K queries on keys at least `distance` back, per head."""
    import probe
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(TINY, n_layer=1), pos='alibi')).eval()
    L, K, distance = 40, 6, 16
    x = torch.randint(0, 256, (3, L))
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        h = model.transformer.h[0].ln_1(model.transformer.wte(x))
        q, k, _ = attn.c_attn(h).split(16, dim=2)
        q, k = q.view(3, L, 2, 8).transpose(1, 2), k.view(3, L, 2, 8).transpose(1, 2)
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        slopes = torch.tensor([2 ** -4, 2 ** -8])[:, None, None]
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(8) - slopes * (i - j)
        att = torch.softmax(logits.masked_fill(j > i, float('-inf')), dim=-1)[:, :, -K:]
        want = (att * ((i - j) >= distance)[-K:]).sum(-1).mean(-1).mean(0)
    got = probe.far_mass(model, x, K, distance)
    assert np.allclose(got[0], want.numpy(), atol=1e-5), (got, want)
    assert 0 < got[0][1] < 1 and got[0][1] > got[0][0]  # the flatter head reaches farther
    assert probe.far_mass(model, x[:, :distance], K, distance) == [[0.0, 0.0]]  # no key that far


def test_far_mass_of_a_run_is_measured_at_the_training_length():
    """eval_extrapolate's far mass at each evaluation length is probe.far_mass of that length's windows, keys
    counted as far from the training length back (not from the window's length)."""
    import probe
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, pos='alibi')).eval()
    data = np.arange(1000) % 251
    ends = E.window_ends(len(data), 96, 8, 3, seed=0)
    mass, _ = E.far_mass_of_run(model, data, ends, [32, 96], 8, 32, 'cpu', cfg())
    assert mass[96] == probe.far_mass(model, E.windows(data, ends, 96)[0], 8, 32)
    assert mass[32] == [[0.0, 0.0]] * 2 and all(v > 0 for layer in mass[96] for v in layer)


def test_head_values_are_what_the_encoding_learned():
    """Kerple's r1 and r2 per layer and head as stored, and the bias the model adds at each distance (the
    forward's clamp included)."""
    import probe
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, pos='kerple'))
    with torch.no_grad():
        model.pe[1].r1[0] = -1.0  # below the forward's clamp at 0.01
    got = probe.head_values(model, [1, 100])
    assert len(got) == 2
    for pe, vals in zip(model.pe, got):
        assert vals['r1'] == pytest.approx(pe.r1.flatten().tolist(), abs=1e-6)
        assert vals['r2'] == pytest.approx(pe.r2.flatten().tolist(), abs=1e-6)
        r1, r2 = pe.r1.flatten().clamp(min=0.01), pe.r2.flatten().clamp(min=0.01)
        for d in (1, 100):
            want = (-r1 * torch.log1p(r2 * d)).tolist()
            assert vals['bias_at'][str(d)] == pytest.approx(want, abs=1e-5)


def test_a_failed_write_leaves_the_previous_results_whole(tmp_path):
    """A value that cannot be written (a NaN perplexity from a diverged checkpoint) raises before results.json is
    opened: the results already there survive whole."""
    (tmp_path / 'results.json').write_text('{"kept": true}')
    with pytest.raises(ValueError, match='non-finite'):
        results.write_ppl_results(str(tmp_path), {'ppl': float('nan')}, [], [], [], [16], make_plot=False)
    assert json.loads((tmp_path / 'results.json').read_text()) == {'kept': True}
