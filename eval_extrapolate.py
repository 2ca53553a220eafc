"""
Length extrapolation: perplexity of trained checkpoints at evaluation lengths beyond the training
length, as in the DAPE paper (§4, Figure 2, Table 5), plus Table 1's timing.

    python eval_extrapolate.py out/kerple out/dape_kerple                 # one row per checkpoint
    python eval_extrapolate.py out/kerple_s* out/dape_kerple_s*           # seeds grouped, p-values
    python eval_extrapolate.py out/kerple --lengths=512,1024,8192 --num_windows=64
    python eval_extrapolate.py --timing --n_layer=24 --n_head=16 --n_embd=1024 --timing_lengths=512,1024

Protocol (paper §4 "Datasets" and Appendix, "the last 256 tokens"; specs/positional.md):
- For an evaluation length L, a window is L+1 consecutive tokens of the validation split. The model
  reads the whole window's first L tokens, and only the last K = `eval_tokens` (256) targets are
  scored (all L of them when L < K).
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
  two-sided t-test p-value per length (Table 5).
- The data must be in the tokenizer the model was trained with; a mismatch is an error.

Outputs (`out_dir`, default results/): results.json (everything, including per-window losses),
results.md, results.csv and ppl_vs_length.png (Figure 2 for your runs). `--timing` writes timing.json
and timing.md instead.
"""

import dataclasses
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from configurator import check_device

ROOT = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# configuration: module globals are the defaults; bare arguments that are checkpoints (a directory or a
# .pt file) are taken out of the command line first, the rest goes to configurator.py.
_names_before_config = set(globals())
ckpts = ''               # comma-separated checkpoint dirs/files, in addition to the bare arguments
labels = ''              # comma-separated, one per checkpoint: overrides the automatic labels/grouping
data_dir = ''            # validation data (data/<name>); '' -> from each checkpoint's training config
lengths = ''             # comma-separated evaluation lengths; '' -> training length x 1, 2, 4, ... <= max_length
max_length = 8192        # longest default evaluation length
eval_tokens = 256        # K: targets scored at the end of every window
num_windows = 16         # windows per length (all lengths share them); scored tokens = num_windows * K
batch_size = 0           # windows per forward; 0 -> max(1, batch_tokens // L)
batch_tokens = 8192      # tokens per forward when batch_size = 0 (8192 on a CPU: one window at L = 8192)
seed = 1337              # seeds the window positions
device = 'auto'          # auto: cuda if available, else cpu
dtype = 'auto'           # auto: bfloat16 autocast on a GPU that supports it, else float32
out_dir = 'results'
plot = True
pairs = ''               # explicit comparisons 'dape-kerple:kerple,...'; '' -> every DAPE-X with its X
# timing mode (Table 1): fresh models, forward time per positional encoding
timing = False
timing_methods = 'rope,t5,alibi,kerple,fire,dape-kerple'  # pos names; dape-X = DAPE V1 on X, dapev2-X = V2
timing_lengths = '256,512'
n_layer = 2              # model size for timing (paper: 350M = 24 x 16 x 1024)
n_head = 4
n_embd = 128
timing_vocab = 50304
timing_block_size = 512
timing_batch_size = 1
timing_warmup = 1
timing_repeats = 3
timing_backward = False  # True: time forward + backward (a training step without the optimizer)
config_keys = [k for k in globals() if k not in _names_before_config and not k.startswith('_')]


class EvalError(ValueError):
    """A problem with the user's input (checkpoint, data, options), reported without a traceback."""


# -----------------------------------------------------------------------------
# command line


def split_argv(argv):
    """Bare arguments that are a directory or a .pt file are checkpoints; other bare arguments (config
    files) and --key=value options are for the configurator."""
    paths, rest = [], []
    for a in argv:
        if not a.startswith('-') and (os.path.isdir(a) or a.endswith('.pt')):
            paths.append(a)
        elif not a.startswith('-') and not a.endswith('.py'):
            raise EvalError(f"no checkpoint at '{a}' (give an out_dir holding ckpt.pt, a .pt file, or a "
                            f"config/*.py file)")
        else:
            rest.append(a)
    return paths, rest


def find_checkpoints(paths):
    """ckpt.pt files for the given paths: a .pt file, a directory holding ckpt.pt, or a directory whose
    immediate subdirectories hold ckpt.pt (e.g. out/ with out/kerple_s1, out/kerple_s2, ...)."""
    found = []
    for p in paths:
        if os.path.isfile(p):
            found.append(p)
        elif os.path.isfile(os.path.join(p, 'ckpt.pt')):
            found.append(os.path.join(p, 'ckpt.pt'))
        elif os.path.isdir(p):
            subs = sorted(os.path.join(p, d, 'ckpt.pt') for d in os.listdir(p)
                          if os.path.isfile(os.path.join(p, d, 'ckpt.pt')))
            if not subs:
                raise EvalError(f"no checkpoint in '{p}': neither {p}/ckpt.pt nor {p}/*/ckpt.pt exists; "
                                f"train one first (python train.py ... --out_dir={p})")
            found += subs
        else:
            raise EvalError(f"no checkpoint at '{p}'; train one first (python train.py ... --out_dir={p})")
    return found


def parse_ints(text, key):
    try:
        values = [int(v) for v in str(text).replace(' ', '').split(',') if v]
    except ValueError:
        raise EvalError(f"--{key} takes comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise EvalError(f"--{key} values must be positive, got {text!r}")
    return values


def pick_device(name):
    """--device as a torch device name, 'auto' resolved; one this machine lacks is an error."""
    if name == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    check_device(name)
    return name


def autocast_context(device_name, dtype_name):
    device_type = 'cuda' if 'cuda' in device_name else 'cpu'
    if dtype_name == 'auto':
        dtype_name = 'bfloat16' if device_type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32'
    if dtype_name == 'float32':
        return nullcontext()
    dt = {'bfloat16': torch.bfloat16, 'float16': torch.float16}.get(dtype_name)
    if dt is None:
        raise EvalError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype_name!r}")
    return torch.autocast(device_type=device_type, dtype=dt)


# -----------------------------------------------------------------------------
# checkpoints and their data


def training_data_dirs(ckpt):
    """Where the checkpoint's training data may be, from train.py's config: data_root/dataset."""
    cfg = ckpt.get('config') or {}
    name = ckpt.get('dataset') or cfg.get('dataset')
    candidates = [d for d in (cfg.get('data_dir'), name and os.path.join(cfg.get('data_root') or 'data', name),
                              name and os.path.join('data', name)) if d]
    return list(dict.fromkeys(candidates))


def find_data_dir(candidates, filename):
    for d in candidates:
        for base in ('', ROOT):  # relative to the working directory, then to the repository
            path = os.path.join(base, d)
            if os.path.isfile(os.path.join(path, filename)):
                return path
    return None


def resolve_data_dir(ckpt, override=''):
    """The validation data of a checkpoint: --data_dir, else train.py's data_root/dataset."""
    candidates = [override] if override else training_data_dirs(ckpt)
    if not candidates:
        raise EvalError("the checkpoint does not say which dataset it was trained on; pass --data_dir=data/<name>")
    path = find_data_dir(candidates, 'val.bin')
    if path is None:
        raise EvalError(f"validation data not found: no val.bin in {' or '.join(candidates)}; prepare the dataset "
                        f"(python data/<name>/prepare.py) or pass --data_dir=")
    return path


def training_tokenizer(ckpt, vocab_size):
    """(tokenizer, how we know) for the data a checkpoint was trained on: its dataset's meta.json when
    that is on this machine, else the vocabulary as sample.py reads it (256: bytes, >= 50257: GPT-2
    BPE, whose size train.py only pads upwards); (None, '') when neither tells."""
    from tokenizer import GPT2_VOCAB_SIZE, load_meta, tokenizer_of_vocab
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
        raise EvalError(f"{run['label']}: the data's vocabulary ({meta['vocab_size']}, {meta['tokenizer']}) is "
                        f"larger than the model's ({vocab}): wrong dataset? pass --data_dir=")
    tok, how = run['tokenizer'], run['tokenizer_from']
    if tok is not None and tok != meta['tokenizer']:
        raise EvalError(f"{run['label']} ({run['path']}) was trained on '{tok}' tokens ({how}), but {run['data_dir']} "
                        f"holds '{meta['tokenizer']}' tokens: its perplexity there would be meaningless; pass "
                        f"--data_dir= with a '{tok}' dataset, or leave it out to use the training data")


def load_val(path):
    from tokenizer import load_meta
    meta = load_meta(path)
    data = np.memmap(os.path.join(path, 'val.bin'), dtype=np.dtype(meta['dtype']), mode='r')
    return data, meta


def load_run(path, dev):
    from model import load_checkpoint
    try:
        # read onto the CPU, then move: a device problem is then never reported as a bad file
        model, ckpt = load_checkpoint(path, 'cpu')
    except FileNotFoundError as e:
        raise EvalError(str(e)) from e
    except (ValueError, TypeError) as e:  # unreadable file, or model_args this model.py rejects
        raise EvalError(f"cannot load {path}: {e}") from e
    if not model.config.causal:
        raise EvalError(f"{path} holds a bidirectional model (causal=False, a CHE encoder?): perplexity needs "
                        f"a causal language model; evaluate it with che_tasks.py")
    model.to(dev).eval()
    return model, ckpt


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
        raise EvalError(f"a window of {longest + 1} tokens does not fit in {n_tokens} validation tokens")
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


@torch.no_grad()
def score_windows(model, x, y, K, batch, dev, ctx, progress=None):
    """Cross-entropy (nats) of each window's last min(K, L) targets: [N, k] float64. The model reads all
    L tokens but computes logits only at the scored positions (`last`), and the targets are sliced to
    the same positions (the released code sliced the logits but not the labels)."""
    k = min(K, x.shape[1])
    losses = []
    for s in range(0, len(x), batch):
        xb, yb = x[s:s + batch].to(dev), y[s:s + batch, -k:].to(dev)
        with ctx:
            logits, _ = model(xb, last=k)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), yb.reshape(-1), reduction='none')
        losses.append(ce.view(len(xb), k).double().cpu())
        if progress:
            progress(s + len(xb))
    return torch.cat(losses).numpy()


def evaluate_run(model, data, meta, ends, eval_lengths, K, cfg, dev, ctx, name=''):
    """{L: result dict} for one model. A result has status 'ok' and loss/ppl/bpb/..., or a reason."""
    out = {}
    for L in eval_lengths:
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
        out[L] = r
        bpb = f"  bpb {r['bpb']:.4f}" if r['bpb'] is not None else ''
        print(f"  {name:<24} L={L:<6} ppl {r['ppl']:10.4f}{bpb}   ({r['n_tokens']} tokens scored, "
              f"{r['tokens_per_s']:,.0f} tok/s, {dt:.1f}s)", flush=True)
    return out


# -----------------------------------------------------------------------------
# settings, labels, groups


# model_args that do not change the function a checkpoint computes (the size of attention's query blocks)
SAME_FUNCTION = ('attn_chunk',)
# train.py config keys that do not change what is trained: where runs read and write, how often they
# log, evaluate and save, on what hardware and how fast; and the seed, which is what a group varies
# over. Every other key tells two runs apart, also keys train.py gains later: averaging over a new
# training option by mistake is worse than one group too many. The model's own options come from
# model_args (a resumed run keeps the checkpoint's, whatever its config says), so they are left out.
NOT_TRAINING = ('seed', 'out_dir', 'data_root', 'eval_interval', 'log_interval', 'eval_iters', 'eval_only',
                'always_save_checkpoint', 'init_from', 'wandb_log', 'wandb_project', 'wandb_run_name',
                'device', 'backend', 'fsdp', 'compile', 'peak_flops')
DAPE_KEYS = ('dape', 'dape_variant', 'dape_width', 'dape_kernel')


def training_setting(ckpt):
    """The training options of a checkpoint that change what is trained (lr, steps, batch, data, ...),
    or None for a checkpoint saved without its config."""
    from model import GPTConfig
    conf = ckpt.get('config')
    if not conf:
        return None
    model_keys = {f.name for f in dataclasses.fields(GPTConfig)} | set(ckpt.get('model_args') or {})
    return {k: v for k, v in conf.items() if k not in NOT_TRAINING and k not in model_keys}


def setting_of(run):
    """All that makes a run (or group) what it is, but its seed: the model, its training, the data."""
    return {'model': {k: v for k, v in run['model_args'].items() if k not in SAME_FUNCTION},
            'training': run.get('training'), 'data_dir': run['data_dir']}


def base_label(a):
    """'kerple', 'dape-kerple', 'dapev2-kerple', with non-default DAPE options and rand_pos spelled out."""
    name = a['pos'] + ('+rand' if a.get('rand_pos') else '')
    if a.get('dape', 'none') == 'none':
        return name
    name = ('dape-' if a['dape'] == 'v1' else 'dapev2-') + name
    if a['dape'] == 'v2' and a.get('dape_kernel', 3) != 3:
        name += f"-k{a['dape_kernel']}"
    if a.get('dape_width', 32) != 32:
        name += f"-D{a['dape_width']}"
    if a.get('dape_variant', 'concat_residual') != 'concat_residual':
        name += f"[{a['dape_variant']}]"
    return name


def differing_fields(dicts):
    return sorted({f for d in dicts for f in d if any(o.get(f, 'n/a') != d[f] for o in dicts)})


def distinguishing(settings):
    """For settings that share a base label: per setting, the 'field=value's that tell it from the
    others. Training fields are compared among the runs that saved their config; the others say so."""
    model_fields = differing_fields([s['model'] for s in settings])
    with_config = [s['training'] for s in settings if s['training'] is not None]
    train_fields = differing_fields(with_config)
    several_data = len({s['data_dir'] for s in settings}) > 1
    out = []
    for s in settings:
        extra = [f"{f}={s['model'].get(f, 'n/a')}" for f in model_fields]
        if s['training'] is None:
            extra += ['no config'] if with_config else []
        else:
            extra += [f"{f}={s['training'].get(f, 'n/a')}" for f in train_fields]
        if several_data:
            extra.append(os.path.basename(os.path.normpath(s['data_dir'])))
        out.append(extra)
    return out


def auto_labels(runs):
    """One label per distinct setting (setting_of): the base label, then the training length when runs
    of several lengths are mixed, then whatever else still tells two settings apart. Runs get the
    same label only when they differ by their seed alone, as group_runs groups by label."""
    keys = [json.dumps(setting_of(r), sort_keys=True) for r in runs]
    settings = {key: json.loads(key) for key in keys}  # tuples and lists alike, as in the key
    names = {key: base_label(s['model']) for key, s in settings.items()}
    if len({s['model']['block_size'] for s in settings.values()}) > 1:
        names = {key: f"{names[key]}@{settings[key]['model']['block_size']}" for key in names}
    for name in set(names.values()):
        same = [key for key in names if names[key] == name]
        if len(same) < 2:
            continue
        for key, extra in zip(same, distinguishing([settings[key] for key in same])):
            names[key] = f"{name}[{','.join(extra)}]" if extra else name
    # should two settings still share a label (data dirs of the same name elsewhere), number them
    for name in set(names.values()):
        same = [key for key in names if names[key] == name]
        for i, key in enumerate(same[1:], 2):
            names[key] = f"{name}#{i}"
    return [names[k] for k in keys]


def mean_std(values):
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), (float(v.std(ddof=1)) if len(v) > 1 else None)


def group_runs(runs, eval_lengths):
    """Runs with the same label form a group: per length, mean and sample std of ppl (and bpb) over
    the runs that have a value; a length none of them has keeps the first reason."""
    groups = {}
    for r in runs:
        groups.setdefault(r['label'], []).append(r)
    out = []
    for label, members in groups.items():
        g = {'label': label, 'runs': [m['path'] for m in members], 'n': len(members),
             'seeds': [m['seed'] for m in members], 'model_args': members[0]['model_args'],
             'training': members[0].get('training'), 'data_dir': members[0]['data_dir'],
             'block_size': members[0]['model_args']['block_size'], 'ppl': {}, 'bpb': {}}
        for L in eval_lengths:
            ok = [m['results'][L] for m in members if m['results'][L]['status'] == 'ok']
            if not ok:
                reason = members[0]['results'][L]['status']
                g['ppl'][L] = g['bpb'][L] = {'status': reason}
                continue
            for metric in ('ppl', 'bpb'):
                vals = [o[metric] for o in ok if o[metric] is not None]
                if not vals:
                    g[metric][L] = {'status': 'n/a: not byte data'}
                    continue
                m, s = mean_std(vals)
                g[metric][L] = {'status': 'ok', 'mean': m, 'std': s, 'n': len(vals), 'values': vals}
        out.append(g)
    return out


# -----------------------------------------------------------------------------
# Welch's t-test, without scipy: the t distribution's tail through the regularized incomplete beta


def _betacf(a, b, x, max_iter=300, eps=3e-16, tiny=1e-300):
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a, b, x):
    """Regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def welch_ttest(a, b):
    """Welch's unequal-variance t-test (scipy.stats.ttest_ind(a, b, equal_var=False)): returns
    (t, df, two-sided p). Needs two or more values on each side and a nonzero variance."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's t-test needs at least two values per group")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        raise ValueError("Welch's t-test is undefined when both groups have zero variance")
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    p = betainc(df / 2.0, 0.5, df / (df + t * t))
    return float(t), float(df), float(min(1.0, p))


def plain_setting(g):
    """A group's setting without its DAPE options: DAPE-X and X trained alike on the same data share it."""
    s = setting_of(g)
    s['model'] = {k: v for k, v in s['model'].items() if k not in DAPE_KEYS}
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
            raise EvalError(f"--pairs: {pair!r} is not 'dape_label:baseline_label' (pairs are separated by ','); "
                            f"the labels are {known}")
        found = [(a, b) for a, b in splits if a in known and b in known]
        if len(found) != 1:
            missing = [x for x in splits[0] if x not in known]
            raise EvalError(f"--pairs: {pair!r}: " + (f"no run is labelled {missing}" if missing else
                            "ambiguous") + f"; the labels are {known} (see --labels to name runs yourself)")
        if found[0][0] == found[0][1]:
            raise EvalError(f"--pairs: {pair!r} compares {found[0][0]!r} with itself")
        out += found
    return out


def comparison_pairs(groups, explicit=()):
    """(dape group, baseline group) pairs: the explicit (label, label) list (parse_pairs), or every
    DAPE-X group whose setting minus the DAPE options equals that of a group without DAPE."""
    by_label = {g['label']: g for g in groups}
    if explicit:
        return [(by_label[a], by_label[b]) for a, b in explicit]

    baselines = {plain_setting(g): g for g in groups if g['model_args'].get('dape', 'none') == 'none'}
    return [(g, baselines[plain_setting(g)]) for g in groups
            if g['model_args'].get('dape', 'none') != 'none' and plain_setting(g) in baselines]


def compare(dape_group, base_group, eval_lengths):
    """Per length: Welch's t-test of the per-seed perplexities, DAPE-X against X."""
    out = {'label': dape_group['label'], 'baseline': base_group['label'], 'p_value': {}, 't': {}}
    for L in eval_lengths:
        a, b = dape_group['ppl'][L], base_group['ppl'][L]
        if a['status'] != 'ok' or b['status'] != 'ok':
            out['p_value'][L] = {'status': a['status'] if a['status'] != 'ok' else b['status']}
            continue
        try:
            t, df, p = welch_ttest(a['values'], b['values'])
        except ValueError:
            why = 'n/a: 1 seed' if min(a['n'], b['n']) < 2 else 'n/a: zero variance'
            out['p_value'][L] = {'status': why}
            continue
        out['p_value'][L] = {'status': 'ok', 'p': p, 't': t, 'df': df,
                             'mean_diff': a['mean'] - b['mean']}
    return out


# -----------------------------------------------------------------------------
# tables, files, plot


def format_table(header, rows, markdown=False):
    if markdown:
        lines = ['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join('---' for _ in header) + ' |']
        return '\n'.join(lines + ['| ' + ' | '.join(r) + ' |' for r in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: '  '.join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return '\n'.join([fmt(header), '  '.join('-' * w for w in widths)] + [fmt(r) for r in rows])


def fmt_value(v, digits):
    if v >= 1e5:
        return f"{v:.3g}"
    return f"{v:.{digits}f}"


def cell(stat, digits=3):
    if stat['status'] != 'ok':
        return stat['status']
    s = fmt_value(stat['mean'], digits)
    return s if stat['std'] is None else f"{s} ± {fmt_value(stat['std'], digits)}"


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
    header = ['DAPE-X vs X'] + [str(L) for L in eval_lengths]
    rows = []
    for c in comparisons:
        row = [f"{c['label']} vs {c['baseline']}"]
        for L in eval_lengths:
            s = c['p_value'][L]
            row.append(s['status'] if s['status'] != 'ok' else f"{s['p']:.3g}")
        rows.append(row)
    return format_table(header, rows, markdown)


def protocol_text(protocol):
    return (f"Perplexity of the last {protocol['eval_tokens']} tokens of each window (whole window through "
            f"the model), {protocol['num_windows']} windows per length at the same seeded end positions "
            f"(seed {protocol['seed']}) for every length and checkpoint. Mean ± sample std over seeds where "
            f"several runs share a setting.")


def jsonable(obj):
    """Length keys as strings, numpy scalars as Python numbers, and no NaN anywhere."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        if not math.isfinite(v):
            raise ValueError(f"non-finite value {v} in the results")
        return v
    return obj


def write_outputs(out, protocol, runs, groups, comparisons, eval_lengths, make_plot=True):
    os.makedirs(out, exist_ok=True)
    has_bpb = any(g['bpb'][L]['status'] == 'ok' for g in groups for L in eval_lengths)
    result = {'protocol': protocol, 'lengths': eval_lengths, 'runs': runs, 'groups': groups,
              'comparisons': comparisons}
    with open(os.path.join(out, 'results.json'), 'w') as f:
        json.dump(jsonable(result), f, indent=1, allow_nan=False)

    md = ['# Length extrapolation', '', protocol_text(protocol), '', '## Perplexity', '',
          group_table(groups, 'ppl', eval_lengths, markdown=True), '']
    if has_bpb:
        md += ['## Bits per byte', '', group_table(groups, 'bpb', eval_lengths, markdown=True), '']
    if comparisons:
        md += ["## DAPE-X vs X: Welch's t-test (two-sided p, per-seed perplexities)", '',
               pvalue_table(comparisons, eval_lengths, markdown=True), '']
    md += ['## Runs (perplexity)', '', run_table(runs, eval_lengths, markdown=True), '']
    with open(os.path.join(out, 'results.md'), 'w') as f:
        f.write('\n'.join(md))

    import csv
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


def plot_ppl(groups, eval_lengths, protocol, path):
    """Figure 2 for these runs: perplexity against evaluation length (log x), one line per model
    (mean, with std error bars where there are several seeds), training lengths marked."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    all_vals, colors, handles = [], {}, []
    for g in groups:
        pts = [(L, g['ppl'][L]) for L in eval_lengths if g['ppl'][L]['status'] == 'ok']
        if not pts:
            continue
        xs = [L for L, _ in pts]
        ys = [s['mean'] for _, s in pts]
        errs = [s['std'] or 0.0 for _, s in pts]
        all_vals += ys
        # DAPE-X and X share a colour so that pairs read at a glance; X dashed with circles, DAPE V1
        # solid with squares, V2 dash-dotted with triangles
        color = colors.setdefault(plain_setting(g), f"C{len(colors) % 10}")
        style, marker = {'none': ('--', 'o'), 'v1': ('-', 's'), 'v2': ('-.', '^')}[g['model_args'].get('dape', 'none')]
        label = g['label'] + (f" (n={g['n']})" if g['n'] > 1 else '')
        if any(errs):
            h = ax.errorbar(xs, ys, yerr=errs, marker=marker, ms=4, linestyle=style, color=color, capsize=3)
        else:
            (h,) = ax.plot(xs, ys, marker=marker, ms=4, linestyle=style, color=color)
        handles.append((h, label))
    for i, b in enumerate(sorted({g['block_size'] for g in groups})):
        h = ax.axvline(b, color='grey', linestyle=':', linewidth=1.2)
        if i == 0:
            handles.append((h, 'training length'))
    ax.set_xscale('log', base=2)
    ax.set_xticks(eval_lengths)
    ax.set_xticklabels([str(L) for L in eval_lengths], rotation=0 if len(eval_lengths) < 8 else 45)
    if all_vals and max(all_vals) / min(all_vals) > 10:
        ax.set_yscale('log')
        ax.set_ylabel('perplexity (log scale)')
    else:
        ax.set_ylabel('perplexity')
    ax.set_xlabel('evaluation length (tokens)')
    ax.set_title(f"Perplexity of the last {protocol['eval_tokens']} tokens vs evaluation length\n"
                 f"({protocol['num_windows']} windows per length; lower is better)", fontsize=10)
    ax.grid(True, which='major', alpha=0.3)
    ax.legend(*zip(*handles), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -----------------------------------------------------------------------------
# timing (Table 1)


def parse_method(name):
    """'kerple' -> (kerple, none); 'dape-kerple' -> (kerple, v1); 'dapev2-kerple' -> (kerple, v2)."""
    for prefix, dape in (('dapev2-', 'v2'), ('dape-', 'v1')):
        if name.startswith(prefix):
            return name[len(prefix):], dape
    return name, 'none'


def run_timing(cfg):
    from model import GPT, GPTConfig
    dev = pick_device(cfg['device'])
    ctx = autocast_context(dev, cfg['dtype'])
    methods = [m for m in cfg['timing_methods'].replace(' ', '').split(',') if m]
    t_lengths = parse_ints(cfg['timing_lengths'], 'timing_lengths')
    sync = torch.cuda.synchronize if 'cuda' in dev else (lambda: None)
    print(f"timing on {dev}: {cfg['n_layer']} layers x {cfg['n_head']} heads x {cfg['n_embd']}, batch "
          f"{cfg['timing_batch_size']}, {'forward + backward' if cfg['timing_backward'] else 'forward'}, "
          f"median of {cfg['timing_repeats']} after {cfg['timing_warmup']} warm-up")
    ms = {}
    for name in methods:
        pos, dape = parse_method(name)
        try:
            model = GPT(GPTConfig(block_size=cfg['timing_block_size'], vocab_size=cfg['timing_vocab'],
                                  n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'],
                                  pos=pos, dape=dape)).to(dev)
        except ValueError as e:
            raise EvalError(f"--timing_methods: {name!r}: {e}") from e
        model.train(cfg['timing_backward'])  # dropout is 0: train mode only changes which path autograd takes
        torch.manual_seed(cfg['seed'])
        ms[name] = {}
        for L in t_lengths:
            if pos == 'learned' and L > cfg['timing_block_size']:
                ms[name][L] = None
                continue
            x = torch.randint(cfg['timing_vocab'], (cfg['timing_batch_size'], L), device=dev)
            times = []
            for i in range(cfg['timing_warmup'] + cfg['timing_repeats']):
                sync()
                t0 = time.perf_counter()
                if cfg['timing_backward']:
                    with ctx:
                        _, loss = model(x, x)
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                else:
                    with torch.no_grad(), ctx:
                        model(x, x)
                sync()
                if i >= cfg['timing_warmup']:
                    times.append((time.perf_counter() - t0) * 1000)
            ms[name][L] = float(np.median(times))
            print(f"  {name:<16} L={L:<6} {ms[name][L]:10.2f} ms", flush=True)
        del model
    ref = 'dape-kerple' if 'dape-kerple' in ms else methods[-1]
    total = {m: (sum(v for v in ms[m].values()) if all(v is not None for v in ms[m].values()) else None) for m in ms}
    header = ['method'] + [f"{L} (ms)" for L in t_lengths] + ['total (ms)', f'ratio to {ref}']
    rows = [[m] + [f"{ms[m][L]:.2f}" if ms[m][L] is not None else 'n/a: learned' for L in t_lengths] +
            ([f"{total[m]:.2f}", f"{total[m] / total[ref]:.4f}"] if total[m] is not None and total[ref] else ['n/a', 'n/a'])
            for m in methods]
    print('\n' + format_table(header, rows))
    out = cfg['out_dir']
    os.makedirs(out, exist_ok=True)
    info = {k: cfg[k] for k in cfg if k.startswith('timing') or k in ('n_layer', 'n_head', 'n_embd', 'dtype')}
    info['device'] = dev if 'cuda' not in dev else torch.cuda.get_device_name()
    with open(os.path.join(out, 'timing.json'), 'w') as f:
        json.dump(jsonable({'setup': info, 'reference': ref, 'ms': ms, 'total_ms': total,
                            'ratio': {m: (total[m] / total[ref] if total[m] and total[ref] else None) for m in ms}}),
                  f, indent=1)
    with open(os.path.join(out, 'timing.md'), 'w') as f:
        f.write(f"# Time cost (Table 1)\n\n{'forward + backward' if cfg['timing_backward'] else 'Forward'} time "
                f"on {info['device']}, {cfg['n_layer']} layers x {cfg['n_head']} heads x {cfg['n_embd']}, "
                f"batch {cfg['timing_batch_size']}, median of {cfg['timing_repeats']}.\n\n"
                + format_table(header, rows, markdown=True) + '\n')
    print(f"wrote {out}/timing.json, {out}/timing.md")
    return ms


# -----------------------------------------------------------------------------


def evaluate(cfg, ckpt_paths):
    """Evaluate checkpoints under the protocol; write and return the results dict."""
    dev = pick_device(cfg['device'])
    ctx = autocast_context(dev, cfg['dtype'])
    K = cfg['eval_tokens']
    if K < 1 or cfg['num_windows'] < 1:
        raise EvalError("--eval_tokens and --num_windows must be positive")
    files = find_checkpoints(ckpt_paths)
    if not files:
        raise EvalError("no checkpoints given: python eval_extrapolate.py out/run1 out/run2 ... (or --ckpts=)")
    user_labels = [s for s in cfg['labels'].split(',') if s] if cfg['labels'] else None
    if user_labels is not None and len(user_labels) != len(files):
        raise EvalError(f"--labels has {len(user_labels)} names for {len(files)} checkpoints: {files}")

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
                     'best_val_loss': ckpt.get('best_val_loss')})
        del model
    for r, lab in zip(runs, user_labels or auto_labels(runs)):
        r['label'] = lab
    pairs = parse_pairs(cfg['pairs'], [r['label'] for r in runs])
    for lab in dict.fromkeys(r['label'] for r in runs):
        iters = [r['iter_num'] for r in runs if r['label'] == lab]
        if len(set(iters)) > 1:  # seeds of one training, but not all at its end (interrupted, or best val)
            print(f"note: the runs of {lab} were saved at different iterations {iters}")

    if cfg['lengths']:
        eval_lengths = sorted(set(parse_ints(cfg['lengths'], 'lengths')))
    else:
        eval_lengths = default_lengths({r['model_args']['block_size'] for r in runs}, cfg['max_length'])

    data_cache, protocol = {}, {'eval_tokens': K, 'num_windows': cfg['num_windows'], 'seed': cfg['seed'],
                                'lengths': eval_lengths, 'data': {}}
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
            raise EvalError(f"{d}/val.bin holds {len(data)} tokens: too few for any of the lengths {eval_lengths}")
        longest = max(fits)
        ends = window_ends(len(data), longest, K, cfg['num_windows'], cfg['seed'])
        if len(ends) < cfg['num_windows']:
            print(f"warning: {d}/val.bin has room for only {len(ends)} windows of {longest} tokens "
                  f"(asked for {cfg['num_windows']})")
        data_cache[d] = (data, meta, ends)
        protocol['data'][d] = {'val_tokens': int(len(data)), 'tokenizer': meta['tokenizer'],
                               'longest_window': int(longest), 'window_ends': ends.tolist()}

    print(f"evaluating {len(runs)} checkpoint(s) on {dev} at lengths {eval_lengths}: last {K} tokens of "
          f"{cfg['num_windows']} windows per length")
    for r in runs:
        data, meta, ends = data_cache[r['data_dir']]
        print(f"{r['path']}  ({r['label']}, {r['data_dir']})")
        model, _ = load_run(r['path'], dev)
        r['results'] = evaluate_run(model, data, meta, ends, eval_lengths, K, cfg, dev, ctx, r['label'])
        del model

    groups = group_runs(runs, eval_lengths)
    comparisons = [compare(a, b, eval_lengths) for a, b in comparison_pairs(groups, pairs)]

    print('\n' + protocol_text(protocol) + '\n\nperplexity\n' + group_table(groups, 'ppl', eval_lengths))
    if any(g['bpb'][L]['status'] == 'ok' for g in groups for L in eval_lengths):
        print('\nbits per byte\n' + group_table(groups, 'bpb', eval_lengths))
    if any(g['n'] > 1 for g in groups):
        print('\nruns\n' + run_table(runs, eval_lengths))
    if comparisons:
        print("\nDAPE-X vs X, Welch's t-test, two-sided p\n" + pvalue_table(comparisons, eval_lengths))
    write_outputs(cfg['out_dir'], protocol, runs, groups, comparisons, eval_lengths, cfg['plot'])
    print(f"\nwrote {cfg['out_dir']}/results.json, results.md, results.csv"
          + (", ppl_vs_length.png" if cfg['plot'] else ''))
    return {'protocol': protocol, 'lengths': eval_lengths, 'runs': runs, 'groups': groups, 'comparisons': comparisons}


def main(argv=None):
    from configurator import configure
    argv = sys.argv[1:] if argv is None else list(argv)
    if '-h' in argv or '--help' in argv:
        print(__doc__.strip() + '\n')  # then the configurator lists the keys and exits
    paths, rest = split_argv(argv)
    cfg = configure({k: globals()[k] for k in config_keys}, rest)
    if cfg['timing']:
        return run_timing(cfg)
    paths += [p for p in cfg['ckpts'].split(',') if p]
    return evaluate(cfg, paths)


if __name__ == '__main__':
    from configurator import ConfigError
    try:
        main()
    except (EvalError, ConfigError) as e:
        print(f"eval_extrapolate.py: error: {e}", file=sys.stderr)
        sys.exit(2)
