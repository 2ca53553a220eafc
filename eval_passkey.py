"""
Passkey retrieval (passkey.py; Mohtashami & Jaggi 2023) of trained checkpoints, per length and depth of
the key, from the training length up: a clean test of extrapolation for a model that learnt the task at
its training length (train.py --passkey_frac).

    python eval_passkey.py out/kerple out/dape_kerple out/rope                     # one table per model
    python eval_passkey.py out/rope --rope_scaling=none,pi,ntk,yarn                 # a row per RoPE scaling
    python eval_passkey.py out/kerple --lengths=128,512,2048 --depths=0,0.5,1 --trials=20 --filler=sentence
    python eval_passkey.py out/kerple_s* out/dape_kerple_s* out/rope_s*            # seeds grouped

Protocol:
- A sample of length L is L + 1 tokens: filler, the needle "The pass key is 71432. Remember it." at
  `depth` (0: first, 1: just before the question), more filler, "What is the pass key? The pass key
  is" and the key's digits. The model reads the first L tokens; its predictions of the digits are scored.
- Score per (length, depth): exact-match accuracy (greedy decoding reproduces every digit) over
  `trials` samples, and the mean log-likelihood per answer token (nats; a model that knows a digit
  comes but not which scores ln(1/10) = -2.303), which grades models that never get all digits right.
- `filler=val`: a random stretch of the validation split of the model's dataset (text it was not
  trained on) per sample; `filler=sentence`: the original's fixed sentence, repeated. Keys and filler
  are seeded by `seed`, the trial, the length and the depth: every model that shares the tokenizer
  reads the same prompts, and a trial hides the same key at every length and depth.
- RoPE context extension at evaluation (positional.py, RoPE.set_scaling): `rope_scaling` lists the
  methods (none, pi, ntk, yarn), each a row of its own for every RoPE checkpoint; models without RoPE
  get one row. `rope_scale` is the factor s; 0 takes s = max(1, L / training length) at each length.
- Seeds: checkpoints that differ only by their seed (as eval_extrapolate.py groups them: same model
  options, training config and data) form a group, read with the same RoPE scaling. Where a group has
  several, the tables over seeds give per length the mean of the per-seed figures (each the mean over
  depths) with the 95% t interval of that mean, of exact match and, the continuous measure that no
  threshold decides, of the log-likelihood per answer token; and how many seeds learned the task, with
  the exact binomial interval of that share: exact match of at least `learned_exact`
  at their training length (the tables state the rule with the day it was set, LEARNED_RULE). A seed that
  did not says nothing about extrapolation.

Outputs (`out_dir`, default results/passkey/): passkey.json (everything, every sample's key and
answer), passkey.md (the tables) and passkey_<model>.png (a heat map per row: accuracy, and the
log-likelihood per token, over length x depth); with several seeds of a setting, the tables over seeds
in passkey.md and `groups` in passkey.json, and for every DAPE-X beside its X (labels 'dape-kerple' and
'kerple') the difference of the means per length, of exact match (its 95% t interval cut to the possible
range, -100 to +100 points) and apart of the log-likelihood per answer token, with Welch's p and the exact
permutation test's p with its Holm adjustment over that measure's table, over the seeds that learned and
over every seed (`comparisons`).

    python eval_passkey.py --tables_from=docs/results/passkey_cpu.json     # a results page's tables again
    python eval_passkey.py out-passkey/kerple_s6 --save_runs=docs/results/passkey_cpu.json  # a run added to them
    python eval_passkey.py --tables_from=docs/results/passkey_X.json --rounding_from=docs/results/passkey_X_default.json

The last: the same runs trained under two roundings of one machine (ATen's vector kernels, and
ATEN_CPU_CAPABILITY=default), each file saved by --save_runs: their test-retest (retest_tables), whether a
run learns retrieval and whether a comparison's conclusion survives a change of rounding alone. With
--tables_from, --figure=PATH.png also draws the tables over seeds against length (plot_groups), a column
per file (rounding_from's beside).
"""

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time

import numpy as np

from common import (InputError, auto_labels, autocast, checkpoints_and_config, find_checkpoints, load_run, load_val,
                    parse_list, pick_device, pick_dtype, resolve_data_dir, rope_scaling_options, setting_of, trained_by,
                    training_setting)
from results import (ALPHA, compare_means, difference_text, format_table, group_over_seeds, holds, holds_at, holm_over,
                     interval_text, jsonable, k_of_n_text, kernels_of, mean_ci, mean_ci_text, p_text, pearson,
                     retest_sides, tests_caption, verdict, verdict_counts)
from configurator import ConfigError
from passkey import DIGITS, chance_logp_per_digit, passkey_prompts, score_prompts, summarize
from positional import rope_scaling_label, set_rope_scaling
from tokenizer import get_tokenizer, load_meta, tokenizer_of_vocab

# -----------------------------------------------------------------------------
_names_before_config = set(globals())
ckpts = ''               # comma-separated checkpoint dirs/files, in addition to the bare arguments
labels = ''              # comma-separated, one per checkpoint; '' -> the checkpoint's folder name
data_dir = ''            # dataset (data/<name>) for the tokenizer and the filler; '' -> the checkpoint's
lengths = ''             # comma-separated; '' -> training length x 1, 2, 4, 8, 16
depths = '0,0.25,0.5,0.75,1'  # where the key sits in the filler: 0 first, 1 last
trials = 10              # samples per length and depth
filler = 'val'           # 'val': the validation split; 'sentence': the original's repeated sentence
digits = DIGITS          # digits of the key
seed = 1337
rope_scaling = 'none'    # comma-separated RoPE context extensions: none, pi, ntk, yarn (a row each)
rope_scale = 0.0         # the factor s; 0 -> max(1, L / training length) at each length L
yarn_alpha = 1.0         # YaRN's ramp: dimensions turning fewer than alpha times over L are interpolated,
yarn_beta = 32.0         # more than beta times kept (the paper's values for LLaMA)
batch_tokens = 8192      # tokens per forward (samples of one length batched)
learned_exact = 0.5      # a seed learned the task: exact match at least this at its training length
device = 'auto'          # auto: cuda if available, else cpu
dtype = 'auto'           # auto: bfloat16 autocast on a GPU that supports it, else float32
out_dir = 'results/passkey'
plot = True
tables_from = ''         # a passkey.json: print its tables over seeds (Markdown, as the results pages show them)
rounding_from = ''       # with tables_from: the same runs trained under another rounding (a results file):
                         # print the test-retest tables of the two instead
figure = ''              # with tables_from: also draw its tables over seeds (and rounding_from's beside) to this PNG
save_runs = ''           # a results file (docs/results/passkey_cpu.json): add these runs' figures to it
config_keys = [k for k in globals() if k not in _names_before_config and not k.startswith('_')]
# learned_exact's default, the rule for 'learned' of every results page, and the day it was set (git log -S
# 'learned_exact = 0.5'): a table states both, so that a rule changed after its runs were made shows
LEARNED_RULE = (0.5, '2026-11-24')


def check_options(cfg):
    """Options that would fail late or be misread fail here, before any checkpoint is read:
    -> (lengths or None, depths, scalings)."""
    lens = parse_list(cfg['lengths'], 'lengths', int) if cfg['lengths'] else None
    if lens and min(lens) < 1:
        raise InputError(f"--lengths must be positive, got {cfg['lengths']!r}")
    deps = parse_list(cfg['depths'], 'depths', float)
    bad = [d for d in deps if not 0.0 <= d <= 1.0]
    if bad:
        raise InputError(f"--depths must be in [0, 1] (0: the key first, 1: just before the question), got {bad}")
    for key, values in (('lengths', lens or []), ('depths', deps)):
        if len(set(values)) < len(values):  # a repeated prompt would count as another trial
            raise InputError(f"--{key} repeats a value ({cfg[key]!r}): give each once")
    scalings = rope_scaling_options(cfg)
    if cfg['trials'] < 1 or cfg['digits'] < 1 or cfg['batch_tokens'] < 1:
        raise InputError("--trials, --digits and --batch_tokens must be positive")
    if cfg['digits'] > 18:  # a key is drawn as a 64-bit integer
        raise InputError(f"--digits is at most 18, got {cfg['digits']}")
    if not 0.0 < cfg['learned_exact'] <= 1.0:
        raise InputError(f"--learned_exact is an exact-match fraction in (0, 1], got {cfg['learned_exact']}")
    if cfg['filler'] not in ('val', 'sentence'):
        raise InputError(f"--filler must be 'val' (the validation split) or 'sentence' (a fixed sentence), "
                         f"got {cfg['filler']!r}")
    return lens, deps, scalings


def tokenizer_and_filler(ckpt, model, cfg):
    """(data_dir or None, tokenizer, filler token array or None) of a checkpoint. The validation split
    is needed for filler=val; filler=sentence only needs the tokenizer, which the vocabulary tells
    when the dataset is not on this machine."""
    try:
        d = resolve_data_dir(ckpt, cfg['data_dir'])
    except InputError:
        if cfg['filler'] == 'val' or cfg['data_dir']:
            raise
        name = tokenizer_of_vocab(model.config.vocab_size)
        if name is None:
            raise InputError("cannot tell the model's tokenizer: its dataset is not here; pass --data_dir=") from None
        return None, get_tokenizer(name), None
    meta = load_meta(d)
    if meta['vocab_size'] > model.config.vocab_size:
        raise InputError(f"{d} has a vocabulary of {meta['vocab_size']}, larger than the model's "
                         f"{model.config.vocab_size}: wrong dataset? pass --data_dir=")
    data = load_val(d)[0] if cfg['filler'] == 'val' else None
    return os.path.normpath(d), get_tokenizer(meta), data


# -----------------------------------------------------------------------------
# tables and plots


def model_table(row, lens, markdown=False):
    """One model: a row per depth, a column per length; 'accuracy% (log-likelihood per token)'."""
    header = ['depth'] + [str(L) for L in lens]
    out = []
    for d in row['depths']:
        cells = []
        for L in lens:
            c = row['cells'][L]
            cells.append(c if isinstance(c, str) else f"{100 * c[d]['accuracy']:.0f}% ({c[d]['logp_mean']:.2f})")
        out.append([f"{d:g}"] + cells)
    return format_table(header, out, markdown)


def summary_table(rows, lens, metric, markdown=False):
    """All models: a row each, a column per length; the metric averaged over depths."""
    header = ['model'] + [str(L) for L in lens]
    out = []
    for r in rows:
        cells = []
        for L in lens:
            c = r['per_length'][L]
            cells.append(c if isinstance(c, str) else
                         f"{100 * c['accuracy']:.0f}%" if metric == 'accuracy' else f"{c['logp_mean']:.3f}")
        out.append([r['label']] + cells)
    return format_table(header, out, markdown)


# the two measures of every table over seeds: exact match, and the log-likelihood per answer token, the continuous
# one, so that no conclusion hangs on the threshold of exact match (or of 'learned'); what a run's figure can be
# (a log-likelihood is at most 0), and so where a mean's interval is cut; only exact match's range is finite, so
# only it bounds a difference
MEASURES = {'accuracy': 'exact match', 'logp_mean': 'log-likelihood per answer token'}
BOUNDS = {'accuracy': (0.0, 1.0), 'logp_mean': (-math.inf, 0.0)}
DIFFERENCE_BOUNDS = {'accuracy': (0.0, 1.0), 'logp_mean': None}


def group_text(metric, over):
    """What group_table's cells are, for its caption; over: which seeds."""
    agree = " (a single point where the seeds agree: nothing to estimate a spread from)"
    if metric == 'accuracy':
        return (f"Exact match, mean over depths: the mean over {over} with the 95% t interval of the mean, cut "
                f"to 0-100%{agree}")
    return (f"Log-likelihood per answer token (nats; chance {chance_logp_per_digit():.3f}), mean over depths: the "
            f"mean over {over} with the 95% t interval of the mean, cut at 0{agree}")


def group_table(groups, lens, metric, markdown=False):
    """The groups of seeds: a row each, a column per length; the metric's mean over seeds (of the per-seed means
    over depths) with the 95% t interval of that mean (common.mean_ci, cut to the possible range, BOUNDS;
    the mean alone for one seed, a single point where the seeds agree), and how many seeds learned the task at
    the training length, with the exact binomial interval of that share."""
    scale, fmt, unit = (100, '{:.0f}', '%') if metric == 'accuracy' else (1, '{:.3f}', '')

    def cell(c):
        if isinstance(c, str):
            return c
        if metric not in c:
            return 'n/a: not kept'
        return mean_ci_text(c[metric]['values'], BOUNDS[metric], lambda v: fmt.format(scale * v), unit)
    header = ['model', 'seeds', 'learned [95% interval]'] + [str(L) for L in lens]
    out = []
    for g in groups:
        m = g['measures'][metric]  # the seeds that have this measure: those its means are over
        out.append([g['label'], ','.join(str(s) for s in m['seeds']) or 'none',
                    'n/a' if m['learned'] is None or not m['n'] else k_of_n_text(m['learned'], m['n'])]
                   + [cell(g['per_length'][L]) for L in lens])
    return format_table(header, out, markdown)


def plot_heatmap(row, lens, path):
    """Accuracy and log-likelihood per token over length x depth, for one model."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    deps = row['depths']
    acc = np.full((len(deps), len(lens)), np.nan)
    lp = np.full((len(deps), len(lens)), np.nan)
    for j, L in enumerate(lens):
        if not isinstance(row['cells'][L], str):
            for i, d in enumerate(deps):
                acc[i, j] = 100 * row['cells'][L][d]['accuracy']
                lp[i, j] = row['cells'][L][d]['logp_mean']
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(deps) + 2.6))
    panels = ((acc, 'exact match (%)', 'viridis', 0, 100, '{:.0f}'),
              (lp, 'log-likelihood per answer token (nats)', 'magma', min(np.nanmin(lp) if np.isfinite(lp).any() else -1,
                                                                         chance_logp_per_digit()), 0, '{:.2f}'))
    for ax, (m, title, cmap, lo, hi, fmt) in zip(axes, panels):
        im = ax.imshow(m, cmap=cmap, vmin=lo, vmax=hi, aspect='auto')
        for i in range(len(deps)):
            for j in range(len(lens)):
                ax.text(j, i, 'n/a' if np.isnan(m[i, j]) else fmt.format(m[i, j]), ha='center', va='center',
                        fontsize=8, color='grey' if np.isnan(m[i, j]) else 'white' if m[i, j] < (lo + hi) / 2 else 'black')
        ax.set_xticks(range(len(lens)), [f"{L}\n{L / row['block_size']:g}x" for L in lens], fontsize=8)
        ax.set_yticks(range(len(deps)), [f"{d:g}" for d in deps], fontsize=8)
        ax.set_xlabel('prompt length (tokens and multiple of the training length)')
        ax.set_ylabel('depth of the key')
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"passkey retrieval: {row['label']} ({row['trials']} samples per cell)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_groups(panels, lens, path):
    """The tables over seeds as curves against length: a column per results file (panels: [(title, group_rows'
    groups)]), a row per measure of MEASURES; per model the mean over its seeds with the 95% t interval of that mean
    as a band (group_table's figures: common.mean_ci cut to BOUNDS; the mean alone for one seed) and each seed's
    figure as a dot, the legend saying how many seeds learned. A model keeps its colour in every panel, so that two
    roundings read side by side.
    -> {(title, label, metric): [(L, mean, lo, hi)]}: what was drawn (percent for exact match)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    labels = list(dict.fromkeys(g['label'] for _, groups in panels for g in groups))
    fig, axes = plt.subplots(len(MEASURES), len(panels), figsize=(5.5 * len(panels) + 1, 8), sharex=True,
                             sharey='row', squeeze=False)
    drawn = {}
    for j, (title, groups) in enumerate(panels):
        for i, (metric, name) in enumerate(MEASURES.items()):
            ax, scale = axes[i][j], 100 if metric == 'accuracy' else 1
            for k, g in enumerate(groups):
                points, seeds = [], []
                for L in lens:
                    c = g['per_length'][L]
                    if isinstance(c, str) or metric not in c:
                        continue
                    values = c[metric]['values']
                    m, lo, hi = mean_ci(values, bounds=BOUNDS[metric]) or (float(np.mean(values)),) * 3
                    points.append((L, scale * m, scale * lo, scale * hi))
                    seeds += [(L, scale * v) for v in values]
                drawn[(title, g['label'], metric)] = points
                if not points:
                    continue
                x, m, lo, hi = map(list, zip(*points))
                color = f"C{labels.index(g['label']) % 10}"
                kept = g['measures'][metric]
                learned = '' if kept['learned'] is None else f", {kept['learned']} learned"
                ax.plot(x, m, marker='o', ms=3, lw=1.3, color=color, label=f"{g['label']} ({kept['n']} seeds{learned})")
                ax.fill_between(x, lo, hi, color=color, alpha=0.1, lw=0)
                # every seed's figure, each model's a little apart along the length, so that the distribution
                # (at this scale often two clusters, learned and not) shows beside its mean
                shift = 2 ** (0.05 * (k - (len(groups) - 1) / 2))
                ax.scatter([L * shift for L, _ in seeds], [v for _, v in seeds], s=12, color=color, alpha=0.6, lw=0)
            if metric == 'logp_mean':
                ax.axhline(chance_logp_per_digit(), color='gray', ls='--', lw=1, label='chance (a digit, not which)')
            ax.set_xscale('log', base=2)
            blocks = {g['block_size'] for g in groups}  # the multiples only where every model has one length
            ax.set_xticks(lens, [f"{L}\n{L / min(blocks):g}x" if len(blocks) == 1 else str(L) for L in lens], fontsize=8)
            ax.minorticks_off()
            ax.set_title(f"{title}: {name}", fontsize=9)
            ax.legend(fontsize=7)
            if j == 0:
                ax.set_ylabel('exact match (%)' if metric == 'accuracy' else 'nats per answer token')
            if i == len(MEASURES) - 1:
                ax.set_xlabel('prompt length (tokens' + (', multiple of the training length)' if len(blocks) == 1 else ')'))
    axes[0][0].set_ylim(-2, 102)
    fig.suptitle("passkey retrieval over seeds, per length: each seed's mean over depths (dots), their mean (line) "
                 "and its 95% t interval (band)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def file_name(label):
    return 'passkey_' + re.sub(r'[^A-Za-z0-9_.+-]+', '_', label).strip('_') + '.png'


# -----------------------------------------------------------------------------


def evaluate(cfg, ckpt_paths):
    """Score the checkpoints on passkey retrieval; write and return the results."""
    lens, deps, scalings = check_options(cfg)
    dev = pick_device(cfg['device'])
    ctx = autocast(dev, pick_dtype(cfg['dtype'], dev))
    files = find_checkpoints(ckpt_paths)
    if not files:
        raise InputError("no checkpoints given: python eval_passkey.py out/run1 out/run2 ... (or --ckpts=)")
    names = [s for s in cfg['labels'].split(',') if s] if cfg['labels'] else None
    if names is not None and len(names) != len(files):
        raise InputError(f"--labels has {len(names)} names for {len(files)} checkpoints: {files}")

    # every checkpoint, its tokenizer and filler first: bad input fails before any evaluation
    runs, sources = [], {}
    for i, path in enumerate(files):
        model, ckpt = load_run(path, 'cpu')
        d, tok, data = tokenizer_and_filler(ckpt, model, cfg)
        name = names[i] if names else os.path.basename(os.path.dirname(os.path.abspath(path)))
        runs.append({'path': path, 'name': name, 'data_dir': d, 'tokenizer': tok.name, 'pos': model.config.pos,
                     'block_size': model.config.block_size,
                     'n_positions': model.pe[0].n_positions if model.config.pos == 'learned' else None,
                     'model_args': dataclasses.asdict(model.config), 'training': training_setting(ckpt),
                     'seed': (ckpt.get('config') or {}).get('seed'), 'trained_by': trained_by(ckpt)})
        sources[(d, tok.name)] = (tok, data)
        del model
    named = [r['name'] for r in runs]
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:  # one row would replace the other in the tables and in --save_runs
        raise InputError(f"two checkpoints are both named {', '.join(twice)} (their folders' names): name each "
                         f"with --labels=a,b,...")
    # runs that differ only by their seed share a setting label (eval_extrapolate.py's: 'kerple',
    # 'kerple[learning_rate=0.001]', ...): the groups of the tables over seeds
    for r, setting in zip(runs, auto_labels([dict(r, data_dir=r['data_dir'] or '') for r in runs])):
        r['setting'] = setting
        # the label tells settings apart only within this evaluation: the setting itself (the data folder by
        # name, not by where it is) goes with each saved row, so that a later save cannot pool another with it
        s = setting_of(dict(r, data_dir=os.path.basename(os.path.normpath(r['data_dir'] or ''))))
        r['setting_key'] = hashlib.sha1(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]
    if scalings != ['none'] and not any(r['pos'] == 'rope' for r in runs):
        raise InputError(f"--rope_scaling={cfg['rope_scaling']} applies to RoPE models only; these have "
                         f"pos={', '.join(sorted({r['pos'] for r in runs}))}")
    defaulted = lens is None
    if defaulted:
        lens = sorted({b * m for b in {r['block_size'] for r in runs} for m in (1, 2, 4, 8, 16)})

    # the prompts, once per tokenizer and filler: the same for every model that shares them. A default
    # length too short for the prompt (a short training length) is left out; one asked for is an error
    prompts, kept = {key: [] for key in sources}, []
    for L in lens:
        try:
            built = {key: passkey_prompts(tok, [L], deps, cfg['trials'], cfg['seed'], data, cfg['digits'])
                     for key, (tok, data) in sources.items()}
        except ValueError as e:  # a length too short for the prompt, or a split too short for the filler
            if defaulted and 'too short' in str(e):
                print(f"note: leaving out length {L}: {e}")
                continue
            hint = " (--filler=sentence needs no validation split)" if 'filler data' in str(e) else ''
            raise InputError(f"{e}{hint}") from None
        kept.append(L)
        for key in built:
            prompts[key] += built[key]
    lens = kept
    if not lens:
        raise InputError("none of the default lengths holds a passkey prompt; give longer ones with --lengths=")

    protocol = {'lengths': lens, 'depths': deps, 'trials': cfg['trials'], 'filler': cfg['filler'],
                'seed': cfg['seed'], 'digits': cfg['digits'], 'rope_scaling': scalings,
                'rope_scale': cfg['rope_scale'] or 'L / block_size', 'yarn_alpha': cfg['yarn_alpha'],
                'yarn_beta': cfg['yarn_beta'], 'chance_logp_per_digit': chance_logp_per_digit(),
                'learned_exact': cfg['learned_exact']}
    if cfg['save_runs']:  # a file that cannot be read or written, or of another protocol, fails now, not after
        saved_runs(cfg['save_runs'], protocol)  # the evaluation
    print(f"passkey retrieval on {dev}: lengths {lens}, depths {deps}, {cfg['trials']} trials each, "
          f"filler={cfg['filler']}, seed {cfg['seed']}")
    rows = []
    for r in runs:
        tok, _ = sources[(r['data_dir'], r['tokenizer'])]
        model, _ = load_run(r['path'], dev)
        for kind in scalings if r['pos'] == 'rope' else ['none']:
            suffix = rope_scaling_label(kind, cfg['rope_scale'], not cfg['rope_scale'], r['block_size'])
            label = r['name'] + suffix
            row = {'label': label, 'setting': r['setting'] + suffix, 'setting_key': r['setting_key'] + suffix,
                   'seed': r['seed'], 'path': r['path'],
                   'pos': r['pos'], 'block_size': r['block_size'],
                   'rope_scaling': kind, 'rope_scale': {}, 'depths': deps, 'trials': cfg['trials'],
                   'cells': {}, 'per_length': {}, 'samples': [], 'trained_by': r['trained_by']}
            for L in lens:
                if r['n_positions'] is not None and L > r['n_positions']:
                    row['cells'][L] = row['per_length'][L] = 'n/a: learned'
                    continue
                s = set_rope_scaling(model, kind, cfg['rope_scale'], L, cfg['yarn_alpha'], cfg['yarn_beta'])
                row['rope_scale'][L] = s
                ps = [dict(p) for p in prompts[(r['data_dir'], r['tokenizer'])] if p['length'] == L]
                t0 = time.time()
                score_prompts(model, ps, dev, ctx, batch=max(1, cfg['batch_tokens'] // L))
                cells = summarize(ps)[L]
                row['cells'][L] = cells
                row['per_length'][L] = {m: float(np.mean([c[m] for c in cells.values()]))
                                        for m in ('accuracy', 'logp_mean', 'logp')}
                row['samples'] += [{'length': L, 'depth': p['depth'], 'trial': p['trial'], 'key': p['key'],
                                    'said': tok.decode(p['said']), 'exact': p['exact'], 'logp': round(p['logp'], 5)}
                                   for p in ps]
                pl = row['per_length'][L]
                print(f"  {label:<28} L={L:<6} exact {100 * pl['accuracy']:5.1f}%  log-likelihood per token "
                      f"{pl['logp_mean']:7.3f}  ({len(ps)} samples, {time.time() - t0:.1f}s)", flush=True)
            set_rope_scaling(model, 'none')
            rows.append(row)
        del model

    groups = group_rows(rows, lens, cfg['learned_exact'])
    comparisons = [c for metric in MEASURES for c in compare_groups(groups, lens, metric)]  # Holm per measure
    write_outputs(cfg, protocol, rows, lens, groups, comparisons)
    if cfg['save_runs']:
        merge_runs(cfg['save_runs'], protocol, rows)
    return {'protocol': protocol, 'rows': rows, 'groups': groups, 'comparisons': comparisons}


def learned_at_training_length(row, learned_exact):
    """Whether a run retrieves at its own training length (exact match of at least learned_exact);
    None where that length was not evaluated."""
    c = row['per_length'].get(row['block_size'])
    return None if c is None or isinstance(c, str) else c['accuracy'] >= learned_exact


def group_rows(rows, lens, learned_exact):
    """Rows that differ only by their seed (the same 'setting') form a group (common.group_over_seeds):
    per length, the mean and sample std over its seeds of the exact match and the log-likelihood per
    token (each seed's figure the mean over depths), with `kept`, the members (indices) whose figures they are,
    and `learned`, how many seeds reach an exact match of learned_exact at their training length (None where
    that length was not evaluated). A results file may lack a measure for some runs (the log-likelihood of runs
    evaluated before it was kept): `measures` says, per measure, which seeds have it at some length and how many
    of those learned, the seeds a table of that measure is over."""
    def value(metric):
        def of(row, L):
            c = row['per_length'][L]
            return c if isinstance(c, str) else c.get(metric, 'n/a: not kept')
        return of
    setting = lambda r: r['setting']
    by_metric = {m: group_over_seeds(rows, setting, lens, value(m)) for m in ('accuracy', 'logp_mean')}
    groups = []
    for i, acc in enumerate(by_metric['accuracy']):
        members = acc['members']
        g = {'label': acc['label'], 'n': len(members), 'seeds': [m['seed'] for m in members],
             'rows': [m['label'] for m in members], 'block_size': members[0]['block_size'], 'per_length': {}}
        for L in lens:
            stats = {m: by_metric[m][i]['stats'][L] for m in by_metric}
            if stats['accuracy']['status'] != 'ok':  # no seed could be evaluated here: the first one's reason
                g['per_length'][L] = stats['accuracy']['status']
                continue
            g['per_length'][L] = {'n': stats['accuracy']['n']}
            for metric, st in stats.items():
                if st['status'] == 'ok':
                    kept = [j for j, m in enumerate(members) if not isinstance(value(metric)(m, L), str)]
                    g['per_length'][L][metric] = {'mean': st['mean'], 'std': st['std'], 'values': st['values'],
                                                  'kept': kept}
        flags = [learned_at_training_length(m, learned_exact) for m in members]
        g['learned_seeds'] = flags
        g['learned'] = None if any(f is None for f in flags) else sum(flags)
        g['measures'] = {}
        for metric in by_metric:
            kept = sorted({j for c in g['per_length'].values() if isinstance(c, dict) and metric in c
                           for j in c[metric]['kept']})
            g['measures'][metric] = {'seeds': [g['seeds'][j] for j in kept], 'n': len(kept),
                                     'learned': None if any(flags[j] is None for j in kept) else
                                     sum(flags[j] for j in kept)}
        groups.append(g)
    return groups


def comparison_pairs(groups):
    """(DAPE-X group, X group) for every DAPE group whose label without its DAPE prefix (and without f's
    init, '-zero') is another group's: 'dape-kerple' against 'kerple' (the labels say the settings match
    but for DAPE); and a DAPE group with f zero at init against the default init's: 'dape-kerple-zero'
    against 'kerple' and against 'dape-kerple'."""
    by_label = {g['label']: g for g in groups}
    out = []
    for g in groups:
        if g['label'].startswith(('dape-', 'dapev2-')):
            default = g['label'].removesuffix('-zero')
            out += [(g, by_label[b]) for b in (default.split('-', 1)[1], default) if b != g['label'] and b in by_label]
    return out


def compare_groups(groups, lens, metric='accuracy'):
    """DAPE-X against X per length, in one of MEASURES: the difference of their means with its 95% t interval
    (cut to the possible range for exact match, which lies in [0, 1]), Welch's p and the exact p
    (common.compare_means), over the seeds that learned retrieval at the training length and, apart, over every
    seed; and the exact p adjusted by Holm's method over all of them, the comparisons of one table (one per
    measure). Over the seeds that have the measure (group_rows' `measures`): `learned` counts those.
    -> [{label, baseline, metric, learned, learned_seeds: {L: comparison}, all_seeds: {L: comparison}, and for
    exact match learned_share: the share of seeds that learned, by compare_means of each seed's 1 or 0}]."""
    out = []
    for a, b in comparison_pairs(groups):
        ma, mb = a['measures'][metric], b['measures'][metric]
        c = {'label': a['label'], 'baseline': b['label'], 'metric': metric,
             'learned': [ma['learned'], ma['n'], mb['learned'], mb['n']], 'learned_seeds': {}, 'all_seeds': {}}
        for L in lens:
            ca, cb = a['per_length'][L], b['per_length'][L]
            if isinstance(ca, str) or isinstance(cb, str) or ca['n'] < a['n'] or cb['n'] < b['n']:
                c['learned_seeds'][L] = c['all_seeds'][L] = {'status': 'n/a: not evaluated'}
                continue
            if metric not in ca or metric not in cb:
                c['learned_seeds'][L] = c['all_seeds'][L] = {'status': 'n/a: not kept'}
                continue
            va, vb = ca[metric]['values'], cb[metric]['values']
            # a value is a member's (kept), so that 'learned' is that seed's, not the one at its position
            learned = lambda g, c: [v for v, j in zip(c[metric]['values'], c[metric]['kept']) if g['learned_seeds'][j]]
            c['all_seeds'][L] = compare_means(va, vb, bounds=DIFFERENCE_BOUNDS[metric])
            c['learned_seeds'][L] = compare_means(learned(a, ca), learned(b, cb), bounds=DIFFERENCE_BOUNDS[metric])
        if metric == 'accuracy':  # the share of seeds that learned, by the same exact test on each seed's 1 or 0
            fa, fb = a['learned_seeds'], b['learned_seeds']
            c['learned_share'] = ({'status': 'n/a: not evaluated'} if any(f is None for f in fa + fb) else
                                  compare_means([float(f) for f in fa], [float(f) for f in fb], bounds=(0, 1)))
        out.append(c)
    holm_over(table_tests(out, lens))
    return out


def table_tests(comparisons, lens):
    """Every comparison of comparison_table, in its order: per pair, each length over the learned seeds and over
    all, then (exact match) the share of seeds that learned."""
    return [t for c in comparisons for t in [c[which][L] for which in ('learned_seeds', 'all_seeds') for L in lens]
            + ([c['learned_share']] if 'learned_share' in c else [])]


def learned_text(learned_exact):
    """The rule for 'learned' as a table states it, with the day the standing rule was set."""
    rule, since = LEARNED_RULE
    when = (f"the rule since {since}" if learned_exact == rule else
            f"this evaluation's rule; the standing one, set on {since}, is {100 * rule:.0f}%")
    return (f"learned: seeds with an exact match of at least {100 * learned_exact:.0f}% at their training length "
            f"({when}), with the exact (Clopper-Pearson) 95% interval of the share of seeds")


def comparison_caption(comparisons, lens):
    """What comparison_table's cells are (the measure its comparisons were made in), and its tests
    (common.tests_caption)."""
    metric = comparisons[0]['metric']
    what = ("exact match in percentage points" if metric == 'accuracy' else
            "log-likelihood per answer token in nats (higher: the answer more likely)")
    share = ("; in the learned column of the row 'all', the exact p of the difference between the shares of seeds "
             "that learned (the same permutation test on each seed's 1, learned, or 0: a conditional test like "
             "Fisher's, two-sided by doubling the smaller tail) and its Holm adjustment" if metric == 'accuracy' else '')
    return (f"DAPE-X minus X, {what}: the difference of the means ["
            + interval_text(bounded=DIFFERENCE_BOUNDS[metric] is not None) + "], Welch's two-sided p, the exact p and its Holm "
            "adjustment, over the seeds that learned retrieval at the training length (learned) and over every seed "
            f"(all){share}. " + tests_caption(table_tests(comparisons, lens)))


def comparison_table(comparisons, lens, markdown=False):
    """A row per DAPE-X against X and per set of seeds: the difference of the means, of exact match in
    percentage points [95% t interval cut to the possible range] or of log-likelihood in nats [95% t interval],
    Welch's p, the exact p and its Holm adjustment (compare_groups, one measure)."""
    def cell(c, metric):
        if c['status'] != 'ok':
            return c['status']
        scale, fmt = (100, '{:+.0f}') if metric == 'accuracy' else (1, '{:+.2f}')
        d = dict(c, diff=scale * c['diff'], ci=[scale * x for x in c['ci']])
        return (f"{difference_text(d, fmt)}, p {p_text(c['p'])}, exact {p_text(c['p_exact'])}, "
                f"Holm {p_text(c['p_holm'])}")
    header = ['DAPE-X minus X', 'seeds', 'learned'] + [str(L) for L in lens]
    rows = []
    for c in comparisons:
        ka, na, kb, nb = c['learned']
        share = c.get('learned_share', {'status': None})
        for which, name in (('learned_seeds', 'learned'), ('all_seeds', 'all')):
            test = (f", exact {p_text(share['p_exact'])}, Holm {p_text(share['p_holm'])}"
                    if which == 'all_seeds' and share['status'] == 'ok' else '')
            rows.append([f"{c['label']} - {c['baseline']}", name, f"{ka} of {na} vs {kb} of {nb}{test}"]
                        + [cell(c[which][L], c['metric']) for L in lens])
    return format_table(header, rows, markdown)


def seed_tables(protocol, rows, lens, markdown=True):
    """The tables over seeds of a passkey.json's rows, as the results pages show them: per group the exact match
    and the log-likelihood per answer token (the mean with its interval, learned), DAPE-X against X in each, and
    every run's exact match."""
    groups = group_rows(rows, lens, protocol['learned_exact'])
    text = []
    for metric in MEASURES:
        # the caption names one set of seeds only where every model has it for this measure
        seed_sets = {tuple(g['measures'][metric]['seeds']) for g in groups}
        over = (f"seeds {','.join(map(str, next(iter(seed_sets))))}" if len(seed_sets) == 1
                else "each model's seeds with this measure (its seeds column)")
        learned = f"; {learned_text(protocol['learned_exact'])}" if metric == 'accuracy' else ''
        text += [f"{group_text(metric, over)}{learned}.", '', group_table(groups, lens, metric, markdown), '']
    for metric in MEASURES:
        comparisons = compare_groups(groups, lens, metric)
        if comparisons:
            text += [comparison_caption(comparisons, lens), '', comparison_table(comparisons, lens, markdown), '']
    text += ['Every run: exact match, mean over depths.', '', summary_table(rows, lens, 'accuracy', markdown)]
    return '\n'.join(text)


def read_results(path):
    """A passkey.json (as this script writes it, or the runs' figures alone: protocol with lengths and
    learned_exact, and rows with label, setting, seed, block_size and per-length accuracy) -> (protocol, rows)."""
    with open(path) as f:
        saved = json.load(f)
    return saved['protocol'], [dict(r, per_length={int(L): c for L, c in r['per_length'].items()})
                               for r in saved['rows']]


def tables_from_file(path):
    """seed_tables of a results file (read_results), for a results page; nothing is evaluated."""
    protocol, rows = read_results(path)
    return seed_tables(protocol, rows, protocol['lengths'])


SAME_PROTOCOL = ('lengths', 'depths', 'trials', 'filler', 'seed', 'digits')  # what makes two runs' figures comparable


def read_saved(path):
    """A results file as --save_runs adds to it: {'protocol', 'rows'}; None where there is none yet (and a
    folder to write it in)."""
    if not os.path.exists(path):
        where = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(where):
            raise InputError(f"--save_runs: no folder {where} for {path}")
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"--save_runs: {path} is not a readable results file ({e}); save to another file") from None
    if not isinstance(saved, dict) or not {'protocol', 'rows'} <= set(saved):
        raise InputError(f"--save_runs: {path} is not a passkey results file (no protocol and rows); save to "
                         f"another file")
    return saved


def saved_runs(path, protocol):
    """The results file `path` (a new one if there is none), if its runs were evaluated as `protocol` says."""
    saved = read_saved(path)
    if saved is None:
        return {'protocol': {k: protocol[k] for k in SAME_PROTOCOL + ('learned_exact',)}, 'rows': []}
    theirs = {k: saved['protocol'][k] for k in SAME_PROTOCOL if k in saved['protocol']}
    ours = {k: protocol[k] for k in theirs}
    if theirs != ours:
        raise InputError(f"--save_runs: {path} holds runs evaluated with {theirs}, this evaluation uses {ours}: "
                         f"evaluate with the file's settings, or save to another file")
    return saved


def merge_runs(path, protocol, rows):
    """Merge rows into the results file `path` (a results page's, read by --tables_from): each run's label,
    setting, seed, training length and per length its exact match and log-likelihood per token, marked
    `source: run`; a run of the same label is replaced in place, a new one goes among its setting's runs
    by seed (before the first of a larger seed). A file of another protocol is an error, left as it was; the file is written whole or not at all."""
    saved = saved_runs(path, protocol)
    kept = [{'label': r['label'], 'setting': r['setting'], 'seed': r['seed'], 'block_size': r['block_size'],
             'per_length': {str(L): c if isinstance(c, str) else {'accuracy': c['accuracy'], 'logp_mean': c['logp_mean']}
                            for L, c in r['per_length'].items()}, 'source': 'run',
             **{k: r.get('trained_by', r).get(k, 'unknown') for k in ('commit', 'command', 'machine', 'date')},
             **({'setting_key': r['setting_key']} if 'setting_key' in r else {})}
            for r in rows]
    for row in kept:
        labels = [r['label'] for r in saved['rows']]
        for r in saved['rows']:  # rows saved before setting_key was kept are not checked
            if 'setting_key' in r and 'setting_key' in row and r['label'] != row['label'] and \
                    (r['setting'] == row['setting']) != (r['setting_key'] == row['setting_key']):
                what = ("another setting under the same label" if r['setting'] == row['setting'] else
                        "the same setting under another label")
                raise InputError(f"--save_runs: {path} holds {r['label']} ({r['setting']}), and {row['label']} "
                                 f"({row['setting']}) is {what}: evaluate the runs of both settings together, "
                                 f"so that their labels tell them apart, and save them to another file")
        other = [r['label'] for r in saved['rows'] if r['label'] != row['label'] and row['seed'] is not None
                 and (r['setting'], r['seed']) == (row['setting'], row['seed'])]
        if other:  # the same run under two labels would count as two seeds
            raise InputError(f"--save_runs: {path} holds {other[0]}, a run of {row['setting']} with seed {row['seed']}, "
                             f"and this evaluation saves it again as {row['label']}: save it under the label "
                             f"{other[0]} (--labels=), or remove that row first")
        if row['label'] in labels:
            saved['rows'][labels.index(row['label'])] = row
            continue
        same = [i for i, r in enumerate(saved['rows']) if r['setting'] == row['setting']]
        later = [i for i in same if (saved['rows'][i]['seed'] or 0) > (row['seed'] or 0)]
        saved['rows'].insert(later[0] if later else same[-1] + 1 if same else len(saved['rows']), row)
    with open(path + '.tmp', 'w') as f:
        json.dump(saved, f, indent=1)
    os.replace(path + '.tmp', path)
    print(f"{len(kept)} run(s) saved in {path}")


# -----------------------------------------------------------------------------
# the test-retest: the same runs trained under two roundings


def _by_run(rows, which):
    """{(setting, seed): row} of one file's rows: what pairs a run with its retest (the labels may differ between
    the files). A (setting, seed) twice is an error: its retest would be ambiguous."""
    out = {}
    for r in rows:
        k = (r['setting'], r['seed'])
        if k in out:
            raise InputError(f"--{which}: two runs of {k[0]} with seed {k[1]} ({out[k]['label']} and {r['label']}): "
                             f"keep one, so that each run has one counterpart under the other rounding")
        out[k] = r
    return out


def _paired_figures(a, b, lens, metric):
    """A run's metric under both roundings at each length where both have it: (a's list, b's list)."""
    pairs = [(a['per_length'][L][metric], b['per_length'][L][metric]) for L in lens
             if all(isinstance(r['per_length'].get(L), dict) and metric in r['per_length'][L] for r in (a, b))]
    return [x for x, _ in pairs], [y for _, y in pairs]


def retest_tables(protocol, rows_a, rows_b, lens):
    """A test-retest of the same runs (setting and seed) trained twice, once under each of two roundings (ATen's
    vector kernels and ATEN_CPU_CAPABILITY=default), rows_a from --tables_from and rows_b from --rounding_from:
    only runs present in both count, and 'learned' is protocol's rule (learned_exact at the training length, as
    group_rows decides it) under both. Three Markdown tables and a caption: per model, how many seeds learned
    under each rounding and how many changed sides, and how the exact match and the log-likelihood per answer
    token move over every seed and length (Pearson's r between the two, the mean absolute move); per run, learned
    or not and its figures at the training length and the longest under both; and every comparison the published
    tables make (compare_groups: DAPE-X against X at each length in each of MEASURES, over the learned seeds and
    over all), computed
    under each rounding as its own table computes it, with whether its conclusion (which side is ahead, and
    whether Holm's exact p is below ALPHA) holds under both."""
    by_a, by_b = _by_run(rows_a, 'tables_from'), _by_run(rows_b, 'rounding_from')
    both = [k for k in by_a if k in by_b]  # in the first file's order: the groups of both come out alike
    if not both:
        return 'no run (setting and seed) is in both files'
    ra, rb = [by_a[k] for k in both], [by_b[k] for k in both]
    ga, gb = group_rows(ra, lens, protocol['learned_exact']), group_rows(rb, lens, protocol['learned_exact'])
    a_name, b_name, how = retest_sides([(x.get('machine'), y.get('machine')) for x, y in zip(ra, rb)])
    r_text = lambda r: 'n/a' if r is None else f"{r:+.2f}"
    move = lambda xs, ys, fmt: fmt.format(np.mean(np.abs(np.subtract(xs, ys)))) if xs else 'n/a'
    learned = lambda g: 'n/a' if g['learned'] is None else k_of_n_text(g['learned'], g['n'])
    yes = lambda f: 'n/a' if f is None else 'yes' if f else 'no'
    changed = lambda fa, fb: sum(x is not None and y is not None and x != y for x, y in zip(fa, fb))

    def figures(runs_a, runs_b):
        """The cells of table 1 after the learned ones: r and mean move of exact match (points) and log-likelihood."""
        cells = []
        for metric, scale, fmt in (('accuracy', 100, '{:.1f}'), ('logp_mean', 1, '{:.3f}')):
            pairs = [_paired_figures(x, y, lens, metric) for x, y in zip(runs_a, runs_b)]
            xs, ys = [scale * v for p in pairs for v in p[0]], [scale * v for p in pairs for v in p[1]]
            cells += [r_text(pearson(xs, ys)), move(xs, ys, fmt)]
        return cells

    summary, per_run, flips = [], [], 0
    for g, h in zip(ga, gb):
        runs_a, runs_b = [by_a[(g['label'], s)] for s in g['seeds']], [by_b[(g['label'], s)] for s in g['seeds']]
        f = changed(g['learned_seeds'], h['learned_seeds'])
        flips += f
        summary.append([g['label'], ','.join(map(str, g['seeds'])), learned(g), learned(h), str(f)]
                       + figures(runs_a, runs_b))
        for x, y, fx, fy in zip(runs_a, runs_b, g['learned_seeds'], h['learned_seeds']):
            pct = lambda r, L: (f"{100 * r['per_length'][L]['accuracy']:.0f}%"
                                if isinstance(r['per_length'].get(L), dict) else 'n/a')
            at = [L for L in lens if isinstance(x['per_length'].get(L), dict) and isinstance(y['per_length'].get(L), dict)]
            longest = max(at, default=None)
            lp = lambda r: f"{r['per_length'][longest]['logp_mean']:.3f}" if 'logp_mean' in r['per_length'][longest] else 'n/a'
            per_run.append([g['label'], str(x['seed']), f"{yes(fx)} / {yes(fy)}",
                            f"{pct(x, x['block_size'])} / {pct(y, y['block_size'])}",
                            'n/a' if longest is None else f"{pct(x, longest)} / {pct(y, longest)} (L={longest})",
                            'n/a' if longest is None else f"{lp(x)} / {lp(y)} (L={longest})"])
    summary.append(['all', f"{len(ra)} runs", '', '', str(flips)] + figures(ra, rb))
    # the comparisons, each computed under each rounding as its own table computes it (Holm over that table)
    checks, shares = [], []
    held, total = {'learned': 0, 'all': 0}, {'learned': 0, 'all': 0}  # over the seeds that learned, over every seed
    for metric, measure in MEASURES.items():
        for ca, cb in zip(compare_groups(ga, lens, metric), compare_groups(gb, lens, metric)):
            for which, name in (('learned_seeds', 'learned'), ('all_seeds', 'all')):
                text, same, tested = holds_at(ca[which], cb[which], lens, 'L')
                held[name], total[name] = held[name] + same, total[name] + tested
                checks.append([f"{ca['label']} - {ca['baseline']}", measure, name, verdict_counts(ca[which].values()),
                               verdict_counts(cb[which].values()), text])
            if 'learned_share' in ca:
                same = holds(ca['learned_share'], cb['learned_share'])
                held['all'], total['all'] = held['all'] + bool(same), total['all'] + (same is not None)
                shares.append([f"{ca['label']} - {ca['baseline']}"] + [share_text(c) for c in (ca, cb)]
                              + ['n/a' if same is None else 'yes' if same else 'no'])
    seeds = sorted({r['seed'] for r in ra}, key=lambda s: (s is None, s or 0))
    text = [format_table(['model', 'seeds', f"learned, {a_name}", f"learned, {b_name}", 'changed sides', 'exact match r',
                          'exact match mean move', 'log-likelihood r', 'log-likelihood mean move'], summary, True),
            format_table(['model', 'seed', f"learned, {a_name} / {b_name}",
                          f"exact match at the training length, {a_name} / {b_name}",
                          f"exact match at the longest length, {a_name} / {b_name}",
                          f"log-likelihood at the longest length, {a_name} / {b_name}"], per_run, True)]
    if checks:
        text.append(format_table(['DAPE-X minus X', 'measure', 'seeds', f"{a_name}: at each of {len(lens)} lengths",
                                  f"{b_name}: at each of {len(lens)} lengths", 'holds under both'],
                                 checks, True))
    if shares:
        text.append(format_table(['DAPE-X against X, seeds that learned', a_name, b_name, 'holds under both'],
                                 shares, True))
    caption = (f"The same runs (seeds {','.join(map(str, seeds))}) trained {how}. Only runs (model and seed) in "
               f"both files count. {learned_text(protocol['learned_exact'])}, under each rounding; changed sides: "
               f"runs learned under one and not the other. r: Pearson's correlation between "
               f"the two roundings over every seed and length (n/a: fewer than 3 pairs, or one side does not vary); "
               f"mean move: the mean absolute difference, in points of exact match, in nats of log-likelihood per "
               f"answer token. Comparisons: DAPE-X minus X's exact match, and apart its log-likelihood per answer token, at "
               f"each length, over the seeds that learned (learned) and over every seed (all), each as its table computes it under each rounding (Holm over that "
               f"table); ahead, and significantly where Holm's exact p is below {ALPHA:g}"
               + ("; and apart the share of seeds that learned, in the exact-match table" if shares else '') +
               f"; a conclusion (ahead, behind or level, significantly or not) holds where both say the same (n/a: no "
               f"test under one of them). {sum(held.values())} of {sum(total.values())} conclusions hold under "
               f"both: {held['all']} of {total['all']} over every seed"
               + (" (the shares of seeds that learned among them)" if shares else '')
               + (f", {held['learned']} of {total['learned']} over the seeds that learned, which the rounding chooses."
                  if total['learned'] else ", none over the seeds that learned (too few for a test under both)."))
    return '\n\n'.join(text + [caption])


def share_text(c):
    """A comparison's share of seeds that learned (compare_groups, exact match) as the test-retest writes it:
    '3 of 6 vs 6 of 6: behind, exact 0.18, Holm 1' ('behind*' where Holm's p is below ALPHA)."""
    ka, na, kb, nb = c['learned']
    t = c['learned_share']
    return (f"{ka} of {na} vs {kb} of {nb}: " + (verdict(t) if t['status'] != 'ok' else
            f"{verdict(t)}, exact {p_text(t['p_exact'])}, Holm {p_text(t['p_holm'])}"))


def figure_from_files(paths, out):
    """plot_groups of results files (read_results; the lengths of the first), a column each, titled by its file and
    the kernels its runs were trained with."""
    panels, lens = [], None
    for path in paths:
        protocol, rows = read_results(path)
        lens = lens or protocol['lengths']
        kernels = kernels_of(r.get('machine') for r in rows)
        panels.append((os.path.basename(path) + ('' if kernels == 'unknown' else f" ({kernels} kernels)"),
                       group_rows(rows, protocol['lengths'], protocol['learned_exact'])))
    return plot_groups(panels, lens, out)


def retest_tables_from_files(path_a, path_b):
    """retest_tables of two results files (as tables_from_file reads them) that hold the same runs trained under two
    roundings; files evaluated with another protocol (SAME_PROTOCOL) are an error: their figures differ for
    reasons other than the rounding."""
    (pa, rows_a), (pb, rows_b) = read_results(path_a), read_results(path_b)
    differ = [k for k in SAME_PROTOCOL if pa.get(k) != pb.get(k)]
    if differ:
        raise InputError("--rounding_from: the two files were evaluated differently, "
                         + ', '.join(f"{k} {pa.get(k)!r} in {path_a} and {pb.get(k)!r} in {path_b}" for k in differ)
                         + ": a test-retest needs the same evaluation of both; evaluate them alike")
    return retest_tables(pa, rows_a, rows_b, pa['lengths'])


def write_outputs(cfg, protocol, rows, lens, groups=(), comparisons=()):
    out = cfg['out_dir']
    os.makedirs(out, exist_ok=True)
    chance = (f"Chance: exact match ~0; log-likelihood per token ln(1/10) = {chance_logp_per_digit():.3f} for a "
              f"model that knows a digit comes but not which.")
    seeded = any(g['n'] > 1 for g in groups)
    learned = learned_text(protocol['learned_exact'])
    text = [f"exact match, mean over depths\n{summary_table(rows, lens, 'accuracy')}",
            f"log-likelihood per answer token (nats), mean over depths\n{summary_table(rows, lens, 'logp')}"]
    by_metric = {m: [c for c in comparisons if c['metric'] == m] for m in MEASURES}
    if seeded:
        text += [f"over seeds: {group_text(m, 'the seeds')}" + (f"; {learned}" if m == 'accuracy' else '')
                 + f"\n{group_table(groups, lens, m)}" for m in MEASURES]
    text += [f"{comparison_caption(cs, lens)}\n{comparison_table(cs, lens)}" for cs in by_metric.values() if cs]
    text += [f"{r['label']}: exact match (log-likelihood per token), per depth\n{model_table(r, lens)}" for r in rows]
    print('\n' + '\n\n'.join(text) + '\n\n' + chance)

    md = ['# Passkey retrieval', '',
          f"{protocol['trials']} samples per length and depth; filler: {protocol['filler']}; seed {protocol['seed']}; "
          f"{protocol['digits']}-digit keys. {chance}", '',
          '## Exact match, mean over depths', '', summary_table(rows, lens, 'accuracy', True), '',
          '## Log-likelihood per answer token (nats), mean over depths', '', summary_table(rows, lens, 'logp', True), '']
    if seeded:
        for m, name in MEASURES.items():
            md += [f"## Over seeds: {name}", '', f"{group_text(m, 'the seeds')}"
                   + (f"; {learned}." if m == 'accuracy' else '.'), '', group_table(groups, lens, m, True), '']
    for m, cs in by_metric.items():
        if cs:
            md += [f"## DAPE-X minus X: {MEASURES[m]}", '', comparison_caption(cs, lens), '',
                   comparison_table(cs, lens, True), '']
    for r in rows:
        md += [f"## {r['label']}: exact match (log-likelihood per token) per depth", '', model_table(r, lens, True), '']
    with open(os.path.join(out, 'passkey.md'), 'w') as f:
        f.write('\n'.join(md))
    with open(os.path.join(out, 'passkey.json'), 'w') as f:
        json.dump(jsonable({'protocol': protocol, 'rows': rows, 'groups': list(groups),
                            'comparisons': list(comparisons)}), f, indent=1, allow_nan=False)
    written = ['passkey.json', 'passkey.md']
    if cfg['plot']:
        for r in rows:
            plot_heatmap(r, lens, os.path.join(out, file_name(r['label'])))
            written.append(file_name(r['label']))
    print(f"wrote {', '.join(os.path.join(out, w) for w in written)}")


def main(argv=None):
    paths, cfg = checkpoints_and_config(sys.argv[1:] if argv is None else list(argv),
                                        {k: globals()[k] for k in config_keys}, __doc__)
    for key, what in (('rounding_from', 'compares two results files: name the first'),
                      ('figure', 'draws a results file: name it')):
        if cfg[key] and not cfg['tables_from']:
            raise InputError(f"--{key}={cfg[key]} {what} with --tables_from (e.g. "
                             f"--tables_from=docs/results/passkey_cpu.json --{key}=...)")
    if cfg['tables_from']:
        reads = ('tables_from', 'rounding_from', 'figure')
        ignored = [f"--{k}" for k in config_keys if k not in reads and cfg[k] != globals()[k]] + paths
        if ignored:  # nothing is evaluated: an evaluation's options would change nothing
            raise InputError(f"--tables_from prints a results file and evaluates nothing; leave out {', '.join(ignored)}")
        for key in ('tables_from', 'rounding_from'):
            if cfg[key] and not os.path.isfile(cfg[key]):
                raise InputError(f"--{key}: no file {cfg[key]}")
        table = (retest_tables_from_files(cfg['tables_from'], cfg['rounding_from']) if cfg['rounding_from']
                 else tables_from_file(cfg['tables_from']))
        print(table)
        if cfg['figure']:
            figure_from_files([p for p in (cfg['tables_from'], cfg['rounding_from']) if p], cfg['figure'])
            print(f"wrote {cfg['figure']}")
        return table
    return evaluate(cfg, paths)


if __name__ == '__main__':
    try:
        main()
    except (InputError, ConfigError) as e:
        print(f"eval_passkey.py: error: {e}", file=sys.stderr)
        sys.exit(2)
