"""
Length extrapolation: perplexity of trained checkpoints at evaluation lengths beyond the training
length, as in the DAPE paper (§4, Figure 2, Table 5). Table 1's timing is bench.py's `timing` section.

    python eval_extrapolate.py out/kerple out/dape_kerple                 # one row per checkpoint
    python eval_extrapolate.py out/kerple_s* out/dape_kerple_s*           # seeds grouped, p-values
    python eval_extrapolate.py out/kerple --lengths=512,1024,8192 --num_windows=64

Protocol (paper §4 "Datasets" and Appendix, "the last 256 tokens"; docs/evaluation.md):
- For an evaluation length L, a window is L+1 consecutive tokens of the validation split. The model
  reads the whole window's first L tokens, and only the last K = `eval_tokens` targets are scored, the
  same K at every length: by default half the shortest evaluated length, at most 256 (the paper's 256 for
  its shortest length, 512), so that even the shortest column's scored tokens have context before them.
  A K longer than the shortest length would score fewer targets there than elsewhere: it is refused.
- Window positions are drawn once, with `seed`, as window END positions, and shared by every length
  and every checkpoint: at each L the same K target tokens are scored, with more or less left context.
  So the columns differ only in context length, never in which tokens are scored. The ends are drawn
  from the positions that leave room for the longest evaluated length (so no window is cut short),
  on a grid of step K so that the scored stretches of two windows never overlap. They depend only on
  the validation data, the longest length, K, `num_windows` and `seed` (all recorded in results.json).
- Perplexity = exp(mean cross-entropy over all scored tokens); for byte data also bits per byte
  (mean cross-entropy / ln 2). A length the validation split cannot hold is reported as 'too long';
  a length a `learned` model cannot encode as 'n/a: learned'. Nothing is silently NaN.
- Checkpoints that differ only by their seed form a group: same model options and same training
  config (learning rate, steps, batch, dropout, dataset, ...; settings that do not change what is
  trained, like out_dir or eval_interval, may differ). A group gets mean ± std (sample std, ddof=1) per
  length, and for every DAPE-X group whose plain X group (trained alike) is also present, Welch's
  two-sided t-test p-value per length (Table 5), the exact permutation test's two-sided p (which cannot
  go below what the seed counts allow: 0.1 with 3 and 3) with its Holm adjustment over every comparison
  of the table, and the difference of the mean perplexities with its 95% confidence interval
  (Welch-Satterthwaite degrees of freedom); a DAPE-X group with f zero at step 0 (dape_init='zero') also
  against the same DAPE-X with the default init, and one trained with an edited dape.py (an ablation of f,
  labelled dape-x[dape.py=<its sha256's first 7 digits>]) against the same DAPE-X with the committed one,
  where it is present. Each checkpoint's model runs the dape.py it was trained with, which it records, so an
  ablation and its baseline are evaluated in one call in either tree.
- Models trained for unequal lengths are compared with a note (printed, and under 'notes' in
  results.json): labels that differ in training iterations or tokens seen, and checkpoints saved before
  their own max_iters. The Welch rows of such pairs are marked (!).
- The data must be in the tokenizer the model was trained with; a mismatch is an error.

Outputs (`out_dir`, default results/): results.json (everything, including per-window losses),
results.md, results.csv and ppl_vs_length.png (Figure 2 for your runs).
"""

import csv
import dataclasses
import json
import math
import os
import shlex
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from common import (InputError, auto_labels, autocast, checkpoints_and_config, dape_of_run, find_checkpoints,
                    find_data_dir, load_run, load_val, parse_list, pick_device, pick_dtype, provenance,
                    resolve_data_dir, rope_scaling_options, setting_of, trained_by, training_data_dirs,
                    training_setting)
from results import (compare_means, difference_text, format_table, group_over_seeds, holm_over, jsonable, mean_std_text,
                     p_text, tests_caption)
from configurator import ConfigError
import probe
from positional import rope_scaling_label, set_rope_scaling
from tokenizer import GPT2_VOCAB_SIZE, load_meta, tokenizer_of_vocab

# -----------------------------------------------------------------------------
# configuration: module globals are the defaults; bare arguments that are checkpoints (a directory or a
# .pt file) are taken out of the command line first, the rest goes to configurator.py.
_names_before_config = set(globals())
ckpts = ''               # comma-separated checkpoint dirs/files, in addition to the bare arguments
labels = ''              # comma-separated, one per checkpoint: overrides the automatic labels/grouping
data_dir = ''            # validation data (data/<name>); '' -> from each checkpoint's training config
lengths = ''             # comma-separated evaluation lengths; '' -> training length x 1, 2, 4, ... <= max_length
max_length = 8192        # longest default evaluation length
eval_tokens = 0          # K: targets scored at the end of every window, at every length; 0 -> half the shortest
                         # length, at most 256; more than the shortest length is refused (it would mix counts)
num_windows = 0          # windows per length (all lengths share them); 0 -> enough for MIN_SCORED scored tokens
                         # per cell, at least 16
batch_size = 0           # windows per forward; 0 -> max(1, batch_tokens // L)
batch_tokens = 8192      # tokens per forward when batch_size = 0 (8192 on a CPU: one window at L = 8192)
seed = 1337              # seeds the window positions
device = 'auto'          # auto: cuda if available, else cpu
dtype = 'auto'           # auto: bfloat16 autocast on a GPU that supports it, else float32
out_dir = 'results'
plot = True
position_loss = False    # also the mean loss at every position of the longest length's windows (log-spaced
                         # buckets, results.json and loss_by_position.png): where past training a model degrades
rope_scaling = 'none'    # comma-separated RoPE context extensions (positional.RoPE): none, pi, ntk, yarn;
                         # each RoPE checkpoint is evaluated once per method, a row each (rope+yarn(s=...))
rope_scale = 0.0         # their factor s; 0 -> max(1, L / training length) at each length L
yarn_alpha = 1.0         # YaRN's ramp: dimensions turning < alpha times over the training length are
yarn_beta = 32.0         # interpolated, > beta times kept
far_mass = False         # also each head's attention mass on keys at least the training length back (probe.py),
                         # over the scored queries of the first far_mass_windows windows, and the encoding's
                         # learned values per head: what makes a static bias degrade, measured
far_mass_windows = 16
pairs = ''               # explicit 'dape-kerple:kerple,...'; '' -> every DAPE-X with its X, f zero also with f default
config_keys = [k for k in globals() if k not in _names_before_config and not k.startswith('_')]

MIN_SCORED = 4096        # scored tokens per cell when num_windows is left to the tool
DEFAULT_K = 256          # the paper's "last 256 tokens"


# -----------------------------------------------------------------------------
# command line


def parse_ints(text, key):
    values = parse_list(text, key, int)
    if any(v < 1 for v in values):
        raise InputError(f"--{key} values must be positive, got {text!r}")
    return values


# -----------------------------------------------------------------------------
# checkpoints and their data


def training_tokenizer(ckpt, vocab_size):
    """(tokenizer, how we know) for the data a checkpoint was trained on: its dataset's meta.json when
    that is on this machine, else the vocabulary as sample.py reads it (256: bytes, >= 50257: GPT-2
    BPE, whose size train.py only pads upwards); (None, '') when neither tells."""
    path = find_data_dir(training_data_dirs(ckpt), 'meta.json')
    if path is not None:
        try:
            return load_meta(path)['tokenizer'], f"{os.path.join(path, 'meta.json')} says so"
        except ValueError:
            pass  # an unreadable meta.json: fall back to the vocabulary
    tok = tokenizer_of_vocab(vocab_size)
    why = {'byte': 'its vocab_size is 256', None: '',
           'gpt2': f"its vocab_size {vocab_size} is GPT-2's {GPT2_VOCAB_SIZE} or more"}[tok]
    return tok, why


def check_data_fits(run, meta):
    """Refuse data the model cannot read: token ids past its vocabulary, or another tokenizer than the
    one it was trained with (which runs, but scores a meaningless perplexity)."""
    vocab = run['model_args']['vocab_size']
    if meta['vocab_size'] > vocab:
        raise InputError(f"{run['label']}: the data's vocabulary ({meta['vocab_size']}, {meta['tokenizer']}) is "
                        f"larger than the model's ({vocab}): wrong dataset? pass --data_dir=")
    tok, how = run['tokenizer'], run['tokenizer_from']
    if tok is not None and tok != meta['tokenizer']:
        raise InputError(f"{run['label']} ({run['path']}) was trained on '{tok}' tokens ({how}), but {run['data_dir']} "
                        f"holds '{meta['tokenizer']}' tokens: its perplexity there would be meaningless; pass "
                        f"--data_dir= with a '{tok}' dataset, or leave it out to use the training data")


# -----------------------------------------------------------------------------
# the protocol


def default_lengths(block_sizes, longest):
    """Each training length times 1, 2, 4, ... up to `longest`, merged over the checkpoints."""
    out = set()
    for b in block_sizes:
        L = b
        out.add(min(b, longest))
        while L * 2 <= longest:
            L *= 2
            out.add(L)
    return sorted(out)


def window_ends(n_tokens, longest, K, n_windows, seed):
    """Positions e of the last target token of each window (inputs data[e-L:e], targets data[e-L+1:e+1]).
    Candidates leave room for `longest` tokens of context and sit on a grid of step K counted back from
    the end of the split, so that the scored stretches data[e-K+1:e+1] of two windows never overlap.
    The same ends serve every length and every checkpoint."""
    if longest + 1 > n_tokens:
        raise InputError(f"a window of {longest + 1} tokens does not fit in {n_tokens} validation tokens")
    candidates = np.arange(n_tokens - 1, longest - 1, -K)
    rng = np.random.default_rng(seed)
    n = min(n_windows, len(candidates))
    return np.sort(rng.choice(candidates, size=n, replace=False))


def windows(data, ends, L):
    """The windows of length L ending at `ends`: inputs x [N, L] and targets y [N, L] (int64)."""
    x = np.stack([np.asarray(data[e - L:e], dtype=np.int64) for e in ends])
    y = np.stack([np.asarray(data[e - L + 1:e + 1], dtype=np.int64) for e in ends])
    return torch.from_numpy(x), torch.from_numpy(y)


def length_unavailable(model, L, n_val):
    """Why the model cannot be evaluated at length L, or None."""
    if L + 1 > n_val:
        return 'too long'
    if model.config.pos == 'learned' and L > model.pe[0].n_positions:
        return 'n/a: learned'
    return None


def scored_tokens(eval_lengths, K=0, n_windows=0):
    """(K, n_windows): the targets scored per window and the windows per length, the same for every length.
    K = 0 takes half the shortest length (at most DEFAULT_K), so that the shortest column's scored targets
    have context too; n_windows = 0 takes enough windows for MIN_SCORED scored tokens per cell (at least 16).
    A K longer than the shortest length is refused: that column would score fewer, other, targets."""
    if K < 0 or n_windows < 0:
        raise InputError(f"--eval_tokens and --num_windows must be positive (0: chosen by the tool), got "
                         f"{K} and {n_windows}")
    shortest = min(eval_lengths)
    default = max(1, min(DEFAULT_K, shortest // 2))
    if K > shortest:
        raise InputError(f"--eval_tokens={K} is more than the shortest evaluation length {shortest}: that column "
                         f"would score {shortest} targets per window and the others {K}, so the columns would "
                         f"average different tokens. Pass --eval_tokens=<={shortest}, or leave it out (then "
                         f"{default}), or drop the short lengths with --lengths=")
    K = K or default
    return K, n_windows or max(16, math.ceil(MIN_SCORED / K))


@torch.no_grad()
def score_windows(model, x, y, K, batch, dev, ctx, progress=None):
    """Cross-entropy (nats) of each window's last K targets: [N, K] float64. The model reads all L tokens
    but computes logits only at the scored positions (`last`), and the targets are sliced to the same
    positions (the released code sliced the logits but not the labels)."""
    if K > x.shape[1]:
        raise ValueError(f"cannot score the last {K} targets of windows of {x.shape[1]} tokens")
    losses = []
    for s in range(0, len(x), batch):
        xb, yb = x[s:s + batch].to(dev), y[s:s + batch, -K:].to(dev)
        with ctx:
            logits, _ = model(xb, last=K)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), yb.reshape(-1), reduction='none')
        losses.append(ce.view(len(xb), K).double().cpu())
        if progress:
            progress(s + len(xb))
    return torch.cat(losses).numpy()


def evaluate_run(model, data, meta, ends, eval_lengths, K, cfg, dev, ctx, name='', rope_scaling='none'):
    """{L: result dict} for one model. A result has status 'ok' and loss/ppl/bpb/..., or a reason. A
    RoPE model is read with the context extension rope_scaling, its factor s set for each length."""
    out = {}
    for L in eval_lengths:
        s = set_rope_scaling(model, rope_scaling, cfg['rope_scale'], L, cfg['yarn_alpha'], cfg['yarn_beta'])
        why = length_unavailable(model, L, len(data))
        if why:
            out[L] = {'status': why}
            print(f"  {name:<24} L={L:<6} {why}")
            continue
        x, y = windows(data, ends, L)
        batch = cfg['batch_size'] or max(1, cfg['batch_tokens'] // L)
        t0 = last_print = time.time()

        def progress(done):
            nonlocal last_print
            now = time.time()
            if now - last_print > 10 and done < len(x):
                print(f"  {name:<24} L={L:<6} {done}/{len(x)} windows, {done * L / (now - t0):,.0f} tok/s",
                      flush=True)
                last_print = now

        ce = score_windows(model, x, y, K, batch, dev, ctx, progress)
        dt = time.time() - t0
        loss = float(ce.mean())
        r = {'status': 'ok', 'loss': loss, 'ppl': math.exp(loss),
             'bpb': loss / math.log(2) if meta['tokenizer'] == 'byte' else None,
             'n_tokens': int(ce.size), 'n_windows': int(len(x)), 'seconds': round(dt, 3),
             'tokens_per_s': round(len(x) * L / max(dt, 1e-9), 1),
             'window_loss': [round(float(v), 6) for v in ce.mean(axis=1)]}
        if rope_scaling != 'none':
            r['rope_scale'] = s
        out[L] = r
        bpb = f"  bpb {r['bpb']:.4f}" if r['bpb'] is not None else ''
        print(f"  {name:<24} L={L:<6} ppl {r['ppl']:10.4f}{bpb}   ({r['n_tokens']} tokens scored, "
              f"{r['tokens_per_s']:,.0f} tok/s, {dt:.1f}s)", flush=True)
    return out


def far_mass_of_run(model, data, ends, eval_lengths, K, block_size, dev, cfg, rope_scaling='none'):
    """({L: [layer][head] attention mass on keys >= block_size back}, the encoding's values per head at a
    distance of 1 and of 1/2, 1, 4 and 16 times the training length): probe.py's measures for one run, on the
    scored queries of the windows ending at `ends`."""
    mass = {}
    for L in eval_lengths:
        set_rope_scaling(model, rope_scaling, cfg['rope_scale'], L, cfg['yarn_alpha'], cfg['yarn_beta'])
        x, _ = windows(data, ends, L)
        mass[L] = probe.far_mass(model, x.to(dev), K, block_size)
    distances = sorted({1, max(1, block_size // 2), block_size, 4 * block_size, 16 * block_size})
    return mass, probe.head_values(model, distances)


def position_buckets(L, per_octave=4):
    """Log-spaced buckets [start, end) of the positions 0 .. L-1 (position p has p tokens of context
    before it): {0}, {1}, then per_octave buckets for every doubling, none empty."""
    edges = sorted({0, 1} | {int(round(2 ** (i / per_octave))) for i in range(int(per_octave * math.log2(L)) + 1)}
                   | {L})
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b <= L]


def loss_by_position(model, data, ends, L, batch, dev, ctx):
    """Mean cross-entropy over the windows of length L at each position, in position_buckets(L):
    {'length', 'buckets': [[start, end, loss], ...]}. Every target of the windows is scored."""
    x, y = windows(data, ends, L)
    per_position = score_windows(model, x, y, L, batch, dev, ctx).mean(axis=0)
    return {'length': L, 'buckets': [[a, b, round(float(per_position[a:b].mean()), 6)]
                                     for a, b in position_buckets(L)]}


def plot_loss_by_position(runs, path):
    """Mean loss against position (log2 axis), one colour per label (seeds share it), training lengths
    marked: where past the training length each model's loss starts to rise."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    labels = list(dict.fromkeys(r['label'] for r in runs if r.get('position_loss')))
    colors = dict(zip(labels, curve_colors(len(labels))))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    seen = set()
    for r in runs:
        pl = r.get('position_loss')
        if not pl:
            continue
        xs = [(a + b - 1) / 2 + 1 for a, b, _ in pl['buckets']]  # bucket centre, 1-based for the log axis
        ax.plot(xs, [v for _, _, v in pl['buckets']], color=colors[r['label']], marker='.', ms=3,
                label=None if r['label'] in seen else r['label'])
        seen.add(r['label'])
    for b in sorted({r['model_args']['block_size'] for r in runs if r.get('position_loss')}):
        ax.axvline(b, color='grey', linestyle=':', linewidth=1.2)
    ax.set_xscale('log', base=2)
    ax.set_xlabel('position in the window (tokens of context + 1; dotted: training length)')
    ax.set_ylabel('mean loss (nats)')
    ax.set_title('Loss by position, longest evaluation length', fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -----------------------------------------------------------------------------
# settings, labels, groups


DAPE_KEYS = ('dape', 'dape_variant', 'dape_width', 'dape_kernel', 'dape_init', 'dape.py')


def group_runs(runs, eval_lengths):
    """Runs with the same label form a group: per length, mean and sample std of ppl (and bpb) over
    the runs that have a value (common.group_over_seeds); a length none of them has keeps the first
    reason."""
    def value(metric):
        def of(run, L):
            res = run['results'][L]
            if res['status'] != 'ok':
                return res['status']
            return 'n/a: not byte data' if res[metric] is None else res[metric]
        return of
    label = lambda r: r['label']
    ppl, bpb = (group_over_seeds(runs, label, eval_lengths, value(m)) for m in ('ppl', 'bpb'))
    out = []
    for gp, gb in zip(ppl, bpb):
        members = gp['members']
        out.append({'label': gp['label'], 'runs': [m['path'] for m in members], 'n': len(members),
                    'seeds': [m['seed'] for m in members], 'model_args': members[0]['model_args'],
                    'training': members[0].get('training'), 'data_dir': members[0]['data_dir'],
                    'rope_scaling': members[0].get('rope_scaling', 'none'),  # part of the setting (setting_of)
                    'dape_py': members[0].get('dape_py'),  # so is an edited dape.py
                    'block_size': members[0]['model_args']['block_size'], 'ppl': gp['stats'], 'bpb': gb['stats']})
    return out


def setting_without(g, keys=DAPE_KEYS):
    """A group's setting without the model options `keys`: without the DAPE options, DAPE-X and X trained
    alike on the same data share it; without dape_init, DAPE-X with f zero at step 0 and the default's."""
    s = setting_of(g)
    s['model'] = {k: v for k, v in s['model'].items() if k not in keys}
    return json.dumps(s, sort_keys=True)


def split_pairs(text):
    """--pairs 'a:b,c:d' as ['a:b', 'c:d'], keeping commas inside brackets (kerple[lr=1,dropout=0])."""
    items, depth, cur = [], 0, ''
    for ch in text:
        depth += (ch == '[') - (ch == ']')
        if ch == ',' and depth == 0:
            items.append(cur)
            cur = ''
        else:
            cur += ch
    return [p.strip() for p in items + [cur] if p.strip()]


def parse_pairs(text, labels):
    """--pairs as [(dape label, baseline label)], checked against the runs' labels before anything is
    evaluated. A label may hold ':' itself, so every ':' is tried as the separator."""
    known = sorted(set(labels))
    out = []
    for pair in split_pairs(text):
        splits = [(pair[:i], pair[i + 1:]) for i, ch in enumerate(pair) if ch == ':' and 0 < i < len(pair) - 1]
        if not splits:
            raise InputError(f"--pairs: {pair!r} is not 'dape_label:baseline_label' (pairs are separated by ','); "
                            f"the labels are {known}")
        found = [(a, b) for a, b in splits if a in known and b in known]
        if len(found) != 1:
            missing = [x for x in splits[0] if x not in known]
            raise InputError(f"--pairs: {pair!r}: " + (f"no run is labelled {missing}" if missing else
                            "ambiguous") + f"; the labels are {known} (see --labels to name runs yourself)")
        if found[0][0] == found[0][1]:
            raise InputError(f"--pairs: {pair!r} compares {found[0][0]!r} with itself")
        out += found
    return out


def comparison_pairs(groups, explicit=()):
    """(dape group, baseline group) pairs: the explicit (label, label) list (parse_pairs), or every
    DAPE-X group whose setting minus the DAPE options equals that of a group without DAPE, then every
    DAPE-X group with f zero at step 0 against the same DAPE-X with the default init, and every DAPE-X group
    trained with an edited dape.py (an ablation) against the same DAPE-X with the committed one, where there
    is one."""
    by_label = {g['label']: g for g in groups}
    if explicit:
        return [(by_label[a], by_label[b]) for a, b in explicit]

    dape = [g for g in groups if g['model_args'].get('dape', 'none') != 'none']
    zero = [g for g in dape if g['model_args'].get('dape_init', 'default') != 'default']

    def by_setting(gs, keys):
        out = {}
        for g in gs:
            k = setting_without(g, keys)
            if k in out:  # two labels for one setting: which is the baseline would be a guess
                raise InputError(f"runs labelled {out[k]['label']!r} and {g['label']!r} have the same setting: give "
                                 f"them one label (or name the comparisons with --pairs)")
            out[k] = g
        return out
    baselines = by_setting([g for g in groups if g not in dape], DAPE_KEYS)
    defaults = by_setting([g for g in dape if g not in zero], ('dape_init',))
    edited = [g for g in dape if 'dape.py' in setting_of(g)['model']]
    committed = by_setting([g for g in dape if g not in edited], ('dape.py',))
    return ([(g, baselines[setting_without(g)]) for g in dape if setting_without(g) in baselines]
            + [(g, defaults[setting_without(g, ('dape_init',))]) for g in zero
               if setting_without(g, ('dape_init',)) in defaults]
            + [(g, committed[setting_without(g, ('dape.py',))]) for g in edited
               if setting_without(g, ('dape.py',)) in committed])


def compare(dape_group, base_group, eval_lengths):
    """Per length: DAPE-X's mean perplexity minus X's with its 95% confidence interval, Welch's t-test and
    the exact permutation test of the per-seed perplexities (common.compare_means; holm_table adds the
    Holm-adjusted p once every comparison of the table is made)."""
    out = {'label': dape_group['label'], 'baseline': base_group['label'], 'p_value': {}, 't': {}}
    for L in eval_lengths:
        a, b = dape_group['ppl'][L], base_group['ppl'][L]
        if a['status'] != 'ok' or b['status'] != 'ok':
            out['p_value'][L] = {'status': a['status'] if a['status'] != 'ok' else b['status']}
            continue
        c = compare_means(a['values'], b['values'])
        if c['status'] != 'ok':
            out['p_value'][L] = {'status': 'n/a: 1 seed' if min(a['n'], b['n']) < 2 else 'n/a: zero variance'}
            continue
        out['p_value'][L] = {'status': 'ok', 'p': c['p'], 't': c['t'], 'df': c['df'], 'mean_diff': c['diff'],
                             'ci': c['ci'], 'p_exact': c['p_exact'], 'p_min': c['p_min'], 'exact': c['exact'],
                             'n_a': c['n_a'], 'n_b': c['n_b']}
    return out


def holm_table(comparisons, eval_lengths):
    """Holm's adjustment of the exact p over every test of the p-value table (each pair at each length): sets
    'p_holm' in place. -> the number of tests."""
    return holm_over([c['p_value'][L] for c in comparisons for L in eval_lengths])


# -----------------------------------------------------------------------------
# tables, files, plot


def fmt_value(v, digits):
    if v >= 1e5:
        return f"{v:.3g}"
    return f"{v:.{digits}f}"


def cell(stat, digits=3):
    if stat['status'] != 'ok':
        return stat['status']
    return mean_std_text(stat['mean'], stat['std'], lambda v: fmt_value(v, digits))


def group_table(groups, metric, eval_lengths, markdown=False):
    header = ['model', 'n'] + [str(L) for L in eval_lengths]
    rows = [[g['label'], str(g['n'])] + [cell(g[metric][L], 4 if metric == 'bpb' else 3) for L in eval_lengths]
            for g in groups]
    return format_table(header, rows, markdown)


def run_table(runs, eval_lengths, markdown=False):
    header = ['run', 'model', 'seed', 'iter'] + [str(L) for L in eval_lengths]
    rows = [[r['name'], r['label'], str(r['seed']), str(r['iter_num'])] +
            [fmt_value(r['results'][L]['ppl'], 3) if r['results'][L]['status'] == 'ok' else r['results'][L]['status']
             for L in eval_lengths] for r in runs]
    return format_table(header, rows, markdown)


def pvalue_table(comparisons, eval_lengths, markdown=False):
    """Per pair and length: Welch's p, and in brackets the exact p and its Holm adjustment (holm_table); then
    the caption (common.tests_caption) and the pairs trained unequally."""
    header = ['DAPE-X vs X'] + [str(L) for L in eval_lengths]
    rows = []
    for c in comparisons:
        row = [f"{c['label']} vs {c['baseline']}" + (' (!)' if c.get('unequal_training') else '')]
        for L in eval_lengths:
            s = c['p_value'][L]
            row.append(s['status'] if s['status'] != 'ok' else
                       f"{s['p']:.3g} (exact {p_text(s['p_exact'])}, Holm {p_text(s['p_holm'])})")
        rows.append(row)
    table = format_table(header, rows, markdown)
    caption = tests_caption([c['p_value'][L] for c in comparisons for L in eval_lengths])
    if caption:
        table += '\n\n' + caption
    if any(c.get('unequal_training') for c in comparisons):
        table += '\n\n(!) the two models were not trained for as long as each other: ' + '; '.join(
            f"{c['label']} vs {c['baseline']}: {c['unequal_training']}" for c in comparisons if c.get('unequal_training'))
    return table


def difference_table(comparisons, eval_lengths, markdown=False):
    """DAPE-X's mean perplexity minus X's, per length, with its 95% confidence interval (Welch-
    Satterthwaite): negative is DAPE lower."""
    header = ['DAPE-X minus X'] + [str(L) for L in eval_lengths]
    rows = [[f"{c['label']} - {c['baseline']}"]
            + [difference_text(dict(c['p_value'][L], diff=c['p_value'][L].get('mean_diff')), '{:+.3f}')
               for L in eval_lengths] for c in comparisons]
    return format_table(header, rows, markdown)


def protocol_text(protocol):
    counts = sorted({d['num_windows'] for d in protocol.get('data', {}).values() if 'num_windows' in d})
    n = f"{counts[0]} to {counts[-1]} (by validation split)" if len(counts) > 1 else protocol['num_windows']
    return (f"Perplexity of the last {protocol['eval_tokens']} tokens of each window (whole window through "
            f"the model), {n} windows per length at the same seeded end positions "
            f"(seed {protocol['seed']}) for every length and checkpoint. Mean ± sample std over seeds where "
            f"several runs share a setting.")


def write_outputs(out, protocol, runs, groups, comparisons, eval_lengths, make_plot=True, notes=()):
    os.makedirs(out, exist_ok=True)
    has_bpb = any(g['bpb'][L]['status'] == 'ok' for g in groups for L in eval_lengths)
    result = {'protocol': protocol, 'lengths': eval_lengths, 'runs': runs, 'groups': groups,
              'comparisons': comparisons, 'notes': list(notes)}
    text = json.dumps(jsonable(result), indent=1, allow_nan=False)  # a bad value raises before a file is touched
    path = os.path.join(out, 'results.json')
    with open(path + '.tmp', 'w') as f:  # a failed write leaves the previous results whole
        f.write(text)
    os.replace(path + '.tmp', path)

    md = ['# Length extrapolation', '', protocol_text(protocol), '']
    if notes:
        md += ['## Notes', ''] + [f"- {n}" for n in notes] + ['']
    md += ['## Perplexity', '',
          group_table(groups, 'ppl', eval_lengths, markdown=True), '']
    if has_bpb:
        md += ['## Bits per byte', '', group_table(groups, 'bpb', eval_lengths, markdown=True), '']
    if comparisons:
        md += ["## DAPE-X vs X: Welch's t-test and the exact permutation test (two-sided p, per-seed perplexities)", '',
               pvalue_table(comparisons, eval_lengths, markdown=True), '',
               "## DAPE-X minus X: difference of mean perplexities [95% confidence interval]", '',
               difference_table(comparisons, eval_lengths, markdown=True), '']
    md += ['## Runs (perplexity)', '', run_table(runs, eval_lengths, markdown=True), '']
    with open(os.path.join(out, 'results.md'), 'w') as f:
        f.write('\n'.join(md))

    with open(os.path.join(out, 'results.csv'), 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['run', 'model', 'seed', 'metric'] + [str(L) for L in eval_lengths])
        for r in runs:
            for metric in ('ppl', 'bpb') if has_bpb else ('ppl',):
                row = []
                for L in eval_lengths:
                    s = r['results'][L]
                    row.append(s['status'] if s['status'] != 'ok' else
                               ('' if s[metric] is None else f"{s[metric]:.6g}"))
                w.writerow([r['path'], r['label'], r['seed'], metric] + row)

    if make_plot:
        plot_ppl(groups, eval_lengths, protocol, os.path.join(out, 'ppl_vs_length.png'))


def curve_colors(n):
    """n colours that tell n curves apart at a glance: tab20's ten dark shades (tab10's colours), then its
    light ones (evenly spaced hues would give neighbours two near greens); beyond twenty, such hues."""
    import matplotlib
    if n <= 20:
        tab20 = matplotlib.colormaps['tab20']
        return [tab20(i) for i in [*range(0, 20, 2), *range(1, 20, 2)][:n]]
    return [matplotlib.colormaps['hsv'](i / n) for i in range(n)]


def ppl_ticks(lo, hi):
    """Tick values for a log perplexity axis from lo to hi: a narrow range (as in a zoom) gets evenly
    spaced round numbers, a wide one 1, 2, 5 x 10^k, so that every axis shows a few plain numbers."""
    from matplotlib.ticker import LogLocator, MaxNLocator
    if hi / lo < 3:
        ticks = MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
    else:
        ticks = LogLocator(subs=(1, 2, 5)).tick_values(lo, hi)
        if sum(lo <= t <= hi for t in ticks) < 3:
            ticks = LogLocator(subs=(1, 1.5, 2, 3, 4, 5, 6, 8)).tick_values(lo, hi)
    return [t for t in ticks if lo <= t <= hi]


def plot_ppl(groups, eval_lengths, protocol, path):
    """Figure 2 for these runs: perplexity (log axis) against evaluation length (log2 axis, also as
    multiples of the training length), one colour per model, mean with a band and error bars of one std
    where there are several seeds. When some curves rise far above the others (RoPE past its training
    length), a second panel zooms on those that stay within 2x of the best perplexity, where the
    differences between similar encodings (X against DAPE-X) are. Returns the figure."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    curves = []  # (label, dape, xs, means, stds)
    for g in groups:
        pts = [(L, g['ppl'][L]) for L in eval_lengths if g['ppl'][L]['status'] == 'ok']
        if pts:
            curves.append((g['label'] + (f" (n={g['n']})" if g['n'] > 1 else ''), g['model_args'].get('dape', 'none'),
                           [L for L, _ in pts], [s['mean'] for _, s in pts], [s['std'] or 0.0 for _, s in pts]))
    best = min((min(m) for *_, m, _ in curves), default=1.0)
    near = [c for c in curves if max(c[3]) <= 2 * best]
    panels = [(curves, 'all models')] + ([(near, 'zoom on the models within 2x of the best (same colours)')]
                                         if 0 < len(near) < len(curves) else [])
    blocks = sorted({g['block_size'] for g in groups})

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    # the colour tells the models apart; the line style and marker say which DAPE, if any (X dashed
    # with circles, DAPE V1 solid with squares, V2 dash-dotted with triangles)
    color = dict(zip([c[0] for c in curves], curve_colors(len(curves))))
    styles = {'none': ('--', 'o'), 'v1': ('-', 's'), 'v2': ('-.', '^')}
    for ax, (shown, title) in zip(axes[0], panels):
        for label, dape, xs, ys, errs in shown:
            style, marker = styles.get(dape, ('-', 'D'))
            ax.plot(xs, ys, linestyle=style, marker=marker, ms=4, color=color[label], label=label)
            if any(errs):
                lo_, hi_ = [y - e for y, e in zip(ys, errs)], [y + e for y, e in zip(ys, errs)]
                ax.fill_between(xs, lo_, hi_, color=color[label], alpha=0.15, linewidth=0)
                ax.errorbar(xs, ys, yerr=errs, fmt='none', ecolor=color[label], capsize=3)
        for i, b in enumerate(blocks):
            ax.axvline(b, color='grey', linestyle=':', linewidth=1.2, label='training length' if i == 0 else None)
        ax.set_xscale('log', base=2)
        ax.xaxis.set_major_locator(FixedLocator(eval_lengths))
        ax.xaxis.set_minor_locator(NullLocator())
        # one training length: each length is also read as a multiple of it (1x, 2x, ... 16x)
        ax.set_xticklabels([f"{L}\n{L / blocks[0]:g}x" if len(blocks) == 1 else str(L) for L in eval_lengths],
                           rotation=0 if len(eval_lengths) < 8 else 45, fontsize=8)
        ax.set_yscale('log')
        # (a std as large as the mean would put the axis at or below 0, where a log axis has nothing)
        values = [v for *_, ys, errs in shown for y, e in zip(ys, errs) for v in (max(y - e, y / 2), y + e)]
        if values:
            lo, hi = min(values), max(values)
            pad = (hi / lo) ** 0.06 if hi > lo else 1.02
            ax.set_ylim(lo / pad, hi * pad)
            ax.yaxis.set_major_locator(FixedLocator(ppl_ticks(lo / pad, hi * pad)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel('evaluation length (tokens' + (' and multiple of the training length)' if len(blocks) == 1
                                                     else ')'))
        ax.set_ylabel('perplexity (log scale)')
        ax.set_title(title, fontsize=10)
        ax.grid(True, which='major', alpha=0.3)
    axes[0][0].legend(fontsize=8)  # the zoom has the same colours; a legend there would hide its curves
    fig.suptitle(f"Perplexity of the last {protocol['eval_tokens']} tokens vs evaluation length "
                 f"({protocol['num_windows']} windows per length; lower is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return fig


# -----------------------------------------------------------------------------
# how long the compared runs were trained


def tokens_seen(ckpt):
    """Training tokens a checkpoint has seen (iterations x sequences per step x training length), or None
    for a checkpoint saved without its config."""
    conf = ckpt.get('config') or {}
    per_step = [conf.get(k) for k in ('batch_size', 'gradient_accumulation_steps')]
    if ckpt.get('iter_num') is None or None in per_step:
        return None
    return ckpt['iter_num'] * per_step[0] * per_step[1] * ckpt['model_args']['block_size']


def per_label(runs, key):
    """{label: the distinct values of run[key] among its runs}, leaving out None (not recorded)."""
    out = {}
    for r in runs:
        out.setdefault(r['label'], set())
        if r.get(key) is not None:
            out[r['label']].add(r[key])
    return out


def unequal_training(runs):
    """Why these runs (of one or more labels) were not trained for as long as each other, or None:
    different iterations or tokens seen, or a checkpoint saved before its own max_iters."""
    why = []
    for key, what in (('iter_num', 'iterations'), ('tokens_seen', 'tokens seen')):
        if len(set().union(*per_label(runs, key).values())) > 1:
            why.append(f"different {what}")
    if any(r.get('max_iters') is not None and r['iter_num'] is not None and r['iter_num'] < r['max_iters']
           for r in runs):
        why.append('stopped before max_iters')
    return ', '.join(why) or None


def training_notes(runs):
    """Notes on runs that are compared but were not trained alike for as long: the seeds of one label
    saved at different iterations, labels trained for different iterations or tokens, and checkpoints
    saved before their own max_iters (an interrupted run, or the best-val-loss checkpoint)."""
    notes = []
    iters = per_label(runs, 'iter_num')
    for lab in iters:
        saved = [r['iter_num'] for r in runs if r['label'] == lab]
        if len(set(saved)) > 1:  # seeds of one training, but not all at its end
            notes.append(f"the runs of {lab} were saved at different iterations {saved}")
    if len(iters) > 1:
        for key, what in (('iter_num', 'iterations'), ('tokens_seen', 'tokens')):
            values = per_label(runs, key)
            if len(set().union(*values.values())) > 1:
                listed = ', '.join(f"{lab} {'/'.join(f'{v:,}' for v in sorted(vs)) or '?'}"
                                   for lab, vs in values.items())
                notes.append(f"the compared models were trained for different numbers of {what}: {listed}")
    for r in runs:
        if r['max_iters'] is not None and r['iter_num'] is not None and r['iter_num'] < r['max_iters']:
            notes.append(f"{r['name']} ({r['label']}) was saved at iteration {r['iter_num']:,} of its max_iters "
                         f"{r['max_iters']:,}: an interrupted run, or not its last checkpoint")
    return notes


# -----------------------------------------------------------------------------


def with_rope_scalings(runs, kinds, cfg):
    """Each RoPE run once per context extension in `kinds`, labelled rope+pi(s=...), rope+yarn(...);
    the others once as they are. A method asked for with no RoPE model to apply it to is an error."""
    if kinds != ['none'] and not any(r['model_args']['pos'] == 'rope' for r in runs):
        raise InputError(f"--rope_scaling={cfg['rope_scaling']} applies to RoPE models only; these have "
                         f"pos={sorted({r['model_args']['pos'] for r in runs})}")
    out = []
    for r in runs:
        for kind in kinds if r['model_args']['pos'] == 'rope' else ['none']:
            suffix = rope_scaling_label(kind, cfg['rope_scale'], not cfg['rope_scale'], r['model_args']['block_size'])
            out.append(dict(r, label=r['label'] + suffix, rope_scaling=kind))
    return out


def evaluate(cfg, ckpt_paths, command='unknown (eval_extrapolate.evaluate called in a process of its own)'):
    """Evaluate checkpoints under the protocol; write and return the results dict. `command` is the command
    line that asked for it, recorded in the results with the commit, machine and date."""
    dev = pick_device(cfg['device'])
    ctx = autocast(dev, pick_dtype(cfg['dtype'], dev))
    if cfg['eval_tokens'] < 0 or cfg['num_windows'] < 0 or cfg['far_mass_windows'] < 1:
        raise InputError("--eval_tokens and --num_windows must be positive (0: chosen by the tool), "
                         "--far_mass_windows positive")
    rope_kinds = rope_scaling_options(cfg)
    files = find_checkpoints(ckpt_paths)
    if not files:
        raise InputError("no checkpoints given: python eval_extrapolate.py out/run1 out/run2 ... (or --ckpts=)")
    user_labels = [s for s in cfg['labels'].split(',') if s] if cfg['labels'] else None
    if user_labels is not None and len(user_labels) != len(files):
        raise InputError(f"--labels has {len(user_labels)} names for {len(files)} checkpoints: {files}")

    # read every checkpoint first (bad ones fail before hours of evaluation; the default lengths and the
    # windows depend on all of them); models are loaded again one at a time to evaluate them
    runs = []
    for path in files:
        model, ckpt = load_run(path, 'cpu')
        d = resolve_data_dir(ckpt, cfg['data_dir'])
        conf = ckpt.get('config') or {}
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if os.path.basename(path) != 'ckpt.pt':  # several checkpoints of one out_dir
            name += '/' + os.path.basename(path)
        tok, tok_from = training_tokenizer(ckpt, model.config.vocab_size)
        runs.append({'path': path, 'name': name,
                     # the model's own config: checkpoints written before an option existed get its default
                     'data_dir': os.path.normpath(d), 'model_args': dataclasses.asdict(model.config),
                     'training': training_setting(ckpt), 'tokenizer': tok, 'tokenizer_from': tok_from,
                     'seed': conf.get('seed'), 'iter_num': ckpt.get('iter_num'),
                     'max_iters': conf.get('max_iters'), 'tokens_seen': tokens_seen(ckpt),
                     'best_val_loss': ckpt.get('best_val_loss'), 'trained_by': trained_by(ckpt),
                     'dape_py': dape_of_run(ckpt)})
        del model
    for r, lab in zip(runs, user_labels or auto_labels(runs)):
        r['label'] = lab
    runs = with_rope_scalings(runs, rope_kinds, cfg)
    pairs = parse_pairs(cfg['pairs'], [r['label'] for r in runs])
    notes = training_notes(runs)
    for note in notes:
        print(f"note: {note}")

    if cfg['lengths']:
        eval_lengths = sorted(set(parse_ints(cfg['lengths'], 'lengths')))
    else:
        eval_lengths = default_lengths({r['model_args']['block_size'] for r in runs}, cfg['max_length'])
    K, n_windows = scored_tokens(eval_lengths, cfg['eval_tokens'], cfg['num_windows'])

    data_cache, protocol = {}, {'eval_tokens': K, 'num_windows': n_windows, 'seed': cfg['seed'],
                                'lengths': eval_lengths, 'data': {}, 'yarn_alpha': cfg['yarn_alpha'],
                                'yarn_beta': cfg['yarn_beta'],
                                'evaluated_by': provenance(command, torch.device(dev).type)}
    for r in runs:
        d = r['data_dir']
        if d in data_cache:
            continue
        data, meta = load_val(d)
        for other in runs:  # before any evaluation, like every other check of the input
            if other['data_dir'] == d:
                check_data_fits(other, meta)
        fits = [L for L in eval_lengths + [cfg['max_length']] if L + 1 <= len(data)]
        if not fits:
            raise InputError(f"{d}/val.bin holds {len(data)} tokens: too few for any of the lengths {eval_lengths}")
        longest = max(fits)
        ends = window_ends(len(data), longest, K, n_windows, cfg['seed'])
        if len(ends) < n_windows:
            print(f"warning: {d}/val.bin has room for only {len(ends)} windows of {longest} tokens "
                  f"(asked for {n_windows})")
        data_cache[d] = (data, meta, ends)
        protocol['data'][d] = {'val_tokens': int(len(data)), 'tokenizer': meta['tokenizer'],
                               'longest_window': int(longest), 'num_windows': len(ends), 'window_ends': ends.tolist()}
    # what was drawn, not what was asked: a split with too little room gives fewer windows (the warning above),
    # and the captions state this count; where splits differ, the fewest (each split's is under 'data')
    protocol['num_windows_asked'], protocol['num_windows'] = n_windows, min(len(c[2]) for c in data_cache.values())
    n_windows = protocol['num_windows']

    print(f"evaluating {len(runs)} checkpoint(s) on {dev} at lengths {eval_lengths}: the same last {K} tokens "
          f"of {n_windows} windows at every length")
    for r in runs:
        data, meta, ends = data_cache[r['data_dir']]
        print(f"{r['path']}  ({r['label']}, {r['data_dir']})")
        model, _ = load_run(r['path'], dev)
        r['results'] = evaluate_run(model, data, meta, ends, eval_lengths, K, cfg, dev, ctx, r['label'],
                                    r['rope_scaling'])
        ok = [L for L in eval_lengths if r['results'][L]['status'] == 'ok']
        if cfg['position_loss'] and ok:
            # a pass of its own over the longest windows, every position scored: the protocol's figures
            # above then do not depend on whether this diagnostic is asked for
            batch = cfg['batch_size'] or max(1, cfg['batch_tokens'] // max(ok))
            set_rope_scaling(model, r['rope_scaling'], cfg['rope_scale'], max(ok), cfg['yarn_alpha'], cfg['yarn_beta'])
            r['position_loss'] = loss_by_position(model, data, ends, max(ok), batch, dev, ctx)
        if cfg['far_mass']:
            r['far_mass'], r['head_values'] = far_mass_of_run(model, data, ends[:cfg['far_mass_windows']], ok, K,
                                                              r['model_args']['block_size'], dev, cfg,
                                                              r['rope_scaling'])
            r['far_mass_windows'] = min(cfg['far_mass_windows'], len(ends))
        del model

    groups = group_runs(runs, eval_lengths)
    comparisons = [compare(a, b, eval_lengths) for a, b in comparison_pairs(groups, pairs)]
    for c in comparisons:  # a p-value between unequally trained models measures the training too
        c['unequal_training'] = unequal_training([r for r in runs if r['label'] in (c['label'], c['baseline'])])
    holm_table(comparisons, eval_lengths)

    print('\n' + protocol_text(protocol) + '\n\nperplexity\n' + group_table(groups, 'ppl', eval_lengths))
    if any(g['bpb'][L]['status'] == 'ok' for g in groups for L in eval_lengths):
        print('\nbits per byte\n' + group_table(groups, 'bpb', eval_lengths))
    if any(g['n'] > 1 for g in groups):
        print('\nruns\n' + run_table(runs, eval_lengths))
    if comparisons:
        print("\nDAPE-X vs X, two-sided p: Welch's t-test (exact permutation test, Holm-adjusted)\n"
              + pvalue_table(comparisons, eval_lengths))
        print("\nDAPE-X minus X, difference of mean perplexities [95% confidence interval]\n"
              + difference_table(comparisons, eval_lengths))
    write_outputs(cfg['out_dir'], protocol, runs, groups, comparisons, eval_lengths, cfg['plot'], notes)
    if cfg['position_loss'] and cfg['plot'] and any(r.get('position_loss') for r in runs):
        plot_loss_by_position(runs, os.path.join(cfg['out_dir'], 'loss_by_position.png'))
    print(f"\nwrote {cfg['out_dir']}/results.json, results.md, results.csv"
          + (", ppl_vs_length.png" if cfg['plot'] else '')
          + (", loss_by_position.png" if cfg['position_loss'] and cfg['plot'] else ''))
    return {'protocol': protocol, 'lengths': eval_lengths, 'runs': runs, 'groups': groups, 'comparisons': comparisons,
            'notes': notes}


def main(argv=None):
    paths, cfg = checkpoints_and_config(sys.argv[1:] if argv is None else list(argv),
                                        {k: globals()[k] for k in config_keys}, __doc__)
    command = shlex.join(['python', 'eval_extrapolate.py', *(sys.argv[1:] if argv is None else argv)])
    return evaluate(cfg, paths, command)


if __name__ == '__main__':
    try:
        main()
    except (InputError, ConfigError) as e:
        print(f"eval_extrapolate.py: error: {e}", file=sys.stderr)
        sys.exit(2)
