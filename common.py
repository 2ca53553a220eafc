"""
What several scripts share: the device and dtype they run in, reading checkpoints and datasets, the
evaluation scripts' command lines, where a run comes from (provenance), and the labels that group runs of one
setting over seeds. What the evaluation scripts make of their runs (statistics over seeds, tables, test-retest,
merging runs into results files) is results.py's.
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

import ast
import datetime
import functools
import hashlib
import inspect
import json
import linecache
import os
import subprocess
import sys
import types
from contextlib import nullcontext
from dataclasses import fields

import numpy as np
import torch

from configurator import ConfigError, check_device, configure
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
    # log-length scaling's learned s was attention's own parameter until it moved into normalisation.py
    return {k.removeprefix('_orig_mod.').removeprefix('module.').replace('.attn.logn_s', '.attn.normalisation.logn_s'):
            v for k, v in state.items()}


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


# -----------------------------------------------------------------------------
# the dape.py a checkpoint was trained with: an edit of f (an ablation) and its baseline, trained in two trees,
# then load in one process each with its own f, and their labels tell them apart

_RECORDED = {}  # sha256 -> the module made from a checkpoint's recorded dape.py (one per definition and process)


def sha256(text):
    return hashlib.sha256(text.encode('utf-8')).hexdigest()


@functools.cache
def dape_here():
    """The text of the dape.py this process imported (read once, as models are built from what was imported)."""
    import dape
    with open(dape.__file__, encoding='utf-8') as f:
        return f.read()


@functools.lru_cache(maxsize=16)
def code_of(source):
    """A dape.py's code without its comments and docstrings (fingerprint.py's canonical syntax tree): two texts
    that differ only there define the same f, and a comment edit is no ablation."""
    import fingerprint
    return fingerprint.canonical(fingerprint.without_docstrings(ast.parse(source)))


def dape_record():
    """What train.py saves with every checkpoint of the dape.py here: {'sha256' of its text, 'edited': whether its
    code differs from the committed one's (git show HEAD:./dape.py; comments and docstrings aside; None outside a
    git checkout), 'source': the text itself (a few kB), from which load_checkpoint builds the model again
    wherever dape.py has changed since}."""
    source = dape_here()
    try:
        out = subprocess.run(['git', 'show', 'HEAD:./dape.py'], cwd=ROOT, capture_output=True, timeout=30)
        committed = out.stdout.decode('utf-8') if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, UnicodeDecodeError):
        committed = None
    try:
        edited = None if committed is None else code_of(source) != code_of(committed)
    except SyntaxError:  # a committed dape.py that does not parse: not the code that runs
        edited = True
    return {'sha256': sha256(source), 'edited': edited, 'source': source}


def dape_module(record, where):
    """The module whose DAPEV1 and DAPEV2 build a checkpoint's model, from its dape_record: the dape.py here where
    the record's code is the same (code_of) or there is no record (a checkpoint older than it), else the recorded
    source as a module of its own. Its file name is registered in linecache, so that inspect and the syntax
    trees of fingerprint.py read its code, and dape_paths.py decides by that code which path runs it (the fast
    ones where it is the definition they implement). Says once per definition that it is used, and why."""
    import dape
    if not record or record['sha256'] == sha256(dape_here()):
        return dape
    sha, source = record['sha256'], record.get('source')
    if sha in _RECORDED:
        return _RECORDED[sha]
    if not isinstance(source, str) or sha256(source) != sha:
        raise ValueError(f"{where}: its record of dape.py is damaged (the source does not have the recorded "
                         f"sha256 {sha[:12]}): the model it was trained with cannot be built; retrain it")
    if code_of(source) == code_of(dape_here()):
        _RECORDED[sha] = dape
        return dape
    name, filename = f"dape_{sha[:12]}", f"<dape.py {sha[:12]}, recorded in a checkpoint>"
    module = types.ModuleType(name, "dape.py as a checkpoint recorded it (common.dape_module)")
    module.__file__ = filename
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # never reloaded
    sys.modules[name] = module  # where inspect finds a class's file
    try:
        exec(compile(source, filename, 'exec'), module.__dict__)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{where}: the dape.py it was trained with (recorded in it) does not run here "
                         f"({type(e).__name__}: {e}); evaluate it with the code it was trained with") from e
    _RECORDED[sha] = module
    how = {True: 'an uncommitted edit', False: 'committed when it was trained', None: 'outside a git checkout'}
    print(f"note: {where} was trained with another dape.py than this one ({how[record.get('edited')]}, sha256 "
          f"{sha[:12]}): its model runs that one, which the checkpoint records (as does every checkpoint of it)")
    return module


def dape_of_run(ckpt):
    """What results files record of a checkpoint's dape.py: {'sha256', 'edited', 'tag'}, or None for a checkpoint
    older than the record. 'tag', the sha256's first 7 hex digits (sha256sum dape.py), labels a DAPE model
    trained with a dape.py whose code is not the committed one's (an edit; outside git, code other than the
    dape.py here), so that an ablation's runs never group with their baseline's; None otherwise."""
    record = ckpt.get('dape_py')
    if not record:
        return None
    other = record['edited'] or (record['edited'] is None and code_of(record.get('source', '')) != code_of(dape_here()))
    has_f = (ckpt.get('model_args') or {}).get('dape', 'none') != 'none'
    return {'sha256': record['sha256'], 'edited': record['edited'],
            'tag': record['sha256'][:7] if has_f and other else None}


def load_checkpoint(path, device='cpu'):
    """Load a train.py checkpoint (a ckpt.pt file or the out_dir holding one) and build its model, with the
    dape.py it was trained with (dape_module). Returns (model, checkpoint dict). Errors name the file and what
    to do."""
    from model import GPT, GPTConfig
    if os.path.isdir(path):
        path = os.path.join(path, 'ckpt.pt')
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one first: python train.py <config> --out_dir=...")
    ckpt = read_checkpoint_file(path, device=device)
    config = GPTConfig(**ckpt['model_args'])
    model = GPT(config, dape=dape_module(ckpt.get('dape_py') if config.dape != 'none' else None, path))
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


def find_checkpoints(paths, labels, script):
    """ckpt.pt files for the given paths: a .pt file, a directory holding ckpt.pt, or a directory whose
    immediate subdirectories hold ckpt.pt (e.g. out/ with out/kerple_s1, out/kerple_s2, ...); with the names
    --labels gives them, one each (None where it gives none). `script` names the command that is missing them."""
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
    if not found:
        raise InputError(f"no checkpoints given: python {script} out/run1 out/run2 ... (or --ckpts=)")
    names = [s for s in labels.split(',') if s] if labels else None
    if names is not None and len(names) != len(found):
        raise InputError(f"--labels has {len(names)} names for {len(found)} checkpoints: {found}")
    return found, names


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
    return np.memmap(os.path.join(path, 'val.bin'), dtype=np.dtype(meta['dtype']), mode='r'), meta


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


def run_main(main, script):
    """Run a script's main(): an error in the user's input (InputError, ConfigError) is one line on stderr,
    '<script>: error: ...', and exit status 2; any other error keeps its traceback."""
    try:
        main()
    except (InputError, ConfigError) as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        sys.exit(2)


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
    loading that checkpoint builds. A DAPE model trained with a dape.py other than the committed one (an
    ablation of f) has its short hash under 'dape.py' (dape_of_run)."""
    from model import GPTConfig
    model = {f.name: f.default for f in fields(GPTConfig)}
    model.update(run['model_args'])
    if (run.get('dape_py') or {}).get('tag'):
        model['dape.py'] = run['dape_py']['tag']
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
    options (attn_suffix) spelled out, and the short hash of an edited dape.py (setting_of):
    'dape-kerple[dape.py=3f9a2c1]'."""
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
    if a.get('dape.py'):
        name += f"[dape.py={a['dape.py']}]"
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
