"""
Which code computes DAPE attention, y = softmax(mask(A + B + f(A, B))) . v, and why it computes dape.py's.
(With stick-breaking or log-length scaling, model.py normalises the plain or torch path's masked logits.)

    plain   dape.py's own code as written, on blocks of query rows against the keys they see (own_code)
    torch   dape_torch.py: the same function from weights(), CPU tiles (whole maps elsewhere), blocked
    triton  dape_triton.py: one fused kernel for all queries (CUDA; CPU tensors under TRITON_INTERPRET=1)

GPTConfig.dape_impl names one, or 'auto': triton on CUDA, torch elsewhere, plain for an edited dape.py.

Decided by code: whether a fast path may run. They implement one version of dape.py, which
dape_torch.IMPLEMENTS records class by class (fingerprint.py): every attribute of the class and its bases,
and the globals their functions read, followed through dape.py. At every call the module's code as it is
in memory, its structure (each layer's type, settings, parameters and hooks, against a module built afresh
from the same arguments; PyTorch's hooks for every module) and what it and its layers' classes read from
libraries (by identity with what this file's import found) are compared with the record, both ways. Where
anything differs, that module runs the plain form with one warning naming it, and forcing a fast path on
it is an error; a comment or docstring edit, even made to the file after import, changes nothing. Not seen:
PyTorch below the names that dape.py and its layers' classes read (nn.Module's machinery, torch.Tensor's
methods, C++ operators, torch function or dispatch modes), a library's object replaced before this file is
imported by code from outside dape.py, closure cells rewritten. The comparison is cached by
the identity of what it read: microseconds per layer and call (docs/gpu.md). The torch path has no other
check: tests/ prove it equal to the plain form (in bfloat16 on the CPU, to rounding: dape_torch.py).

Checked by numbers: the fused kernel alone, where a compiler can be wrong. At its first call of each kind
(_kernel_key: its binary, and which gradients are asked for) it runs forward and backward on the call's
own inputs, cut small, against the plain form in float64, in float32 and in a 16-bit call's dtype too
(dape_check.py). A kernel that fails there, or whose launch later raises, sends that kind of call to the
torch path with one warning; one that disagrees, to the torch path only where that agrees on the same
inputs, else to the plain form (the cause: a change the record could not see, or the compiler). Forcing
the kernel, each is an error. Under torch.distributed the ranks agree on the verdict for training calls
(in lockstep); evaluation calls, which one rank may make alone, decide locally.
"""

import functools
import inspect
import itertools
import warnings
import weakref

import torch
import torch.distributed as dist

import dape
import dape_check
import dape_torch
import fingerprint
from positional import Terms, as_map

IMPLS = ("auto", "plain", "torch", "triton")
NAMES = {"torch": "the PyTorch path (dape_torch.py)", "plain": "the plain form (dape.py)"}
CODE = weakref.WeakKeyDictionary()  # module -> (what it was read from, None or what differs from IMPLEMENTS)
VERDICTS = {}  # kind of kernel call (_kernel_key) -> None (the kernel computes dape.py's function) or why not
BELOW = {}  # kind of kernel call that the kernel may not compute -> the path that does: "torch" or "plain"
with torch.device("meta"):  # what dape.py's classes and their layers read from libraries, found at import
    SEEN = {cls.__name__: fingerprint.library(cls(2)) for cls in (dape.DAPEV1, dape.DAPEV2)}
# Where 'auto' tries the kernel (the tests add "cpu", where Triton's interpreter runs it, as auto on a GPU)
KERNEL_DEVICES = ("cuda",)
_warned = set()
dape_triton = None  # imported on first use: Triton is a CUDA-only dependency


def attention(module, q, k, v, scores, causal, q_offset, step, impl="auto", dropout_p=0.0, pe=None,
              normalise=None):
    """y [B, H, Tq, hs] of the queries q (rows q_offset.. of the sequence) against the keys k, v [B, H, Tk,
    hs], with DAPE's module (dape.py). scores(s, e, logits=True) gives query rows [s, e)'s logits A
    [B, H, R, Tk] float32 (None when not asked for) and the encoding's bias (None, a map, or Terms). step:
    queries per block on the blocked paths. pe: the encoding (positional.py). normalise: None for softmax,
    or the caller's own normalisation as (what, fn): fn(logits, qi, future) gives the output of the queries
    at sequence indices qi from their masked logits (-inf where future) and applies the attention dropout
    itself; `what` names it where the fused kernel, which computes softmax only, is refused."""
    Tq = q.shape[2]
    what = None if normalise is None else normalise[0]
    path = _first_path(impl, q, module, dropout_p, pe, what)
    differs = code_differs(module) if path != "plain" else None
    path = path if differs is None else _step_down(differs, impl, path, "plain")
    if path == "triton":
        bias = scores(0, Tq, logits=False)[1]
        key = _kernel_key(module, q, k, v, bias, causal, q_offset)
        why_not = _trust_kernel(key, module, q, k, v, bias, causal, q_offset)
        if why_not is None:
            on_failure = None if impl == "triton" else functools.partial(_backward_on_torch, module, key, causal,
                                                                         q_offset)
            try:
                return dape_triton.attention(q, k, v, bias, *module.weights(), module.variant, causal,
                                             q_offset=q_offset, on_backward_failure=on_failure)
            except Exception as e:  # a launch the check did not foresee: the same as a failed check
                if impl == "triton":
                    raise
                why_not = VERDICTS[key] = f"the fused kernel failed ({dape_check.describe(e)})"
                BELOW[key] = "torch"
        path = _step_down(why_not, impl, "triton", BELOW.get(key, "torch"))
    residual_f = functools.partial(dape_torch.residual_f if path == "torch" else dape_torch.own_code, module)
    ys = []
    for s in range(0, Tq, step):
        e = min(s + step, Tq)
        A, bias = scores(s, e)
        qi = torch.arange(q_offset + s, q_offset + e, device=q.device)
        future = torch.arange(k.shape[2], device=q.device)[None, :] > qi[:, None] if causal else None
        if normalise is not None:
            ys.append(normalise[1](module(A, as_map(bias), future, mask_future=True, residual_f=residual_f), qi,
                                   future))
            continue
        probs = module.probs(A, as_map(bias), future, residual_f)
        ys.append((torch.nn.functional.dropout(probs, dropout_p) if dropout_p else probs).to(v.dtype) @ v)
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)


def cannot(impl, device, dtype, n_head, head_size, width, kernel_size, encoding, dropout_p=0.0, compiling=False,
           normalisation=None):
    """Why dape_impl=impl cannot run attention of these heads and f in dtype on device, with the encoding
    (a class of positional.py) and normalisation (model.normalisation's words; None: softmax), or None: what
    train.py checks before it starts."""
    if impl != "triton":
        return None
    q = torch.empty(1, n_head, 1, head_size, dtype=dtype, device=device)
    return _kernel_unsupported(q, width, kernel_size, dropout_p, encoding, compiling, normalisation)


def _first_path(impl, q, module, dropout_p, pe, normalisation=None):
    """The path impl names, or for auto the kernel where it can run this call (saying once why not where a
    GPU could have run it) and the torch path elsewhere."""
    if impl in ("plain", "torch") or (impl == "auto" and q.device.type not in KERNEL_DEVICES):
        return "plain" if impl == "plain" else "torch"
    why = _kernel_unsupported(q, module.width, module.kernel, dropout_p, pe, torch.compiler.is_compiling(),
                              normalisation)
    if why is None:
        return "triton"
    if impl == "triton":
        raise ValueError(f"dape_impl='triton' cannot run here: {why}; use dape_impl='auto', 'torch' or 'plain'")
    warn_once(f"DAPE's fused kernel does not cover {why}: using the PyTorch path (dape_torch.py)")
    return "torch"


def _step_down(why, impl, path, below):
    """`below` for the calls `path` cannot serve, saying why once; an error where impl forced `path`."""
    if impl == path:
        raise ValueError(f"dape_impl={impl!r} cannot run here: {why}; use dape_impl='auto' or 'plain'")
    warn_once(f"DAPE: {why}: running {NAMES[below]} for these calls")
    return below


def _kernel_unsupported(q, width, kernel_size, dropout_p, pe, compiling, normalisation=None):
    global dape_triton
    if pe is not None and (pe.contextual or pe.needs_content):  # the kernel forms A = q.k and B alone
        return f"{pe.__name__ if isinstance(pe, type) else type(pe).__name__}, whose logits depend on the content"
    if normalisation is not None:
        return f"{normalisation} (the kernel computes softmax(logits) only)"
    if dropout_p or compiling:
        return "attention dropout in training" if dropout_p else "torch.compile (the kernel runs in eager mode)"
    if dape_triton is None:
        try:
            import dape_triton
        except ImportError as e:
            return f"a machine without Triton ({e})"
    return dape_triton.unavailable(q, width, kernel_size)


def warn_once(message):
    """warnings.warn, once per message for the process (Python's own filter forgets under pytest)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


# ---------------------------------------------------------------------------------------------------------
# decided by code


@torch.compiler.disable  # reads Python objects, not tensors
def code_differs(module):
    """None when the module's code, as it is in memory now, is the dape.py that the fast paths implement
    (dape_torch.IMPLEMENTS); else what differs. Decided again only when something it read has changed."""
    seen = CODE.get(module)
    if seen is None or not fingerprint.unchanged(seen[0]):
        CODE[module] = seen = (fingerprint.watch(module), _differs(module))
    return seen[1]


def _differs(module):
    cls = type(module)
    record = next((k.__name__ for k in cls.__mro__ if k.__name__ in dape_torch.IMPLEMENTS), None)
    want, seen = dape_torch.IMPLEMENTS.get(record, {}), SEEN.get(record, {})
    try:
        got, live = fingerprint.definition([cls]), fingerprint.library(module)
    except ValueError as e:  # two parts under one key
        return str(e)
    name = next((n for n in sorted(got.keys() | want.keys(), key=str.lower) if got.get(n) != want.get(n)), None)
    if name is not None:  # both ways: a part deleted differs too
        return f"{name} is not the dape.py that the fast paths implement (edited?)"
    try:  # the module as its class builds it from the same arguments, on no memory
        with torch.device("meta"):
            fresh = cls(**{p: getattr(module, p) for p in list(inspect.signature(cls.__init__).parameters)[1:]})
    except Exception as e:
        return f"{cls.__qualname__} cannot be built afresh to compare with ({dape_check.describe(e)})"
    (got, hooks), (want, _) = fingerprint.structure(module), fingerprint.structure(fresh)
    if hooks:
        return "PyTorch's global module hooks are set (the fast paths do not call f's layers)"
    layer = next(((g, w) for g, w in itertools.zip_longest(got, want) if g != w), None)
    if layer is not None:
        return f"f's layers differ from what dape.py builds: {_difference(*layer)}"
    name = next((n for n in sorted(live.keys() | seen.keys(), key=lambda k: (k not in live or k not in seen, k))
                 if live.get(n) is not seen.get(n) or hasattr(live.get(n), "__wrapped__")), None)  # by identity
    return None if name is None else f"{name} is not what dape.py read when dape_paths.py was imported (patched?)"


def _difference(got, want):
    """How a layer of fingerprint.structure() differs from what dape.py builds, in words."""
    layer = lambda x: "nothing" if x is None else f"{x[0] or 'the module'}: {x[1].__name__}"
    if got is None or want is None or got[:2] != want[:2]:
        return f"{layer(got)} where it builds {layer(want)}"
    (g, w), say = (dict(got[2]), dict(want[2])), lambda v: f"a {type(v).__name__}" if callable(v) else v  # (once)
    what = [f"{k} = {say(g.get(k, 'nothing'))} (dape.py: {say(w.get(k, 'nothing'))})" for k in
            sorted(g.keys() | w.keys()) if k not in g or k not in w or g[k] != w[k]]
    what += [f"parameters {dict(got[3])} (dape.py: {dict(want[3])})"] if got[3] != want[3] else []
    return f"{got[0] or 'the module'} has " + "; ".join(what + ["hooks"] * got[4])


# ---------------------------------------------------------------------------------------------------------
# checked by numbers: the fused kernel


def _kernel_key(module, q, k, v, bias, causal, q_offset):
    """A kind of kernel call: its binary (dape_triton.binary), and which gradients its backward computes."""
    tensors = [q, k, v] + ([] if bias is None else list(bias) if isinstance(bias, Terms) else [bias])
    autocast = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else None
    return dape_triton.binary(q, k, v, bias, module.weights()[0], module.variant, causal, q_offset) + (
        autocast, torch.is_grad_enabled(), tuple(t.requires_grad for t in tensors),
        tuple(p.requires_grad for p in module.parameters()))


def _trust_kernel(key, module, q, k, v, bias, causal, q_offset):
    """None when the kernel may compute this kind of call, else why not and BELOW[key] what does instead."""
    if key not in VERDICTS:
        why, below = dape_check.check(module, q, k, v, bias, causal, q_offset)
        if torch.is_grad_enabled() and dist.is_available() and dist.is_initialized():
            worst = torch.tensor([0.0 if why is None else 1.0 + (below == "plain")], device=q.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the plain form where any rank needs it
            why = why or ("the fused kernel failed its check on another rank" if worst.item() else None)
            below = ("torch", "torch", "plain")[int(worst.item())]
        VERDICTS[key], BELOW[key] = why, below
    return VERDICTS[key]


def _backward_on_torch(module, key, causal, q_offset, error, inputs, needs, dy):
    """The kernel's backward launch raised under auto: remember it, say so, and compute this call's gradients
    on the torch path from the kernel's own inputs."""
    VERDICTS[key], BELOW[key] = f"the fused kernel's backward pass failed ({dape_check.describe(error)})", "torch"
    warn_once(f"DAPE: {VERDICTS[key]}: running {NAMES['torch']} for these calls")
    return dape_check.torch_path_gradients(module, inputs, needs, dy, causal, q_offset)
