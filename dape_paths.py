"""
Which code computes DAPE attention, y = softmax(mask(A + B + f(A, B))) . v, and why it can be trusted.

    plain   dape.py's module exactly as written (the definition), in blocks of queries
    torch   dape_torch.py: the same function from the module's weights(), without the plain form's
            intermediate maps (CPU tiles; whole maps elsewhere), in blocks of queries
    triton  dape_triton.py: one fused kernel for all queries (CUDA; CPU tensors under TRITON_INTERPRET=1)

GPTConfig.dape_impl names one, or 'auto': triton on CUDA, torch elsewhere. A forced path that cannot run
a call, or that disagrees with the plain form, is an error; under 'auto' such a call takes the next path
down (triton -> torch -> plain), saying why in one warning per kind of call.

The fast paths compute f from the module's weights(), not from its code, so a path is trusted for a kind
of call only once it has matched the plain form on it. At the first call of each kind (the module's class
and settings, which of its parameters train, device, dtype and autocast, training or not, the bias's form
and whether it needs a gradient, the mask, and for the kernel the lengths and strides Triton specializes
on) the path and the plain form run on the call's own tensors cut to a few sequences, queries and keys, the
plain form in float64 (no TF32 on any GPU), and the output and the gradient of every input and parameter
that requires one must agree. The torch path is held to float32 rounding, so any edit of f in dape.py shows
(both fast paths compute the same f, so it is checked first, on every device); the kernel to its dtype's
rounding. Under torch.distributed the ranks agree on the verdict for training calls (one all-reduce: DDP and
FSDP step in lockstep, and a rank that ran another path would leave the others waiting); evaluation calls,
which one rank may make alone, decide locally.
"""

import copy
import functools
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dape_torch
from positional import Terms, as_map

IMPLS = ("auto", "plain", "torch", "triton")
# How far a path's output and gradients may be from the float64 plain form: the root-mean-square of the
# difference as a fraction of the tensor's own (at least 1% of the largest of all), or 4 times the plain
# form's own float32 error, whichever is larger. The torch path in float32 agrees to rounding, but sums its
# parameters' gradients over tiles in another order than autograd does, and where the terms of such a sum
# cancel (b2's is zero in truth) its rounding can reach 1e-4 of the result; the kernel's float16 / bfloat16
# products round every operand, through two layers of f, the softmax and their gradients. A broken path, or
# an edited f (LeakyReLU's slope 0.01 -> 0.011 already moves the output by 5e-4 or more), is off by far more.
TOLERANCE = {"torch": {torch.float32: 1e-4, torch.float16: 0.1, torch.bfloat16: 0.2},
             "triton": {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.2}}
EDITED = "f in dape.py differs from the fast paths'"
NAMES = {"torch": "the PyTorch path (dape_torch.py)", "plain": "the plain form (dape.py)"}
CUT = dict(batch=2, rows=40)  # the check's inputs: sequences, and queries and keys kept of the call's
VERDICTS = {}  # kind of call -> None (the path computes dape.py's function) or why not
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
    if path == "triton":
        bias = scores(0, Tq, logits=False)[1]
        why_not = _trust("triton", module, q, k, v, bias, causal, q_offset)
        if why_not is None:
            try:
                return dape_triton.attention(q, k, v, bias, *module.weights(), module.variant, causal,
                                             q_offset=q_offset)
            except Exception as e:  # a launch the check did not foresee: the same as a failed check
                if impl == "triton":
                    raise
                why_not = VERDICTS[_key("triton", module, q, k, v, bias, causal, q_offset)] = \
                    f"the fused kernel failed ({_describe(e)})"
        path = _step_down(why_not, impl, "triton")
    ys = []
    for s in range(0, Tq, step):
        e = min(s + step, Tq)
        A, bias = scores(s, e)
        qi = torch.arange(q_offset + s, q_offset + e, device=q.device)
        future = torch.arange(k.shape[2], device=q.device)[None, :] > qi[:, None] if causal else None
        if path == "torch":
            why_not = _trust("torch", module, A, None, None, bias, causal, q_offset + s)
            if why_not is not None:
                path = _step_down(why_not, impl, "torch")
        probs = module.probs(A, as_map(bias), future, _torch_residual_f(module) if path == "torch" else None)
        if dropout_p:
            probs = F.dropout(probs, dropout_p)
        ys.append(probs.to(v.dtype) @ v)
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)


def _torch_residual_f(module):
    """dape_torch.py's residual_f for this module, which dape.py's variants then feed."""
    return functools.partial(dape_torch.residual_f, module)


def cannot(impl, device, dtype, n_head, head_size, width, kernel_size, encoding, dropout_p=0.0, compiling=False):
    """Why dape_impl=impl cannot run attention of these heads and f in dtype on device, with the encoding
    (a class of positional.py), or None: what train.py checks before it starts (the check against the plain
    form comes at the first call)."""
    if impl != "triton":
        return None
    q = torch.empty(1, n_head, 1, head_size, dtype=dtype, device=device)
    return _kernel_unsupported(q, width, kernel_size, dropout_p, encoding, compiling)


def _first_path(impl, q, module, dropout_p, pe):
    """The path to try first: the one impl names, or for auto the kernel where it can run this call (saying
    once why not where a GPU could have run it) and the torch path elsewhere."""
    if impl in ("plain", "torch") or (impl == "auto" and q.device.type not in KERNEL_DEVICES):
        return "plain" if impl == "plain" else "torch"
    why = _kernel_unsupported(q, module.width, module.kernel, dropout_p, pe, torch.compiler.is_compiling())
    if why is None:
        return "triton"
    if impl == "triton":
        raise ValueError(f"dape_impl='triton' cannot run here: {why}; use dape_impl='auto', 'torch' or 'plain'")
    warn_once(f"DAPE's fused kernel does not cover {why}: using the PyTorch path (dape_torch.py)")
    return "torch"


def _step_down(why, impl, path):
    """The path below `path` for the calls it cannot serve: an error where impl forced it, else one warning
    per cause. An edited f steps every fast path aside."""
    if impl == path:
        raise ValueError(f"dape_impl={impl!r} cannot run here: {why}; use dape_impl='auto' or 'plain'")
    below = "plain" if path == "torch" or why.startswith(EDITED) else "torch"
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
# the check


def _spec(n):
    """How Triton specializes an integer argument: its value when 1, divisible by 16, or neither."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def _key(path, module, q, k, v, bias, causal, q_offset):
    """What decides whether a path computes dape.py's function on a call like this one."""
    tensors = [q] + ([] if k is None else [k, v]) + ([] if bias is None else list(bias) if isinstance(bias, Terms)
                                                      else [bias])
    autocast = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else None
    form = None if bias is None else "terms" if isinstance(bias, Terms) else \
        "shared" if bias.dim() == 3 or bias.shape[0] == 1 else "per sequence"
    key = (path, repr(module), module.variant, tuple(p.requires_grad for p in module.parameters()), str(q.device), q.dtype, autocast,
           torch.is_grad_enabled(), form, tuple(t.requires_grad for t in tensors), causal)
    if path == "triton":  # what Triton compiles a separate binary for
        key += (q.shape[1], q.shape[3], _spec(q.shape[2]), _spec(k.shape[2]), _spec(q_offset),
                tuple(_spec(s) for t in tensors for s in t.stride()), tuple(t.data_ptr() % 16 for t in tensors))
    return key


def _trust(path, module, q, k, v, bias, causal, q_offset):
    """None when `path` may compute this call (for torch, q is the block's logits A), else why not."""
    key = _key(path, module, q, k, v, bias, causal, q_offset)
    if key not in VERDICTS:
        try:
            why = _check(path, module, q, k, v, bias, causal, q_offset)
        except Exception as e:  # whatever stops the path here stops it for every call of the kind
            why = f"{'the fused kernel' if path == 'triton' else 'dape_torch.py'} failed ({_describe(e)})"
        if torch.is_grad_enabled() and dist.is_available() and dist.is_initialized():
            failed = torch.tensor([float(why is not None)], device=q.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if why is None and failed.item():
                why = f"the {path} path failed its check on another rank"
        VERDICTS[key] = why
    return VERDICTS[key]


def _describe(e):
    text = str(e).strip()
    return type(e).__name__ + (f": {text.splitlines()[-1][:300]}" if text else "")


def _cut(n, offset=False):
    """A length of the same kind as n for Triton (1, a multiple of 16, or neither), at most CUT['rows']."""
    if n <= CUT["rows"] or (offset and n == 0):
        return n
    return 32 if n % 16 == 0 else 16 + n % 16


def _check(path, module, q, k, v, bias, causal, q_offset):
    """None, or how `path` differs from the plain form on the call's own inputs, cut small (for the torch
    path q is the block's logits A, and k and v are None)."""
    b, tq = min(q.shape[0], CUT["batch"]), _cut(q.shape[2])
    tk = _cut(q.shape[3] if k is None else k.shape[2])
    q_offset = _cut(q_offset, offset=True)
    if isinstance(bias, Terms):
        bias = Terms(bias.u[:b, :, :tq], bias.w[:b, :, :tk])
    elif bias is not None:
        bias = bias[..., :tq, :tk] if bias.dim() == 3 or bias.shape[0] == 1 else bias[:b, :, :tq, :tk]
    qi = torch.arange(q_offset, q_offset + tq, device=q.device)
    future = torch.arange(tk, device=q.device)[None, :] > qi[:, None] if causal else None
    train = torch.is_grad_enabled()
    leaf = lambda t: t.detach().requires_grad_(train and t.requires_grad)
    inputs = {"A": leaf(q[:b, :, :tq, :tk])} if k is None else \
        {"q": leaf(q[:b, :, :tq]), "k": leaf(k[:b, :, :tk]), "v": leaf(v[:b, :, :tk])}
    if isinstance(bias, Terms):
        inputs.update(u=leaf(bias.u), w=leaf(bias.w))
    elif bias is not None:
        inputs["bias"] = leaf(bias)

    def run(mod, x, impl):
        bias = Terms(x["u"], x["w"]) if "u" in x else x.get("bias")
        if impl == "triton":
            return dape_triton.attention(x["q"], x["k"], x["v"], bias, *mod.weights(), mod.variant, causal,
                                         q_offset=q_offset)
        A = x["A"] if "A" in x else x["q"] @ x["k"].transpose(-1, -2) * (1.0 / math.sqrt(x["q"].shape[-1]))
        probs = mod.probs(A, as_map(bias), future, _torch_residual_f(mod) if impl == "torch" else None)
        return probs.to(x["v"].dtype) @ x["v"] if "v" in x else probs

    def results(mod, x, impl, autocast):
        with torch.autocast(q.device.type, enabled=autocast):
            y = run(mod, x, impl)
        named = {"f." + n: p for n, p in mod.named_parameters()}
        return _outputs(y, x, named)

    as_float = lambda dtype: {n: t.detach().to(dtype).requires_grad_(t.requires_grad) for n, t in inputs.items()}
    want = results(copy.deepcopy(module).double(), as_float(torch.float64), "plain", False)
    b2 = next("df." + n for n, p in module.named_parameters() if p is module.weights()[3])
    autocast = torch.is_autocast_enabled(q.device.type)
    # the definition first (both fast paths compute f from weights(), so an edited f shows in the torch path,
    # held to float32 rounding), then the path as the call runs it
    checks = [("torch", as_float(torch.float32), False, torch.float32)]
    if path == "triton":
        checks.append(("triton", inputs, autocast, q.dtype))
    elif autocast:
        checks.append(("torch", inputs, True, torch.get_autocast_dtype(q.device.type)))
    # what float32 rounding alone does to this call: the plain form's own float32 error. A gradient that sums
    # many terms which cancel (b2's is zero in truth) can lose more than TOLERANCE to rounding alone
    rounding = _errors(results(module, as_float(torch.float32), "plain", False), want, zero=b2)
    for impl, x, autocast, dtype in checks:
        why = _disagreement(results(module, x, impl, autocast), want, TOLERANCE[impl][dtype], b2, rounding)
        if why is None:
            continue
        if impl == "triton":
            return f"the fused kernel's {why} (dape_triton.py, on this device)"
        if dtype == torch.float32:
            return f"{EDITED} (dape_torch.py and dape_triton.py compute it from weights(); edited?): {why}"
        return f"dape_torch.py's {why} under autocast"
    return None


def _outputs(y, inputs, params):
    """The output, then the gradient of every input and parameter that requires one, by name."""
    out = {"y": y.detach().double()}
    wrt = {n: t for n, t in {**inputs, **params}.items() if t.requires_grad}
    if wrt and torch.is_grad_enabled():
        G = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y.device)
        grads = torch.autograd.grad((y.double() * G).sum(), list(wrt.values()), allow_unused=True)
        out.update({f"d{n}": torch.zeros_like(t, dtype=torch.float64) if g is None else g.double()
                    for (n, t), g in zip(wrt.items(), grads)})
    return out


def _errors(got, want, zero=None):
    """Per tensor of `want` (a dict of named tensors), how far `got`'s is from it: the root mean square of the
    difference as a fraction of the tensor's own (at least 1% of the largest of all; zero: the name of a
    tensor that is zero in truth, b2's gradient, a constant per head under the softmax, measured against the
    largest of all). inf where got's is missing or not finite."""
    rms = lambda t: t.norm().item() / max(t.numel(), 1) ** 0.5
    top = max(rms(w) for w in want.values())
    out = {}
    for name, w in want.items():
        a = got.get(name)
        ok = a is not None and bool(torch.isfinite(a).all())
        out[name] = rms(a - w) / (top if name == zero else max(rms(w), 1e-2 * top)) if ok else math.inf
    return out


def _disagreement(got, want, tolerance, zero=None, rounding=None):
    """None, or which tensor of `got` differs from `want`'s by more than tolerance (see TOLERANCE and
    _errors), or than 4 times what float32 rounding alone does to it (`rounding`: the plain form's own
    errors), is missing, or is not finite."""
    rounding = rounding or {}
    for name, err in _errors(got, want, zero).items():
        if name not in got:
            return f"{name} is missing"
        if err == math.inf:
            return f"{name} is not finite"
        allowed = max(tolerance, 4 * rounding.get(name, 0.0))
        if not err <= allowed:
            return (f"{name} differs from the plain form by {err:.2g} of its size (root mean square; "
                    f"tolerance {allowed:.2g})")
    return None
