"""
Length extrapolation as the DAPE paper measures it (§4, Figure 2, Table 5): the perplexity of trained checkpoints
at evaluation lengths from their training length up, on the same scored tokens at every length, seeds of a setting
grouped and DAPE-X set against X. Table 1's timing is bench.py's `timing` section.

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
- Checkpoints that differ only by their seed (settings that do not change what is trained, like out_dir,
  may differ) form a group: mean ± sample std per length; DAPE-X against X trained alike (results.py:
  Welch's p per length as in Table 5, the exact permutation test's with Holm's adjustment over the table, the
  difference of the means with its 95% interval); a DAPE-X group with f zero at step 0 (dape_init='zero') also
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
                    resolve_data_dir, rope_scaling_options, run_main, setting_of, trained_by, training_data_dirs,
                    training_setting)
from results import (compare, dape_pairs, difference_table, group_runs, holm_table, parse_pairs, plot_loss_by_position,
                     ppl_run_table, ppl_table, protocol_text, pvalue_table, tokens_seen, training_notes,
                     unequal_training, write_ppl_results)
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


# -----------------------------------------------------------------------------
# which groups are compared


DAPE_KEYS = ('dape', 'dape_variant', 'dape_width', 'dape_kernel', 'dape_init', 'dape.py')


def comparison_pairs(groups, explicit=()):
    """(dape group, baseline group) pairs: the explicit (label, label) list (parse_pairs), or results.dape_pairs'
    of the groups: every DAPE-X against X trained alike on the same data (their settings without DAPE's options
    agree), and a DAPE-X with f zero at step 0, or trained with an edited dape.py (an ablation), also against the
    same DAPE-X without that departure, where there is one."""
    by_label = {g['label']: g for g in groups}

    def parts(label):
        s = setting_of(by_label[label])
        m = s['model']
        alike = json.dumps(dict(s, model={k: v for k, v in m.items() if k not in DAPE_KEYS}), sort_keys=True)
        which = 'none' if m['dape'] == 'none' else json.dumps([m[k] for k in ('dape', 'dape_variant', 'dape_width',
                                                                               'dape_kernel')])
        departs = (None if m['dape_init'] == 'default' else m['dape_init'], m.get('dape.py'))
        return alike, which, departs
    return [(by_label[a], by_label[b]) for a, b in explicit or dape_pairs(by_label, parts)]


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
    files, user_labels = find_checkpoints(ckpt_paths, cfg['labels'], 'eval_extrapolate.py')

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
        eval_lengths = sorted(set(parse_list(cfg['lengths'], 'lengths', int)))
        if eval_lengths[0] < 1:
            raise InputError(f"--lengths values must be positive, got {cfg['lengths']!r}")
    else:
        eval_lengths = default_lengths({r['model_args']['block_size'] for r in runs}, cfg['max_length'])
    K, n_windows = scored_tokens(eval_lengths, cfg['eval_tokens'], cfg['num_windows'])

    data_cache, protocol = {}, {'eval_tokens': K, 'num_windows': n_windows, 'seed': cfg['seed'],
                                'lengths': eval_lengths, 'data': {}, 'yarn_alpha': cfg['yarn_alpha'],
                                'yarn_beta': cfg['yarn_beta'],
                                'evaluated_by': provenance(command, torch.device(dev).type)}
    for d in dict.fromkeys(r['data_dir'] for r in runs):  # each data folder once, in the runs' order
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

    print('\n' + protocol_text(protocol) + '\n\nperplexity\n' + ppl_table(groups, 'ppl', eval_lengths))
    if any(g['bpb'][L]['status'] == 'ok' for g in groups for L in eval_lengths):
        print('\nbits per byte\n' + ppl_table(groups, 'bpb', eval_lengths))
    if any(g['n'] > 1 for g in groups):
        print('\nruns\n' + ppl_run_table(runs, eval_lengths))
    if comparisons:
        print("\nDAPE-X vs X, two-sided p: Welch's t-test (exact permutation test, Holm-adjusted)\n"
              + pvalue_table(comparisons, eval_lengths))
        print("\nDAPE-X minus X, difference of mean perplexities [95% confidence interval]\n"
              + difference_table(comparisons, eval_lengths))
    write_ppl_results(cfg['out_dir'], protocol, runs, groups, comparisons, eval_lengths, cfg['plot'], notes)
    if cfg['position_loss'] and cfg['plot'] and any(r.get('position_loss') for r in runs):
        plot_loss_by_position(runs, os.path.join(cfg['out_dir'], 'loss_by_position.png'))
    print(f"\nwrote {cfg['out_dir']}/results.json, results.md, results.csv"
          + (", ppl_vs_length.png" if cfg['plot'] else '')
          + (", loss_by_position.png" if cfg['position_loss'] and cfg['plot'] else ''))
    return {'protocol': protocol, 'lengths': eval_lengths, 'runs': runs, 'groups': groups, 'comparisons': comparisons,
            'notes': notes}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    paths, cfg = checkpoints_and_config(argv, {k: globals()[k] for k in config_keys}, __doc__)
    return evaluate(cfg, paths, shlex.join(['python', 'eval_extrapolate.py', *argv]))


if __name__ == '__main__':
    run_main(main, 'eval_extrapolate.py')
