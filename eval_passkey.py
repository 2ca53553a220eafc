"""
Passkey retrieval (passkey.py; Mohtashami & Jaggi 2023), the protocol: a model that learnt to retrieve at its
training length (train.py --passkey_frac) reads prompts of every length from that length up, the key hidden at each
depth, and is scored on the key's digits; past its training length, retrieval tests extrapolation alone.

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
- Seeds: checkpoints that differ only by their seed (as eval_extrapolate.py groups them) form a group, read
  with the same RoPE scaling. A seed learned the task where its exact match at its training length is at least
  `learned_exact`; one that did not says nothing about extrapolation. What is made of a group (results.py): per
  length, the mean over its seeds with the 95% t interval of that mean, of exact match and of the log-likelihood
  per answer token (the continuous measure that no threshold decides), how many seeds learned, and DAPE-X
  against X in each measure, over the seeds that learned and over every seed.

Outputs (`out_dir`, default results/passkey/): passkey.json (everything, every sample's key and answer),
passkey.md (the tables) and passkey_<model>.png (a heat map per row over length x depth).

    python eval_passkey.py --tables_from=docs/results/passkey_cpu.json     # a results page's tables again
    python eval_passkey.py out-passkey/kerple_s6 --save_runs=docs/results/passkey_cpu.json  # a run added to them
    python eval_passkey.py --tables_from=docs/results/passkey_X.json --rounding_from=docs/results/passkey_X_default.json

The last: the test-retest of the same runs trained twice (under two roundings of one machine, or on two
machines), each file saved by --save_runs. With --tables_from, --figure=PATH.png also draws the tables over seeds
against length, a column per file (rounding_from's beside).
"""

import dataclasses
import hashlib
import json
import os
import re
import sys
import time

import numpy as np

from common import (InputError, auto_labels, autocast, checkpoints_and_config, dape_of_run, find_checkpoints, load_run,
                    load_val, parse_list, pick_device, pick_dtype, resolve_data_dir, rope_scaling_options, run_main,
                    setting_of, trained_by, training_setting)
from results import (MEASURES, SAME_PROTOCOL, compare_groups, comparison_caption, comparison_table, figure_from_files,
                     group_rows, group_table, group_text, jsonable, learned_text, length_table, merge_rows, new_figure,
                     passkey_summary_table, read_passkey_results, read_results, retest_tables_from_files, save_figure,
                     seed_tables, write_json)
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
    def cell(d, L):
        c = row['cells'][L]
        return c if isinstance(c, str) else f"{100 * c[d]['accuracy']:.0f}% ({c[d]['logp_mean']:.2f})"
    return length_table(row['depths'], lens, [('depth', lambda d: f"{d:g}")], cell, markdown)


def plot_heatmap(row, lens, path):
    """Accuracy and log-likelihood per token over length x depth, for one model."""
    deps = row['depths']
    acc, lp = np.full((len(deps), len(lens)), np.nan), np.full((len(deps), len(lens)), np.nan)
    for j, L in enumerate(lens):
        if not isinstance(row['cells'][L], str):  # a length not evaluated stays n/a
            for i, d in enumerate(deps):
                acc[i, j] = 100 * row['cells'][L][d]['accuracy']
                lp[i, j] = row['cells'][L][d]['logp_mean']
    fig, axes = new_figure(1, 2, (11, 0.5 * len(deps) + 2.6))
    panels = ((acc, 'exact match (%)', 'viridis', 0, 100, '{:.0f}'),
              (lp, 'log-likelihood per answer token (nats)', 'magma', min(np.nanmin(lp) if np.isfinite(lp).any() else -1,
                                                                         chance_logp_per_digit()), 0, '{:.2f}'))
    for ax, (m, title, cmap, lo, hi, fmt) in zip(axes[0], panels):
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
    save_figure(fig, path, 110)


def file_name(label):
    return 'passkey_' + re.sub(r'[^A-Za-z0-9_.+-]+', '_', label).strip('_') + '.png'


# -----------------------------------------------------------------------------


def evaluate(cfg, ckpt_paths):
    """Score the checkpoints on passkey retrieval; write and return the results."""
    lens, deps, scalings = check_options(cfg)
    dev = pick_device(cfg['device'])
    ctx = autocast(dev, pick_dtype(cfg['dtype'], dev))
    files, names = find_checkpoints(ckpt_paths, cfg['labels'], 'eval_passkey.py')

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
                     'seed': (ckpt.get('config') or {}).get('seed'), 'trained_by': trained_by(ckpt),
                     'dape_py': dape_of_run(ckpt)})  # an edited dape.py labels its runs (common.setting_of)
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
                   'seed': r['seed'], 'path': r['path'], 'pos': r['pos'], 'block_size': r['block_size'],
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
                row['cells'][L] = cells = summarize(ps)[L]
                row['per_length'][L] = pl = {m: float(np.mean([c[m] for c in cells.values()]))
                                             for m in ('accuracy', 'logp_mean', 'logp')}
                row['samples'] += [{'length': L, 'depth': p['depth'], 'trial': p['trial'], 'key': p['key'],
                                    'said': tok.decode(p['said']), 'exact': p['exact'], 'logp': round(p['logp'], 5)}
                                   for p in ps]
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


def tables_from_file(path):
    """seed_tables of a results file (read_passkey_results), for a results page; nothing is evaluated."""
    protocol, rows = read_passkey_results(path)
    return seed_tables(protocol, rows, protocol['lengths'])


def saved_runs(path, protocol):
    """The results file `path` (a new one if there is none, in a folder that is there), if its runs were evaluated
    as `protocol` says."""
    if not os.path.exists(path):
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise InputError(f"--save_runs: no folder {os.path.dirname(os.path.abspath(path))} for {path}")
        return {'protocol': {k: protocol[k] for k in SAME_PROTOCOL + ('learned_exact',)}, 'rows': []}
    saved = read_results(path, '--save_runs', 'save to another file', 'rows', what='passkey')
    theirs = {k: saved.get('protocol', {})[k] for k in SAME_PROTOCOL if k in saved.get('protocol', {})}
    ours = {k: protocol[k] for k in theirs}
    if theirs != ours or 'protocol' not in saved:
        raise InputError(f"--save_runs: {path} holds runs evaluated with {theirs}, this evaluation uses {ours}: "
                         f"evaluate with the file's settings, or save to another file")
    return saved


def merge_runs(path, protocol, rows):
    """Merge rows into the results file `path` (results.merge_rows: a run of the same label is replaced in place, a
    new one goes among its setting's runs by seed): each run's label, setting, seed, training length, where it was
    trained, and per length its exact match and log-likelihood per token. A file of another protocol, or a row
    whose setting another label holds (or whose label holds another setting), is an error, the file left as it
    was."""
    saved = saved_runs(path, protocol)
    kept = [{'label': r['label'], 'setting': r['setting'], 'seed': r['seed'], 'block_size': r['block_size'],
             'per_length': {str(L): c if isinstance(c, str) else {'accuracy': c['accuracy'], 'logp_mean': c['logp_mean']}
                            for L, c in r['per_length'].items()}, 'source': 'run',
             **{k: r.get('trained_by', r).get(k, 'unknown') for k in ('commit', 'command', 'machine', 'date')},
             **({'setting_key': r['setting_key']} if 'setting_key' in r else {})}
            for r in rows]
    for row in kept:
        for r in saved['rows']:  # rows saved before setting_key was kept are not checked
            if 'setting_key' in r and 'setting_key' in row and r['label'] != row['label'] and \
                    (r['setting'] == row['setting']) != (r['setting_key'] == row['setting_key']):
                what = ("another setting under the same label" if r['setting'] == row['setting'] else
                        "the same setting under another label")
                raise InputError(f"--save_runs: {path} holds {r['label']} ({r['setting']}), and {row['label']} "
                                 f"({row['setting']}) is {what}: evaluate the runs of both settings together, "
                                 f"so that their labels tell them apart, and save them to another file")
    merge_rows(path, saved, kept, lambda r: r['label'], lambda r: r['setting'], 'rows')


def write_outputs(cfg, protocol, rows, lens, groups=(), comparisons=()):
    out = cfg['out_dir']
    os.makedirs(out, exist_ok=True)
    chance = (f"Chance: exact match ~0; log-likelihood per token ln(1/10) = {chance_logp_per_digit():.3f} for a "
              f"model that knows a digit comes but not which.")
    seeded = any(g['n'] > 1 for g in groups)
    learned = learned_text(protocol['learned_exact'])
    text = [f"exact match, mean over depths\n{passkey_summary_table(rows, lens, 'accuracy')}",
            f"log-likelihood per answer token (nats), mean over depths\n{passkey_summary_table(rows, lens, 'logp')}"]
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
          '## Exact match, mean over depths', '', passkey_summary_table(rows, lens, 'accuracy', True), '',
          '## Log-likelihood per answer token (nats), mean over depths', '',
          passkey_summary_table(rows, lens, 'logp', True), '']
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
    write_json(os.path.join(out, 'passkey.json'), jsonable({'protocol': protocol, 'rows': rows, 'groups': list(groups),
                                                             'comparisons': list(comparisons)}))
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
    run_main(main, 'eval_passkey.py')
