"""
Train a GPT (model.py) with any positional encoding and DAPE on data/<dataset>/{train,val}.bin, in the
manner of nanoGPT's train.py: the defaults below are module globals, changed by config files and
--key=value (configurator.py); every field of model.GPTConfig is a key too.

One process (CPU or one GPU):
$ python train.py config/gutenberg_char_cpu.py
$ python train.py config/arxiv_128.py --pos=kerple --dape=v2 --dape_kernel=3
DDP on the GPUs (or CPU processes, gloo) of one node; --fsdp=True shards parameters, gradients and
optimizer state instead (FSDP2, fully_shard) for models that do not fit one GPU:
$ torchrun --standalone --nproc_per_node=8 train.py config/arxiv_512.py
$ torchrun --standalone --nproc_per_node=8 train.py config/arxiv_512_6.7b.py        # fsdp = True
Several nodes (run on each, with its --node_rank):
$ torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 train.py ...
Continue a run from out_dir/ckpt.pt (bit-exact on CPU, same losses as if it had never stopped):
$ python train.py config/gutenberg_char_cpu.py --init_from=resume

The batch: gradient_accumulation_steps is the total number of micro-batches per optimizer step over
all processes; each of the world_size processes runs gradient_accumulation_steps / world_size of them,
so one step sees batch_size * gradient_accumulation_steps sequences whatever the number of GPUs.
"""
import dataclasses
import json
import math
import os
import random
import shlex
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

import dape_paths
import passkey
from common import (InputError, autocast, check_dataset, check_weights, dape_module, dape_record, machine_text,
                    pick_dtype, provenance, read_checkpoint_file)
from configurator import ConfigError, check_device, config_defaults, configure, update_config
import normalisation
from model import GPT, GPTConfig
from positional import ENCODINGS
from tokenizer import get_tokenizer, load_meta

# -----------------------------------------------------------------------------
# default config values: the paper's 125M model (Appendix B, Table 3) on the embedded byte-level
# dataset. config/ holds the paper's setups and a CPU-sized one (config/gutenberg_char_cpu.py).
# I/O
out_dir = 'out'
eval_interval = 1000  # evaluate (and checkpoint) every this many iterations, and at the end
log_interval = 10
eval_iters = 100  # batches per split per process for the loss estimate
eval_only = False  # evaluate once and exit
always_save_checkpoint = True  # checkpoint at every evaluation, not only when val loss improves
init_from = 'scratch'  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
# wandb logging (used only when asked for and installed)
wandb_log = False
wandb_project = 'dape'
wandb_run_name = 'run'
# data
dataset = 'gutenberg_char'
data_root = 'data'  # the dataset lives in data_root/dataset/
gradient_accumulation_steps = 8  # micro-batches per step, over all processes (see the top)
batch_size = 32  # sequences per micro-batch: 32 x 8 = 256 sequences per step, as the paper
passkey_frac = 0.0  # fraction of training rows replaced by passkey samples at block_size (passkey.py), so that
                    # a small model learns the task and eval_passkey.py past block_size tests extrapolation
# model: every field of model.GPTConfig is a config key with model.py's default, so a new model option
# is settable here without editing this file. Where train.py's default differs:
globals().update({_f.name: _f.default for _f in dataclasses.fields(GPTConfig)})
block_size = 512  # the paper's training length (Table 3); the arxiv/books3 configs set 128/512/1024
vocab_size = 0  # 0: the dataset's, from meta.json; a larger value pads the embedding
# AdamW optimizer
learning_rate = 6e-4  # max learning rate
max_iters = 50000  # total number of optimizer steps
weight_decay = 1e-1  # on matrices only (model.configure_optimizers)
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the gradient norm at this value; 0: no clipping
# learning rate schedule: linear warmup, then cosine decay to min_lr
decay_lr = True
warmup_iters = 500  # 1% of 50k
lr_decay_iters = 50000  # ~= max_iters per Chinchilla
min_lr = 6e-5  # ~= learning_rate / 10 per Chinchilla
# system
device = 'auto'  # 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...; torchrun sets cuda:LOCAL_RANK
dtype = 'auto'  # 'auto': bfloat16 autocast on a GPU that supports it, else float32 (common.py); 'float16'
backend = 'auto'  # torch.distributed backend: 'auto' (nccl on GPU, gloo on CPU), 'nccl', 'gloo'
fsdp = False  # shard parameters, gradients and optimizer state over the processes (FSDP2, fully_shard)
compile = False  # torch.compile the model
seed = 1337
peak_flops = 0.0  # accelerator peak FLOP/s for MFU; 0: from the GPU's name (A100 312e12, H100 989e12)
# -----------------------------------------------------------------------------
DEFAULTS = config_defaults(globals())  # every name above is a config key


class NonFiniteLossError(RuntimeError):
    pass


class CheckpointError(ValueError):
    """out_dir's checkpoint cannot be used as asked (unreadable, foreign, or about to be overwritten)."""


# model options a resumed run may set anew: they change no parameter
RESUME_CHANGEABLE = ('dropout', 'attn_chunk', 'dape_impl')


def check_config(cfg):
    """Options that would fail late, or silently train nothing, fail here: before any process group,
    data or model (ConfigError, which main() prints as one line)."""
    for k in ('batch_size', 'gradient_accumulation_steps', 'eval_interval', 'log_interval', 'eval_iters'):
        if getattr(cfg, k) < 1:
            raise ConfigError(f"{k} must be >= 1, got {getattr(cfg, k)}")
    for k in ('max_iters', 'warmup_iters', 'lr_decay_iters', 'min_lr', 'weight_decay', 'grad_clip'):
        if getattr(cfg, k) < 0:
            raise ConfigError(f"{k} must be >= 0, got {getattr(cfg, k)}")
    if not cfg.learning_rate > 0:
        raise ConfigError(f"learning_rate must be > 0, got {cfg.learning_rate}")
    if not 0.0 <= cfg.passkey_frac < 1.0:
        raise ConfigError(f"passkey_frac must be in [0, 1) (a fraction of the training rows), got {cfg.passkey_frac}")
    choices = {'init_from': ('scratch', 'resume'), 'dtype': ('auto', 'float32', 'bfloat16', 'float16'),
               'backend': ('auto', 'nccl', 'gloo')}
    for k, allowed in choices.items():
        if getattr(cfg, k) not in allowed:
            raise ConfigError(f"{k} must be one of {', '.join(allowed)}; got {getattr(cfg, k)!r}")
    check_device(cfg.device)
    if cfg.backend == 'nccl' and (cfg.device == 'cpu' or not torch.cuda.is_available()):
        where = "--device=cpu" if cfg.device == 'cpu' else "no CUDA device is available"
        raise ConfigError(f"backend=nccl needs CUDA GPUs, but {where}; use --backend=gloo (or auto: nccl on GPU, "
                          f"gloo on CPU)")
    model_args = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig)}
    try:  # the model options, before reading data (vocab_size comes from meta.json when 0)
        GPTConfig(**{**model_args, 'vocab_size': cfg.vocab_size or 1})
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_dape_impl(config, device, dtype, compiling):
    """dape_impl='triton' where the fused kernel cannot run (no CUDA, no Triton, a shape or dtype it does
    not take, an encoding or a normalisation it does not cover): a ConfigError before training starts."""
    if config.dape == "none":
        return
    why = dape_paths.cannot(config.dape_impl, torch.device(device), dtype, config.n_head,
                            config.n_embd // config.n_head, config.dape_width,
                            config.dape_kernel if config.dape == "v2" else 1, ENCODINGS[config.pos],
                            config.dropout, compiling, normalisation.describe(config))
    if why is not None:
        raise ConfigError(f"dape_impl=triton cannot run here: {why}; use --dape_impl=auto (the fused kernel "
                          f"where it runs and agrees with dape.py, else PyTorch), torch or plain")


# -----------------------------------------------------------------------------
# learning rate decay scheduler (cosine with warmup)

def get_lr(it, cfg):
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:  # 1) linear warmup
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:  # 2) after the decay, min_lr
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)  # 3) cosine in between
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


# -----------------------------------------------------------------------------
# checkpoints

def save_checkpoint(checkpoint, path):
    """torch.save to path + '.tmp' in the same folder, fsync, then rename over path: a crash at any
    point leaves either the old file or the new one, never a truncated ckpt.pt."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def read_checkpoint(path, cfg):
    """init_from='resume': the checkpoint at path, with clear errors for a missing, unreadable or
    foreign file. 'scratch': None, after making sure that training will not overwrite a checkpoint
    there (a run's checkpoint is never destroyed by a forgotten --init_from=resume)."""
    if cfg.init_from == 'scratch':
        if os.path.exists(path) and not cfg.eval_only:
            raise CheckpointError(f"{path} already exists and init_from='scratch' would overwrite it: continue "
                                  f"that run with --init_from=resume, or train into another --out_dir")
        return None
    if not os.path.exists(path):
        raise FileNotFoundError(f"init_from='resume' but {path} does not exist; train from scratch first "
                                f"(--init_from=scratch) or set --out_dir")
    try:  # all that resuming needs
        return read_checkpoint_file(path, ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss', 'rng'))
    except ValueError as e:
        raise CheckpointError(f"{e}. It cannot be resumed and was left as it is; train into another "
                              f"--out_dir") from e


def resumed_model_args(saved, config, path, given=()):
    """The model options of a resumed run: the checkpoint's. An option this run sets (given, or set to other
    than its default) must agree with them, since a trained model cannot change shape or encoding; only the
    RESUME_CHANGEABLE ones may be set anew. -> (model_args, notes on what changed)"""
    args, clash, notes = {}, [], []
    for f in dataclasses.fields(GPTConfig):
        k, old = f.name, saved.get(f.name, f.default)  # (a checkpoint older than the option: its default)
        asked = (k in given or config[k] != DEFAULTS[k]) and config[k] != old
        if asked and k in RESUME_CHANGEABLE:
            notes.append(f"resuming with {k}={config[k]!r} (the checkpoint's: {old!r})")
        elif asked:
            clash.append(f"{k}={config[k]!r} (the checkpoint has {old!r})")
        args[k] = config[k] if asked else old
    if clash:
        raise ConfigError(f"{path} cannot be resumed with {', '.join(clash)}: leave these options out (or "
                          f"give the checkpoint's values), or train a new model into another --out_dir")
    return args, notes


def rng_state(data_state):
    """This process's random states, in types torch.load(weights_only=True) accepts."""
    npst = np.random.get_state()
    return {'torch': torch.get_rng_state(),
            'cuda': torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            'numpy': (npst[0], npst[1].tolist(), *npst[2:]),
            'python': random.getstate(),
            'data': data_state}


def set_rng_state(state, data_gen):
    torch.set_rng_state(state['torch'])
    if state['cuda'] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])
    np.random.set_state((state['numpy'][0], np.array(state['numpy'][1], dtype=np.uint32), *state['numpy'][2:]))
    random.setstate((state['python'][0], tuple(state['python'][1]), state['python'][2]))
    data_gen.set_state(state['data'])


# -----------------------------------------------------------------------------

def processes(cfg):
    """This process's place in the run: (ddp, rank, local_rank, world_size, device), with the process
    group started when launched by torchrun."""
    import torch.distributed as dist
    if int(os.environ.get('RANK', -1)) == -1:  # not launched by torchrun
        device = cfg.device if cfg.device != 'auto' else ('cuda' if torch.cuda.is_available() else 'cpu')
        return False, 0, 0, 1, device
    rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    use_cuda = torch.cuda.is_available() and cfg.device != 'cpu'
    device = f'cuda:{local_rank}' if use_cuda else 'cpu'
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=cfg.backend if cfg.backend != 'auto' else ('nccl' if use_cuda else 'gloo'))
    return True, rank, local_rank, world_size, device


def batch_reader(cfg, data_dir, data_dtype, device):
    """get_batch(split, generator, block) -> (x, y) [batch_size, block] on device: random windows of the
    split, drawn with the given generator (so that a checkpoint can record where the stream is).
    With passkey_frac > 0, that fraction of the training rows are passkey samples (passkey.py)."""
    tok = get_tokenizer(load_meta(data_dir)) if cfg.passkey_frac > 0 else None

    def get_batch(split, gen, block):
        # a new memmap every batch avoids a memory leak (https://stackoverflow.com/q/45132940)
        data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=data_dtype, mode='r')
        if len(data) <= block:
            raise ValueError(f"{data_dir}/{split}.bin has {len(data)} tokens, fewer than block_size+1 = "
                             f"{block + 1}; prepare more data or lower block_size")
        ix = torch.randint(len(data) - block, (cfg.batch_size,), generator=gen)
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        if tok is not None and split == 'train':  # the filler from the training split, never validation text
            try:
                x, y = passkey.mix_into_batch(x, y, data, tok, cfg.passkey_frac, gen)
            except ValueError as e:  # block_size too short for the prompt
                raise ConfigError(f"passkey_frac={cfg.passkey_frac}: {e}; raise block_size or set passkey_frac=0") from None
        if device.startswith('cuda'):  # pin and move asynchronously
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)
    return get_batch


def checkpoint_to_resume(cfg, config, ckpt_path, ddp, master):
    """Rank 0 reads out_dir's checkpoint (on resume; from scratch, only whether one is in the way); the
    others get its small part, or the error, by broadcast, and its tensors when they are loaded.
    Returns (checkpoint or None, its small part)."""
    import torch.distributed as dist
    ckpt, small = None, {}
    if master:
        try:
            ckpt = read_checkpoint(ckpt_path, cfg)
            small = {k: v for k, v in (ckpt or {}).items() if k not in ('model', 'optimizer')}
        except (FileNotFoundError, CheckpointError) as e:
            small = {'error': (type(e).__name__, str(e))}
    if ddp:  # every process learns of a bad file too, instead of waiting for rank 0 forever
        box = [small]
        dist.broadcast_object_list(box, src=0)
        small = box[0]
    if 'error' in small:
        kind, msg = small['error']
        raise (FileNotFoundError if kind == 'FileNotFoundError' else CheckpointError)(msg)
    return ckpt, small


def peak_flops_of(cfg, device, dtype):
    """The accelerator's peak FLOP/s for MFU, or None on a CPU."""
    if not device.startswith('cuda'):
        return cfg.peak_flops or None
    name = torch.cuda.get_device_name()
    peak = cfg.peak_flops or (989e12 if ('H100' in name or 'H200' in name) else 312e12)
    return peak / 2 if dtype == torch.float32 and not cfg.peak_flops else peak  # tf32's peak


def train(config=None, command='unknown (train.train called in a process of its own)', given=None, **overrides):
    """Run training with DEFAULTS updated by `config` (a dict, e.g. from configure()) and `overrides`;
    `command` is the command line that asked for it, which the checkpoint records (main passes it); `given`, the
    keys the user set (main: the command line's --key=value ones; None: those of `overrides`), which a resumed
    checkpoint must agree with even where they are at their default. Returns a dict: iter_num, best_val_loss,
    losses (train loss of every step run here), evals ([(iter, train, val)]), model (the trained raw model)."""
    given = set(overrides) if given is None else set(given)
    config = update_config(DEFAULTS, {**(config or {}), **overrides})
    cfg = SimpleNamespace(**config)
    check_config(cfg)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)

    # -- processes, devices, precision ---------------------------------------------------------------
    ddp, rank, local_rank, world_size, device = processes(cfg)
    master = rank == 0
    device_type = 'cuda' if 'cuda' in device else 'cpu'
    if cfg.fsdp and not ddp:
        print("fsdp=True in a single process: nothing to shard, training without it")
    use_fsdp = cfg.fsdp and ddp
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be a multiple of "
                          f"the number of processes ({world_size}): it counts micro-batches over all of them")
    accum = cfg.gradient_accumulation_steps // world_size  # micro-steps of this process
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ptdtype = pick_dtype(cfg.dtype, device)
    dtype = str(ptdtype).removeprefix('torch.')
    ctx = autocast(device, ptdtype)
    check_dape_impl(SimpleNamespace(**config), device, ptdtype, cfg.compile)

    # -- data ----------------------------------------------------------------------------------------
    data_dir = os.path.join(cfg.data_root, cfg.dataset)
    try:
        meta, data_dtype = check_dataset(data_dir, cfg.dataset)
    except json.JSONDecodeError as e:
        raise InputError(f"{data_dir}/meta.json is not valid JSON ({e}); rebuild the dataset with "
                         f"`python data/{cfg.dataset}/prepare.py`") from None
    except ValueError as e:  # its message names the file and the prepare command
        raise InputError(str(e)) from None
    get_batch = batch_reader(cfg, data_dir, data_dtype, device)
    data_gen = torch.Generator().manual_seed(cfg.seed + rank)  # training batches; its state is checkpointed
    batch_state = [data_gen.get_state()]  # state before the latest training batch was drawn

    # -- model init or resume -----------------------------------------------------------------------
    model_args = {f.name: config[f.name] for f in dataclasses.fields(GPTConfig)}
    model_args['vocab_size'] = cfg.vocab_size or meta['vocab_size']
    iter_num, best_val_loss = 0, 1e9
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    ckpt, small = checkpoint_to_resume(cfg, config, ckpt_path, ddp, master)
    if cfg.init_from == 'resume':
        if small.get('dataset') != cfg.dataset and master:
            print(f"note: the checkpoint was trained on '{small.get('dataset')}', continuing on '{cfg.dataset}'")
        model_args, notes = resumed_model_args(small['model_args'], config, ckpt_path, given)
        for note in notes if master else ():
            print(note)
        config.update({k: v for k, v in model_args.items() if k != 'vocab_size'})  # what the run really is
        check_dape_impl(SimpleNamespace(**config), device, ptdtype, cfg.compile)
        iter_num, best_val_loss = small['iter_num'], small['best_val_loss']
    if model_args['vocab_size'] < meta['vocab_size'] and cfg.init_from == 'resume':
        own = f" (--dataset={small['dataset']})" if small.get('dataset') else ''
        raise ConfigError(f"the checkpoint's vocabulary ({model_args['vocab_size']}) cannot hold dataset "
                          f"'{cfg.dataset}''s {meta['vocab_size']} tokens (meta.json); resume on its own dataset{own} "
                          f"or train a new model into another --out_dir")
    if model_args['vocab_size'] < meta['vocab_size']:
        raise ConfigError(f"vocab_size={model_args['vocab_size']} is smaller than dataset '{cfg.dataset}''s "
                          f"{meta['vocab_size']} (meta.json); leave vocab_size=0 to take the dataset's")
    for split in ('train', 'val'):  # every batch, training's and evaluation's, is block_size + 1 tokens long
        n = os.path.getsize(os.path.join(data_dir, f'{split}.bin')) // data_dtype.itemsize
        if n <= model_args['block_size']:
            raise ConfigError(f"{data_dir}/{split}.bin has {n} tokens, fewer than block_size+1 = "
                              f"{model_args['block_size'] + 1}; lower --block_size or prepare more data")
    if master:  # only now: a run that cannot start leaves no empty out_dir behind
        os.makedirs(cfg.out_dir, exist_ok=True)

    torch.manual_seed(cfg.seed)  # the same initial weights in every process (FSDP shards them as they are)
    gptconf = GPTConfig(**model_args)
    # the dape.py that defines f, which every save records (common.dape_record): evaluation builds the model
    # with it again, wherever dape.py has changed since; a resumed run continues with its own
    dape_py = (small.get('dape_py') if cfg.init_from == 'resume' else None) or dape_record()
    try:
        f_module = dape_module(dape_py if gptconf.dape != 'none' else None, ckpt_path)
    except ValueError as e:  # a damaged record, or one that does not run here
        raise CheckpointError(f"{e}. It cannot be resumed and was left as it is") from None
    model = GPT(gptconf, dape=f_module)
    if cfg.init_from == 'resume' and master:  # weights that do not fit (a file edited or mixed up): named, not loaded
        try:
            check_weights(ckpt_path, ckpt['model'], model)
        except ValueError as e:
            raise CheckpointError(f"{e}. It cannot be resumed and was left as it is") from None
    flops_per_token = model.flops_per_token(gptconf.block_size)
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * gptconf.block_size
    # what computed the run: the same seed on another CPU model, kernel set or torch rounds differently, and
    # at small scale that alone can decide whether a run learns a task (docs/passkey_results.md), so the log
    # and the checkpoint record it, with the step from which each machine trained
    machine = machine_text(device_type)
    machines = list(small.get('machines', [])) if cfg.init_from == 'resume' else []
    if not machines or machines[-1][1] != machine:
        if machines and master:
            print(f"note: the checkpoint was trained on {machines[-1][1]}; continuing on {machine}, whose "
                  f"rounding differs, so this run will not match one trained on a single machine")
        machines.append((iter_num, machine))
    # and the code and command behind every start, so that a published result names its commit (a resume
    # adds an entry: a run may span two commits)
    origin = list(small.get('provenance', [])) if cfg.init_from == 'resume' else []
    origin.append((iter_num, provenance(command, device_type)))
    if master:
        print(f"{world_size} process(es) on {device_type} ({machine}), {dtype}{', FSDP' if use_fsdp else ''}; "
              f"{accum} micro-step(s) of {cfg.batch_size} x {gptconf.block_size} per process, "
              f"{tokens_per_iter:,} tokens per iteration")
        print(f"model: {model.get_num_params() / 1e6:.2f}M parameters, pos={gptconf.pos}, dape={gptconf.dape}, "
              f"{flops_per_token * tokens_per_iter / 1e12:.3g} TFLOPs per iteration")
    model.to(device)
    torch.manual_seed(cfg.seed + rank)  # dropout and randomized positions differ between processes
    np.random.seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)

    if use_fsdp:
        from torch.distributed.fsdp import fully_shard
        # each block is its own unit (all-gathered just before use and freed after); the root holds
        # the embedding (tied to lm_head), the final norm and the positional modules
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    raw_model = model  # without compile/DDP wrappers: what state dicts are taken from

    # fp16 needs loss scaling; under FSDP the scaler must agree on overflow across shards
    if use_fsdp and dtype == 'float16':
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler(enabled=True)
    else:
        scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)

    if cfg.init_from == 'resume':
        # one format for every setup: full (unsharded) state dicts keyed by parameter name, read on
        # rank 0 and broadcast to the others (only rank 0 needs the file)
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ddp)
        set_model_state_dict(raw_model, ckpt['model'] if master else {}, options=opts)
        set_optimizer_state_dict(raw_model, optimizer, ckpt['optimizer'] if master else {}, options=opts)
        if small.get('scaler'):
            scaler.load_state_dict(small['scaler'])
        rng = small['rng']
        if rng['world_size'] == world_size:
            set_rng_state(rng['ranks'][rank], data_gen)
        else:
            data_gen.manual_seed(cfg.seed + rank + 1000003 * iter_num)  # fresh batches, not the old ones
            if master:
                print(f"resuming with {world_size} processes, the checkpoint had {rng['world_size']}: "
                      f"batches are drawn afresh (the run is no longer bit-exact)")
        ckpt = small = None  # free memory
        if master:
            print(f"resumed from {ckpt_path} at iteration {iter_num} (best val loss {best_val_loss:.4f})")
        if iter_num >= cfg.max_iters and not cfg.eval_only and master:
            print(f"note: the checkpoint is already at iteration {iter_num} >= max_iters={cfg.max_iters}, so "
                  f"nothing is trained; to train further, resume with a larger --max_iters (above {iter_num})")

    if cfg.compile:
        if master:
            print("compiling the model... (takes a ~minute)")
        model = torch.compile(model)
    if ddp and not use_fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)

    def all_mean(value):
        if not ddp:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.item() / world_size

    @torch.no_grad()
    def estimate_loss():
        """Mean loss over eval_iters batches per split and process, at the training length. The
        batches come from their own fixed-seed generator, so evaluating never moves the training
        stream (resume stays exact) and every evaluation sees the same batches."""
        out = {}
        model.eval()
        # rand_pos_eval draws positions from the global RNG: forked, so that they too leave the training
        # stream where it was (a checkpoint saved after an evaluation holds the state from before it)
        with torch.random.fork_rng(devices=[torch.device(device)] if device_type == 'cuda' else []):
            for i, split in enumerate(('train', 'val')):
                gen = torch.Generator().manual_seed(cfg.seed + 7777 + 31 * rank + i)
                losses = torch.zeros(cfg.eval_iters)
                for k in range(cfg.eval_iters):
                    X, Y = get_batch(split, gen, gptconf.block_size)
                    with ctx:
                        _, loss = model(X, Y)
                    losses[k] = loss.item()
                out[split] = all_mean(losses.mean().item())
        model.train()
        return out

    def checkpoint():
        """Save out_dir/ckpt.pt (collective: every process takes part, rank 0 writes)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(raw_model, options=opts)
        osd = get_optimizer_state_dict(raw_model, optimizer, options=opts)
        states = [rng_state(batch_state[0])]
        if ddp:
            states = [None] * world_size
            dist.all_gather_object(states, rng_state(batch_state[0]))
        if master:
            ck = {'model': msd, 'optimizer': osd, 'model_args': model_args, 'iter_num': iter_num,
                  'best_val_loss': best_val_loss, 'config': config, 'dataset': cfg.dataset,
                  'rng': {'world_size': world_size, 'ranks': states}, 'scaler': scaler.state_dict(),
                  'machines': machines, 'provenance': origin, 'dape_py': dape_py}
            save_checkpoint(ck, ckpt_path)
            print(f"saved checkpoint to {ckpt_path}")

    # -- logging -------------------------------------------------------------------------------------
    if cfg.wandb_log and master:
        try:
            import wandb
            wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=config)
        except ImportError:
            print("wandb_log=True but wandb is not installed (pip install wandb): not logging to wandb")
            cfg.wandb_log = False
    peak = peak_flops_of(cfg, device, ptdtype)

    # -- training loop --------------------------------------------------------------------------------
    batch_state[0] = data_gen.get_state()
    X, Y = get_batch('train', data_gen, gptconf.block_size)  # first batch
    t0 = time.time()
    local_iter_num, running_mfu = 0, -1.0
    losses_seen, evals = [], []
    while True:
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group['lr'] = lr

        # evaluate the loss on train/val and write checkpoints
        if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters or cfg.eval_only:
            losses = estimate_loss()
            evals.append((iter_num, losses['train'], losses['val']))
            if master:
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                if cfg.wandb_log:
                    wandb.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'],
                               'lr': lr, 'mfu': running_mfu * 100})
            if not math.isfinite(losses['val']):
                raise NonFiniteLossError(f"validation loss is {losses['val']} at iteration {iter_num}; "
                                         f"{kept(ckpt_path)}")
            if losses['val'] < best_val_loss or cfg.always_save_checkpoint:
                best_val_loss = min(best_val_loss, losses['val'])
                if iter_num > 0 and not cfg.eval_only:
                    checkpoint()
            t0 = time.time()  # time the training steps only
        if cfg.eval_only or iter_num >= cfg.max_iters:
            break

        # forward, backward and update, with gradient accumulation over micro-steps
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(accum):
            if ddp and not use_fsdp:
                # synchronise gradients only at the last micro-step (DDP's no_sync, without the context)
                model.require_backward_grad_sync = (micro_step == accum - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / accum  # the mean over micro-steps
            batch_state[0] = data_gen.get_state()  # regenerates the batch drawn next: the resume point
            X, Y = get_batch('train', data_gen, gptconf.block_size)  # prefetch while the GPU works
            scaler.scale(loss).backward()
            loss_sum += loss.detach()
        lossf = all_mean(loss_sum.item())  # the step's loss, averaged over processes (all agree on it)
        if not math.isfinite(lossf):
            raise NonFiniteLossError(
                f"loss is {lossf} at iteration {iter_num} (lr {lr:.2e}): stopping before the update; "
                f"{kept(ckpt_path)}. Try a lower learning_rate or longer "
                f"warmup_iters, dtype='bfloat16' instead of float16, a smaller grad_clip, or check the data.")
        if cfg.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)  # free the gradients' memory now

        # timing and logging
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        losses_seen.append(lossf)
        if iter_num % cfg.log_interval == 0 and master:
            if local_iter_num >= 5 and peak:  # let the training loop settle a bit
                mfu = flops_per_token * tokens_per_iter / world_size / dt / peak
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
            mfu_text = f"{running_mfu * 100:.2f}%" if running_mfu >= 0 else 'n/a'
            print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, time {dt * 1000:.2f}ms, "
                  f"{tokens_per_iter / dt:,.0f} tok/s, mfu {mfu_text}")
        iter_num += 1
        local_iter_num += 1

    return {'iter_num': iter_num, 'best_val_loss': best_val_loss, 'losses': losses_seen, 'evals': evals,
            'model': raw_model}


def kept(ckpt_path):
    """What a run stopped by a non-finite loss leaves behind, for its error message."""
    if os.path.exists(ckpt_path):
        return f"{ckpt_path} keeps the last good checkpoint"
    return f"no checkpoint had been saved yet (the next would have gone to {ckpt_path})"


def reports_errors():
    """Whether this process prints the errors that every process of a torchrun run finds alike (config,
    data, checkpoint): one per node (LOCAL_RANK 0), so that under torchrun they read as one line, as
    without it. Per node rather than rank 0 alone: a dataset missing on one node is seen there."""
    return int(os.environ.get('LOCAL_RANK', 0)) == 0


def exit_after_reporter(code):
    """Exit a process that leaves the error to the reporting one, a moment later: torchrun stops all
    processes as soon as one has failed, which could stop the reporter before it has printed. In the
    usual case the reporter fails at the same point, exits first, and torchrun stops this one at once."""
    time.sleep(5)
    sys.exit(code)


def main(argv=None):
    # the command line is parsed here, not by configure(argv=None), whose error exit would print the
    # error once per process under torchrun
    argv = sys.argv[1:] if argv is None else argv
    try:
        # the keys set on the command line (one a config file sets to its default cannot be told from one it
        # leaves alone: those count only where they differ from the default)
        given = {a[2:].partition('=')[0] for a in argv if a.startswith('--')}
        train(configure(DEFAULTS, argv), command=shlex.join(['python', 'train.py', *argv]), given=given)
    except ConfigError as e:
        if not reports_errors():
            exit_after_reporter(2)
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (NonFiniteLossError, CheckpointError, FileNotFoundError, InputError) as e:
        if not reports_errors():
            exit_after_reporter(1)
        sys.exit(f"error: {e}")
    finally:
        import gc
        import torch.distributed as dist
        if dist.is_initialized():
            gc.collect()  # FSDP's sharded tensors refer to the group: freed first, or teardown can abort
            dist.destroy_process_group()


if __name__ == '__main__':
    main()
