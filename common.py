"""
What several scripts share: the device and dtype they run in, reading checkpoints and datasets, the
evaluation scripts' command lines, list options and result files, the labels that group runs of one
setting over seeds, and the statistics over seeds (mean and sample std, Welch's t-test and t interval, cut to
the possible range for bounded values, the exact permutation test and Holm's adjustment).
Scripts import this file (and the library files model.py, tokenizer.py, configurator.py), never each
other.

The one device and dtype rule (train.py, eval_extrapolate.py, sample.py, visualize.py, che_tasks.py):
- device='auto' is the first CUDA GPU when there is one, else the CPU; a named device this machine
  lacks is an error.
- dtype='auto' is bfloat16 autocast on a CUDA GPU that supports it, and float32 everywhere else.
  bfloat16 keeps float32's range, so training needs no loss scaling; float16 does (train.py then uses a
  GradScaler), so it is used only when asked for. On the CPU, autocast makes these models slower and
  less precise, so 'auto' stays in float32 there; an explicit dtype is honoured on any device.
"""

import datetime
import functools
import inspect
import itertools
import json
import math
import os
import re
import subprocess
from contextlib import nullcontext
from dataclasses import fields

import numpy as np
import torch

from configurator import check_device, configure
from positional import RoPE

ROOT = os.path.dirname(os.path.abspath(__file__))
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


class InputError(ValueError):
    """A problem with the user's input (checkpoint, data, options): scripts print it as one line."""


# -----------------------------------------------------------------------------
# device and dtype


def pick_device(name):
    """--device as a torch device name, 'auto' resolved; one this machine lacks is an error."""
    if name == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    check_device(name)
    return name


def pick_dtype(name, device):
    """--dtype as a torch dtype, 'auto' resolved by the rule above."""
    if name == 'auto':
        bf16 = device.startswith('cuda') and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    if name not in DTYPES:
        raise InputError(f"dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def autocast(device, dtype):
    """The context the model runs in: autocast to dtype, or nothing for float32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.split(':')[0], dtype=dtype)


# -----------------------------------------------------------------------------
# checkpoints


def read_checkpoint_file(path, keys=('model', 'model_args'), device='cpu'):
    """torch.load a train.py checkpoint file, checked: an unreadable file, one without all of `keys`, or
    one whose model_args hold an option this model.py does not know (a newer model.py's: building without it
    would make another model than the file's) is a ValueError naming it (the file is only read). Whether its
    weights fit its model_args is checked against the model the caller builds from them (check_weights):
    building one here would double the memory of a large model's resume."""
    from model import GPTConfig
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e}); "
                         f"it may be truncated or not written by train.py") from e
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
    if missing:
        raise ValueError(f"{path} is not a train.py checkpoint: it lacks {missing}")
    if not isinstance(ckpt['model_args'], dict):
        raise ValueError(f"{path} is not a train.py checkpoint: its model_args is a "
                         f"{type(ckpt['model_args']).__name__}, not a dict of options")
    unknown = sorted(set(ckpt['model_args']) - {f.name for f in fields(GPTConfig)})
    if unknown:
        raise ValueError(f"{path} has model options this model.py does not know: {unknown}; use it with the "
                         f"code that wrote it")
    return ckpt


def unwrapped(state):
    """A state dict under the model's own names: torch.compile and DDP wrap them; the model does not."""
    out = {}
    for k, v in state.items():
        for prefix in ('_orig_mod.', 'module.'):
            k = k[len(prefix):] if k.startswith(prefix) else k
        out[k] = v
    return out


def check_weights(path, state, model):
    """A ValueError naming the file unless its state dict holds exactly the model's tensors, in their shapes:
    a file edited by hand or mixed up with another run's would otherwise stop load_state_dict with a traceback
    (a size mismatch), or leave some weights at their random init. -> the state dict under the model's own
    names (unwrapped), ready for load_state_dict."""
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds no weights (its 'model' is a {type(state).__name__}, not a state dict): "
                         f"retrain it, or use another checkpoint")
    state, expected = unwrapped(state), model.state_dict()
    wrong = [f"{k} is {tuple(v.shape) if torch.is_tensor(v) else type(v).__name__}, not {tuple(expected[k].shape)}"
             for k, v in state.items() if k in expected and not (torch.is_tensor(v) and v.shape == expected[k].shape)]
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if wrong or missing or unexpected:
        found = [f"{what}: {', '.join(names[:3])}" + (', ...' if len(names) > 3 else '') for what, names in
                 (('shape', wrong), ('missing', missing), ('unexpected', unexpected)) if names]
        raise ValueError(f"{path} does not match its own model_args ({'; '.join(found)}): "
                         f"retrain it, or use another checkpoint")
    return state


def load_checkpoint(path, device='cpu'):
    """Load a train.py checkpoint (a ckpt.pt file or the out_dir holding one) and build its model.
    Returns (model, checkpoint dict). Errors name the file and what to do."""
    from model import GPT, GPTConfig
    if os.path.isdir(path):
        path = os.path.join(path, 'ckpt.pt')
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one first: python train.py <config> --out_dir=...")
    ckpt = read_checkpoint_file(path, device=device)
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(check_weights(path, ckpt['model'], model))
    return model.to(device), ckpt


def load_run(path, device):
    """A causal language model from a checkpoint, in eval mode on device: (model, checkpoint dict)."""
    try:
        # read onto the CPU, then move: a device problem is then never reported as a bad file
        model, ckpt = load_checkpoint(path, 'cpu')
    except FileNotFoundError as e:
        raise InputError(str(e)) from e
    except (ValueError, TypeError) as e:  # unreadable file, or model_args this model.py rejects
        raise InputError(f"cannot load {path}: {e}") from e
    if not model.config.causal:
        raise InputError(f"{path} holds a bidirectional model (causal=False, a CHE encoder?): this needs "
                         f"a causal language model; evaluate it with che_tasks.py")
    model.to(device).eval()
    return model, ckpt


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
                raise InputError(f"no checkpoint in '{p}': neither {p}/ckpt.pt nor {p}/*/ckpt.pt exists; "
                                 f"train one first (python train.py ... --out_dir={p})")
            found += subs
        else:
            raise InputError(f"no checkpoint at '{p}'; train one first (python train.py ... --out_dir={p})")
    return found


# -----------------------------------------------------------------------------
# datasets


def check_dataset(data_dir, name):
    """Check data_dir/{train,val}.bin against meta.json; return (meta, numpy dtype).
    Any missing or inconsistent file is an error naming the prepare command."""
    from tokenizer import load_meta
    prepare = f"python data/{name}/prepare.py"
    meta = load_meta(data_dir)
    if meta.get('dtype') not in ('uint8', 'uint16'):
        raise ValueError(f"{data_dir}/meta.json: dtype must be 'uint8' or 'uint16', got "
                         f"{meta.get('dtype')!r}; re-run `{prepare} --force`")
    dt = np.dtype(meta['dtype'])
    if meta['vocab_size'] > np.iinfo(dt).max + 1:
        raise ValueError(f"{data_dir}/meta.json: vocab_size {meta['vocab_size']} does not fit {dt}; "
                         f"re-run `{prepare} --force`")
    for split in ('train', 'val'):
        path = os.path.join(data_dir, f'{split}.bin')
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: dataset '{name}' is not (fully) prepared. Run `{prepare}`.")
        size = os.path.getsize(path)
        if size % dt.itemsize:
            raise ValueError(f"{path} has {size} bytes, not a multiple of {dt} ({dt.itemsize} bytes): "
                             f"truncated or written with another dtype; re-run `{prepare} --force`")
        expected = meta.get(f'{split}_tokens')
        if expected is not None and size // dt.itemsize != expected:
            raise ValueError(f"{path} holds {size // dt.itemsize} tokens but meta.json says {expected}: "
                             f"stale or truncated; re-run `{prepare} --force`")
    return meta, dt


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
        raise InputError("the checkpoint does not say which dataset it was trained on; pass --data_dir=data/<name>")
    path = find_data_dir(candidates, 'val.bin')
    if path is None:
        raise InputError(f"validation data not found: no val.bin in {' or '.join(candidates)}; prepare the dataset "
                         f"(python data/<name>/prepare.py) or pass --data_dir=")
    return path


def load_val(path):
    """The validation split as a read-only memmap, and the dataset's meta.json."""
    from tokenizer import load_meta
    meta = load_meta(path)
    data = np.memmap(os.path.join(path, 'val.bin'), dtype=np.dtype(meta['dtype']), mode='r')
    return data, meta


# -----------------------------------------------------------------------------
# the evaluation scripts' command lines and result files (eval_extrapolate.py, eval_passkey.py)


def checkpoints_and_config(argv, defaults, doc):
    """-> (checkpoint paths, settings). Bare arguments that are a directory or a .pt file are
    checkpoints, as are those listed in --ckpts; config files and --key=value options set `defaults`
    (configurator.py). --help prints `doc`, then the configurator lists the keys and exits."""
    if '-h' in argv or '--help' in argv:
        print(doc.strip() + '\n')
    paths, rest = [], []
    for a in argv:
        if not a.startswith('-') and (os.path.isdir(a) or a.endswith('.pt')):
            paths.append(a)
        elif not a.startswith('-') and not a.endswith('.py'):
            raise InputError(f"no checkpoint at '{a}' (give an out_dir holding ckpt.pt, a .pt file, or a "
                             f"config/*.py file)")
        else:
            rest.append(a)
    cfg = configure(defaults, rest)
    return paths + [p for p in cfg['ckpts'].split(',') if p], cfg


def parse_list(text, key, kind=str):
    """A comma-separated option (--lengths=64,128) as a non-empty list of `kind`."""
    what = {int: 'integers', float: 'numbers'}.get(kind, 'names')
    try:
        values = [kind(v) for v in str(text).replace(' ', '').split(',') if v]
    except ValueError:
        raise InputError(f"--{key} takes comma-separated {what}, got {text!r}") from None
    if not values:
        raise InputError(f"--{key} is empty")
    return values


def rope_scaling_options(cfg):
    """The RoPE context extensions asked for (--rope_scaling=none,pi,ntk,yarn, --rope_scale,
    --yarn_alpha, --yarn_beta; positional.RoPE.set_scaling), checked before any checkpoint is read:
    -> the list of methods."""
    kinds = parse_list(cfg['rope_scaling'], 'rope_scaling')
    unknown = [k for k in kinds if k not in RoPE.SCALINGS]
    if unknown:
        raise InputError(f"--rope_scaling: unknown {unknown}; choose from {', '.join(RoPE.SCALINGS)}")
    if cfg['rope_scale'] and not cfg['rope_scale'] >= 1:
        raise InputError(f"--rope_scale must be >= 1 (the context extension factor s), or 0 for L / training "
                         f"length; got {cfg['rope_scale']}")
    if cfg['rope_scale'] and kinds == ['none']:
        raise InputError("--rope_scale has no effect without --rope_scaling=pi, ntk or yarn")
    if not 0 <= cfg['yarn_alpha'] < cfg['yarn_beta']:
        raise InputError(f"--yarn_alpha and --yarn_beta need 0 <= alpha < beta, got {cfg['yarn_alpha']}, "
                         f"{cfg['yarn_beta']}")
    defaults = inspect.signature(RoPE.set_scaling).parameters
    if 'yarn' not in kinds and (cfg['yarn_alpha'], cfg['yarn_beta']) != (defaults['alpha'].default,
                                                                         defaults['beta'].default):
        raise InputError("--yarn_alpha and --yarn_beta have no effect without --rope_scaling=yarn")
    return kinds


def cpu_name():
    """The CPU's model name, family and model number (/proc/cpuinfo, e.g. 'AMD EPYC (family 25, model 1)'),
    for every figure that a timing goes with: machines of one name differ (the name alone can be as bare as
    'AMD EPYC'), so figures compare only within one run on one of them."""
    import platform
    try:
        with open('/proc/cpuinfo') as f:
            fields = {}
            for line in f:
                if not line.strip():
                    break  # the first processor's fields are enough
                key, _, value = line.partition(':')
                fields[key.strip()] = value.strip()
        number = f" (family {fields['cpu family']}, model {fields['model']})" \
            if 'cpu family' in fields and 'model' in fields else ''
        return fields['model name'] + number
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


def machine_text(device_type):
    """The processor, its kernels and torch: on a CPU its model (common.cpu_name) and the vector kernels ATen
    picked (e.g. 'AMD EPYC (family 25, model 1), AVX2 kernels, torch 2.13.0+cpu'), on CUDA the GPU's name."""
    if device_type == 'cuda':
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    if device_type == 'cpu':
        return f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()} kernels, torch {torch.__version__}"
    return f"{device_type}, torch {torch.__version__}"


def code_version():
    """The code's commit, as `git describe --always --dirty` names it ('-dirty': with uncommitted edits), or
    'unknown' where this is not a git checkout: with the machine it tells a later rerun what could differ."""
    try:
        out = subprocess.run(['git', 'describe', '--always', '--dirty'], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 'unknown'
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else 'unknown'


def provenance(command, device_type='cpu'):
    """Where a run comes from: {commit, command, machine, date}, recorded with every result that is published."""
    return {'commit': code_version(), 'command': command, 'machine': machine_text(device_type),
            'date': datetime.date.today().isoformat()}


def trained_by(ckpt):
    """Where a checkpoint came from, as train.py recorded it: {commit, command, machine, date}, each the values
    of its starts in order (a resumed run may have several), 'unknown' where the checkpoint predates the record."""
    starts = [p for _, p in ckpt.get('provenance', [])]
    joined = lambda values: ' ; '.join(dict.fromkeys(values)) or 'unknown'
    return {'commit': joined(p['commit'] for p in starts), 'command': joined(p['command'] for p in starts),
            'machine': joined(m for _, m in ckpt.get('machines', [])), 'date': joined(p['date'] for p in starts)}


def format_table(header, rows, markdown=False):
    """Rows of strings under a header: aligned columns for the console, or a Markdown table."""
    if markdown:
        lines = ['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join('---' for _ in header) + ' |']
        return '\n'.join(lines + ['| ' + ' | '.join(r) + ' |' for r in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: '  '.join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return '\n'.join([fmt(header), '  '.join('-' * w for w in widths)] + [fmt(r) for r in rows])


def jsonable(obj):
    """For json.dump: length keys as strings, numpy scalars as Python numbers, and no NaN anywhere."""
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


# -----------------------------------------------------------------------------
# runs that differ only by their seed: one setting, one label (eval_extrapolate.py, eval_passkey.py)

# model_args that do not change the function a checkpoint computes (attention's query blocks, DAPE's kernel)
SAME_FUNCTION = ('attn_chunk', 'dape_impl')
# train.py config keys that do not change what is trained: where runs read and write, how often they
# log, evaluate and save, on what hardware and how fast; and the seed, which is what a group varies
# over. Every other key tells two runs apart, also keys train.py gains later: averaging over a new
# training option by mistake is worse than one group too many. The model's own options come from
# model_args (a resumed run keeps the checkpoint's, whatever its config says), so they are left out.
NOT_TRAINING = ('seed', 'out_dir', 'data_root', 'eval_interval', 'log_interval', 'eval_iters', 'eval_only',
                'always_save_checkpoint', 'init_from', 'wandb_log', 'wandb_project', 'wandb_run_name',
                'device', 'backend', 'fsdp', 'compile', 'peak_flops')


def training_setting(ckpt):
    """The training options of a checkpoint that change what is trained (lr, steps, batch, data, ...),
    or None for a checkpoint saved without its config."""
    conf = ckpt.get('config')
    if not conf:
        return None
    from model import GPTConfig
    model_keys = {f.name for f in fields(GPTConfig)} | set(ckpt.get('model_args') or {})
    return {k: v for k, v in conf.items() if k not in NOT_TRAINING and k not in model_keys}


def setting_of(run):
    """All that makes a run (or group) what it is, but its seed: the model, its training, the data, and
    how RoPE is read. A model option that a run's checkpoint predates counts as its default, which is what
    loading that checkpoint builds."""
    from model import GPTConfig
    model = {f.name: f.default for f in fields(GPTConfig)}
    model.update(run['model_args'])
    return {'model': {k: v for k, v in model.items() if k not in SAME_FUNCTION},
            'training': run.get('training'), 'data_dir': run['data_dir'],
            'rope_scaling': run.get('rope_scaling', 'none')}


# the attention's options as a label spells them after the encoding's name ('nope+sb', 'kerple+logn'), and as
# che_tasks.py's grids take them in an encoding's place (pos_options)
ATTN_SUFFIXES = {'sb': {'attn': 'stickbreaking'}, 'sbc': {'attn': 'stickbreaking', 'sb_current': True},
                 'logn': {'logn_scale': 'learned'}, 'logn-fixed': {'logn_scale': 'fixed'}}


def attn_suffix(a):
    """'+sb' (stick-breaking), '+sbc' (with the query's own key in the stick), then '+logn' or '+logn-fixed'
    (log-length scaling) for model options a; '' for softmax attention unscaled."""
    opts = {k: a.get(k) for k in ('attn', 'sb_current', 'logn_scale')}
    found = [name for name, want in ATTN_SUFFIXES.items()
             if all(opts[k] == v for k, v in want.items()) and not (name == 'sb' and opts['sb_current'])]
    return ''.join('+' + name for name in found)


def pos_options(spec):
    """An encoding with the attention's options after it, as grids name them ('nope+sb', 'kerple+logn',
    'kerple+sb+logn-fixed') -> (pos, {GPTConfig field: value}); a plain encoding -> (pos, {})."""
    pos, *suffixes = spec.split('+')
    options = {}
    for suffix in suffixes:
        if suffix not in ATTN_SUFFIXES:
            raise ValueError(f"{spec!r}: unknown option '+{suffix}' after the encoding; choose from "
                             f"{', '.join('+' + s for s in ATTN_SUFFIXES)}")
        options.update(ATTN_SUFFIXES[suffix])
    return pos, options


def base_label(a):
    """'kerple', 'dape-kerple', 'dapev2-kerple', with non-default DAPE options, rand_pos and the attention's
    options (attn_suffix) spelled out."""
    name = a['pos'] + ('+rand' if a.get('rand_pos') else '') + attn_suffix(a)
    if a.get('dape', 'none') == 'none':
        return name
    name = ('dape-' if a['dape'] == 'v1' else 'dapev2-') + name
    if a['dape'] == 'v2' and a.get('dape_kernel', 3) != 3:
        name += f"-k{a['dape_kernel']}"
    if a.get('dape_width', 32) != 32:
        name += f"-D{a['dape_width']}"
    if a.get('dape_variant', 'concat_residual') != 'concat_residual':
        name += f"[{a['dape_variant']}]"
    if a.get('dape_init', 'default') != 'default':
        name += f"-{a['dape_init']}"
    return name


def auto_labels(runs):
    """One label per distinct setting (setting_of), so that runs share a label (and group_runs groups
    them) only when they differ by their seed alone: the base label, the training length when several
    are mixed, then in brackets what tells settings of one base label apart (kerple[learning_rate=0.003];
    'no config' for a checkpoint saved without its training config, the data folder's name); '#2', '#3'
    should two settings still read alike."""
    keys = [json.dumps(setting_of(r), sort_keys=True) for r in runs]
    settings = {key: json.loads(key) for key in keys}  # tuples and lists alike, as in the key
    several_lengths = len({s['model']['block_size'] for s in settings.values()}) > 1

    def facts(s):
        training = {'no config'} if s['training'] is None else {f"{f}={v}" for f, v in s['training'].items()}
        data = os.path.basename(os.path.normpath(s['data_dir']))
        return {f"{f}={v}" for f, v in s['model'].items()} | training | {data}
    names = {key: base_label(s['model']) + (f"@{s['model']['block_size']}" if several_lengths else '')
             for key, s in settings.items()}
    for name in set(names.values()):
        same = [key for key in names if names[key] == name]
        if len(same) > 1:
            shared = set.intersection(*(facts(settings[key]) for key in same))
            for key in same:
                extra = sorted(facts(settings[key]) - shared)
                names[key] = f"{name}[{','.join(extra)}]" if extra else name
    for name in set(names.values()):
        for i, key in enumerate([key for key in names if names[key] == name][1:], 2):
            names[key] = f"{name}#{i}"
    return [names[k] for k in keys]


def mean_std(values):
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), (float(v.std(ddof=1)) if len(v) > 1 else None)


def over_seeds(values):
    """One setting's figures over its seeds: {'status': 'ok', mean, std (sample, ddof=1; None for one
    seed), n, values}."""
    m, s = mean_std(values)
    return {'status': 'ok', 'mean': m, 'std': s, 'n': len(values), 'values': [float(v) for v in values]}


def group_over_seeds(runs, label, lengths, value):
    """Runs that share label(run) form a group (in the order first seen); per length L, over_seeds of
    the members' value(run, L). value is a number, or a str saying why a run has none (not servable,
    too long, ...), which leaves that run out; where no run has a number, the group keeps the first
    reason. -> [{'label', 'members', 'stats': {L: over_seeds(...) or {'status': reason}}}]"""
    by_label = {}
    for r in runs:
        by_label.setdefault(label(r), []).append(r)
    groups = []
    for name, members in by_label.items():
        stats = {}
        for L in lengths:
            values = [value(m, L) for m in members]
            numbers = [v for v in values if not isinstance(v, str)]
            stats[L] = over_seeds(numbers) if numbers else {'status': values[0]}
        groups.append({'label': name, 'members': members, 'stats': stats})
    return groups


def mean_std_text(mean, std, fmt='{:.1f}', unit=''):
    """'mean ± std' as every table writes it (the mean alone for one seed): fmt is a format string or a
    function of a number, unit follows the mean ('%')."""
    f = fmt if callable(fmt) else fmt.format
    return f(mean) + unit + ('' if std is None else ' ± ' + f(std))


# -----------------------------------------------------------------------------
# Welch's t-test and the confidence interval of a difference, without scipy: the t distribution's tail
# through the regularized incomplete beta


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


def t_quantile(p, df):
    """The t distribution's quantile: t with P(T <= t) = p, for df > 0 degrees of freedom (fractional
    df as Welch-Satterthwaite gives), by bisection on the tail that betainc computes."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    tail = 2 * min(p, 1 - p)  # two-sided tail beyond |t|
    lo, hi = 0.0, 1.0
    while betainc(df / 2.0, 0.5, df / (df + hi * hi)) > tail:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if betainc(df / 2.0, 0.5, df / (df + mid * mid)) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    t = (lo + hi) / 2
    return t if p >= 0.5 else -t


def mean_ci(values, level=0.95, bounds=None):
    """The mean of values with its confidence interval (Student's t, n - 1 degrees of freedom): (mean, lo, hi),
    or None with fewer than two values. bounds=(lo, hi) for values that cannot leave [lo, hi] (accuracies): the
    interval is cut to them, which removes no possible mean (so keeps its coverage) and stays in bounds."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return None
    m = float(v.mean())
    half = t_quantile(0.5 + level / 2, len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    lo, hi = m - half, m + half
    if bounds is not None:  # (widened to hold the mean, which can round an ulp past a bound)
        lo, hi = max(lo, min(bounds[0], m)), min(hi, max(bounds[1], m))
    return m, lo, hi


def mean_ci_text(values, bounds=None, fmt='{:.1f}', unit=''):
    """'mean [lo, hi]' with mean_ci's 95% interval as every table over seeds writes it (the mean alone for one
    value, '-' for none): fmt is a format string or a function of a number, unit follows the mean ('%')."""
    f = fmt if callable(fmt) else fmt.format
    if len(values) == 0:
        return '-'
    ci = mean_ci(values, bounds=bounds)
    if ci is None:
        return f(float(values[0])) + unit
    m, lo, hi = ci
    return f"{f(m)}{unit} [{f(lo)}, {f(hi)}]"


def beta_quantile(q, a, b):
    """x with I_x(a, b) = q, by bisection on betainc (monotone in x)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if betainc(a, b, mid) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15:
            break
    return (lo + hi) / 2


def binomial_ci(k, n, level=0.95):
    """The exact (Clopper-Pearson) confidence interval of a proportion, k successes of n: (lo, hi), each in
    [0, 1]. Its coverage is at least `level` for every true proportion, which is what 'learned in k of n seeds'
    with n of 3 to 10 needs: a normal interval would cover 10 of 10 with [1, 1]."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"binomial_ci needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    tail = (1 - level) / 2
    lo = 0.0 if k == 0 else beta_quantile(tail, k, n - k + 1)
    hi = 1.0 if k == n else beta_quantile(1 - tail, k + 1, n - k)
    return lo, hi


def k_of_n_text(k, n, level=0.95):
    """'7 of 10 [35, 93]%': a count of seeds with its exact binomial interval, in percent."""
    lo, hi = binomial_ci(k, n, level)
    return f"{k} of {n} [{100 * lo:.0f}, {100 * hi:.0f}]%"

# -----------------------------------------------------------------------------
# statistics that fit a few seeds a side: the exact permutation test (its p cannot go below what the sample
# sizes allow, where Welch's can), Holm's adjustment for the comparisons of one table, and Welch's t interval,
# cut for a bounded quantity (accuracies) to the differences that are possible at all

ALPHA = 0.05                 # the level at which generated text calls a difference significant
EXACT_MAX = 200_000          # enumerate every split of the runs up to this many: 10 runs a side (C(20, 10) splits)
PERMUTATION_DRAWS = 100_000  # beyond that, this many seeded random splits
STATS_SEED = 0               # the random splits are seeded: a table is the same on every rerun
ROUNDING_TOL = 100 * np.finfo(np.float64).eps  # relative to the data: the same values summed in another order differ


@functools.lru_cache(maxsize=16)
def _splits(n, k):
    """Every k-subset of range(n), as the rows of a read-only (C(n, k), k) index array."""
    rows = np.fromiter(itertools.combinations(range(n), k), dtype=np.dtype((np.intp, k)), count=math.comb(n, k))
    rows.flags.writeable = False
    return rows


def permutation_test(a, b, seed=STATS_SEED):
    """Two-sided permutation test of mean(a) - mean(b). The null distribution is the difference over every
    split of the pooled values into groups of len(a) and len(b) (each set of runs once, as
    scipy.stats.permutation_test(permutation_type='independent', n_resamples=np.inf) enumerates them), and
    p = 2 x the smaller share of splits at most / at least the observed difference, capped at 1, as scipy
    computes it. Splits count as equal to the observed one within 100 machine epsilons relative, scipy's
    tolerance, but relative to the data's scale where the difference itself is smaller (identical groups
    then give p = 1 whatever the rounding). Beyond EXACT_MAX splits, PERMUTATION_DRAWS seeded random
    ones, the observed split counted as one more (the +1 correction, so that p is never 0).
    -> {'p', 'p_min': the smallest p these two sample sizes allow (2 / the number of splits, where the
    observed split is the one most extreme), 'splits': how many were counted, 'exact': all of them or not}."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = len(a), len(b)
    if na < 1 or nb < 1:
        raise ValueError("a permutation test needs at least one value per group")
    x = np.concatenate([a, b])
    n, total = na + nb, x.sum()
    exact = math.comb(n, na) <= EXACT_MAX
    if exact:
        sums = x[_splits(n, na)].sum(axis=1)
        extra = 0
    else:
        rng, sums = np.random.default_rng(seed), []
        for start in range(0, PERMUTATION_DRAWS, 10_000):  # in batches, to bound the memory
            order = rng.permuted(np.broadcast_to(np.arange(n), (min(10_000, PERMUTATION_DRAWS - start), n)), axis=1)
            sums.append(x[order[:, :na]].sum(axis=1))
        sums, extra = np.concatenate(sums), 1
    # a's sum fixes the difference (the total is fixed): the same arithmetic for every split and the observed one
    null = sums / na - (total - sums) / nb
    observed = a.sum() / na - (total - a.sum()) / nb
    tol = ROUNDING_TOL * max(abs(observed), float(np.abs(x).max()))
    count = len(null) + extra
    less = (np.count_nonzero(null <= observed + tol) + extra) / count
    greater = (np.count_nonzero(null >= observed - tol) + extra) / count
    return {'p': float(min(1.0, 2 * min(less, greater))), 'p_min': min(1.0, 2 / count), 'splits': len(null),
            'exact': exact}


def holm(pvalues):
    """Holm's step-down adjustment of m p-values (statsmodels' multipletests(method='holm')): in ascending
    order, the i-th (from 0) becomes the largest (m - j) p_j over j <= i, capped at 1, so that the adjusted
    values keep the order of the raw ones. An entry None (no test) stays None and is not counted in m.
    -> the adjusted p-values, in the order given."""
    order = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    out, running = list(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * pvalues[i]))  # never below a smaller p's
        out[i] = running
    return out


def compare_means(a, b, level=0.95, bounds=None):
    """a against b: the difference of their means with its confidence interval, Welch's two-sided p and the
    exact permutation test's (permutation_test). The interval is Welch's t interval (Welch-Satterthwaite
    degrees of freedom). bounds=(lo, hi) for values that cannot leave [lo, hi] (accuracies): the interval is
    then cut to [lo - hi, hi - lo], the differences that are possible at all (the cut removes no possible true
    difference, so the interval keeps its coverage, and stays in bounds), and groups without spread (every
    seed at 100%) are compared too, by the exact test alone, their interval the single point [diff, diff]
    (there is nothing to estimate a spread from: not a claim of certainty). Values outside the bounds are an
    error (a wrong scale, 0-1 against 0-100).
    -> {'status': 'ok', n_a, n_b, mean_a, mean_b, diff, ci: [lo, hi], ci_method ('t', or 't, clipped' where
    bounds were given, whether or not the cut changed it), level, t, df, p (Welch's; None where neither side
    varies), p_exact, p_min (the smallest p_exact these sample sizes allow), exact (every split counted)}, or
    {'status': why not} with fewer than two values a side or, without bounds, no spread on either. Holm's
    adjustment is per table: holm_over adds 'p_holm'."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) < 2 or len(b) < 2:
        return {'status': f"n/a: {min(len(a), len(b))} seed{'s' if min(len(a), len(b)) != 1 else ''}",
                'n_a': len(a), 'n_b': len(b)}
    if bounds is not None:
        lo, hi = bounds
        slack = 1e-9 * (hi - lo)  # a mean of per-length accuracies may round past its bound; a wrong scale may not
        if min(a + b) < lo - slack or max(a + b) > hi + slack:
            raise ValueError(f"values outside the bounds {tuple(bounds)} given for them")
    spread = np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b)
    if spread == 0 and bounds is None:
        return {'status': 'n/a: zero variance', 'n_a': len(a), 'n_b': len(b)}
    t, df, p = welch_ttest(a, b) if spread > 0 else (None, None, None)
    diff = float(np.mean(a) - np.mean(b))
    if abs(diff) <= ROUNDING_TOL * max(map(abs, a + b)):
        diff = 0.0  # the same values summed in another order: rounding, not a side ahead (verdict reads its sign)
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(spread) if spread > 0 else 0.0
    ci, method = [diff - half, diff + half], 't'
    if bounds is not None:
        # (widened to hold diff itself, which a mean of values at a bound can round an ulp past)
        ci = [float(max(ci[0], min(lo - hi, diff))), float(min(ci[1], max(hi - lo, diff)))]
        method = 't, clipped'
    perm = permutation_test(a, b)
    return {'status': 'ok', 'n_a': len(a), 'n_b': len(b), 'mean_a': float(np.mean(a)), 'mean_b': float(np.mean(b)),
            'diff': diff, 'ci': ci, 'ci_method': method, 'level': level, 't': t, 'df': df, 'p': p,
            'p_exact': perm['p'], 'p_min': perm['p_min'], 'exact': perm['exact']}


def holm_over(comparisons):
    """Holm's adjustment of the exact p over the comparisons of one table (compare_means results, or any dicts
    with status, p_exact; those without a test are not counted): sets each tested one's 'p_holm', in place.
    -> the number of comparisons counted."""
    tested = [c for c in comparisons if c['status'] == 'ok']
    for c, p in zip(tested, holm([c['p_exact'] for c in tested])):
        c['p_holm'] = p
    return len(tested)


def p_text(p):
    """A p-value as the tables write it: two significant digits, '< 0.001' below that, 'n/a' for no test."""
    if p is None:
        return 'n/a'
    return '< 0.001' if p < 0.001 else f"{p:.2g}"


def interval_text(bounded, level=0.95, bounds=(0, 100)):
    """What a table's interval is, for its caption: Welch's t interval, and for bounded values (compare_means
    with bounds) that it is cut to the possible range of a difference; bounds: the values' range as the table
    writes them (percent, or percentage points of exact match: both tables that use it)."""
    text = f"{100 * level:.0f}% confidence interval (Welch-Satterthwaite t)"
    if bounded:
        lo, hi = bounds
        text += f", cut to the possible range, {lo - hi:+g} to {hi - lo:+g} (a single point where neither side varies)"
    return text


def tests_caption(comparisons, alpha=ALPHA):
    """The caption line of a table of comparisons (compare_means results after holm_over): what its p-values
    are, how many comparisons Holm's adjustment counts, and the smallest exact p each pair of seed counts
    allows; where even the smallest cannot reach alpha after the adjustment, that nothing in the table can.
    '' for a table without a test."""
    tested = [c for c in comparisons if c['status'] == 'ok']
    if not tested:
        return ''
    smallest = {}
    for c in tested:
        smallest.setdefault(tuple(sorted((c['n_a'], c['n_b']))), (c['p_min'], c['exact']))
    sizes = ', '.join(f"{p:.2g} with {na} and {nb} seeds" + ('' if exact else f" ({PERMUTATION_DRAWS} random splits)")
                      for (na, nb), (p, exact) in sorted(smallest.items()))
    m = len(tested)
    text = (f"p: Welch's t-test; exact: the two-sided permutation test over every split of the seeds between "
            f"the two sides; Holm: the exact p adjusted by Holm's method for the {m} comparison"
            f"{'s' if m != 1 else ''} of this table. Smallest possible exact p: {sizes}.")
    if m * min(p for p, _ in smallest.values()) >= alpha:
        text += f" No comparison of this table can reach a Holm p below {alpha:g}."
    return text


def difference_text(c, fmt='{:+.1f}'):
    """A compare_means result in a table: '+15.0 [-2.1, +32.1]' (the difference and its confidence
    interval), or its status."""
    if c['status'] != 'ok':
        return c['status']
    f = fmt if callable(fmt) else fmt.format
    return f"{f(c['diff'])} [{f(c['ci'][0])}, {f(c['ci'][1])}]"


def significance(c, alpha=ALPHA):
    """'higher', 'lower' (a against b, where the exact p adjusted by Holm's method over its table is below
    alpha) or None. Needs holm_over to have been applied to c's table."""
    if c['status'] != 'ok' or c.get('p_holm') is None or not c['p_holm'] < alpha:
        return None
    return 'higher' if c['diff'] > 0 else 'lower'


# -----------------------------------------------------------------------------
# the test-retest of the same runs trained under two roundings (ATen's vector kernels and
# ATEN_CPU_CAPABILITY=default): what che_tasks.py and eval_passkey.py report alike


def kernels_of(machines):
    """Which of ATen's vector kernels trained runs, from their recorded machine texts (machine_text:
    '..., AVX512 kernels, ...'): 'AVX512', 'DEFAULT', several joined, or 'unknown'."""
    found = {m.group(1) for text in machines for m in re.finditer(r'(\w+) kernels', text or '')}
    return ', '.join(sorted(found)) or 'unknown'


def cpu_of(machine):
    """The machine alone of a recorded machine text (machine_text): 'AMD EPYC (family 26, model 2), AVX512 kernels,
    torch 2.13.0+cpu' -> 'AMD EPYC (family 26, model 2)'; None where none was recorded."""
    if not machine or machine == 'unknown':
        return None
    return re.sub(r', (\w+ kernels|torch ).*$', '', machine)


def retest_machines(pairs):
    """Where a test-retest's runs were trained, pairs [(machine text, its retest's)]: 'one machine', or 'one machine
    per run (2 machines: A; B)' where the runs were spread over several; and the runs whose retest ran on another
    machine than the run itself (their difference is not the rounding's alone), and those without a recorded
    machine, are counted."""
    cpus = [(cpu_of(a), cpu_of(b)) for a, b in pairs]
    names = sorted({c for pair in cpus for c in pair if c})
    apart = sum(a != b for a, b in cpus if a and b)
    unknown = sum(not (a and b) for a, b in cpus)
    text = 'one machine' if len(names) <= 1 else f"one machine per run ({len(names)} machines: {'; '.join(names)})"
    if apart:
        text += (f", except {apart} run{'s' if apart != 1 else ''} retrained on another machine (there the machine "
                 f"differs too)")
    if unknown:
        text += f" ({unknown} run{'s' if unknown != 1 else ''} without a recorded machine)"
    return text


def retest_sides(pairs):
    """What a test-retest's two sides differ in, from its runs' recorded machine texts, pairs [(run's, its
    retest's)]: (a_name, b_name, how), the sides' names for the tables' columns and, for the caption, how the same
    runs were trained twice. Two kernels: the sides are the kernels, a change of rounding on one machine (as
    retest_machines says where). The same kernels on two machines, one a side: the sides are the machines, a change
    of machine alone. Otherwise (the same kernels on the same machines, or kernels not recorded) the sides are the
    two files, tables_from and rounding_from."""
    ka, kb = kernels_of(a for a, _ in pairs), kernels_of(b for _, b in pairs)
    if 'unknown' not in (ka, kb) and ka != kb:
        return ka, kb, (f"under two roundings of {retest_machines(pairs)}: ATen's {ka} kernels and its {kb} kernels, "
                        f"otherwise identical" + (" (DEFAULT: ATEN_CPU_CAPABILITY=default, ATen's plain C++ kernels)"
                                                  if 'DEFAULT' in (ka, kb) else ''))
    cpus_a, cpus_b = {cpu_of(a) for a, _ in pairs}, {cpu_of(b) for _, b in pairs}
    if ka == kb != 'unknown' and len(cpus_a) == len(cpus_b) == 1 and None not in cpus_a | cpus_b and cpus_a != cpus_b:
        (ma,), (mb,) = cpus_a, cpus_b
        na, nb = (re.sub(r' \(family .*\)$', '', m) for m in (ma, mb))
        if na == nb:  # two models of one name: the names in full
            na, nb = ma, mb
        return na, nb, (
            f"twice with ATen's {ka} kernels, on two machines: {ma} (tables_from), then {mb} (rounding_from), "
            f"otherwise identical")
    kernels = (f"ATen's {ka} kernels both times" if ka == kb != 'unknown' else
               f"ATen's kernels as the runs record them, {ka} (tables_from) and {kb} (rounding_from; unknown: not recorded)")
    return f"{ka} (tables_from)", f"{kb} (rounding_from)", f"twice, on {retest_machines(pairs)}, with {kernels}"


def pearson(x, y):
    """Pearson's correlation of two equally long lists; None where either does not vary or has fewer than 3."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):  # (a constant's std can round to 1e-17, not 0)
        return None
    return float(np.corrcoef(x, y)[0, 1])


def verdict(c, alpha=ALPHA):
    """A comparison as the pages state it: which side is ahead ('ahead', 'behind', 'level'), with '*' where
    Holm's exact p is below alpha (significance); its status where it has no test."""
    if c['status'] != 'ok':
        return c['status']
    ahead = 'ahead' if c['diff'] > 0 else 'behind' if c['diff'] < 0 else 'level'
    return ahead + ('*' if significance(c, alpha) else '')


def holds(ca, cb):
    """Whether a comparison's conclusion (verdict) is the same under two roundings: True or False, None where
    either has no test."""
    if not ca['status'] == cb['status'] == 'ok':
        return None
    return verdict(ca) == verdict(cb)


def verdict_counts(comparisons):
    """One pair's comparisons (e.g. one a test length) in a few words: 'ahead at 17, significantly at 2; behind
    significantly at 0' (significantly: Holm's exact p below ALPHA)."""
    cs = list(comparisons)
    return (f"ahead at {sum(c['status'] == 'ok' and c['diff'] > 0 for c in cs)}, "
            f"significantly at {sum(significance(c) == 'higher' for c in cs)}; behind "
            f"significantly at {sum(significance(c) == 'lower' for c in cs)}")


def holds_at(ca, cb, keys, name):
    """Where one pair's conclusions hold under both roundings, ca and cb {key: comparison} (e.g. per length
    `name`=key): (text 'at 15 of 17; not at N=51,61' or 'n/a' where no key has a test under both, how many
    hold, how many have a test under both)."""
    none = {'status': 'n/a: not evaluated'}  # a key one rounding's file lacks has no test under both
    ca, cb = {k: ca.get(k, none) for k in keys}, {k: cb.get(k, none) for k in keys}
    tested = [k for k in keys if holds(ca[k], cb[k]) is not None]
    other = [k for k in tested if not holds(ca[k], cb[k])]
    text = (f"at {len(tested) - len(other)} of {len(tested)}" + (f"; not at {name}={','.join(map(str, other))}" if other else '')
            if tested else 'n/a')
    return text, len(tested) - len(other), len(tested)
