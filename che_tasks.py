"""
CHE and retrieval: train short, test long (the DAPE paper's Table 2 and Appendix D; docs/che.md, docs/retrieval.md).
The protocol, Ruoss et al.'s (ACL 2023): a cell (task, encoding, DAPE) is trained once per seed and learning rate,
each step on one N ~ U{1..train_max_len}; then fresh samples are scored at every length, in distribution (ID) at the
training lengths, which says whether a run learned its task (ID accuracy at least learned_frac of the way from chance
to 100%), and out of distribution (OOD, Table 2's extrapolation score) at the test lengths above them (the paper:
41..500; the CPU default: 41..100, every 5th), on each of a task's test distributions. A score is the mean accuracy
over its lengths. CHE's tasks (che_data.py) train model.py's bidirectional encoder (causal=False) with randomized
positions; a retrieval task (retrieval_data.py: flip-flop, MQAR) trains a causal model, scored where the next token
is determined, at positions 0..T-1 as its configs set it (rand_pos=False; the runner's default, rand_pos=True,
draws randomized positions for any task).

What is made of the runs (results.py): Table 2's shape, with the paper's statistic (the max over seeds and learning
rates) and the mean beside it; the tables over seeds (how many learned, ID over every seed, OOD over those that
learned, DAPE-X against X) and per test length; save_runs merges the runs' figures into a results file small enough
to commit, tables_from prints those tables from one, and with rounding_from the test-retest of two trainings.

$ python che_tasks.py --task=reverse_string --pos=kerple --dape=v1         # CPU smoke run
$ python che_tasks.py --task=even_pairs --pos=alibi --seeds=0,1,2 --learning_rates=1e-4,3e-4,5e-4
$ python che_tasks.py config/che_paper.py --task=reverse_string --pos=fire --dape=v1   # paper scale
$ python che_tasks.py --grid=True                                           # Table 2 (smoke scale)
$ python che_tasks.py config/flip_flop_cpu.py --grid=False --pos=fox --dape=v1          # a retrieval task
$ python che_tasks.py config/che_cpu_reverse.py --tables_from=docs/results/che_reverse_string.json
$ ATEN_CPU_CAPABILITY=default python che_tasks.py config/che_cpu_learned.py --seeds=0 --save_runs=other.json
$ python che_tasks.py config/che_cpu_learned.py --tables_from=mine.json --rounding_from=other.json
"""
import itertools
import json
import math
import os
import shlex
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import che_data
import retrieval_data
from che_data import TABLE2_TASKS, make_batch, max_sequence_length
from common import (InputError, autocast as autocast_context, dape_of_run, dape_record, pick_device, pick_dtype,
                    pos_options, provenance)
from results import (MERGE_FIX, PAPER_TABLE2, RUN_KEYS, TASKS, check_selection, compact_runs, encoding_label,
                     length_tables, load_cells, max_mean_text, merge_rows, paper_table, parse_learning_rates,
                     plot_per_length, read_results, retest_tables, run_key, seeds_table, summarize, summary_table,
                     write_json)
from configurator import check_device, configure
from model import GPT, GPTConfig
from positional import ENCODINGS


def get_task(name):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from: {', '.join(TASKS)}")
    return TASKS[name]


def file_name(dape):
    return dape.replace(':', '-')


# -----------------------------------------------------------------------------
# runner: model, training, evaluation

def model_block_size(task, train_max_len):
    """block_size = the longest framed training sequence (N = train_max_len plus its |y| placeholders; a retrieval
    task's sequence): the training range. It sizes `learned` (which cannot run past it unless trained with randomized
    positions, whose table then has rand_pos_max rows) and FIRE's L0; the relative encodings run at any length."""
    return task.seq_len(train_max_len) if task.causal else max_sequence_length(task, train_max_len)


def build_model(task, cfg, config_only=False):
    # randomized positions change nothing for an encoding that ignores positions (nope), and
    # GPTConfig refuses the combination: switch them off there rather than fail a grid cell
    pos, attn_options = pos_options(cfg['pos'])  # 'nope+sb': stick-breaking attention without an encoding
    uses_positions = pos not in ENCODINGS or ENCODINGS[pos].uses_positions
    rand_pos = cfg['rand_pos'] and uses_positions  # (an unknown pos is left to GPTConfig to reject)
    # the head is a Linear of its own, as in the reference suite: tied to the embedding, output class c
    # would share its weights with input token c
    gcfg = GPTConfig(block_size=model_block_size(task, cfg['train_max_len']),
                     vocab_size=task.input_vocab if task.causal else max(task.input_vocab + 1, task.output_vocab),
                     n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'],
                     dropout=cfg['dropout'], bias=cfg['bias'], pos=pos, dape=cfg['dape'].partition(':')[0],
                     dape_init=cfg['dape'].partition(':')[2] or 'default', dape_variant=cfg['dape_variant'],
                     dape_width=cfg['dape_width'], dape_kernel=cfg['dape_kernel'], causal=task.causal,
                     bidir_bias=cfg['bidir_bias'], tie_weights=False, rand_pos=rand_pos,
                     rand_pos_max=cfg['rand_pos_max'] if rand_pos else 0,
                     rand_pos_eval=rand_pos and cfg['rand_pos_eval'], **attn_options)
    return gcfg if config_only else GPT(gcfg)


def frame(task, batch_size, length, rng, variant=None):
    """A batch as the model reads it: idx [B, T], targets [B, T] (-1 where nothing is trained) and scored
    [B, T] (where accuracy is counted). CHE: the encoder framing of che_data.make_batch, the last |y|
    positions trained, those up to a masked task's terminator scored. A retrieval task: its generator
    (or one of its test distributions, variant), scored where it is trained."""
    if task.causal:
        idx, targets = (task.variants[variant] if variant else task.generate)(batch_size, length, rng)
        return idx, targets, targets >= 0
    idx, targets, y, mask = make_batch(task, batch_size, length, rng)
    scored = np.zeros(idx.shape, dtype=bool)
    scored[:, -y.shape[1]:] = mask
    return idx, targets, scored


def output_loss_and_correct(model, task, idx, targets, scored, autocast):
    """Cross-entropy over the output vocabulary (ids 0..output_vocab-1) at the trained positions (mean
    over them), and the correctness [B, T] of the argmax prediction at the scored ones."""
    with autocast:
        logits, _ = model(idx, targets)
    out = logits[..., :task.output_vocab].float()
    trained = targets >= 0
    loss = F.cross_entropy(out[trained], targets[trained])
    return loss, (out.argmax(-1) == targets) & scored


def _to_device(arrays, device):
    return [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]


def train(model, task, cfg, device, autocast, log=print):
    """Adam at a constant learning rate, gradient clipping; each step one N ~ U{1..train_max_len}
    for the whole batch. model.train() makes the model draw randomized positions (cfg rand_pos)."""
    rng = np.random.default_rng(cfg['seed'])
    opt = torch.optim.Adam(model.parameters(), lr=cfg['learning_rate'])
    model.train()
    t0, losses, accs, every = time.time(), [], [], cfg['log_interval']  # log the mean of every log_interval steps
    for step in range(1, cfg['max_iters'] + 1):
        N = int(rng.integers(task.min_len, cfg['train_max_len'] + 1))
        idx, targets, scored = _to_device(frame(task, cfg['batch_size'], N, rng), device)
        loss, correct = output_loss_and_correct(model, task, idx, targets, scored, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg['grad_clip'] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        opt.step()
        losses.append(loss.item())
        accs.append(correct.sum().item() / scored.sum().item())
        if step % every == 0 or step == cfg['max_iters']:
            log(f"  step {step}/{cfg['max_iters']}: loss {np.mean(losses[-every:]):.4f}, "
                f"train acc {100 * np.mean(accs[-every:]):.2f}%, {time.time() - t0:.1f}s")
    return {'steps': cfg['max_iters'], 'time_s': time.time() - t0,
            'final_loss': float(np.mean(losses[-every:])), 'final_train_acc': float(np.mean(accs[-every:]))}


def eval_batches(cfg):
    """Batch sizes of one length's evaluation. A forward draws one set of randomized positions for its
    whole batch, so each batch is one position draw: at least eval_draws batches (of at most
    eval_batch_size samples), never more than there are samples."""
    n = min(cfg['eval_samples'], max(cfg['eval_draws'], math.ceil(cfg['eval_samples'] / cfg['eval_batch_size'])))
    return [len(part) for part in np.array_split(np.arange(cfg['eval_samples']), n)]


def position_draws(cfg):
    """How many independent position draws each length's accuracy rests on; 0: fixed positions 0..T-1."""
    randomized = cfg['rand_pos'] and cfg['rand_pos_eval'] and ENCODINGS[pos_options(cfg['pos'])[0]].uses_positions
    return len(eval_batches(cfg)) if randomized else 0


def evaluate(model, task, lengths, cfg, device, autocast, log=print, rng_seed=None, variant=None):
    """Token-weighted masked accuracy at every N in lengths on fresh samples (eval_samples per length,
    in eval_batches(cfg)); positions drawn at random as in training (cfg rand_pos_eval, the reference
    suite's protocol) or 0..T-1. Stops at the first length the model cannot serve (`learned` past its
    table: ValueError) and returns (per-length accuracies, error message or None). variant: one of the
    task's other test distributions."""
    rng = np.random.default_rng(cfg['seed'] + 1_000_003 if rng_seed is None else rng_seed)
    model.eval()
    accs, t0 = {}, time.time()
    with torch.no_grad():
        for i, N in enumerate(lengths):
            right = total = 0
            for B in eval_batches(cfg):
                idx, targets, scored = _to_device(frame(task, B, N, rng, variant), device)
                try:
                    _, correct = output_loss_and_correct(model, task, idx, targets, scored, autocast)
                except ValueError as e:
                    log(f"  N={N} (sequence length {idx.shape[1]}): not servable: {e}")
                    return accs, f"N={N} (sequence length {idx.shape[1]}): {e}"
                right += correct.sum().item()
                total += scored.sum().item()
            accs[N] = right / total
            if (i + 1) % max(1, len(lengths) // 5) == 0 or i + 1 == len(lengths):
                log(f"  eval N={N}: acc {100 * accs[N]:.2f}% ({i + 1}/{len(lengths)} lengths, "
                    f"{time.time() - t0:.1f}s)")
    return accs, None


def eval_lengths(cfg):
    """The test lengths of the extrapolation (OOD) score, all above the training range."""
    return list(range(cfg['eval_min_len'], cfg['eval_max_len'] + 1, cfg['eval_stride']))


def id_lengths(cfg):
    """The training lengths the in-distribution (ID) accuracy is measured at."""
    first = get_task(cfg['task']).min_len if cfg.get('task') in TASKS else 1
    return list(range(first, cfg['train_max_len'] + 1, cfg['id_stride']))


def _span(lengths):
    stride = lengths[1] - lengths[0] if len(lengths) > 1 else 1
    return f"N={lengths[0]}..{lengths[-1]}" + (f" every {stride}" if stride > 1 else "")


def evaluate_id_ood(model, task, cfg, device, autocast, log=print):
    """In-distribution accuracy at id_lengths(cfg) and the extrapolation score at eval_lengths(cfg):
    two separate sets of lengths and samples, so that neither leaks into the other.
    -> dict of per-length accuracies (%), scores (%, None where not servable) and the error; a task's
    other test distributions (task.variants) at the test lengths under their own names."""
    out = {}
    tests = [('id', id_lengths(cfg), cfg['seed'] + 2_000_003, None),
             ('ood', eval_lengths(cfg), cfg['seed'] + 1_000_003, None)]
    tests += [(v, eval_lengths(cfg), cfg['seed'] + 3_000_017 + i, v) for i, v in enumerate(task.variants)]
    for name, lengths, seed, variant in tests:
        what = {'id': 'in-distribution', 'ood': 'extrapolation'}.get(name, f'extrapolation, {name}')
        log(f"  {what}: {_span(lengths)}")
        accs, error = evaluate(model, task, lengths, cfg, device, autocast, log, rng_seed=seed, variant=variant)
        out[name] = {'per_length': {str(N): 100 * a for N, a in accs.items()}, 'error': error,
                     # a model that cannot run at some length has no score (tables say "n/s") rather
                     # than a mean over the lengths it happened to reach
                     'score': float(np.mean(list(accs.values()))) * 100 if error is None else None}
    return out


def _run_path(cfg):
    return os.path.join(cfg['out_dir'], 'runs',
                        f"{cfg['task']}_{cfg['pos']}_{file_name(cfg['dape'])}_s{cfg['seed']}_"
                        f"lr{cfg['learning_rate']:g}.json")


# options that change how a run is driven or shown, not what it computes: a finished run is reused
# (resume=True) whatever they are
_NOT_RESULT_KEYS = {'out_dir', 'plot', 'resume', 'grid', 'grid_tasks', 'grid_pos', 'grid_dape', 'grid_dape_pos',
                    'seeds', 'learning_rates', 'log_interval', 'compile', 'learned_frac', 'save_runs',
                    'tables_from', 'rounding_from'}


def _load_run(path):
    """A run's record in out_dir/runs/, which resume=True reuses; a ValueError naming it where it is not whole
    JSON (cut short by a full disk or a copy): it is left for the user to delete, as it may be all there is of
    that run."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"resume=True reuses {path}, which is not whole JSON ({e}): delete it to train that run "
                         f"again, or pass --resume=False") from None


def run_one(cfg, log=print, command='unknown'):
    """Train and evaluate one run: one (task, pos, dape) at one seed and learning rate, recorded with where it
    was trained ('trained': common.provenance of `command`: the rounding a later save cannot know).
    -> result dict (also written to out_dir/runs/ as JSON, which resume=True reuses)."""
    # the dape.py that trains it: an edit of f (an ablation) is labelled apart from its baseline, and not reused
    dape_py = dape_of_run({'dape_py': dape_record(), 'model_args': {'dape': cfg['dape']}})
    if cfg['out_dir'] and cfg['resume'] and os.path.exists(_run_path(cfg)):
        saved = _load_run(_run_path(cfg))
        if cfg['dape'] != 'none' and (saved.get('dape_py') or {}).get('sha256') != dape_py['sha256']:
            log(f"== {_run_path(cfg)}: trained with another dape.py, or before runs recorded it: run again")
        elif all(saved.get('config', {}).get(k) == v for k, v in cfg.items() if k not in _NOT_RESULT_KEYS):
            log(f"== {_run_path(cfg)}: finished earlier with the same settings, reused")
            return saved
        else:
            log(f"== {_run_path(cfg)}: other settings, run again")
    task = get_task(cfg['task'])
    device = pick_device(cfg['device'])
    dtype = pick_dtype(cfg['dtype'], device)
    autocast = autocast_context(device, dtype)
    torch.manual_seed(cfg['seed'])
    label = encoding_label(cfg['pos'], cfg['dape']) + (f"[dape.py={dape_py['tag']}]" if dape_py['tag'] else '')
    dtype_name = str(dtype).replace('torch.', '')
    result = {'task': task.name, 'level': task.level, 'pos': cfg['pos'], 'dape': cfg['dape'],
              'encoding': label, 'seed': cfg['seed'], 'learning_rate': cfg['learning_rate'],
              'random_baseline': 100 * task.random_baseline,
              'device': device, 'dtype': dtype_name, 'config': dict(cfg),
              'trained': provenance(command, torch.device(device).type), 'dape_py': dape_py}
    log(f"== {task.name} | {label} (pos={cfg['pos']}, dape={cfg['dape']}), seed {cfg['seed']}, "
        f"lr {cfg['learning_rate']:g}, on {device} ({dtype_name})")
    model = build_model(task, cfg).to(device)
    result.update(n_params=sum(p.numel() for p in model.parameters()), block_size=model.config.block_size,
                  rand_pos=model.config.rand_pos, rand_pos_eval=model.config.rand_pos_eval)
    if cfg['compile']:
        model = torch.compile(model, dynamic=True)
    result['train'] = train(model, task, cfg, device, autocast, log)
    result['final_train_acc'] = 100 * result['train']['final_train_acc']
    t0 = time.time()
    ev = evaluate_id_ood(model, task, cfg, device, autocast, log)
    result['eval_time_s'] = time.time() - t0
    draws = position_draws(cfg)
    result['eval'] = {'samples_per_length': cfg['eval_samples'], 'position_draws_per_length': draws,
                      'id_lengths': id_lengths(cfg), 'ood_lengths': eval_lengths(cfg)}
    result['id_per_length'], result['id_score'] = ev['id']['per_length'], ev['id']['score']
    result['per_length'], result['score'] = ev['ood']['per_length'], ev['ood']['score']
    result['error'] = ev['ood']['error'] or ev['id']['error']
    result['variants'] = {v: {'per_length': ev[v]['per_length'], 'score': ev[v]['score']} for v in task.variants}
    result['servable'] = result['error'] is None
    log(f"== {task.name} | {label}, seed {cfg['seed']}, lr {cfg['learning_rate']:g}: "
        f"ID {_pct(result['id_score'])} ({_span(id_lengths(cfg))}), "
        f"OOD score {_pct(result['score'])} ({_span(eval_lengths(cfg))})"
        + ''.join(f", OOD {v} {_pct(r['score'])}" for v, r in result['variants'].items())
        + f", random {result['random_baseline']:.0f}%, final train acc {result['final_train_acc']:.2f}%; "
        f"{_eval_text(cfg['eval_samples'], draws)}")
    if cfg['out_dir']:
        os.makedirs(os.path.dirname(_run_path(cfg)), exist_ok=True)
        write_json(_run_path(cfg), result)
    return result


def _eval_text(samples, draws):
    """What each length's accuracy rests on."""
    where = f"{draws} position draw{'s' if draws > 1 else ''} per length" if draws else "positions 0..T-1"
    return f"{samples} samples per length, {where}"


def parse_seeds(cfg):
    return [int(s) for s in _split(cfg['seeds'])] if cfg['seeds'] else [cfg['seed']]


def run_cell(cfg, log=print, command='unknown'):
    """One (task, pos, dape) at every seed x learning rate: each run trained and evaluated (or reused,
    resume=True). -> the cell: its runs and their max and mean (also written as JSON, with a plot)."""
    task = get_task(cfg['task'])
    seeds, rates = parse_seeds(cfg), parse_learning_rates(cfg)
    runs = [run_one(dict(cfg, seed=s, learning_rate=lr), log, command) for lr in rates for s in seeds]
    cell = {'task': task.name, 'level': task.level, 'pos': cfg['pos'], 'dape': cfg['dape'],
            'encoding': encoding_label(cfg['pos'], cfg['dape']), 'random_baseline': 100 * task.random_baseline,
            'seeds': seeds, 'learning_rates': rates, 'n_runs': len(runs),
            'statistic': f"max over {len(seeds)} seed(s) x {len(rates)} learning rate(s), mean beside it",
            'position_draws_per_length': position_draws(cfg), 'samples_per_length': cfg['eval_samples']}
    cell.update(summarize(runs))
    cell['runs'] = runs
    if len(runs) > 1:
        log(f"== {task.name} | {cell['encoding']} over {len(seeds)} seed(s) x {len(rates)} rate(s): "
            f"OOD max {_pct(cell['score'])} (mean {_pct(cell['score_mean'])}), "
            f"ID max {_pct(cell['id_score'])} (mean {_pct(cell['id_score_mean'])})")
    if cfg['out_dir']:
        stem = os.path.join(cfg['out_dir'], f"{task.name}_{cfg['pos']}_{file_name(cfg['dape'])}")
        write_json(stem + '.json', cell)
        if cfg['plot']:
            plot_per_length({cell['encoding']: cell}, task, stem + '.png', cfg['train_max_len'], len(runs),
                            _eval_text(cfg['eval_samples'], position_draws(cfg)))
    return cell


def _pct(score):
    return 'n/s (not servable)' if score is None else f"{score:.2f}%"


def _split(s):
    return [v.strip() for v in s.split(',') if v.strip()]


def resolve_tasks(spec):
    named = {'table2': TABLE2_TASKS, 'all': che_data.TASKS, 'retrieval': retrieval_data.TASKS}
    if spec in named:
        return list(named[spec])
    names = _split(spec)
    for n in names:
        get_task(n)
    return names


def grid_table(cells, tasks, columns, cfg):
    """Two Markdown tables shaped like the paper's Table 2 (a row per task, a column per encoding):
    the extrapolation score, then the in-distribution accuracy of the same runs."""
    labels = [encoding_label(p, d) for p, d in columns]
    seeds, rates = parse_seeds(cfg), parse_learning_rates(cfg)
    several = len(seeds) * len(rates) > 1
    lines = []
    for key in ('score', 'id_score'):  # the extrapolation score, then under a title of its own the ID accuracy
        if key == 'id_score':
            lines += ['', f"In distribution (ID): training lengths {_span(id_lengths(cfg))}:", '']
        lines += ['| Level | Task | Random | ' + ' | '.join(labels) + ' |',
                  '| --- | --- | --- |' + ' --- |' * len(labels)]
        for t in tasks:
            for v in [None, *(TASKS[t].variants if key == 'score' else ())]:  # then its other test distributions
                row = [max_mean_text(cells.get((t, p, d)), key, several, v) for p, d in columns]
                lines.append(f"| {TASKS[t].level} | {f'{t}, {v}' if v else t} | {100 * TASKS[t].random_baseline:.0f} | "
                             + ' | '.join(row) + ' |')
    statistic = (f"the max over seeds {','.join(map(str, seeds))} x learning rates "
                 f"{','.join(f'{lr:g}' for lr in rates)} (the paper's statistic), the mean in brackets"
                 if several else f"one run (seed {seeds[0]}, lr {rates[0]:g})")
    lines += ['', f"Accuracy (%): above, the extrapolation score; each the mean over its lengths "
                  f"({_eval_text(cfg['eval_samples'], position_draws(cfg))}); {statistic}; "
                  f"{cfg['max_iters']} steps of batch {cfg['batch_size']}, "
                  f"{cfg['n_layer']}L/{cfg['n_head']}H/d{cfg['n_embd']}, randomized positions "
                  f"{'up to ' + str(cfg['rand_pos_max']) if cfg['rand_pos'] else 'off'}"
                  f"{' (in evaluation too)' if cfg['rand_pos'] and cfg['rand_pos_eval'] else ''}"
                  + (f", bidir_bias={cfg['bidir_bias']} (CHE's encoders)" if any(not TASKS[t].causal for t in tasks)
                     else "") + ". n/s: not servable at the test lengths."
                  + (" The paper: max over seeds and learning rates after 200k steps, lengths 41..500."
                     if any(t in PAPER_TABLE2 for t in tasks) else "")]
    return '\n'.join(lines)


def table_selection(cfg):
    """The tasks and (pos, dape) columns the config selects from a results file: the grid's, or its one cell."""
    if cfg['grid']:
        return resolve_tasks(cfg['grid_tasks']), grid_columns(cfg)
    return [cfg['task']], [(cfg['pos'], cfg['dape'])]


def tables_from_file(cfg):
    """The tables over seeds (seeds_table) of the runs in the file cfg['tables_from'] (one that
    save_runs wrote), for the config's tasks, encodings and learned rule, and where its runs keep their
    per-length figures the tables per length (length_tables): no training. With cfg['rounding_from'],
    the test-retest tables of those runs against the same runs in that file instead (retest_tables)."""
    tasks, columns = table_selection(cfg)
    cells, _ = load_cells(cfg['tables_from'], 'tables_from')
    if cfg['rounding_from']:
        return retest_tables(cells, load_cells(cfg['rounding_from'], 'rounding_from')[0], tasks, columns, cfg)
    by_length = length_tables(cells, tasks, columns, cfg)
    return seeds_table(cells, tasks, columns, cfg) + ('\n\nPer test length:\n\n' + by_length if by_length else '')


def merge_runs(path, runs, origin=None):
    """Merge runs (compact_runs) into the results file `path` (results.merge_rows: a rerun of a seed replaces its
    earlier figures), each with where it was trained: its own record, else `origin` (common.provenance)."""
    saved = read_results(path, 'save_runs', MERGE_FIX, keys=RUN_KEYS) if os.path.exists(path) else {'runs': []}
    for r in runs:  # a run of an edited f would replace its baseline's under the same key, or the reverse
        old = next((s for s in saved['runs'] if run_key(s) == run_key(r)), None)
        if old is not None and old.get('dape_tag') != r.get('dape_tag'):
            raise InputError(f"--save_runs: {path} holds {run_key(r)} trained with dape.py "
                             f"{old.get('dape_tag') or 'as committed'}, and this run with dape.py "
                             f"{r.get('dape_tag') or 'as committed'}: save an ablation's runs in a file of their own")
    merge_rows(path, saved, [{**(origin or {}), **r} for r in runs], run_key, lambda r: run_key(r)[:-1])


def grid_columns(cfg):
    """The grid's (pos, dape) columns: every grid_pos without DAPE, and with each DAPE of grid_dape
    those of grid_dape_pos ('' = every grid_pos)."""
    encodings = _split(cfg['grid_pos'])
    with_dape = _split(cfg['grid_dape_pos']) or encodings
    return [(p, d) for d in _split(cfg['grid_dape']) for p in encodings if d == 'none' or p in with_dape]


def run_grid(cfg, log=print, command='unknown (che_tasks.run_grid called in a process of its own)'):
    """Every task x every (pos, dape), each at every seed x learning rate: train, evaluate, print and
    write the Table 2-shaped tables. With resume=True, runs finished earlier (out_dir/runs/) are reused,
    so an interrupted grid picks up where it stopped, and grids split by task share one out_dir. `command`:
    the command line, recorded with the commit, machine and date of every run saved to save_runs."""
    tasks = resolve_tasks(cfg['grid_tasks'])
    columns = grid_columns(cfg)
    paper = any(t in PAPER_TABLE2 for t in tasks)  # the paper's figures beside CHE tasks only
    cells, t0 = {}, time.time()
    out = cfg['out_dir']
    for t in tasks:
        for p, d in columns:
            one = dict(cfg, task=t, pos=p, dape=d, plot=False)
            try:
                cells[(t, p, d)] = run_cell(one, log, command)
            except ValueError as e:  # a configuration the model rejects: record, go on
                log(f"== {t} | {encoding_label(p, d)}: error: {e}")
                cells[(t, p, d)] = {'task': t, 'pos': p, 'dape': d, 'error': str(e)}
            done = tasks[:tasks.index(t) + 1]
            table = grid_table(cells, done, columns, cfg)
            if out:  # rewritten after every cell, so a long grid can be read while it runs
                with open(os.path.join(out, 'table.md'), 'w') as f:
                    f.write(table + '\n\nEvery cell:\n\n' + summary_table(cells, done, columns)
                            + '\n\nOver seeds:\n\n' + seeds_table(cells, done, columns, cfg)
                            + ('\n\nDAPE paper, Table 2:\n\n' + paper_table(tasks) if paper else '') + '\n')
                write_json(os.path.join(out, 'grid.json'), list(cells.values()))
        if out and cfg['plot']:
            plot_per_length({encoding_label(p, d): cells[(t, p, d)] for p, d in columns}, TASKS[t],
                            os.path.join(out, f"{t}.png"), cfg['train_max_len'],
                            len(parse_seeds(cfg)) * len(parse_learning_rates(cfg)),
                            _eval_text(cfg['eval_samples'], position_draws(cfg)))
    if cfg['save_runs']:
        device = torch.device(pick_device(cfg['device'])).type
        merge_runs(cfg['save_runs'], compact_runs(cells), provenance(command, device))
    log(f"\ngrid finished in {time.time() - t0:.0f}s\n")
    log(table)
    log('\nOver seeds:\n\n' + seeds_table(cells, tasks, columns, cfg))
    if paper:
        log('\nDAPE paper, Table 2 (for reference):\n\n' + paper_table(tasks))
    return cells, table


# -----------------------------------------------------------------------------
# configuration (configurator conventions as in train.py). Defaults: a CPU smoke run of a few
# minutes per task; config/che_paper.py is the paper's setting (GPU).
_names_before_config = set(globals())
task = 'reverse_string'
pos = 'kerple'                # an encoding; +sb, +sbc, +logn or +logn-fixed after it: attention options (pos_options)
dape = 'none'                # none | v1 | v2; v1:zero, v2:zero: f's last layer zero at init (dape.py)
dape_variant = 'concat_residual'
dape_width = 32              # D_DAPE (paper: 64)
dape_kernel = 3              # DAPE v2 kernel width
n_layer = 2                  # paper: 5
n_head = 4                   # paper: 8
n_embd = 64                  # paper: 256
dropout = 0.0
bias = False
bidir_bias = 'alibi'         # which biases tell a key on the left from one on the right: alibi (as
                             # Ruoss et al.'s reference), all (alibi, kerple, kerple_power, fire), none
rand_pos = True              # randomized positions (Ruoss et al.) in training
rand_pos_max = 2048          # the maximum randomized position L
rand_pos_eval = True         # and at evaluation, as Ruoss et al.'s code does; False: positions 0..T-1
train_max_len = 40           # training lengths N ~ U{1..train_max_len}
max_iters = 300              # paper: 200k
batch_size = 32              # paper: 128
learning_rate = 3e-4         # spec: one of 1e-4, 3e-4, 5e-4; constant
learning_rates = ''          # several, comma-separated (e.g. 1e-4,3e-4,5e-4); '' = learning_rate
seed = 0
seeds = ''                   # several, comma-separated (e.g. 0,1,2); '' = seed
learned_frac = 0.5           # a run learned its task when its ID accuracy is this far from chance to 100%
                             # (each task family's configs set theirs: the rule its tables state)
grad_clip = 1.0
id_stride = 1                # in-distribution accuracy at lengths 1..train_max_len, every id_stride-th
eval_min_len = 41
eval_max_len = 100           # paper: 500
eval_stride = 5              # paper: 1 (every length)
eval_samples = 64            # per length; paper: 512
eval_batch_size = 64         # at most this many samples per forward
eval_draws = 4               # at least this many forwards per length: each draws its own positions
log_interval = 50
device = 'auto'              # auto: cuda if available (common.pick_device)
dtype = 'auto'               # auto: bfloat16 autocast on a GPU that has it, else float32 (common.pick_dtype)
compile = False
out_dir = 'out-che'          # '' writes nothing
resume = False               # True: reuse runs finished earlier in out_dir/runs/ with the same settings
plot = True
grid = False                 # True: every grid_tasks x grid_pos x grid_dape, Table 2 shaped
grid_tasks = 'table2'        # table2 (the paper's 14) | all (CHE's 15) | retrieval | comma-separated names
grid_pos = 'alibi,kerple,fire'
grid_dape = 'none,v1'
grid_dape_pos = ''           # the encodings run with DAPE (grid_dape other than none); '' = every grid_pos
save_runs = ''               # after the runs (a cell or a grid): every run's ID and OOD figures merged into
                             # this JSON file (small)
tables_from = ''             # print the tables over seeds of the runs in this save_runs file; no training
rounding_from = ''           # with tables_from: the same runs trained under another rounding (a save_runs file):
                             # print the test-retest tables of the two instead
config_keys = [k for k in globals() if k not in _names_before_config and not k.startswith('_')]


def check_config(cfg):
    """Fail before any training on a bad task name or a (pos, dape) the model rejects (builds every
    cell's GPTConfig, which validates itself: ValueError naming the field), and on a file it would read or
    write only afterwards: save_runs, tables_from, rounding_from and the run records resume=True reuses."""
    tasks, columns = table_selection(cfg)  # a grid's unknown task is an error here (resolve_tasks), a cell's below
    outside = set(_split(cfg['grid_dape_pos'])) - set(_split(cfg['grid_pos']))
    if cfg['grid'] and outside:
        raise ValueError(f"grid_dape_pos names {', '.join(sorted(outside))}, which grid_pos="
                         f"{cfg['grid_pos']!r} does not run: list them in grid_pos too")
    cells = [(t, p, d) for t in tasks for p, d in columns]
    if not cells:
        raise ValueError("the grid is empty: set grid_tasks, grid_pos and grid_dape")
    for t, p, d in cells:
        build_model(get_task(t), dict(cfg, task=t, pos=p, dape=d), config_only=True)
        if cfg['train_max_len'] < get_task(t).min_len:
            raise ValueError(f"train_max_len={cfg['train_max_len']}: task {t} needs N >= {get_task(t).min_len}")
        if get_task(t).causal:  # the longest test sequence can be made (mqar has a finite set of keys)
            try:
                get_task(t).generate(1, cfg['eval_max_len'], np.random.default_rng(0))
            except ValueError as e:
                raise ValueError(f"eval_max_len={cfg['eval_max_len']}: {e}: lower --eval_max_len") from None
    for k in ('max_iters', 'batch_size', 'train_max_len', 'eval_samples', 'eval_batch_size', 'eval_draws',
              'eval_stride', 'id_stride', 'log_interval', 'eval_min_len'):
        if cfg[k] < 1:
            raise ValueError(f"{k} must be >= 1, got {cfg[k]}")
    if not eval_lengths(cfg):
        raise ValueError(f"no evaluation lengths in eval_min_len..eval_max_len = "
                         f"{cfg['eval_min_len']}..{cfg['eval_max_len']}")
    if cfg['eval_min_len'] <= cfg['train_max_len']:
        raise ValueError(f"eval_min_len={cfg['eval_min_len']} must be above train_max_len="
                         f"{cfg['train_max_len']}: the extrapolation score is measured beyond the training lengths")
    try:
        seeds, rates = parse_seeds(cfg), parse_learning_rates(cfg)
    except ValueError:
        raise ValueError(f"seeds must be comma-separated integers and learning_rates comma-separated numbers, "
                         f"got seeds={cfg['seeds']!r}, learning_rates={cfg['learning_rates']!r}") from None
    if len(set(seeds)) < len(seeds) or len(set(rates)) < len(rates):
        raise ValueError(f"seeds and learning_rates must not repeat, got {seeds} and {rates}")
    for lr in [cfg['learning_rate']] + rates:
        if not lr > 0:
            raise ValueError(f"learning_rate must be > 0, got {lr}")
    if not 0 <= cfg['learned_frac'] <= 1:
        raise ValueError(f"learned_frac must be in [0, 1] (the share of the way from chance to 100% that "
                         f"counts as learned), got {cfg['learned_frac']}")
    if cfg['rounding_from'] and not cfg['tables_from']:
        raise ValueError(f"rounding_from={cfg['rounding_from']!r} compares two results files: name the first "
                         f"with tables_from (e.g. --tables_from=docs/results/che_bucket_sort_5x.json)")
    if cfg['save_runs'] and cfg['tables_from']:
        raise ValueError(f"save_runs={cfg['save_runs']} with tables_from={cfg['tables_from']}: tables_from trains "
                         f"nothing, so there are no runs to save: drop one of them")
    if cfg['save_runs']:  # now, not after the training whose runs it is to keep
        folder = os.path.dirname(cfg['save_runs']) or '.'
        if not os.path.isdir(folder):
            raise ValueError(f"save_runs={cfg['save_runs']}: there is no folder {folder} to write it in: create it "
                             f"or name a file in an existing folder")
        if os.path.exists(cfg['save_runs']):
            read_results(cfg['save_runs'], 'save_runs', MERGE_FIX, keys=RUN_KEYS)
    if cfg['tables_from']:
        fix = "name a file that --save_runs wrote"
        runs = read_results(cfg['tables_from'], 'tables_from', fix, keys=RUN_KEYS)['runs']
        if cfg['rounding_from']:
            read_results(cfg['rounding_from'], 'rounding_from', fix, keys=RUN_KEYS)
        check_selection(cfg['tables_from'], runs, tasks, columns, cfg)
    elif cfg['out_dir'] and cfg['resume']:  # a record cut short would stop the runs midway: say so before they start
        for (t, p, d), s, lr in itertools.product(cells, seeds, rates):
            path = _run_path(dict(cfg, task=t, pos=p, dape=d, seed=s, learning_rate=lr))
            if os.path.exists(path):
                _load_run(path)
    if cfg['dtype'] not in ('auto', 'float32', 'bfloat16', 'float16'):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {cfg['dtype']!r}")
    check_device(cfg['device'])


def main(argv=None):
    """argv: command-line arguments (None: sys.argv[1:]). -> the cell, or the grid's (cells, table)."""
    config = configure({k: globals()[k] for k in config_keys}, argv)
    try:
        check_config(config)
    except ValueError as e:
        if argv is not None:
            raise
        print(f"che_tasks: {e}", file=sys.stderr)
        sys.exit(2)
    if config['tables_from']:
        print(table := tables_from_file(config))
        return table
    command = shlex.join(['python', 'che_tasks.py', *(sys.argv[1:] if argv is None else argv)])
    if config['grid']:
        return run_grid(config, command=command)
    cell = run_cell(config, command=command)
    if config['save_runs']:  # as run_grid saves its cells'
        merge_runs(config['save_runs'], compact_runs({(cell['task'], cell['pos'], cell['dape']): cell}),
                   provenance(command, torch.device(pick_device(config['device'])).type))
    return cell


if __name__ == '__main__':
    main()
