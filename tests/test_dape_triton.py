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
                                             dict(block_m=32, block_n=16)),
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


def test_float16():
    """float16 inputs (as under autocast): products in float16, accumulation and softmax in float32; y
    and the gradients of q, k, v in float16. (bfloat16 takes the same code; Triton's interpreter cannot
    run its tl.dot, so it is checked on a GPU only.)"""
    inputs = make(ks=3, Bn=1, Tq=20)
    q = inputs[0]
    G = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    want = outputs_and_grads(reference, inputs, torch.float64, G, "concat_residual", True)
    xs = [t.detach().to(torch.float16 if i < 3 else torch.float32).requires_grad_() for i, t in enumerate(inputs)]
    y = dape_triton.attention(*xs, "concat_residual", True)
    assert y.dtype == torch.float16
    got = [y.detach()] + list(torch.autograd.grad((y.double() * G).sum(), xs))
    assert [g.dtype for g in got[:4]] == [torch.float16] * 4
    top = max(w.abs().max().item() for w in want)
    for name, g, w in zip(NAMES, got, want):
        scale = max(w.abs().max().item(), 1e-2 * top)
        assert (g.double() - w).abs().max().item() / scale < 2e-2, name


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
    "w1-channels": (dict(w1=torch.zeros(6, 3, 3)), "C_in = 6"),
    "even-kernel": (dict(w1=torch.zeros(6, 6, 2), w2=torch.zeros(3, 6, 2)), "must be odd"),
    "w2-shape": (dict(w2=torch.zeros(3, 5, 3)), "w2"),
    "b1-shape": (dict(b1=torch.zeros(5)), "b1"),
    "q-offset": (dict(q_offset=-1), "q_offset must be an int >= 0"),
    "causal": (dict(causal=1), "causal must be True or False"),
    "block": (dict(block_m=24), "block_m must be a power of two >= 16"),
    "small-block": (dict(block_n=8), "block_n must be a power of two >= 16"),
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


COMPILE = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import dape_triton as dt

dt._build()
ks, HP, HSP, DP = json.loads(sys.argv[1])
const = dict(HP=HP, HSP=HSP, DP=DP, BLOCK_M=dt.BLOCK_M, BLOCK_N=dt.BLOCK_N, KS=ks, PAD=ks // 2, A_IN=True,
             HAS_B=True, RES_B=True, CAUSAL=True, SLOPE=dt.SLOPE, **dt._dot_dtype(torch.bfloat16))
for kernel, extra in ((dt._forward, {}), (dt._backward, dict(NEED_DB=True))):
    c = dict(const, **extra)
    io = ("Q", "K", "V", "Y", "DY")
    ptr = lambda a: a[0].isupper() and a not in ("H", "HS", "Tq", "Tk")  # the tensors
    sig = {a: "constexpr" if a in c else "*bf16" if a in io else "*fp32" if ptr(a) else
           "fp32" if a == "scale" else "i32" for a in kernel.arg_names}
    k = triton.compile(ASTSource(kernel, sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=dt.NUM_WARPS, num_stages=dt.NUM_STAGES, maxnreg=dt.MAX_REGISTERS))
    print(kernel.__name__, k.metadata.shared)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ks", [1, 3])
def test_compiles_for_h100(ks):
    """The kernels compile for an H100 (sm_90, bfloat16: Triton's compiler and ptxas, no GPU needed) at the
    largest tiles unavailable() lets through (16 heads of 64, D = 32), within its shared memory per block."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", COMPILE, f"[{ks}, 16, 64, 32]"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    shared = dict(line.split() for line in out.stdout.splitlines())
    assert set(shared) == {"_forward", "_backward"}
    assert all(int(v) <= 227 * 1024 for v in shared.values()), shared
