"""
What DAPE costs: training step time against the same model without DAPE, the DAPE modules alone against
dape.py's plain form (the paper's Appendix J), evaluation at long lengths, the GPU path, and the paper's
Table 1. Prints a table of figures and ratios per section and writes everything to a JSON file.

$ python bench.py                                   # train, module, eval, gpu at the CPU demo config
$ python bench.py --quick                           # a tiny model, a few repeats: under a minute
$ python bench.py --sections=train --pos=kerple,alibi --repeats=20
$ python bench.py --sections=train --pos=kerple --dape=none,v1 --attn=softmax,stickbreaking,logn   # vs softmax
$ python bench.py --size=125m --sections=gpu        # on a GPU: the paper's 125M, bf16, compile on/off
$ python bench.py --sections=timing                 # Table 1: the paper's 350M, forward + backward

Sections (docs/benchmark.md says how each figure is measured)
- train   a training step for each pos x dape (x --attn), interleaved, against the same pos without DAPE
- module  DAPE V1 and V2 alone, forward + backward: the fast paths against dape.py's plain form, checked equal
- eval    the evaluation forward at long lengths, batch 1: time per token and peak memory, blocked and unblocked
- gpu     the training step and evaluation at 125M in bf16, eager and compiled, and the fused kernel's targets
- fit     the fused kernels compiled for each GPU architecture: shared memory, registers, spills (no GPU needed)
- timing  the paper's Table 1: forward + backward of a fresh model per method at each length
- decide  what dape_paths.py's decision on the code costs per call, against a decoding step
"""

import copy
import ctypes
import functools
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import threading
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import dape_torch
from common import code_version, cpu_name, machine_text
from results import format_table, measured
from configurator import config_defaults, configure
from dape import DAPEV1, DAPEV2
from model import GPT, GPTConfig, KVCache
from positional import ENCODINGS, as_map

# -----------------------------------------------------------------------------
# config (nanoGPT style: these globals are the defaults, overridden by config files and --key=value)
sections = "train,module,eval,gpu"  # also: timing (Table 1), fit (the fused kernel compiled for each GPU),
# decide (what dape_paths.py's decision on the code costs per call, against a decoding step)
quick = False  # a tiny model and few repeats: the whole run in under a minute
size = "demo"  # demo (config/demo_cpu.py, what demo.sh trains), char (config/gutenberg_char_cpu.py), tiny, 125m
n_layer = None  # None: from size
n_head = None
n_embd = None
block_size = None  # training length of the train section
batch_size = None
vocab_size = 256
pos = "nope,rope,t5,alibi,kerple,fire"  # train section: encodings (each with every dape)
ref_pos = "rope"  # train section: the encoding each step is also compared with ('vs ref'), with the same dape
dape = "none,v1,v2"
attn = "softmax"  # train section: attention variants (ATTN_VARIANTS), each with every pos x dape
dape_width = 32
dape_kernel = 3
repeats = 10  # measured rounds
warmup = 3  # unmeasured rounds first
module_lengths = "512,2048"
module_batch = 1
module_modes = "causal,full"
module_repeats = 5
eval_pos = "kerple"
eval_dape = "none,v1,v2"
eval_lengths = "2048,8192"
eval_repeats = 2
eval_unblocked_max_gb = 4.0  # skip the unblocked evaluation when its attention maps would exceed this
gpu_size = "125m"
# pos[+dape[:impl]][/attn]: +v1 is dape_impl auto (the fused kernel on CUDA), +v1:torch whole maps, /attn one
# of ATTN_VARIANTS (softmax if none); the first is the reference of the ratios, and its encoding the one the
# kernel's targets are read for
gpu_models = "kerple,kerple+v1,kerple+v1:torch,kerple+v2,kerple+v2:torch,fox,fox+v1,path,kerple/stickbreaking"
gpu_shapes = "512x8,512x32,1024x16,1024x32"  # T x batch
gpu_compile = "eager,compiled"  # which of the two to time (the fused kernel runs eager only)
gpu_eval_lengths = "2048,8192"
gpu_deadline = 0  # seconds: models not reached by then are reported as such (0: no limit)
gpu_compile_on_cpu = False
timing_methods = "kerple,rope,t5,alibi,fire,dape-kerple,dapev2-kerple"  # the first is the ratios' reference
timing_lengths = "512,1024,2048"
timing_n_layer = 24  # the paper's 350M: 24 x 16 x 1024
timing_n_head = 16
timing_n_embd = 1024
timing_batch_size = 1
timing_backward = True  # forward + backward (a training step without the optimizer); False: forward only
timing_dtype = "bfloat16"  # autocast on the GPU
timing_repeats = 5
fit_archs = "80,86,89,90"  # compute capabilities the fused kernel is compiled for (sm_80: A100, ... sm_90: H100)
fit_dtypes = "bfloat16,float16,float32"
fit_out = "docs/results/kernel_fit.json"  # the table the fit test reads; entries of the same kernels are reused
fit_jobs = 1  # compiler processes at once (one per CPU core)
decide_context = 512  # decide section: the cached tokens of the decoding step
tables_from = ""  # an --out file (docs/benchmark.md's tables) or a fit file (docs/gpu.md's): print them, run nothing
threads = 0  # torch.set_num_threads; 0: PyTorch's default
seed = 0
out = "results/bench.json"

# attention variants (--attn, /attn in --gpu_models): GPTConfig's options against softmax attention
ATTN_VARIANTS = {
    "softmax": {},
    "stickbreaking": dict(attn="stickbreaking"),
    "stickbreaking_current": dict(attn="stickbreaking", sb_current=True),
    "logn": dict(logn_scale="learned"),
    "stickbreaking_logn": dict(attn="stickbreaking", logn_scale="learned"),
}
SIZES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=4),
    "125m": dict(n_layer=12, n_head=12, n_embd=768, block_size=512, batch_size=8),
}
# sizes taken from train.py config files: their model and batch settings
CONFIG_SIZES = {"demo": "demo_cpu.py", "char": "gutenberg_char_cpu.py"}
SIZE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size")
QUICK = dict(size="tiny", pos="alibi,kerple", repeats=3, warmup=1, module_lengths="128", module_repeats=2,
             eval_lengths="256,512", eval_repeats=1, gpu_size="tiny", timing_n_layer=2, timing_n_head=4,
             timing_n_embd=64, timing_lengths="64,128", timing_repeats=2)


def model_size(name, cfg=None):
    """n_layer, n_head, n_embd, block_size, batch_size of a named size, then the explicit overrides."""
    if name in CONFIG_SIZES:
        found = {}
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", CONFIG_SIZES[name])
        exec(open(path).read(), {"__file__": path}, found)  # __file__, as configurator.py gives it
        sz = {k: found[k] for k in SIZE_KEYS}
    elif name in SIZES:
        sz = SIZES[name]
    else:
        raise ValueError(f"size={name!r}: choose {', '.join(list(CONFIG_SIZES) + list(SIZES))}")
    return {k: v if cfg is None or cfg.get(k) is None else cfg[k] for k, v in sz.items()}


# -----------------------------------------------------------------------------
# measuring


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(fn, device):
    """Run fn() once; return (peak bytes above the start, total peak bytes) (docs/benchmark.md says how)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return peak - start, peak
    if not os.path.exists("/proc/self/statm"):  # not Linux, no way to sample: the high-water mark alone
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        fn()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, after - before), after
    start = rss_bytes()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    seen, done = [start], threading.Event()

    def sample():
        while not done.is_set():
            seen[0] = max(seen[0], rss_bytes())
            time.sleep(0.0005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    peak = max(seen[0], rss_bytes())
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if maxrss > maxrss_before:  # the call set a new high-water mark: the kernel's exact figure
        peak = max(peak, maxrss)
    return peak - start, peak


MEMORY_JOBS = []  # (fn, store): peak-memory measurements, made after all timings (run_memory_jobs)


def return_freed_memory_to_os():
    """Ask glibc to map every block of 64 KB or more on its own and unmap it when freed, and to trim
    the heap's free top beyond 128 KB, so that the RSS follows the live memory. False where not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024) and libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024))
    except (OSError, AttributeError):
        return False


def run_memory_jobs():
    released = return_freed_memory_to_os()
    for fn, store in MEMORY_JOBS:
        peaks = []
        for _ in range(2):  # the lower of two calls: the first can include one-time allocations
            gc.collect()
            if released:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            peaks.append(peak_memory(fn, "cpu"))
        store(*min(peaks))
    MEMORY_JOBS.clear()
    return released


def interleaved(fns, rounds, warm, device="cpu"):
    """Time each of fns (name -> callable) once per round, in turn; returns name -> list of seconds
    of the measured rounds."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    times = {name: [] for name in fns}
    for r in range(warm + rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= warm:
                times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(ts, base):
    return statistics.median(t / b for t, b in zip(ts, base))


def mb(x):
    return round(x / 2 ** 20, 1)


def table(title, rows, cols):
    """Print rows (dicts) under a title as an aligned table of the given columns."""
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    print(f"\n{title}")
    print(format_table(cols, [[fmt(r.get(c, "")) for c in cols] for r in rows]) if rows else "  (nothing)")


# -----------------------------------------------------------------------------
# plain attention baselines: the same model with its attention replaced


def plain_attend_block(self, q, k, v, pe, future, dropout_p, scores, qi=None, sdpa=False):
    """nanoGPT's attention with the encoding's bias added: what a PE without DAPE must not be slower
    than. (Additive encodings only; no DAPE; softmax; causal. qi: the queries' indices, unused.)"""
    bias = as_map(scores(logits=False)[1])
    if sdpa:
        mask = torch.zeros(future.shape, device=q.device) if bias is None else bias
        mask = mask.masked_fill(future, float("-inf")).to(q.dtype)[None]  # 4-D, as model.py gives it
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    if bias is not None:
        att = att + bias
    att = att.masked_fill(future, float("-inf"))
    att = F.softmax(att, dim=-1)
    return att @ v


def make_plain(model, sdpa):
    for block in model.transformer.h:
        block.attn.attend_block = types.MethodType(
            lambda self, *a, _sdpa=sdpa: plain_attend_block(self, *a, sdpa=_sdpa), block.attn)
    return model


def module_call(mod, A, bias, future, mode, fast=False):
    """What the module computes in each mode: causal -> softmax(masked logits), full -> logits; fast:
    through dape_torch.py rather than dape.py's plain form."""
    residual_f = functools.partial(dape_torch.residual_f, mod) if fast else None
    if mode == "full":  # as in a bidirectional encoder: no mask, nothing zeroed
        return mod(A, bias, None, residual_f=residual_f)
    return mod.probs(A, bias, future, residual_f)


# -----------------------------------------------------------------------------
# sections


# a reader's edits of dape.py, made to each built module as that edit of its __init__ would build it (dape_paths.py
# then runs f's own code): --dape=v1~silu, v2~deep
EDITS = {
    "silu": lambda m: m.mlp.__setitem__(1, nn.SiLU()) if hasattr(m, "mlp") else setattr(m, "act", nn.SiLU()),
    "deep": lambda m: m.mlp.insert(2, nn.Linear(m.width, m.width)).insert(3, nn.LeakyReLU(m.slope)) if hasattr(
        m, "mlp") else setattr(m, "act", nn.Sequential(m.act, nn.Conv2d(m.width, m.width, 1), nn.LeakyReLU(m.slope))),
}


def new_model(sz, cfg, pos_name, dape_name, device="cpu", attn_name="softmax", **kw):
    """dape_name: none, v1, v2, or v1:torch / v1:triton (and v2's) to force dape_impl, v1~silu (an edit of EDITS);
    attn_name: one of ATTN_VARIANTS."""
    dape_name, _, edit = dape_name.partition("~")
    dape_name, _, impl = dape_name.partition(":")
    gcfg = GPTConfig(block_size=sz["block_size"], vocab_size=cfg["vocab_size"], n_layer=sz["n_layer"],
                     n_head=sz["n_head"], n_embd=sz["n_embd"], dropout=0.0, pos=pos_name, dape=dape_name,
                     dape_width=cfg["dape_width"], dape_kernel=cfg["dape_kernel"], dape_impl=impl or "auto",
                     **ATTN_VARIANTS[attn_name], **kw)
    model = GPT(gcfg)
    if edit:
        for block in model.transformer.h:
            EDITS[edit](block.attn.dape)
    return model.to(device)


def random_batch(cfg, sz, device="cpu"):
    """Inputs and targets of the size's batch and length, drawn from --seed."""
    torch.manual_seed(cfg["seed"])
    return [torch.randint(0, cfg["vocab_size"], (sz["batch_size"], sz["block_size"]), device=device) for _ in range(2)]


def train_step(model, x, y, device="cpu", autocast_dtype=None, compile_model=False):
    """A training step of model on the batch x, y as a callable: forward (in autocast_dtype), backward, AdamW."""
    opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device)
    run = torch.compile(model) if compile_model else model

    def step():
        with torch.autocast(device_type=device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            _, loss = run(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def train_section(cfg, sz):
    pos_list, dape_list = cfg["pos"].split(","), cfg["dape"].split(",")
    attn_list = cfg["attn"].split(",")
    unknown = [a for a in attn_list if a not in ATTN_VARIANTS]
    if unknown:
        raise SystemExit(f"--attn: unknown {', '.join(unknown)}; choose from {', '.join(ATTN_VARIANTS)}")
    x, y = random_batch(cfg, sz)
    steps = {}  # (pos, dape, attn) -> step, for every pos x dape x attention variant, and the plain baselines
    for p in pos_list:
        for a in attn_list:
            for d in dape_list:
                steps[(p, d, a)] = train_step(new_model(sz, cfg, p, d, attn_name=a), x, y)
        PE = ENCODINGS[p]
        if not (PE.contextual or PE.needs_content or PE.reads_input):  # baselines: positional bias or none
            for name, sdpa in (("plain-manual", False), ("plain-sdpa", True)):
                steps[(p, name, "softmax")] = train_step(make_plain(new_model(sz, cfg, p, "none"), sdpa), x, y)
    times = interleaved(steps, cfg["repeats"], cfg["warmup"])
    rows = []
    for (p, d, a), ts in times.items():
        base = times.get((p, "none", a))  # ratio: to the same encoding without DAPE, in the same rounds
        ref = times.get((cfg["ref_pos"], d, a))  # and to the reference encoding with the same DAPE
        soft = times.get((p, d, "softmax"))  # and to the same model with softmax attention
        rows.append(dict(pos=p, dape=d, attn=a, ms=1e3 * statistics.median(ts), ms_min=1e3 * min(ts),
                         ratio=paired_ratio(ts, base) if base else None,
                         vs_ref=paired_ratio(ts, ref) if ref and p != cfg["ref_pos"] else None,
                         vs_softmax=paired_ratio(ts, soft) if soft and a != "softmax" else None,
                         ms_all=[round(1e3 * t, 2) for t in ts]))
    variants = ["attn", "vs_softmax"] if attn_list != ["softmax"] else []
    table(f"train: step time, {sz} (vs_ref: against {cfg['ref_pos']})", rows,
          ["pos", "dape"] + variants[:1] + ["ms", "ms_min", "ratio", "vs_ref"] + variants[1:])
    return dict(size=sz, device="cpu", rows=rows, tokens_per_step=sz["batch_size"] * sz["block_size"])


def module_section(cfg, sz):
    H, D, k, Bn = sz["n_head"], cfg["dape_width"], cfg["dape_kernel"], cfg["module_batch"]
    rows = []
    for T in [int(t) for t in cfg["module_lengths"].split(",")]:
        for mode in cfg["module_modes"].split(","):
            for name in ("v1", "v2"):
                torch.manual_seed(cfg["seed"])
                ours = DAPEV1(H, D) if name == "v1" else DAPEV2(H, D, k)
                with torch.no_grad():  # move the weights off their init so that f matters
                    for prm in ours.parameters():
                        prm.add_(0.3 * torch.randn_like(prm))
                naive = copy.deepcopy(ours)  # dape.py's plain form, as Appendix J writes it
                A0, B0 = torch.randn(Bn, H, T, T), torch.randn(H, T, T)
                fut = torch.ones(T, T, dtype=torch.bool).triu(1) if mode == "causal" else None
                G = torch.randn(Bn, H, T, T)

                def run(mod, A0=A0, B0=B0, G=G, fut=fut, mode=mode, ours=ours, dtype=torch.float32):  # (bound now:
                    # memory is measured after the loop, when the name ours is the last module's)
                    A, B_ = A0.to(dtype, copy=True).requires_grad_(), B0.to(dtype, copy=True).requires_grad_()
                    mod.zero_grad(set_to_none=True)
                    outp = module_call(mod, A, B_, fut, mode, fast=mod is ours)
                    outp.backward(G.to(dtype))
                    return [outp.detach(), A.grad, B_.grad] + [p.grad for p in mod.parameters()]
                # equal outputs and gradients, all of them, checked against the naive module in float64:
                # float32 itself is not the reference (PyTorch's conv backward on the CPU loses ~1e-2
                # relative at T = 1024, while ours stays ~1e-6)
                truth = run(copy.deepcopy(naive).double(), dtype=torch.float64)
                top = max(t.abs().max().item() for t in truth)
                # each tensor's error relative to its own largest value, floored at 1e-2 of the largest of
                # all: the output bias's gradient is zero in truth (a softmax is blind to a constant added
                # to a row), and float32 leaves it at ~2e-7 of the largest, the naive module's as ours
                # (over 1e-4 of a 1e-3 floor); a wrong tensor is off by ~100%
                scale = [max(t.abs().max().item(), 1e-2 * top) for t in truth]
                def errors(got):  # per tensor: the largest error, and the fraction of elements off by > 1e-4
                    out = []
                    for g, t, sc in zip(got, truth, scale):
                        e = (g.double() - t).abs() / sc
                        out.append((e.max().item(), (e > 1e-4).double().mean().item()))
                    return out
                errs, naive_errs = errors(run(ours)), errors(run(naive))
                # equal, tensor by tensor: within 1e-4 except at a 1e-5 fraction of elements at most (a
                # LeakyReLU input within rounding of 0 can take the other slope in float32: a few pairs
                # of a 2048^2 map), or no further from float64 than the naive module in float32 (x2)
                equal = all(frac <= 1e-5 or e <= 2 * n for (e, frac), (n, _) in zip(errs, naive_errs))
                err, naive_err = max(e for e, _ in errs), max(n for n, _ in naive_errs)
                mismatch = max(f for _, f in errs)
                truth = None  # (frees the float64 copy before timing)
                times = interleaved({"naive": lambda: run(naive), "ours": lambda: run(ours)},
                                    cfg["module_repeats"], 1)
                row = dict(module=name, mode=mode, T=T, batch=Bn, naive_ms=1e3 * statistics.median(times["naive"]),
                           ours_ms=1e3 * statistics.median(times["ours"]),
                           speedup=paired_ratio(times["naive"], times["ours"]), equal=bool(equal), max_rel_err=err,
                           naive_max_rel_err=naive_err, mismatch_frac=mismatch)
                rows.append(row)

                def store_naive(extra, total, row=row):  # (the jobs run in turn: the naive module's first)
                    row.update(naive_mb=mb(extra), naive_bytes=extra)

                def store_ours(extra, total, row=row):
                    row.update(ours_mb=mb(extra), mem_ratio=extra / max(row.pop("naive_bytes"), 1))
                MEMORY_JOBS.append((functools.partial(run, naive), store_naive))
                MEMORY_JOBS.append((functools.partial(run, ours), store_ours))
    return dict(n_head=H, width=D, kernel=k, rows=rows)


def decide_section(cfg, sz):
    """dape_paths.code_differs once decided (what each DAPE layer pays at every call to learn that its code is
    still what the fast paths implement), against a decoding step of the size's model with DAPE V1 on
    Kerple: one token after decide_context cached ones, on the CPU."""
    import dape_paths
    torch.manual_seed(cfg["seed"])
    model = new_model(sz, cfg, "kerple", "v1").eval()
    module = model.transformer.h[0].attn.dape
    dape_paths.code_differs(module)
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        dape_paths.code_differs(module)
    per_call = (time.perf_counter() - t) / n
    x = torch.randint(0, cfg["vocab_size"], (1, cfg["decide_context"] + 1))
    steps = []
    with torch.no_grad():
        for _ in range(cfg["warmup"] + cfg["repeats"]):
            cache = KVCache(sz["n_layer"])
            model(x[:, :-1], cache=cache)
            t = time.perf_counter()
            model(x[:, -1:], cache=cache)
            steps.append(time.perf_counter() - t)
    step = statistics.median(steps[cfg["warmup"]:])
    res = dict(per_call_us=per_call * 1e6, step_ms=step * 1e3, n_layer=sz["n_layer"],
               share=per_call * sz["n_layer"] / step, context=cfg["decide_context"])
    print(f"decide: a decision already made costs {res['per_call_us']:.1f} us per layer and call; a decoding step "
          f"after {res['context']} tokens takes {res['step_ms']:.2f} ms, of which the {res['n_layer']} layers' "
          f"decisions are {100 * res['share']:.2f}%")
    return res


def eval_section(cfg, sz):
    rows = []
    for T in [int(t) for t in cfg["eval_lengths"].split(",")]:
        for d in cfg["eval_dape"].split(","):
            torch.manual_seed(cfg["seed"])
            model = new_model(sz, cfg, cfg["eval_pos"], d).eval()
            x = torch.randint(0, cfg["vocab_size"], (1, T + 1))
            # the unblocked attention holds A, B, logits and probabilities of one layer: 4 [H, T, T] float32 maps
            # (DAPE's whole-map path also its hidden map; the tiled CPU path, which this section runs, does not)
            unblocked_gb = T * T * 4 * 4 * sz["n_head"] / 2 ** 30
            for blocked in (True, False):
                row = dict(pos=cfg["eval_pos"], dape=d, T=T, blocked=blocked)
                if not blocked and unblocked_gb > cfg["eval_unblocked_max_gb"]:
                    rows.append(dict(row, skipped=f"unblocked maps ~{unblocked_gb:.1f} GB > eval_unblocked_max_gb"))
                    continue

                def run(model=model, x=x, T=T, chunk=0 if blocked else T):  # (the chunk set at each call:
                    # memory is measured after the loop, when the other row has set its own)
                    for blk in model.transformer.h:
                        blk.attn.attn_chunk = chunk
                    with torch.no_grad():
                        model(x[:, :-1], x[:, 1:], last=min(256, T))
                ts = interleaved({"eval": run}, cfg["eval_repeats"], 1)["eval"]
                t = statistics.median(ts)
                row.update(ms=1e3 * t, us_per_token=1e6 * t / T)
                rows.append(row)

                def store(extra, total, row=row):
                    row.update(peak_mb=mb(extra), rss_peak_mb=mb(total))
                MEMORY_JOBS.append((run, store))
    return dict(size=sz, rows=rows)


def models_of(cfg):
    """--gpu_models as (name, pos, dape, attn): 'kerple' (no DAPE), 'kerple+v1' (dape_impl auto: the fused kernel
    on CUDA), 'kerple+v1:torch' (whole maps), 'kerple/stickbreaking' (an attention variant of ATTN_VARIANTS);
    the first is the reference of every ratio."""
    out = []
    for name in cfg["gpu_models"].split(","):
        model, _, attn_name = name.partition("/")
        pos_name, _, dape_name = model.partition("+")
        if pos_name not in ENCODINGS or dape_name.partition(":")[0] not in ("", "v1", "v2") or \
                (attn_name or "softmax") not in ATTN_VARIANTS:
            raise SystemExit(f"--gpu_models: {name!r} is not <encoding>[+v1|+v2[:torch|:triton]][/attention] "
                             f"(encodings: {', '.join(ENCODINGS)}; attention: {', '.join(ATTN_VARIANTS)})")
        out.append((name, pos_name, dape_name or "none", attn_name or "softmax"))
    return out


def gpu_section(cfg):
    """Training steps in bf16 autocast at each T x batch of --gpu_shapes for each model of --gpu_models, eager
    and (--gpu_compile) compiled: each model's steps interleaved with the first model's, whose ratio is the
    median of the paired rounds; the ratio to the same encoding without DAPE (from the medians); peak memory
    of a step; a model that does not fit is reported as out of memory. Then the evaluation forward, batch 1, at
    each of --gpu_eval_lengths. A model not reached by --gpu_deadline (seconds) is reported as such.
    Without CUDA: the same models and steps on the tiny size (the PyTorch path, compile off unless
    --gpu_compile_on_cpu) and evaluation at 2 and 4 times its length, so that every step is exercised."""
    t0 = time.time()
    models = models_of(cfg)
    if torch.cuda.is_available():
        device, sz = "cuda", model_size(cfg["gpu_size"], None)
        compiles = [c == "compiled" for c in cfg["gpu_compile"].split(",")]
        shapes = [tuple(int(v) for v in s.split("x")) for s in cfg["gpu_shapes"].split(",")]
        lengths = [int(t) for t in cfg["gpu_eval_lengths"].split(",")]
    else:
        device, sz = "cpu", model_size("tiny", None)
        compiles = [False, True] if cfg["gpu_compile_on_cpu"] else [False]
        shapes = [(sz["block_size"], sz["batch_size"])]
        lengths = [2 * sz["block_size"], 4 * sz["block_size"]]
    late = lambda: cfg["gpu_deadline"] and time.time() - t0 > cfg["gpu_deadline"]
    ref = models[0]
    rows = []
    for T, batch in shapes:
        shape = dict(sz, block_size=T, batch_size=batch)
        for compile_model in compiles:
            where = dict(T=T, batch=batch, compiled=compile_model)

            def step(pos_name, dape_name, attn_name):  # each model from the same seed, on the same batch
                x, y = random_batch(cfg, shape, device)
                model = new_model(shape, cfg, pos_name, dape_name, device, attn_name)
                return train_step(model, x, y, device, torch.bfloat16, compile_model)
            try:
                ref_step = step(*ref[1:])
            except torch.OutOfMemoryError:
                rows += [dict(where, model=m[0], skipped="out of memory") for m in models]
                torch.cuda.empty_cache()
                continue
            for name, pos_name, dape_name, attn_name in models:
                row = dict(where, model=name, pos=pos_name, dape=dape_name, attn=attn_name)
                rows.append(row)
                if late():
                    row["skipped"] = "past --gpu_deadline"
                    continue
                try:
                    fn = ref_step if name == ref[0] else step(pos_name, dape_name, attn_name)
                    ts = interleaved({"model": fn} if fn is ref_step else {"model": fn, "ref": ref_step},
                                     cfg["repeats"], cfg["warmup"], device)
                    ts.setdefault("ref", ts["model"])
                    if device == "cuda":  # compiled and allocated by now: the step alone
                        row["peak_mb"] = mb(peak_memory(fn, device)[1])
                    row.update(ms=1e3 * statistics.median(ts["model"]), ratio=paired_ratio(ts["model"], ts["ref"]))
                except torch.OutOfMemoryError:
                    row["skipped"] = "out of memory"
                fn = None
                torch.cuda.empty_cache()  # (nothing to do where CUDA never started)
            del ref_step
    for row in rows:  # to the same encoding (and attention) without DAPE, in the same place
        base = next((r for r in rows if r.get("dape") == "none" and r.get("pos") == row.get("pos") and "ms" in r
                     and r.get("attn") == row.get("attn")
                     and (r["T"], r["batch"], r["compiled"]) == (row["T"], row["batch"], row["compiled"])), None)
        if base is not None and "ms" in row:
            row["vs_base"] = row["ms"] / base["ms"]
    evals = []
    for T in lengths:
        for name, pos_name, dape_name, attn_name in models:
            row = dict(model=name, pos=pos_name, dape=dape_name, attn=attn_name, T=T)
            evals.append(row)
            if late():
                row["skipped"] = "past --gpu_deadline"
                continue
            torch.manual_seed(cfg["seed"])
            x = torch.randint(0, cfg["vocab_size"], (1, T + 1), device=device)
            try:
                model = new_model(sz, cfg, pos_name, dape_name, device, attn_name).eval()

                def run(model=model, x=x):
                    with torch.no_grad(), torch.autocast(device, torch.bfloat16):
                        model(x[:, :-1], x[:, 1:], last=256)
                ts = interleaved({"eval": run}, cfg["eval_repeats"], 1, device)["eval"]
                row.update(ms=1e3 * statistics.median(ts))
                if device == "cuda":
                    row["peak_mb"] = mb(peak_memory(run, device)[1])
            except torch.OutOfMemoryError:
                row["skipped"] = "out of memory"
            model = run = None
            torch.cuda.empty_cache()
    for row in evals:
        base = next((e for e in evals if e["model"] == ref[0] and e["T"] == row["T"] and "ms" in e), None)
        if base is not None and "ms" in row:
            row["ratio"] = row["ms"] / base["ms"]
    table(f"gpu section on {device}: evaluation forward, batch 1, bf16 (ratio: to {ref[0]})", evals,
          ["model", "T", "ms", "ratio", "peak_mb", "skipped"])
    table(f"gpu section on {device}: training steps, bf16 (ratio: to {ref[0]}, paired rounds; vs_base: to the "
          f"same encoding without DAPE)", rows, ["model", "T", "batch", "compiled", "ms", "ratio", "vs_base",
                                                 "peak_mb", "skipped"])
    res = dict(device=device, fallback=device != "cuda", size=sz, dtype="bfloat16", reference=ref[0], rows=rows,
               eval=evals, gpu=torch.cuda.get_device_name() if device == "cuda" else None,
               seconds=round(time.time() - t0, 1))
    res["verdicts"] = gpu_verdicts(res, cfg)
    return res


def gpu_verdicts(res, cfg):
    """The fused kernel's targets at 125M, bf16, eager (the kernel does not run under torch.compile), each
    'met', 'not met' or 'not measured' with the figure or the reason: a V1 / V2 training step of
    DAPE-<encoding> against the encoding's at T=512, batch 32; the peak memory of that V1 step; a step at
    T=1024, batch 32 within 80 GB; the evaluation forward at the longest of --gpu_eval_lengths. The encoding
    is the reference model's (the first of --gpu_models)."""
    import dape_paths
    longest = max(e["T"] for e in res["eval"]) if res["eval"] else None
    targets = [("DAPE V1 training step / without DAPE, T=512 batch 32", "v1", 1.15),
               ("DAPE V2 training step / without DAPE, T=512 batch 32", "v2", 1.3),
               ("DAPE V1 peak memory of a step / without DAPE, T=512 batch 32", "mem", 1.2),
               # 80 GB as the card is sold, 80e9 bytes: an 80 GB H100 reports about 79.2 GiB to CUDA
               ("DAPE V1 training step at T=1024, batch 32, within 80 GB", "fit", 80e9 / 2 ** 20),
               (f"DAPE V1 evaluation at {longest} tokens / without DAPE", "eval", 1.5)]
    pos = next(r["pos"] for r in res["rows"] + res["eval"] if r.get("pos"))
    if res["device"] != "cuda":
        return [dict(target=t, verdict="not measured", why="no CUDA GPU") for t, _, _ in targets]
    failed = [v for v in dape_paths.VERDICTS.values() if v is not None]
    if failed:
        why = f"the fused kernel failed its check against dape.py here ({failed[0]})"
        return [dict(target=t, verdict="not measured", why=why) for t, _, _ in targets]
    eager = [r for r in res["rows"] if not r.get("compiled") and r.get("attn", "softmax") == "softmax"]
    step = {(r["dape"], r["T"], r["batch"]): r for r in eager if r.get("pos") == pos and "ms" in r}
    out_of_memory = {(r["T"], r["batch"]) for r in eager if r.get("pos") == pos and r.get("dape") == "v1"
                     and r.get("skipped") == "out of memory"}
    evals = {e["dape"]: e["ms"] for e in res["eval"] if e.get("pos") == pos and e["T"] == longest and "ms" in e
             and e.get("attn", "softmax") == "softmax"}
    gpu_mb = torch.cuda.get_device_properties(0).total_memory / 2 ** 20

    def at_512(dape, key):  # DAPE's step at T=512, batch 32 against the encoding's own
        row, base = step.get((dape, 512, 32)), step.get(("none", 512, 32))
        return None if row is None or base is None else row.get(key, 0) / max(base.get(key, 0), 1e-9)
    values = dict(v1=at_512("v1", "ms"), v2=at_512("v2", "ms"), mem=at_512("v1", "peak_mb"),
                  fit=step.get(("v1", 1024, 32), {}).get("peak_mb"),
                  eval=evals["v1"] / evals["none"] if "v1" in evals and "none" in evals else None)
    out = []
    for target, what, limit in targets:
        value = values[what]
        if what == "fit" and (1024, 32) in out_of_memory:
            value = float("inf") if gpu_mb >= limit else None
        if value is None:
            out.append(dict(target=target, verdict="not measured",
                            why="not in this run's --gpu_shapes / --gpu_models" if what != "fit" or gpu_mb >= limit
                            else f"this GPU has {gpu_mb * 2 ** 20 / 1e9:.0f} GB"))
        else:
            shown = (("out of memory" if value == float("inf") else f"{value * 2 ** 20 / 1e9:.1f} GB") if what == "fit"
                     else f"{value:.2f}")
            out.append(dict(target=target, verdict="met" if value <= limit else "not met", value=value, shown=shown))
    return out


def timing_section(cfg):
    """The paper's Table 1: time of a forward (or, with --timing_backward, forward + backward) of a
    fresh model for each method at each length, batch --timing_batch_size, in --timing_dtype autocast
    on the GPU (float32 on the CPU), and each method's total over the lengths as a ratio to the first.
    Methods: an encoding (kerple), dape-X (DAPE V1 on X) or dapev2-X."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, cfg["timing_dtype"]) if device == "cuda" else None
    lengths = [int(t) for t in cfg["timing_lengths"].split(",")]
    sz = dict(n_layer=cfg["timing_n_layer"], n_head=cfg["timing_n_head"], n_embd=cfg["timing_n_embd"],
              block_size=max(lengths), batch_size=cfg["timing_batch_size"])
    methods = cfg["timing_methods"].split(",")
    fns = {}
    for name in methods:
        prefix, _, pos_name = name.rpartition("-")
        dape_name = {"": "none", "dape": "v1", "dapev2": "v2"}.get(prefix)
        if dape_name is None:
            raise SystemExit(f"timing_methods: {name!r} is not an encoding, dape-<encoding> or dapev2-<encoding>")
        torch.manual_seed(cfg["seed"])
        model = new_model(sz, cfg, pos_name, dape_name, device).train(cfg["timing_backward"])
        for T in lengths:
            x = torch.randint(0, cfg["vocab_size"], (sz["batch_size"], T), device=device)

            def run(model=model, x=x):
                with torch.autocast(device, dtype or torch.float32, enabled=dtype is not None):
                    if not cfg["timing_backward"]:
                        with torch.no_grad():
                            return model(x, x)
                    _, loss = model(x, x)
                loss.backward()
                model.zero_grad(set_to_none=True)
            fns[(name, T)] = run
    times = interleaved(fns, cfg["timing_repeats"], cfg["warmup"], device)
    total = {m: sum(statistics.median(times[(m, T)]) for T in lengths) for m in methods}
    rows = [{"method": m, **{f"{T}_ms": 1e3 * statistics.median(times[(m, T)]) for T in lengths},
             "total_ms": 1e3 * total[m], "ratio": total[m] / total[methods[0]]} for m in methods]
    table(f"timing (Table 1): {'forward + backward' if cfg['timing_backward'] else 'forward'}, {sz}, "
          f"{device}{' ' + cfg['timing_dtype'] if dtype else ''}; ratio to {methods[0]}",
          rows, ["method"] + [f"{T}_ms" for T in lengths] + ["total_ms", "ratio"])
    return dict(device=device, size=sz, rows=rows)


def config_head_shapes():
    """(heads, head size, f's width) -> the config files that train at that shape. Head sizes that are
    multiples of 16 and pad to the same power of two compile to the same kernels (the size is a runtime
    argument, specialized only by its divisibility by 16; tests/test_dape_triton.py checks 80 against 128):
    such shapes share the row of the largest."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config")
    found_shapes = {}
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            found = {}
            # __file__, as configurator.py gives it: a config may read the file beside it (config/passkey_cpu_2layer.py)
            exec(open(os.path.join(root, name)).read(), {"__file__": os.path.join(root, name)}, found)
            if "n_head" in found:
                H = found["n_head"]
                hs = found["n_embd"] // H
                found_shapes.setdefault((H, hs, found.get("dape_width", GPTConfig.dape_width)), []).append(name[:-3])
    shapes = {}
    for (H, hs, D), names in sorted(found_shapes.items()):
        same = [s for s in found_shapes if s[0] == H and s[2] == D and s[1] % 16 == 0 and hs % 16 == 0
                and max(16, 1 << (s[1] - 1).bit_length()) == max(16, 1 << (hs - 1).bit_length())]
        rep = max(same, key=lambda s: s[1]) if same else (H, hs, D)
        shapes.setdefault(rep, []).extend(n if (H, hs, D) == rep else f"{n} ({H}x{hs})" for n in names)
    return shapes


def fit_section(cfg):
    """Compile the fused kernels for every architecture x dtype x V1/V2 x bias x mask x config head shape;
    reuse the entries of --fit_out made from the same kernels (dape_triton.source_hash()); write it."""
    import dape_triton
    dape_triton._build()
    digest = dape_triton.source_hash()
    old = {}
    if os.path.exists(cfg["fit_out"]):
        with open(cfg["fit_out"]) as f:
            saved = json.load(f)
        if saved.get("source_hash") == digest:
            old = {fit_key(e): e for e in saved["entries"]}
    shapes = config_head_shapes()
    entries, todo, t0 = [], [], time.time()
    archs, dtypes = [int(a) for a in cfg["fit_archs"].split(",")], cfg["fit_dtypes"].split(",")
    grid = [(arch, dtype, shape, ks, bias, causal) for arch in archs for dtype in dtypes for shape in shapes
            for ks in (1, 3) for bias in (True, False) for causal in (True, False)]
    # FoX's bias as terms (formed on chip; causal only), in the 16-bit dtypes training uses
    grid += [(arch, dtype, shape, ks, "terms", True) for arch in archs for dtype in dtypes if dtype != "float32"
             for shape in shapes for ks in (1, 3)]
    for arch, dtype, (H, hs, D), ks, bias, causal in grid:
        e = dict(arch=arch, dtype=dtype, n_head=H, head_size=hs, width=D, kernel_size=ks, bias=bias, causal=causal)
        if fit_key(e) in old:
            entries.append(old[fit_key(e)])
        else:
            e["refused"] = dape_triton.refused(arch, getattr(torch, dtype), H, hs, D, ks)
            todo.append(e)
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing
    with ProcessPoolExecutor(cfg["fit_jobs"], mp_context=multiprocessing.get_context("spawn")) as pool:
        for i, (e, result) in enumerate(zip(todo, pool.map(compile_entry, todo))):
            entries.append(dict(e, **result))
            print(f"fit {i + 1}/{len(todo)} compiled ({len(entries)} of {len(grid)}): " + fit_line(entries[-1]),
                  flush=True)
            if (i + 1) % 8 == 0:  # written as it goes: an interrupted run resumes
                write_fit(cfg["fit_out"], digest, shapes, entries)
    saved = write_fit(cfg["fit_out"], digest, shapes, entries)
    print(f"\nfit: {len(entries)} combinations ({time.time() - t0:.0f} s), written to {cfg['fit_out']}; each cell: "
          f"shared memory per block, forward / backward; spill stores per thread, forward / backward\n")
    print(fit_tables(saved))
    return dict(source_hash=digest, entries=entries)


def compile_entry(e):
    import dape_triton
    return dape_triton.compile_for(e["arch"], getattr(torch, e["dtype"]), e["n_head"], e["head_size"], e["width"],
                                   e["kernel_size"], bias=e["bias"], causal=e["causal"])


def fit_key(e):
    return tuple(e[k] for k in ("arch", "dtype", "n_head", "head_size", "width", "kernel_size", "bias", "causal"))


def fit_line(e):
    f, b = e["forward"], e["backward"]
    return (f"sm_{e['arch']} {e['dtype']} {e['n_head']}x{e['head_size']} D={e['width']} k={e['kernel_size']} "
            f"{dict([(True, 'bias'), (False, 'no bias'), ('terms', 'FoX terms')])[e['bias']]} "
            f"{'causal' if e['causal'] else 'bidirectional'}: forward "
            f"{f['shared'] // 1024} KB {f['registers']} regs {f['spill_stores']} B spilled, backward "
            f"{b['shared'] // 1024} KB {b['registers']} regs {b['spill_stores']} B spilled"
            + (f" (refused: {e['refused']})" if e["refused"] else ""))


def write_fit(path, digest, shapes, entries):
    """Write the fit file (what tests/test_dape_triton.py and docs/gpu.md's tables read); returns what it holds."""
    import dape_triton
    import triton
    fit = dict(source_hash=digest, triton=triton.__version__, shared_kb=dape_triton.SHARED_KB,
               shapes={f"{H}x{hs} D={D}": names for (H, hs, D), names in shapes.items()}, entries=entries,
               command="python bench.py --sections=fit")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(fit, f, indent=0)
    os.replace(path + ".tmp", path)
    return fit


def fit_markdown(entries, shapes, dtypes="16-bit"):
    """docs/gpu.md's table for the 16-bit dtypes (float16 and bfloat16) or for float32: a row per config
    head shape and V1 / V2, a column per architecture; each cell the largest figures over the dtypes, a
    bias map, FoX's terms or none, causal or not: shared memory per block forward / backward, then ptxas'
    spill stores per thread forward / backward; 'refused' where dape_triton refuses the combination
    (the PyTorch path runs), '**no**' where a kernel does not fit and is not refused. Registers per
    thread in a line below."""
    import dape_triton
    cells, regs = {}, set()
    for e in entries:
        if (e["dtype"] == "float32") != (dtypes == "float32"):
            continue
        c = cells.setdefault((e["n_head"], e["head_size"], e["width"], e["kernel_size"]), {}).setdefault(
            e["arch"], dict(shared=[0, 0], spill=[0, 0], refused=False))
        for i, k in enumerate(("forward", "backward")):
            c["shared"][i] = max(c["shared"][i], e[k]["shared"])
            c["spill"][i] = max(c["spill"][i], e[k]["spill_stores"])
            regs.add(e[k]["registers"])
        c["refused"] |= bool(e["refused"])
    archs = sorted({a for row in cells.values() for a in row})
    out = ["| heads x size, D (configs) | f | " + " | ".join(f"sm_{a} ({dape_triton.SHARED_KB[a]} KB)" for a in archs)
           + " |", "| --- | --- |" + " --- |" * len(archs)]
    for (H, hs, D, ks), row in sorted(cells.items()):
        texts = []
        for a in archs:
            c = row[a]
            fits = max(c["shared"]) <= dape_triton.SHARED_KB[a] * 1024
            texts.append(f"{c['shared'][0] / 1024:.0f} / {c['shared'][1] / 1024:.0f} KB, "
                         f"{c['spill'][0]} / {c['spill'][1]} B" + ("" if fits else " refused" if c["refused"]
                                                                  else " **no**"))
        out.append(f"| {H}x{hs}, {D} ({', '.join(shapes[(H, hs, D)])}) | {'V1' if ks == 1 else f'V2 k={ks}'} | "
                   + " | ".join(texts) + " |")
    if regs:
        out.append(f"\nRegisters per thread: {min(regs)}" + (f" to {max(regs)}" if len(regs) > 1 else "") + ".")
    return "\n".join(out)


def fit_tables(fit):
    """docs/gpu.md's fit tables (16-bit, then float32) from what the fit section wrote."""
    shapes = {}
    for key, names in fit["shapes"].items():  # "12x64 D=32"
        heads, width = key.split(" D=")
        shapes[tuple(int(v) for v in heads.split("x")) + (int(width),)] = names
    return "\n\n".join(f"{dtypes} (Triton {fit['triton']}):\n\n{fit_markdown(fit['entries'], shapes, dtypes)}"
                       for dtypes in ("16-bit", "float32"))


# -----------------------------------------------------------------------------
# docs/benchmark.md's tables from a file that main() wrote


def markdown(header, rows):
    return format_table(header, rows, markdown=True)


def bench_tables(res):
    """The Markdown of a bench.py run: where, when and how loaded, then a table per section it ran."""
    m = res["meta"]
    load0, load1 = m["loadavg_start"][0], m["loadavg_end"][0]
    out = [f"`{m.get('command', 'python bench.py')}`: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; "
           f"{m['started']}; load {load0:.1f} at the start, {load1:.1f} at the end; {m['seconds'] / 60:.1f} min."]
    if "train" in res:
        r0, ref = res["train"], m["config"]["ref_pos"]
        sz = r0["size"]
        variants = any(r.get("attn", "softmax") != "softmax" for r in r0["rows"])  # then a column each
        out += [f"Training step, {sz['n_layer']} layers x {sz['n_head']} heads x {sz['n_embd']}, length "
                f"{sz['block_size']}, batch {sz['batch_size']}, float32 on the {r0['device']} (milliseconds: median "
                f"and fastest of the rounds; x none: the median of the per-round ratios to the same encoding "
                f"without DAPE (plain-manual and plain-sdpa: that model with nanoGPT's attention, written out or "
                f"scaled_dot_product_attention, against it); x {ref}: to {ref} with the same DAPE"
                + ("; attn: the attention variant, x softmax: to the same model with softmax attention" if variants
                   else "") + "):",
                markdown(["pos", "dape"] + ["attn"] * variants + ["ms (min)", "x none", f"x {ref}"]
                         + ["x softmax"] * variants,
                         [[r["pos"], r["dape"]] + [r.get("attn", "softmax")] * variants
                          + [f"{r['ms']:.1f} ({r['ms_min']:.1f})", measured(r, "ratio", ".2f"),
                             measured(r, "vs_ref", ".2f")]
                          + [measured(r, "vs_softmax", ".2f")] * variants for r in r0["rows"]])]
    if "module" in res:
        r0 = res["module"]
        out += [f"DAPE alone, forward + backward, {r0['n_head']} heads, D = {r0['width']}, V2 k = {r0['kernel']}: "
                f"the fast path against dape.py's plain form on the same weights (speed-up: the median of "
                f"the per-round ratios; memory: the peak allocated beyond the inputs; equal: outputs and every "
                f"gradient within float32's error of a float64 run):",
                markdown(["f", "mask", "T", "ms, plain / fast", "speed-up", "MB, plain / fast", "memory ratio",
                          "equal"],
                         [[r["module"], r["mode"], str(r["T"]), f"{r['naive_ms']:.1f} / {r['ours_ms']:.1f}",
                           f"{r['speedup']:.1f}", f"{r['naive_mb']} / {r['ours_mb']}", f"{r['mem_ratio']:.2f}",
                           "yes" if r["equal"] else "**no**"] for r in r0["rows"]])]
    if "eval" in res:
        r0 = res["eval"]
        out += ["Evaluation forward, batch 1, loss on the last 256 tokens; blocked: queries in blocks, as the "
                "model evaluates by default (peak: memory allocated beyond the model):",
                markdown(["pos", "dape", "T", "blocked", "ms", "us per token", "peak MB"],
                         [[r["pos"], r["dape"], str(r["T"]), "yes" if r["blocked"] else "no", measured(r, "ms", ".0f"),
                           measured(r, "us_per_token", ".0f"), measured(r, "peak_mb", "")] for r in r0["rows"]])]
    if "decide" in res:
        r0 = res["decide"]
        out.append(f"Checking dape.py's code before a call: {r0['per_call_us']:.1f} us per layer, "
                   f"{100 * r0['share']:.2f}% of a decoding step after {r0['context']} tokens "
                   f"({r0['step_ms']:.2f} ms, {r0['n_layer']} layers).")
    if "timing" in res:
        r0 = res["timing"]
        lengths = [k[:-3] for k in r0["rows"][0] if k.endswith("_ms") and k != "total_ms"]
        out += [f"Table 1's timing on the {r0['device']}, {r0['size']['n_layer']} layers x {r0['size']['n_head']} "
                f"heads x {r0['size']['n_embd']}, batch {r0['size']['batch_size']} (ms; ratio: the total over the "
                f"lengths to the first method's):",
                markdown(["method"] + [f"T = {T}" for T in lengths] + ["ratio"],
                         [[r["method"]] + [f"{r[T + '_ms']:.0f}" for T in lengths] + [f"{r['ratio']:.2f}"]
                          for r in r0["rows"]])]
    if "gpu" in res:
        r0 = res["gpu"]
        out += [f"The gpu section on {r0['gpu'] or r0['device']}: training steps, bf16 autocast (x {r0['reference']}: "
                f"paired rounds; x base: the encoding without DAPE):",
                markdown(["model", "T x batch", "compiled", "ms", f"x {r0['reference']}", "x base", "peak MB"],
                         [[r["model"], f"{r['T']} x {r['batch']}", "yes" if r["compiled"] else "no",
                           measured(r, "ms", ".1f"), measured(r, "ratio", ".2f"), measured(r, "vs_base", ".2f"),
                           measured(r, "peak_mb", "")] for r in r0["rows"]])]
    return "\n\n".join(out)


def tables_of(path):
    """docs/benchmark.md's tables from a file main() wrote (--out), or docs/gpu.md's from a fit file."""
    if not os.path.isfile(path):
        raise SystemExit(f"--tables_from: no file {path} (python bench.py --out={path} writes one)")
    with open(path) as f:
        res = json.load(f)
    if "entries" in res:
        return fit_tables(res)
    if "meta" not in res:
        raise SystemExit(f"--tables_from: {path} is neither a bench.py --out file nor a fit file "
                         f"(python bench.py --sections=fit writes one)")
    return bench_tables(res)


# the sections, in the order they run: name -> (config, size) -> what the JSON file holds of it
SECTIONS = {"train": train_section, "module": module_section, "eval": eval_section,
            "gpu": lambda cfg, sz: gpu_section(cfg), "timing": lambda cfg, sz: timing_section(cfg),
            "fit": lambda cfg, sz: fit_section(cfg), "decide": decide_section}


def main(argv=None):
    cfg = configure(config_defaults(globals()), argv)
    if cfg["tables_from"]:
        text = tables_of(cfg["tables_from"])
        print(text)
        return text
    if cfg["quick"]:
        defaults = config_defaults(globals())
        for k, v in QUICK.items():
            if cfg[k] == defaults[k]:  # explicit settings win over --quick
                cfg[k] = v
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    sz = model_size(cfg["size"], cfg)
    wanted = cfg["sections"].split(",")
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}: choose from {', '.join(SECTIONS)}")
    command = " ".join(["python bench.py"] + list(sys.argv[1:] if argv is None else argv))  # as a page shows it
    res = dict(meta=dict(torch=torch.__version__, python=platform.python_version(), threads=torch.get_num_threads(),
                         cpu=cpu_name(), cuda=torch.cuda.is_available(), command=command,
                         loadavg_start=os.getloadavg(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                         config=cfg, size=sz, commit=code_version(), date=time.strftime("%Y-%m-%d"),
                         machine=machine_text("cuda" if torch.cuda.is_available() else "cpu")))
    print(f"bench: torch {torch.__version__}, {torch.get_num_threads()} threads, size {sz}, load {os.getloadavg()}")
    t0 = time.time()
    for name, section in SECTIONS.items():
        if name in wanted:
            res[name] = section(cfg, sz)
    res["meta"]["memory_returned_to_os"] = run_memory_jobs()
    if "module" in res:  # (the module and eval tables wait for the memory measurements)
        m = res["module"]
        table(f"module: DAPE alone, forward + backward, H={m['n_head']} D={m['width']} k={m['kernel']}", m["rows"],
              ["module", "mode", "T", "batch", "naive_ms", "ours_ms", "speedup", "naive_mb", "ours_mb", "mem_ratio",
               "equal"])
    if "eval" in res:
        table(f"eval: forward at long lengths, batch 1, {res['eval']['size']}", res["eval"]["rows"],
              ["pos", "dape", "T", "blocked", "ms", "us_per_token", "peak_mb", "rss_peak_mb", "skipped"])
    if "gpu" in res:  # last: one line per target of the fused kernel
        print("\nthe fused kernel's targets (bench.py --size=125m --sections=gpu):")
        for v in res["gpu"]["verdicts"]:
            print(f"  {v['target']}: {v['verdict']} ({v.get('shown') or v.get('why')})")
    res["meta"].update(loadavg_end=os.getloadavg(), seconds=round(time.time() - t0, 1))
    if cfg["out"]:
        os.makedirs(os.path.dirname(os.path.abspath(cfg["out"])), exist_ok=True)
        with open(cfg["out"], "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"\nwrote {cfg['out']} ({res['meta']['seconds']} s)")
    return res


if __name__ == "__main__":
    main()
