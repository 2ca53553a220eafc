"""dape_triton.attention, the fused DAPE attention kernel: output and every gradient against an
independent float64 autograd reference, prefix consistency, agreement with dape.py's modules, and its
input checks.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before
anything imports Triton), which is slow: the shapes are small, and the block sizes 16 (the least
the kernel takes) still give several query and key blocks at T = 20 and 37. The float32 kernel must
match the float64 reference to float32 rounding: each tensor within 1e-4 of its own largest entry."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # without a GPU, conftest.py has set TRITON_INTERPRET=1 before this import

import dape_triton  # noqa: E402
from dape import DAPEV1, DAPEV2  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not dape_triton.available(DEVICE),
                                reason=f"dape_triton cannot run: {dape_triton.unavailable(DEVICE)}")
TOL = 1e-4


def reference(q, k, v, bias, w1, b1, w2, b2, variant, causal, q_offset=0, scale=None):
    """What attention computes, written like the paper's Appendix J: the bias tiled over the batch and
    concatenated (or added) to the logits, f as two (1, k) convolutions with zero padding (V1: k = 1), V2
    zeroing the future of its inputs and of its hidden map, then mask, softmax and v."""
    Bn, H, Tq, hs = q.shape
    Tk = k.shape[2]
    A = q @ k.transpose(-1, -2) * (1 / math.sqrt(hs) if scale is None else scale)
    future = None
    if causal:
        future = torch.arange(Tk, device=q.device)[None, :] > q_offset + torch.arange(Tq, device=q.device)[:, None]
    if bias is None:
        x, res = A, A
    else:
        Bb = (bias if bias.dim() == 4 else bias[None]).expand(Bn, -1, -1, -1)
        x, res = {"concat_residual": (torch.cat((A, Bb), 1), A + Bb),
                  "concat": (torch.cat((A, Bb), 1), A),
                  "add_residual": (A + Bb, A + Bb),
                  "bias_only": (Bb, A + Bb)}[variant]
    ks = w1.shape[-1]
    v2_causal = ks > 1 and future is not None
    zero = (lambda t: t.masked_fill(future, 0.0)) if v2_causal else (lambda t: t)
    pad = (0, ks // 2)
    h = zero(F.leaky_relu(F.conv2d(zero(x), w1[:, :, None], b1, padding=pad), 0.01))
    logits = res + F.conv2d(h, w2[:, :, None], b2, padding=pad)
    if future is not None:
        logits = logits.masked_fill(future, float("-inf"))
    return F.softmax(logits, dim=-1) @ v


def make(Bn=2, H=3, D=6, hs=8, Tq=20, Tk=None, ks=1, variant="concat_residual", bias="shared", seed=0):
    """Random inputs [q, k, v, bias, w1, b1, w2, b2] in float64 on DEVICE. q is a transposed view of a
    [B, T, H, hs] tensor, as the model passes it; bias: None, 'shared' [H, Tq, Tk], 'one' [1, H, Tq, Tk]
    or 'batch' [B, H, Tq, Tk]."""
    Tk = Tq if Tk is None else Tk
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    q = r(Bn, Tq, H, hs).transpose(1, 2)
    k, v = r(Bn, H, Tk, hs), r(Bn, H, Tk, hs)
    B = {None: None, "shared": lambda: r(H, Tq, Tk), "one": lambda: r(1, H, Tq, Tk),
         "batch": lambda: r(Bn, H, Tq, Tk)}[bias]
    B = B() if B is not None else None
    C = 2 * H if B is not None and variant in ("concat_residual", "concat") else H
    weights = [r(D, C, ks) * 0.5, r(D) * 0.5, r(H, D, ks) * 0.5, r(H) * 0.5]
    return [None if t is None else t.to(DEVICE) for t in [q, k, v, B] + weights]


NAMES = ["y", "q", "k", "v", "bias", "w1", "b1", "w2", "b2"]


def outputs_and_grads(fn, inputs, dtype, G, *args, **kwargs):
    """fn's output and the gradients of sum(output * G) in every input given (None for a missing bias)."""
    xs = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
    y = fn(*xs, *args, **kwargs)
    grads = torch.autograd.grad((y.to(G.dtype) * G).sum(), [x for x in xs if x is not None])
    grads = iter(grads)
    return [y.detach()] + [None if x is None else next(grads) for x in xs]


def assert_matches_reference(inputs, variant, causal, tol=TOL, dtype=torch.float32, **kwargs):
    q = inputs[0]
    G = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    want = outputs_and_grads(reference, inputs, torch.float64, G, variant, causal,
                             **{k: v for k, v in kwargs.items() if k in ("q_offset", "scale")})
    got = outputs_and_grads(dape_triton.attention, inputs, dtype, G, variant, causal, **kwargs)
    top = max(w.abs().max().item() for w in want if w is not None)
    for name, g, w in zip(NAMES, got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == dtype and g.shape == w.shape, (name, g.dtype, g.shape)
        # each tensor against its own scale, floored at 1% of the largest: b2's gradient is zero in truth
        # (a constant per head, under the softmax), so only float32 noise
        scale = max(w.abs().max().item(), 1e-2 * top)
        err = (g.double() - w).abs().max().item() / scale
        assert err < tol, f"{name}: max error {err:.2e} of its scale {scale:.3g} (tolerance {tol})"


# (kernel size, variant, bias, causal, make(...) overrides, attention(...) keywords)
CASES = {
    # V1: every variant, both bias layouts, no bias, both masks, T = 1 / 7 / 20 / 37
    "v1-concat_residual-shared-causal-T37": (1, "concat_residual", "shared", True, dict(Tq=37), {}),
    "v1-concat-batch-bidirectional": (1, "concat", "batch", False, {}, {}),
    "v1-add_residual-shared-causal-T7": (1, "add_residual", "shared", True, dict(Tq=7, hs=6), {}),
    "v1-bias_only-batch-causal": (1, "bias_only", "batch", True, {}, {}),
    "v1-nobias-causal-H5-D12": (1, "concat_residual", None, True, dict(H=5, D=12), {}),
    "v1-nobias-bidirectional-T1": (1, "concat_residual", None, False, dict(Tq=1), {}),
    "v1-query-block": (1, "concat_residual", "one", True, dict(Tq=18, Tk=37), dict(q_offset=16)),
    "v1-kv-cache-step": (1, "concat_residual", "shared", True, dict(Tq=1, Tk=21), dict(q_offset=20)),
    # V2 (k = 3; k = 5 once)
    "v2-concat_residual-shared-causal-T37": (3, "concat_residual", "shared", True, dict(Tq=37),
                                             dict(config=dict(block_m=32, block_n=16))),
    "v2-concat-shared-bidirectional": (3, "concat", "shared", False, {}, {}),
    "v2-add_residual-batch-causal": (3, "add_residual", "batch", True, dict(hs=6), {}),
    "v2-bias_only-shared-bidirectional": (3, "bias_only", "shared", False, {}, {}),
    "v2-bias_only-batch-causal-T7": (3, "bias_only", "batch", True, dict(Tq=7), {}),
    "v2-nobias-causal-D12": (3, "concat_residual", None, True, dict(D=12), dict(scale=0.3)),
    "v2-nobias-bidirectional": (3, "concat_residual", None, False, dict(Bn=1), {}),
    "v2-T1": (3, "concat_residual", "batch", True, dict(Tq=1), {}),
    "v2-query-block": (3, "concat", "batch", True, dict(Tq=18, Tk=37), dict(q_offset=16)),
    "v2-kv-cache-step": (3, "concat_residual", "shared", True, dict(Tq=1, Tk=21), dict(q_offset=20)),
    "v2-k5-concat_residual-batch-causal-T37": (5, "concat_residual", "batch", True, dict(Tq=37, Bn=1), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    ks, variant, bias, causal, shape, kwargs = CASES[case]
    inputs = make(ks=ks, variant=variant, bias=bias, **shape)
    assert_matches_reference(inputs, variant, causal, **kwargs)


def test_bias_without_grad():
    """A bias that needs no gradient (a fixed encoding): the others are unchanged, the bias gets None."""
    q, k, v, B, w1, b1, w2, b2 = make(ks=3, Tq=7)
    xs = [t.float().requires_grad_() for t in (q, k, v, w1, b1, w2, b2)]
    y = dape_triton.attention(*xs[:3], B.float(), *xs[3:], "concat_residual", True)
    y.sum().backward()
    want = reference(q, k, v, B, w1, b1, w2, b2, "concat_residual", True)
    assert (y.double() - want).abs().max() < TOL * want.abs().max()
    assert all(x.grad is not None for x in xs)


def reference_rounded(q, k, v, bias, w1, b1, w2, b2, variant, causal, dy, lo, block_n=16):
    """What the kernels compute for float16 / bfloat16 inputs, and their gradients for the output gradient
    dy, in float64 with every tl.dot operand rounded to `lo` where the kernels round it (V1, one group of
    heads): products of rounded values accumulated exactly, the softmax online over blocks of block_n keys
    with P rounded for P.V, y and the gradients of q, k, v returned in `lo`. Each product of the backward
    pass is the gradient of one bilinear map, taken by autograd on rounded operands."""
    R = lambda t: t.to(lo).double()

    def grads(op, x, w, g):  # the gradients of op(x, w) (bilinear) for the upstream g, operands rounded
        x_, w_ = R(x).requires_grad_(), R(w).requires_grad_()
        return torch.autograd.grad(op(x_, w_), (x_, w_), R(g))

    Bn, H, T, hs = q.shape
    scale = 1 / math.sqrt(hs)
    A = (R(q) @ R(k).transpose(-1, -2)) * scale
    Bb = None if bias is None else (bias if bias.dim() == 4 else bias[None]).expand(Bn, -1, -1, -1)
    if Bb is None:
        X, res = A, A
    else:
        X, res = {"concat_residual": (torch.cat((A, Bb), 1), A + Bb), "concat": (torch.cat((A, Bb), 1), A),
                  "add_residual": (A + Bb, A + Bb), "bias_only": (Bb, A + Bb)}[variant]
    mix = lambda x, w: torch.einsum("dc,bcij->bdij", w[:, :, 0], x)  # f's layers, V1
    z = mix(R(X), R(w1)) + b1[:, None, None]
    h = F.leaky_relu(z, 0.01)
    s = res + mix(R(h), R(w2)) + b2[:, None, None]
    future = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else torch.zeros(T, T, dtype=torch.bool)
    s = s.masked_fill(future, float("-inf"))
    m = torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype)
    l = torch.zeros(s.shape[:-1], dtype=s.dtype)
    acc = torch.zeros(Bn, H, T, hs, dtype=s.dtype)
    for n0 in range(0, T, block_n):
        block = s[..., n0:n0 + block_n]
        m_new = torch.maximum(m, block.max(-1).values)
        p = torch.exp(block - m_new[..., None])
        l = l * torch.exp(m - m_new) + p.sum(-1)
        acc = acc * torch.exp(m - m_new)[..., None] + R(p) @ R(v[:, :, n0:n0 + block_n])
        m = m_new
    y = R(acc / l[..., None])
    P = torch.exp(s - (m + torch.log(l))[..., None])
    dl = P * (R(dy) @ R(v).transpose(-1, -2) - (dy.double() * y).sum(-1)[..., None])
    dv = R(P).transpose(-1, -2) @ R(dy)
    dh, dw2 = grads(mix, h, w2, dl)
    dz = torch.where(z > 0, dh, 0.01 * dh)
    dX, dw1 = grads(mix, X, w1, dz)
    if Bb is None:
        dA, dB = dX + dl, None
    elif variant in ("concat_residual", "concat"):
        dA, dB = dX[:, :H] + dl, dX[:, H:] + (dl if variant == "concat_residual" else 0)
    else:
        dA, dB = (dX + dl, dX + dl) if variant == "add_residual" else (dl, dX + dl)
    dA = dA.masked_fill(future, 0.0)
    dq, dk = (R(dA) @ R(k)) * scale, (R(dA).transpose(-1, -2) @ R(q)) * scale
    dbias = None if dB is None else dB.masked_fill(future, 0.0).sum(0)  # bias shared by the batch
    return [y, R(dq), R(dk), R(dv), dbias, dw1, dz.sum((0, 2, 3)), dw2, dl.sum((0, 2, 3))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant,bias", [("concat_residual", "shared"), ("bias_only", "shared"), ("concat_residual", None)])
def test_half_precision_rounds_where_the_gpu_does(dtype, variant, bias):
    """float16 / bfloat16 inputs (autocast): every product's operands rounded to that dtype, float32
    accumulation, y and the gradients of q, k, v in that dtype. Checked against reference_rounded, which
    rounds at the same places: y, dq, dk, dv equal but for a rare last-bit difference (the kernel sums in
    float32, the reference exactly, and a sum close to a rounding boundary can land on its other side), the
    float32 gradients to 1e-4. A missing rounding (P before P.V, dL before W2^T dL, ...) is off by ~1e-3 in
    most elements. Triton's interpreter cannot multiply bfloat16: there the kernels emulate it (_lo), so this
    test runs the bfloat16 path without a GPU."""
    q, k, v, B, w1, b1, w2, b2 = make(Tq=37, variant=variant, bias=bias)
    G = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    qkv = [t.to(dtype).to(DEVICE) for t in (q, k, v)]
    rest = [None if t is None else t.float().to(DEVICE) for t in (B, w1, b1, w2, b2)]
    xs = [t if t is None else t.clone().requires_grad_() for t in qkv + rest]
    dy = G.to(dtype).to(DEVICE)
    y = dape_triton.attention(*xs, variant, True)
    assert y.dtype == dtype
    got = [y.detach()] + [None if x is None else g for x, g in
                          zip(xs, iter_grads(torch.autograd.grad(y, [x for x in xs if x is not None], dy), xs))]
    assert [g.dtype for g in got[:4]] == [dtype] * 4
    want = reference_rounded(*[None if t is None else t.detach().double().cpu() for t in qkv + rest],
                             variant, True, dy.cpu(), dtype)
    # float16 products of 11-bit significands no longer sum exactly in float32, so last-bit differences are
    # commoner than with bfloat16's 8 bits, and reach the float32 gradients through rounded intermediates;
    # on a GPU the tensor cores' own order of addition adds some
    few, tol = (0.01, 1e-4) if dtype == torch.bfloat16 and DEVICE.type == "cpu" else (0.05, 1e-3)
    top = max(w.abs().max().item() for w in want if w is not None)
    for name, g, w in zip(NAMES, got, want):
        if w is None:
            assert g is None
            continue
        err = (g.double().cpu() - w).abs() / max(w.abs().max().item(), 1e-2 * top)
        if name in ("y", "q", "k", "v"):  # rounded outputs: equal, but for a few last-bit differences
            off = (err > 1e-5).double().mean().item()
            assert off < few and err.max().item() < 2 ** -7, f"{name}: {100 * off:.1f}% of elements differ"
        else:  # b2's gradient is zero in truth (a constant per head, under the softmax): noise
            assert err.max().item() < (10 * tol if name == "b2" else tol), f"{name}: max error {err.max().item():.1e}"


def iter_grads(grads, xs):
    """The gradients of the given (non-None) inputs, in the order of xs."""
    grads = iter(grads)
    return [None if x is None else next(grads) for x in xs]


def test_v2_prefix_consistency():
    """V2 with a causal mask: a row's output does not depend on how many keys follow it, so the rows of a
    length-20 run are those of a length-37 run, and a block of queries (q_offset) gives the rows of the
    whole run."""
    q, k, v, B, w1, b1, w2, b2 = (t if t is None else t.float() for t in make(ks=3, Bn=1, Tq=37, bias="batch"))
    w = (w1, b1, w2, b2, "concat_residual", True)
    full = dape_triton.attention(q, k, v, B, *w)
    T = 20
    prefix = dape_triton.attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], B[:, :, :T, :T], *w)
    torch.testing.assert_close(prefix, full[:, :, :T], rtol=0, atol=1e-5)
    block = dape_triton.attention(q[:, :, T:], k, v, B[:, :, T:], *w, q_offset=T)
    torch.testing.assert_close(block, full[:, :, T:], rtol=0, atol=1e-5)


@pytest.mark.recorded_dape
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_matches_dape_module(version):
    """Against dape.py's module: softmax(module(A, B, future, mask_future=True)) @ v, output and weight
    gradients, with the module's own weights."""
    torch.manual_seed(0)
    H, T, hs = 3, 20, 8
    if version == "v1":
        m = DAPEV1(H, width=6, variant="concat")
    else:
        m = DAPEV2(H, width=6, kernel=3, variant="add_residual")
    m = m.to(DEVICE)
    q, k, v = (torch.randn(2, H, T, hs, device=DEVICE) for _ in range(3))
    B = torch.randn(H, T, T, device=DEVICE)
    future = torch.ones(T, T, dtype=torch.bool, device=DEVICE).triu(1)
    A = q @ k.transpose(-1, -2) / math.sqrt(hs)
    want = F.softmax(m(A, B, future, mask_future=True), dim=-1) @ v
    want_grads = torch.autograd.grad(want.sum(), list(m.parameters()))
    got = dape_triton.attention(q, k, v, B, *m.weights(), m.variant, True)
    got_grads = torch.autograd.grad(got.sum(), list(m.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    top = max(w.abs().max().item() for w in want_grads)  # b2's gradient is zero in truth: noise
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * top)


def test_available():
    assert dape_triton.available(DEVICE) and dape_triton.unavailable(DEVICE) is None


def _bad(**change):
    q, k, v, B, w1, b1, w2, b2 = (t.float() for t in make(ks=3, Bn=1, Tq=7))
    args = dict(q=q, k=k, v=v, bias=B, w1=w1, b1=b1, w2=w2, b2=b2, variant="concat_residual", causal=True)
    args.update(change)
    return args


BAD = {
    "q-3d": (dict(q=torch.zeros(3, 7, 8)), "q must be a 4-D tensor"),
    "int-q": (dict(q=torch.zeros(1, 3, 7, 8, dtype=torch.int64)), "q must be float32, float16 or bfloat16"),
    "k-dtype": (dict(k=torch.zeros(1, 3, 7, 8, dtype=torch.float16)), "one dtype"),
    "k-heads": (dict(k=torch.zeros(1, 2, 7, 8)), "k and v must be"),
    "v-length": (dict(v=torch.zeros(1, 3, 6, 8)), "k and v must be"),
    "variant": (dict(variant="mul"), "variant must be one of"),
    "no-bias-variant": (dict(bias=None, variant="concat"), "needs a bias"),
    "bias-shape": (dict(bias=torch.zeros(3, 7, 6)), "bias must be"),
    "bias-batch": (dict(bias=torch.zeros(2, 3, 7, 7)), "bias must be"),
    "bias-terms": (dict(bias=(torch.zeros(1, 3, 7), torch.zeros(1, 3, 6))), r"bias terms must be u \[B, H, Tq\]"),
    "bias-terms-pair": (dict(bias=(torch.zeros(1, 3, 7),)), r"bias terms must be a pair"),
    "w1-channels": (dict(w1=torch.zeros(6, 3, 3)), "C_in = 6"),
    "even-kernel": (dict(w1=torch.zeros(6, 6, 2), w2=torch.zeros(3, 6, 2)), "must be odd"),
    "w2-shape": (dict(w2=torch.zeros(3, 5, 3)), "w2"),
    "b1-shape": (dict(b1=torch.zeros(5)), "b1"),
    "q-offset": (dict(q_offset=-1), "q_offset must be an int >= 0"),
    "causal": (dict(causal=1), "causal must be True or False"),
    "block": (dict(config=dict(block_m=24)), r"config\['block_m'\] must be a power of two >= 16"),
    "small-block": (dict(config=dict(block_n=8)), r"config\['block_n'\] must be a power of two >= 16"),
    "config-key": (dict(config=dict(blockm=16)), "unknown keys"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_errors(case):
    change, message = BAD[case]
    change = {k: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for k, t in change.items()}
    with pytest.raises(ValueError, match=message):
        dape_triton.attention(**_bad(**change))


@pytest.mark.slow
@pytest.mark.parametrize("ks", [1, 3])
def test_matches_reference_larger(ks):
    """The default blocks at a model-like shape: H = 4, D = 32, hs = 16, T = 70 (5 blocks each way)."""
    inputs = make(Bn=2, H=4, D=32, hs=16, Tq=70, ks=ks)
    assert_matches_reference(inputs, "concat_residual", True)


# Compiled for GPUs this machine does not have (Triton's compiler and ptxas need none), in a process of
# its own: the kernels here are interpreted. Each entry compiles the forward and backward kernels as a launch
# of the model's attention would specialize them: (architecture, dtype, heads, head size, D, k, bias, causal).
# The tightest: sm_86 (A10, RTX 30xx, L4 and RTX 40xx are alike: 99 KB of shared memory per block, the least
# of the architectures), 16-bit V1 and V2 at the 125M model's heads (12 x 64) and the 6.7B model's (32 x 128),
# FoX's terms, and float32 where the kernel takes it (at most 16 heads there; dape_triton.refused).
TIGHTEST = [(86, "bfloat16", 12, 64, 32, 1, True, True), (86, "bfloat16", 12, 64, 32, 3, True, True),
            (86, "bfloat16", 32, 128, 32, 1, True, True), (86, "float16", 32, 128, 32, 3, True, True),
            (86, "bfloat16", 32, 128, 32, 3, "terms", True),
            (86, "float32", 12, 64, 32, 1, True, True), (86, "float32", 12, 64, 32, 3, True, True)]
# What the slow test compares with docs/results/kernel_fit.json: one entry per architecture
SAMPLE = [(80, "bfloat16", 12, 64, 32, 3, True, True), (86, "bfloat16", 12, 64, 32, 3, True, True),
          (89, "float16", 32, 80, 32, 1, True, True), (90, "bfloat16", 32, 128, 32, 3, "terms", True),
          (86, "float32", 4, 32, 32, 3, False, False)]
# the 2.7B model's heads (32 x 80) compile to the 6.7B model's kernels (32 x 128): the table's row for both
TABLE_ROW = {(32, 80, 32): (32, 128, 32)}
COMPILE = """
import json, sys, torch, dape_triton
for arch, dtype, H, hs, D, ks, bias, causal in json.loads(sys.argv[1]):
    result = dape_triton.compile_for(arch, getattr(torch, dtype), H, hs, D, ks, bias=bias, causal=causal)
    print(json.dumps(result), flush=True)
"""
FIT_TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results", "kernel_fit.json")


def compile_sample(sample):
    """compile_for on each entry of sample, in a process without TRITON_INTERPRET."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(sample)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def fit_table():
    import json
    with open(FIT_TABLE) as f:
        table = json.load(f)
    keys = ("arch", "dtype", "n_head", "head_size", "width", "kernel_size", "bias", "causal")
    return table, {tuple(e[k] for k in keys): e for e in table["entries"]}


def test_the_tightest_kernels_fit_sm86():
    """The kernels as they are now, compiled for the architecture with the least shared memory per block at
    the tightest shapes the configs train: each within it, with tensor-core products in the 16-bit kernels
    (a kernel edit that breaks an architecture fails here)."""
    for key, result in zip(TIGHTEST, compile_sample(TIGHTEST)):
        arch, dtype, H, hs, D, ks = key[:6]
        assert dape_triton.refused(arch, getattr(torch, dtype), H, hs, D, ks) is None, key
        for kernel in ("forward", "backward"):
            assert result[kernel]["shared"] <= dape_triton.SHARED_KB[arch] * 1024, (key, kernel, result)
            assert (result[kernel]["mma"] > 0) == (dtype != "float32"), (key, kernel, result)


def test_the_fingerprint_ignores_comments_and_docstrings(monkeypatch):
    """source_hash(), which ties docs/results/kernel_fit.json to the kernels, reads their code: a comment or a
    docstring added to every function it reads leaves it as it was; a statement changes it."""
    import inspect
    real = inspect.getsource
    before = dape_triton.source_hash()

    def edited(addition):
        def getsource(obj):
            src = real(obj).rstrip("\n")
            if addition == "docstring":
                return src.replace('"""', '"""A reader\'s note. ', 1) + "\n"
            head = next(line for line in src.splitlines() if line.lstrip().startswith("def "))
            return src + "\n" + " " * (len(head) - len(head.lstrip()) + 4) + addition + "\n"
        return getsource
    for addition in ("# a reader's note", "docstring"):
        monkeypatch.setattr(inspect, "getsource", edited(addition))
        assert dape_triton.source_hash() == before, addition
    monkeypatch.setattr(inspect, "getsource", edited("pass"))
    assert dape_triton.source_hash() != before


@pytest.mark.slow
def test_fit_table_entries_are_what_the_compiler_says():
    """docs/results/kernel_fit.json (bench.py --sections=fit) says of a sample of its entries, one per architecture,
    exactly what compiling them now says, when it was made with this Triton and these kernels."""
    import triton
    table, entries = fit_table()
    if table["triton"] != triton.__version__ or table["source_hash"] != dape_triton.source_hash():
        pytest.skip("docs/results/kernel_fit.json was made with another Triton or other kernels")
    for key, result in zip(SAMPLE, compile_sample(SAMPLE)):
        H, hs, D = TABLE_ROW.get(key[2:5], key[2:5])
        row = entries[(*key[:2], H, hs, D, *key[5:])]
        assert {k: row[k] for k in result} == result, (key, result, row)


@pytest.mark.recorded_dape
@pytest.mark.slow
def test_fit_table_covers_every_combination_and_each_fits():
    """The table was made from these kernels (dape_triton.source_hash(): their source, launch settings and
    Triton's version; otherwise regenerate it: python bench.py --sections=fit), covers every architecture x
    dtype x config head shape x V1/V2 x bias x mask, and every kernel in it fits its architecture's shared
    memory per block, or the combination is refused by dape_triton.refused (float32 on the 99 KB GPUs)."""
    import bench
    import triton
    table, entries = fit_table()
    if table["triton"] != triton.__version__:
        pytest.skip(f"docs/results/kernel_fit.json was compiled with Triton {table['triton']}, this is {triton.__version__}")
    assert table["source_hash"] == dape_triton.source_hash(), \
        "docs/results/kernel_fit.json describes other kernels: regenerate it with python bench.py --sections=fit"
    shapes = bench.config_head_shapes()
    archs, dtypes = [80, 86, 89, 90], ["bfloat16", "float16", "float32"]
    want = {(a, d, *s, ks, b, c) for a in archs for d in dtypes for s in shapes for ks in (1, 3)
            for b in (True, False) for c in (True, False)}
    want |= {(a, d, *s, ks, "terms", True) for a in archs for d in dtypes[:2] for s in shapes for ks in (1, 3)}
    assert want <= set(entries), sorted(want - set(entries), key=str)[:5]  # bias is True, False or 'terms'
    for (arch, dtype, H, hs, D, ks, bias, causal), e in entries.items():
        fits = max(e["forward"]["shared"], e["backward"]["shared"]) <= dape_triton.SHARED_KB[arch] * 1024
        refused = dape_triton.refused(arch, getattr(torch, dtype), H, hs, D, ks)
        assert e["refused"] == refused
        assert fits or refused, e


GROUPED = {
    # 20 heads pad to 32: two groups of 16, the second 4 real heads and 12 padded ones
    "v1-20-heads": (1, "concat_residual", "shared", True, dict(H=20, Tq=20, Bn=1), {}),
    "v2-20-heads": (3, "add_residual", "batch", True, dict(H=20, Tq=18, Bn=1), {}),
    "v1-20-heads-bias_only-bidirectional": (1, "bias_only", "shared", False, dict(H=20, Tq=17, Bn=1), {}),
    "v2-20-heads-nobias": (3, "concat_residual", None, True, dict(H=20, Tq=17, Bn=1), dict(q_offset=0)),
    # every chunk loop with several passes and a partial last one: head size 40 in chunks of 16 (v too),
    # f's width 40 (padded 64) in blocks of 16
    "v1-chunks": (1, "concat", "shared", True, dict(hs=40, D=40, Tq=20, Bn=1),
                  dict(config=dict(ec=16, ev=16, dc=16))),
    "v2-chunks": (3, "concat_residual", "shared", True, dict(hs=40, D=40, Tq=20, Bn=1),
                  dict(config=dict(ec=16, ev=16, dc=16))),
}


@pytest.mark.parametrize("case", list(GROUPED))
def test_grouped_heads_and_chunks_match_reference(case):
    """More heads than one program holds (the 2.7B and 6.7B models' 32): programs per group of 16 heads,
    each computing every head's logits for f; and the loops over chunks of the head size, of v and of f's
    hidden channels, at shapes small enough for the interpreter."""
    ks, variant, bias, causal, shape, kwargs = GROUPED[case]
    inputs = make(ks=ks, variant=variant, bias=bias, **shape)
    assert_matches_reference(inputs, variant, causal, **kwargs)


def test_27b_heads_run_fused():
    """The 2.7B model's attention shape, 32 heads of 80 (two groups; v in chunks of 64 and 16), fused, at a
    short length."""
    inputs = make(Bn=1, H=32, hs=80, D=32, Tq=17)
    assert_matches_reference(inputs, "concat_residual", True)


TERMS = {
    "v1": (1, dict(Tq=37), {}),
    "v2": (3, dict(Tq=20), {}),
    "v1-query-block": (1, dict(Tq=18, Tk=37), dict(q_offset=16)),
    "v2-20-heads": (3, dict(H=20, Tq=17, Bn=1), {}),
}


@pytest.mark.parametrize("case", list(TERMS))
def test_bias_terms_match_the_map_they_stand_for(case):
    """FoX's bias B_ij = u_i - w_j (u, w: running sums of log forget gates) given as its terms, which the
    kernels form on chip: the same output and gradients as the float64 reference reading the map, u's and
    w's gradients flowing through the map's construction."""
    ks, shape, kwargs = TERMS[case]
    q, k, v, _, w1, b1, w2, b2 = make(ks=ks, bias=None, variant="concat_residual", **shape)
    Bn, H, Tq = q.shape[:3]
    Tk = k.shape[2]
    g = torch.Generator().manual_seed(3)
    gates = torch.nn.functional.logsigmoid(torch.randn(Bn, H, Tk, generator=g, dtype=torch.float64) + 2).cumsum(-1)
    off = kwargs.get("q_offset", 0)
    u, w = gates[..., off:off + Tq].to(DEVICE), gates.to(DEVICE)
    C = 2 * H
    w1 = torch.randn(w1.shape[0], C, ks, generator=g, dtype=torch.float64).to(DEVICE) * 0.5
    G = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)

    def run(fn, dtype, as_map):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, u, w, w1, b1, w2, b2)]
        bias = xs[3][..., :, None] - xs[4][..., None, :] if as_map else (xs[3], xs[4])
        y = fn(*xs[:3], bias, *xs[5:], "concat_residual", True, **kwargs)
        return [y.detach()] + list(torch.autograd.grad((y.to(G.dtype) * G).sum(), xs))

    want = run(reference, torch.float64, as_map=True)
    got = run(dape_triton.attention, torch.float32, as_map=False)
    top = max(t.abs().max().item() for t in want)
    for name, a, b in zip(["y", "q", "k", "v", "u", "w", "w1", "b1", "w2", "b2"], got, want):
        err = (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-2 * top)
        assert err < TOL, f"{name}: max error {err:.2e}"
