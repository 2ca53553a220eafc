"""
The fused kernel (dape_triton.py) against dape.py's plain form in float64, on one call's own inputs cut
small: what dape_paths.py runs at the kernel's first call of each kind, where a compiler could be wrong.
Whether f is the one the kernel implements is not asked here: dape_paths.py decides that by the code.

Forward and backward, the output and the gradient of every input and parameter that requires one; the
queries and keys cut to lengths of the call's own Triton class (dape_triton.same_class), the strides and
pointers those of the call's tensors, so that the check compiles and runs the binaries the model runs. The
kernel runs in float32, held to float32 rounding, and for a 16-bit call in its dtype too, held to that
dtype's rounding: the loose tolerance never decides alone whether the kernel computes f, except on a GPU
whose shared memory cannot hold float32 tiles of this shape (dape_triton.refused).
"""

import copy
import functools
import math
import types

import torch

import dape_torch
from positional import Terms, as_map

# How far the kernel's output and every gradient may be from the float64 plain form: the root mean square of
# the difference as a fraction of the tensor's own (at least 1% of the largest of all, as b2's gradient is
# zero in truth: a constant per head under the softmax). float32 is rounding; 16-bit dtypes round every
# operand of the kernel's products, through two layers of f, the softmax and their gradients.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.2}
CUT = dict(batch=2, rows=40)  # sequences, and queries and keys kept of the call's
dape_triton = None  # imported by check(): Triton is a CUDA-only dependency


def check(module, q, k, v, bias, causal, q_offset):
    """(None, None), or how the kernel differs from the plain form in float64 on the call's own inputs, cut
    small (bias: None, a map or Terms), and the path that computes the call instead: "torch", or "plain"
    where the kernel disagrees and the PyTorch path, run on the same inputs, does not agree."""
    global dape_triton
    import dape_triton
    cut = functools.partial(dape_triton.same_class, most=CUT["rows"])  # lengths of the call's Triton class
    b, tq, tk, q_offset = min(q.shape[0], CUT["batch"]), cut(q.shape[2]), cut(k.shape[2]), cut(q_offset)
    x = {"q": q[:b, :, :tq], "k": k[:b, :, :tk], "v": v[:b, :, :tk]}
    if isinstance(bias, Terms):
        x.update(u=bias.u[:b, :, :tq], w=bias.w[:b, :, :tk])
    elif bias is not None:
        x["bias"] = bias[..., :tq, :tk] if bias.dim() == 3 or bias.shape[0] == 1 else bias[:b, :, :tq, :tk]
    x = {n: t.detach().requires_grad_(torch.is_grad_enabled() and t.requires_grad) for n, t in x.items()}
    try:
        with torch.autocast(q.device.type, enabled=False):
            want = outputs(copy.deepcopy(module).double(), _cast(x, torch.float64), causal, q_offset, attend)
    except Exception as e:
        return f"the check's float64 reference (dape.py's plain form) failed ({describe(e)})", "torch"
    autocast = torch.is_autocast_enabled(q.device.type)
    low = q.dtype if q.dtype != torch.float32 else torch.get_autocast_dtype(q.device.type) if autocast else None
    for dtype in (torch.float32, low):
        if dtype is None or (dtype == torch.float32 and low and dape_triton.unavailable(x["q"].float()) is not None):
            continue  # float32 tiles that do not fit this GPU (dape_triton.refused): the 16-bit run alone
        try:
            with torch.autocast(q.device.type, enabled=autocast and dtype != torch.float32):
                got = outputs(module, _cast(x, dtype) if dtype == torch.float32 else x, causal, q_offset, fused)
        except Exception as e:
            return f"the fused kernel failed in {str(dtype)[6:]} at its check ({describe(e)})", "torch"
        why = disagreement(got, want, TOLERANCE[dtype])
        if why is not None:
            also = _torch_path_differs(module, x, want, causal, q_offset)
            return f"the fused kernel's {why} (in {str(dtype)[6:]}): the compiler (dape_triton.py, on this " \
                   f"device) or a change of dape.py that dape_paths.py cannot see; " + \
                   ("the PyTorch path agrees on this call" if also is None else f"the PyTorch path's {also} too"), \
                   "torch" if also is None else "plain"
    return None, None


def _torch_path_differs(module, x, want, causal, q_offset):
    """None where the PyTorch path (dape_torch.py) agrees in float32 with the reference want, else how not."""
    def run(m, x, causal, q_offset):
        return attend(m, x, causal, q_offset, functools.partial(dape_torch.residual_f, m))
    try:
        with torch.autocast(x["q"].device.type, enabled=False):
            return disagreement(outputs(module, _cast(x, torch.float32), causal, q_offset, run), want,
                                TOLERANCE[torch.float32])
    except Exception as e:
        return f"run failed ({describe(e)})"


def describe(e):
    """An exception in one line: its type and its last line of text."""
    text = str(e).strip()
    return type(e).__name__ + (f": {text.splitlines()[-1][:300]}" if text else "")


def _cast(x, dtype):
    return {n: t.detach().to(dtype).requires_grad_(t.requires_grad) for n, t in x.items()}


def attend(module, x, causal, q_offset, residual_f=None):
    """The plain form's y from the named inputs x (q, k, v, and the bias as a map or its terms u, w); with
    residual_f, the torch path's."""
    bias = Terms(x["u"], x["w"]) if "u" in x else x.get("bias")
    A = x["q"] @ x["k"].transpose(-1, -2) * (1.0 / math.sqrt(x["q"].shape[-1]))
    qi = torch.arange(q_offset, q_offset + A.shape[2], device=A.device)
    future = torch.arange(A.shape[3], device=A.device)[None, :] > qi[:, None] if causal else None
    return module.probs(A, as_map(bias), future, residual_f).to(x["v"].dtype) @ x["v"]


def torch_path_gradients(module, inputs, needs, dy, causal, q_offset):
    """The gradients on the torch path of the kernel's inputs (q, k, v, bias, u, w, w1, b1, w2, b2: None where
    absent or not needed) for the incoming gradient dy, then None: what a failed backward launch returns."""
    leaves = [None if t is None else t.detach().requires_grad_(n) for t, n in zip(inputs, needs)]
    x = {n: t.float() for n, t in zip(("q", "k", "v", "bias", "u", "w"), leaves) if t is not None}
    f = types.SimpleNamespace(weights=lambda: leaves[6:10], kernel=module.kernel, zero_future=module.zero_future,
                              slope=module.slope)
    with torch.enable_grad():
        y = attend(module, x, causal, q_offset, functools.partial(dape_torch.residual_f, f))
        wrt = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, dy.float(), allow_unused=True))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in leaves) + (None,)


def fused(module, x, causal, q_offset):
    """The kernel's y from the named inputs x."""
    bias = Terms(x["u"], x["w"]) if "u" in x else x.get("bias")
    return dape_triton.attention(x["q"], x["k"], x["v"], bias, *module.weights(), module.variant, causal,
                                 q_offset=q_offset)


def outputs(module, x, causal, q_offset, run):
    """y = run(module, x, causal, q_offset), then the gradient of every input and parameter that requires one,
    by name, all in float64."""
    y = run(module, x, causal, q_offset)
    out = {"y": y.detach().double()}
    wrt = {n: t for n, t in {**x, **{"f." + n: p for n, p in module.named_parameters()}}.items() if t.requires_grad}
    if wrt and torch.is_grad_enabled():
        G = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y.device)
        grads = torch.autograd.grad((y.double() * G).sum(), list(wrt.values()), allow_unused=True)
        out.update({f"d{n}": torch.zeros_like(t, dtype=torch.float64) if g is None else g.double()
                    for (n, t), g in zip(wrt.items(), grads)})
    return out


def disagreement(got, want, tolerance):
    """None, or which tensor of got is not finite or differs from want's by more than tolerance (TOLERANCE)."""
    top = max(_rms(w) for w in want.values())
    for name, w in want.items():
        err = _rms(got[name] - w) / max(_rms(w), 1e-2 * top) if torch.isfinite(got[name]).all() else math.inf
        if not err <= tolerance:
            return f"{name} differs from the plain form by {err:.2g} of its size (root mean square; tolerance " \
                   f"{tolerance:.2g})"
    return None


def _rms(t):
    return t.norm().item() / max(t.numel(), 1) ** 0.5
