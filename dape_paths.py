"""
Which code computes DAPE attention, y = softmax(mask(A + B + f(A, B))) . v, and why it computes dape.py's.

    plain   dape.py's module exactly as written (the definition), in blocks of queries
    torch   dape_torch.py: the same function from the module's weights(), without the plain form's
            intermediate maps (CPU tiles; whole maps elsewhere), in blocks of queries
    triton  dape_triton.py: one fused kernel for all queries (CUDA; CPU tensors under TRITON_INTERPRET=1)

GPTConfig.dape_impl names one, or 'auto': triton on CUDA, torch elsewhere.

Decided by code: whether a fast path may run. They implement one version of dape.py, whose fingerprint
dape_torch.IMPLEMENTS records part by part (fingerprint.py): METHODS on the class and its bases, the
functions and constants of dape.py those read, the class attributes. At every call the module's code as
it is in memory now (a method replaced on the class, a swapped __code__, a global of dape.py) and its
structure (each layer's type, settings, parameters and hooks, an instance's own attributes among them,
against a module built afresh from the same arguments) are compared with it. Where anything differs, that
module runs the plain form with one warning naming what differs, and forcing a fast path on it is an
error; a comment or docstring edit changes nothing. The comparison is cached by the identity of what it
read, so a decision already made costs microseconds per layer and call (docs/gpu.md). The torch path has
no other check: tests/ prove it equal to the plain form.

Checked by numbers: the fused kernel alone, where a compiler can be wrong. At its first call of each kind
(_kernel_key: what Triton compiles a separate binary for, and which gradients are asked for) it runs
forward and backward on the call's own inputs, cut to a few sequences, queries and keys of the same Triton
class, against the plain form in float64: in float32, held to float32 rounding, and for a 16-bit call in
its dtype too, held to that dtype's rounding (so the loose tolerance never decides whether it computes f).
Its backward takes the incoming gradient contiguous, so the check runs the binaries the model runs. A
kernel that fails or disagrees there, or whose launch later raises, forward or backward, sends that kind
of call to the torch path with one warning naming the stage under 'auto', and is an error under 'triton'.
Under torch.distributed the ranks agree on the kernel's verdict for training calls (DDP and FSDP step in
lockstep); evaluation calls, which one rank may make alone, decide locally.
"""

import functools
import inspect
import itertools
import types
import warnings
import weakref

import torch
import torch.distributed as dist

import dape_check
import dape_torch
import fingerprint
from positional import Terms, as_map

IMPLS = ("auto", "plain", "torch", "triton")
METHODS = ("__init__", "forward", "probs", "_run", "residual_f", "f", "weights")  # what the fast paths copy
NAMES = {"torch": "the PyTorch path (dape_torch.py)", "plain": "the plain form (dape.py)"}
CODE = weakref.WeakKeyDictionary()  # module -> (what it was read from, None or what differs from IMPLEMENTS)
VERDICTS = {}  # kind of kernel call (_kernel_key) -> None (the kernel computes dape.py's function) or why not
# Where 'auto' tries the kernel: CUDA. (Under Triton's interpreter it also runs on CPU tensors, slowly: the
# tests add "cpu" here to check what auto does on a GPU.)
KERNEL_DEVICES = ("cuda",)
_warned = set()
dape_triton = None  # imported on first use: Triton is a CUDA-only dependency


def attention(module, q, k, v, scores, causal, q_offset, step, impl="auto", dropout_p=0.0, pe=None):
    """y [B, H, Tq, hs] of the queries q (rows q_offset.. of the sequence) against the keys k, v [B, H, Tk,
    hs], with DAPE's module (dape.py). scores(s, e, logits=True) gives query rows [s, e)'s logits A
    [B, H, R, Tk] float32 (None when not asked for) and the encoding's bias (None, a map, or Terms). step:
    queries per block on the blocked paths. pe: the encoding (positional.py)."""
    Tq = q.shape[2]
    path = _first_path(impl, q, module, dropout_p, pe)
    differs = code_differs(module) if path != "plain" else None
    if differs is not None:
        path = _step_down(differs, impl, path, "plain")
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
        path = _step_down(why_not, impl, "triton", "torch")
    residual_f = functools.partial(dape_torch.residual_f, module) if path == "torch" else None
    ys = []
    for s in range(0, Tq, step):
        e = min(s + step, Tq)
        A, bias = scores(s, e)
        qi = torch.arange(q_offset + s, q_offset + e, device=q.device)
        future = torch.arange(k.shape[2], device=q.device)[None, :] > qi[:, None] if causal else None
        probs = module.probs(A, as_map(bias), future, residual_f)
        if dropout_p:
            probs = torch.nn.functional.dropout(probs, dropout_p)
        ys.append(probs.to(v.dtype) @ v)
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)


def cannot(impl, device, dtype, n_head, head_size, width, kernel_size, encoding, dropout_p=0.0, compiling=False):
    """Why dape_impl=impl cannot run attention of these heads and f in dtype on device, with the encoding
    (a class of positional.py), or None: what train.py checks before it starts."""
    if impl != "triton":
        return None
    q = torch.empty(1, n_head, 1, head_size, dtype=dtype, device=device)
    return _kernel_unsupported(q, width, kernel_size, dropout_p, encoding, compiling)


def _first_path(impl, q, module, dropout_p, pe):
    """The path impl names, or for auto the kernel where it can run this call (saying once why not where a
    GPU could have run it) and the torch path elsewhere."""
    if impl in ("plain", "torch") or (impl == "auto" and q.device.type not in KERNEL_DEVICES):
        return "plain" if impl == "plain" else "torch"
    why = _kernel_unsupported(q, module.width, module.kernel, dropout_p, pe, torch.compiler.is_compiling())
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


def _kernel_unsupported(q, width, kernel_size, dropout_p, pe, compiling):
    global dape_triton
    if pe is not None and (pe.contextual or pe.needs_content):  # the kernel forms A = q.k and B alone
        name = pe.__name__ if isinstance(pe, type) else type(pe).__name__
        return f"{name}, whose logits depend on the content"
    if dropout_p:
        return "attention dropout in training"
    if compiling:
        return "torch.compile (the kernel runs in eager mode)"
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
        CODE[module] = seen = (fingerprint.watch(module, METHODS), _differs(module))
    return seen[1]


def _differs(module):
    cls = type(module)
    for name, print_ in fingerprint.definition(cls, METHODS).items():
        if dape_torch.IMPLEMENTS.get(name, "absent") != print_:
            return f"{name} is not the dape.py that the fast paths implement (edited?)"
    try:  # the module as its class builds it from the same arguments, on no memory
        with torch.device("meta"):
            fresh = cls(**{p: getattr(module, p) for p in list(inspect.signature(cls.__init__).parameters)[1:]})
    except Exception as e:
        return f"{cls.__qualname__} cannot be built afresh to compare with ({dape_check.describe(e)})"
    (got, hooks), (want, _) = fingerprint.structure(module), fingerprint.structure(fresh)
    if hooks:
        return "PyTorch's global module hooks are set (the fast paths do not call f's layers)"
    for g, w in itertools.zip_longest(got, want):
        if g != w:
            return f"f's layers differ from what dape.py builds: {_difference(g, w)}"
    return None


def _difference(got, want):
    """How a layer of fingerprint.structure() differs from what dape.py builds, in words."""
    if got is None or want is None or got[:2] != want[:2]:
        return f"{_layer(got)} where it builds {_layer(want)}"
    g, w = dict(got[2]), dict(want[2])
    what = [f"{k} = {g.get(k, 'nothing')} (dape.py: {w.get(k, 'nothing')})" for k in sorted(g.keys() | w.keys())
            if k not in g or k not in w or g[k] != w[k]]
    what += [f"parameters {dict(got[3])} (dape.py: {dict(want[3])})"] if got[3] != want[3] else []
    return f"{got[0] or 'the module'} has " + "; ".join(what + ["hooks"] * got[4])


def _layer(layer):
    return "nothing" if layer is None else f"{layer[0] or 'the module'}: {layer[1].__name__}"


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
    """None when the kernel may compute this kind of call, else why not (checked at its first call)."""
    if key not in VERDICTS:
        why = dape_check.check(module, q, k, v, bias, causal, q_offset)
        if torch.is_grad_enabled() and dist.is_available() and dist.is_initialized():
            failed = torch.tensor([float(why is not None)], device=q.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if why is None and failed.item():
                why = "the fused kernel failed its check on another rank"
        VERDICTS[key] = why
    return VERDICTS[key]


def _backward_on_torch(module, key, causal, q_offset, error, inputs, needs, dy):
    """The kernel's backward launch raised under auto: remember it, say so, and compute this call's gradients
    on the torch path from the kernel's own inputs (q, k, v, bias, u, w, w1, b1, w2, b2)."""
    VERDICTS[key] = f"the fused kernel's backward pass failed ({dape_check.describe(error)})"
    warn_once(f"DAPE: {VERDICTS[key]}: running {NAMES['torch']} for these calls")
    leaves = [None if t is None else t.detach().requires_grad_(n) for t, n in zip(inputs, needs)]
    x = {n: t.float() for n, t in zip(("q", "k", "v", "bias", "u", "w"), leaves) if t is not None}
    f = types.SimpleNamespace(weights=lambda: leaves[6:10], kernel=module.kernel, zero_future=module.zero_future,
                              slope=module.slope)
    with torch.enable_grad():
        y = dape_check.attend(module, x, causal, q_offset, functools.partial(dape_torch.residual_f, f))
        wrt = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, dy.float(), allow_unused=True))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in leaves) + (None,)
