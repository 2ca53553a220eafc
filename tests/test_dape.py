"""DAPE's f, outputs and every gradient, against an independent float64 autograd reference.

f is computed in three ways: dape.py's plain form (the definition), and dape_torch.py's fast paths, whole
maps with autograd (CUDA, torch.compile) and, on the CPU, tile by tile with a hand-written backward
pass. All must compute the same function as the paper's module: the reference below is written like
Appendix J (tile B over the batch, concatenate, channels-last MLP or (1, k) convolutions) and run in
float64, so that float32 rounding is the only difference allowed."""

import functools
import glob
import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import dape_paths
import dape_torch
import fingerprint
from dape import DAPEV1, DAPEV2, VARIANTS

H, D = 3, 5


def reference(m, A, B, future, mode):
    """What m computes, written independently of dape.py, in the dtype of A."""
    Bb = None if B is None else (B if B.dim() == 4 else B[None]).expand(A.shape[0], -1, -1, -1)
    if Bb is None:
        x, res = A, A
    elif m.variant == "concat_residual":
        x, res = torch.cat((A, Bb), 1), A + Bb
    elif m.variant == "concat":
        x, res = torch.cat((A, Bb), 1), A
    elif m.variant == "add_residual":
        x, res = A + Bb, A + Bb
    else:  # bias_only
        x, res = Bb, A + Bb
    if isinstance(m, DAPEV1):
        fc1, fc2 = m.mlp[0], m.mlp[2]
        h = F.leaky_relu(x.permute(0, 2, 3, 1) @ fc1.weight.to(A.dtype).t() + fc1.bias.to(A.dtype), 0.01)
        f = (h @ fc2.weight.to(A.dtype).t() + fc2.bias.to(A.dtype)).permute(0, 3, 1, 2)
    else:  # V2: the future is zeroed before each convolution
        zero = (lambda t: t.masked_fill(future, 0.0)) if future is not None else (lambda t: t)
        pad = (0, m.kernel // 2)
        w = lambda c: (c.weight.to(A.dtype), c.bias.to(A.dtype))
        h = zero(F.leaky_relu(F.conv2d(zero(x), *w(m.conv1), padding=pad), 0.01))
        f = F.conv2d(h, *w(m.conv2), padding=pad)
    logits = res + f
    if mode == "logits" or future is None:
        return logits
    logits = logits.masked_fill(future, float("-inf"))
    return logits if mode == "masked" else F.softmax(logits, dim=-1)


FAST = True  # the `path` fixture sets it: dape_torch.py's residual_f (True) or dape.py's plain form (False)


def run(m, A, B, future, mode):
    residual_f = functools.partial(dape_torch.residual_f, m) if FAST else None
    if mode == "probs":
        return m.probs(A, B, future, residual_f)
    return m(A, B, future, mask_future=mode == "masked", residual_f=residual_f)


def outputs_and_grads(m, A0, B0, G, future, mode, fn, dtype):
    """fn's output and the gradients of sum(output * G) in A, B and m's parameters (the reference reads
    the float32 parameters through .to(float64), so their gradients arrive on them either way)."""
    A = A0.to(dtype).requires_grad_()
    B = None if B0 is None else B0.to(dtype).requires_grad_()
    out = fn(m, A, B, future, mode)
    finite = torch.isfinite(out)  # the masked entries (-inf) carry no gradient
    loss = (out.masked_fill(~finite, 0.0) * G.to(dtype)).sum()
    got = torch.autograd.grad(loss, [A] + ([B] if B is not None else []) + list(m.parameters()))
    return [out.detach().masked_fill(~finite, 0.0)] + list(got)


def assert_equal_to_reference(m, A, B, future, mode, tol=1e-4):
    G = torch.randn(A.shape[0], m.n_head, *A.shape[-2:], generator=torch.Generator().manual_seed(7))
    want = outputs_and_grads(m, A, B, G, future, mode, reference, torch.float64)
    got = outputs_and_grads(m, A, B, G, future, mode, run, torch.float32)
    names = ["output", "dA"] + (["dB"] if B is not None else []) + [n for n, _ in m.named_parameters()]
    top = max(w.abs().max().item() for w in want)
    for name, g, w in zip(names, got, want):
        # each tensor against its own scale, floored at 1% of the largest: a gradient that is zero in
        # truth (the output bias's, under a softmax) is float32 noise; a wrong one is off by ~100%
        scale = max(w.abs().max().item(), 1e-2 * top)
        err = (g.double() - w).abs().max().item() / scale
        assert err < tol, f"{name}: relative error {err:.2e}"


def module(kind, variant, has_bias, seed=0):
    torch.manual_seed(seed)
    m = DAPEV1(H, D, variant, has_bias) if kind == "v1" else DAPEV2(H, D, int(kind[3:]), variant, has_bias)
    with torch.no_grad():  # off the init, so that every weight moves the result
        for p in m.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return m


def maps(Bn, Tq, Tk, bias, t0, seed=1):
    g = torch.Generator().manual_seed(seed)
    A = 2 * torch.randn(Bn, H, Tq, Tk, generator=g)
    B = {"none": None, "shared": torch.randn(H, Tq, Tk, generator=g),
         "batched": torch.randn(Bn, H, Tq, Tk, generator=g)}[bias]
    qi, ki = torch.arange(t0, t0 + Tq), torch.arange(Tk)
    return A, B, ki[None, :] > qi[:, None]


KINDS = ["v1", "v2k1", "v2k3", "v2k5"]
MODES = ["probs", "masked", "logits", "bidirectional"]
CASES = [(k, v, b) for k, v, b in itertools.product(KINDS, VARIANTS, ["shared", "batched", "none"])
         if b != "none" or v == "concat_residual"]


@pytest.fixture(params=["cpu-tiles", "whole-maps", "plain"])
def path(request, monkeypatch):
    """Every way of computing f: the CPU's tiles (made small, so that a map takes many tiles and groups
    of sequences), the whole-map autograd path that CUDA and torch.compile take, and the plain form."""
    if request.param == "cpu-tiles":
        monkeypatch.setattr(dape_torch, "TILE_PAIRS", 40)
    elif request.param == "whole-maps":
        monkeypatch.setattr(dape_torch, "use_tiles", lambda x: False)
    else:
        monkeypatch.setattr(sys.modules[__name__], "FAST", False)
    return request.param


@pytest.mark.parametrize("kind,variant,bias", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_f_and_its_gradients_equal_the_reference(path, kind, variant, bias, mode):
    m = module(kind, variant, bias != "none")
    A, B, future = maps(3, 11, 11, bias, t0=0)
    assert_equal_to_reference(m, A, B, None if mode == "bidirectional" else future, mode)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["probs", "logits"])
def test_a_block_of_queries_against_all_keys(path, kind, mode):
    """Attention in blocks (and the KV cache) asks for rows t0 .. t0 + Tq - 1 against keys 0 .. Tk - 1."""
    m = module(kind, "concat_residual", True)
    A, B, future = maps(2, 4, 13, "shared", t0=6)
    assert_equal_to_reference(m, A, B, future, mode)


@pytest.mark.parametrize("tile_pairs", [1, 7, 64, 10 ** 6])
def test_any_tiling_gives_the_same_result(monkeypatch, tile_pairs):
    """One row per tile, a few rows of one sequence, several sequences per tile, the whole batch."""
    monkeypatch.setattr(dape_torch, "TILE_PAIRS", tile_pairs)
    for kind in KINDS:
        m = module(kind, "concat_residual", True)
        A, B, future = maps(3, 9, 9, "shared", t0=0)
        assert_equal_to_reference(m, A, B, future, "probs")


def test_a_broadcast_bias_of_batch_one():
    m = module("v2k3", "concat_residual", True)
    A, B, future = maps(2, 7, 7, "shared", t0=0)
    torch.testing.assert_close(run(m, A, B[None], future, "probs"), run(m, A, B, future, "probs"), atol=1e-6,
                               rtol=1e-6)


def test_bf16_inputs_are_computed_in_float32():
    m = module("v1", "concat_residual", True)
    A, B, future = maps(2, 6, 6, "shared", t0=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(m, A.bfloat16(), B, future, "probs")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, run(m, A.bfloat16().float(), B, future, "probs"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_float64_runs_in_float64(kind):
    """Without autocast the CPU path computes in the inputs' dtype (its scratch buffers included)."""
    m = module(kind, "concat_residual", True).double()
    A, B, future = maps(2, 7, 7, "shared", t0=0)
    A, B = A.double().requires_grad_(), B.double()
    out = run(m, A, B, future, "probs")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(m, A, B, future, "probs"), atol=1e-12, rtol=1e-12)
    out.sum().backward()
    assert A.grad.dtype == torch.float64


@pytest.mark.parametrize("kind", KINDS)
def test_recomputing_the_hidden_map_in_backward(monkeypatch, kind):
    """save_hidden = False (less memory in training): the backward pass recomputes h, same gradients."""
    monkeypatch.setattr(dape_torch, "SAVE_HIDDEN", False)
    monkeypatch.setattr(dape_torch, "TILE_PAIRS", 40)
    m = module(kind, "concat_residual", True)
    A, B, future = maps(3, 9, 9, "shared", t0=0)
    assert_equal_to_reference(m, A, B, future, "probs")


@pytest.mark.parametrize("kind", KINDS)
def test_tilings_are_remembered_per_mask(monkeypatch, kind):
    """The CPU path reuses a tiling for the same shapes and mask: masks of the same shape in turn (causal,
    a window of 3 keys, causal again) each get their own."""
    monkeypatch.setattr(dape_torch, "TILE_PAIRS", 40)
    m = module(kind, "concat_residual", True)
    A, B, causal = maps(2, 9, 9, "shared", t0=0)
    i = torch.arange(9)
    window = causal | (i[None, :] < i[:, None] - 2)
    for future in (causal, window, causal):
        assert_equal_to_reference(m, A, B, future, "probs")


# -----------------------------------------------------------------------------
# dape_init: f's last layer zero


@pytest.mark.parametrize("kind", [DAPEV1, DAPEV2])
@pytest.mark.parametrize("variant,bias", [(v, True) for v in VARIANTS] + [("concat_residual", False)])
def test_zero_init_starts_as_the_encoding(kind, variant, bias):
    """With dape_init zero, f = 0 at step 0: A + B (the residual variants), A (concat, and A + f(A) without a
    bias); the default init adds f's noise. A training step then moves f's last layer, and the next one f's
    first layer too."""
    torch.manual_seed(0)
    m = kind(H, D, variant=variant, has_bias=bias, init="zero")
    A = torch.randn(2, H, 7, 7)
    B = torch.randn(H, 7, 7) if bias else None
    want = A if B is None or variant == "concat" else A + B
    assert torch.equal(m(A, B), want)
    torch.manual_seed(0)
    assert not torch.allclose(kind(H, D, variant=variant, has_bias=bias)(A, B), want)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    first = [p.detach().clone() for p in m.weights()]
    for _ in range(2):
        opt.zero_grad()
        (m(A.requires_grad_(), B) ** 2).mean().backward()
        opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(m.weights(), first))


def test_zero_init_in_a_model_draws_the_same_random_numbers():
    """A seed gives both inits the same weights but f's last layer: so runs of the two differ in that alone;
    the model's logits at step 0 are its encoding's (Kerple with DAPE's weights for everything else)."""
    from model import GPT, GPTConfig
    cfg = dict(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, pos="kerple", dape="v1")
    torch.manual_seed(0)
    default = GPT(GPTConfig(**cfg))
    torch.manual_seed(0)
    zero = GPT(GPTConfig(**cfg, dape_init="zero"))
    for (name, p), q in zip(default.named_parameters(), zero.parameters()):
        last = name.endswith(("mlp.2.weight", "mlp.2.bias"))
        assert torch.equal(q, torch.zeros_like(q)) if last else torch.equal(p, q), name
    plain = GPT(GPTConfig(**{**cfg, "dape": "none"}))
    plain.load_state_dict(zero.state_dict(), strict=False)
    x = torch.randint(0, 32, (2, 16))
    torch.testing.assert_close(zero(x, x)[0], plain(x, x)[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="unknown dape_init='small'"):
        GPTConfig(**cfg, dape_init="small")
    with pytest.raises(ValueError, match="dape_init='zero' has no effect with dape='none'"):
        GPTConfig(**{**cfg, "dape": "none"}, dape_init="zero")


@pytest.mark.parametrize("kind", [DAPEV1, DAPEV2])
def test_reset_parameters_is_pytorchs_own_init(kind):
    """The default init is PyTorch's own for every layer of f, V1's inside its Sequential too (what
    model.py's GPT calls after GPT-2's init of every Linear): the same draws as the layers built afresh in
    order from the same seed; with init zero, the last layer then zeroed."""
    from torch import nn
    for init in ("default", "zero"):
        m = kind(H, D, init=init)
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(0.5)  # as GPT-2's init leaves them: anything else
        torch.manual_seed(3)
        m.reset_parameters()
        torch.manual_seed(3)
        C, k = m.in_channels, m.kernel
        fresh = [nn.Linear(C, D), nn.Linear(D, H)] if kind is DAPEV1 else \
            [nn.Conv2d(C, D, (1, k), padding=(0, k // 2)), nn.Conv2d(D, H, (1, k), padding=(0, k // 2))]
        want = [p for layer in fresh for p in layer.parameters()]
        got = list(m.parameters())
        assert all(torch.equal(g, w) for g, w in zip(got[:2], want[:2]))
        assert all(torch.equal(g, torch.zeros_like(g) if init == "zero" else w) for g, w in zip(got[2:], want[2:]))


# -----------------------------------------------------------------------------
# the fast paths' record of dape.py


def test_the_fast_paths_record_the_dape_py_they_implement():
    """dape_torch.IMPLEMENTS is dape.py's definition as it is. An edit of dape.py fails here (and only here
    among the tests of the fast paths, which conftest.py then skips): the plain form runs it meanwhile, with one
    warning. Whoever wants the fast paths on the edit changes them to compute it (their equality tests above and
    in tests/test_dape_triton.py must pass) and sets the record to what the message says."""
    now = {cls.__qualname__: fingerprint.definition([cls]) for cls in (DAPEV1, DAPEV2)}
    # printed as dape_torch.py writes it: the entries both classes hold once (_SHARED), then each class's own
    shared = {k: v for k, v in now["DAPEV1"].items() if now["DAPEV2"].get(k) == v}
    entries = lambda d, indent: "".join(f'{indent}"{k}": {json.dumps(d[k])},\n' for k in sorted(d, key=str.lower))
    text = ("_SHARED = {\n" + entries(shared, "    ") + "}\nIMPLEMENTS = {\n"
            + "".join(f'    "{c}": {{\n        **_SHARED,\n' + entries({k: v for k, v in d.items() if k not in shared},
                                                                     "        ") + "    },\n" for c, d in now.items())
            + "}")
    assert now == dape_torch.IMPLEMENTS, (
        "dape.py is not the version that the fast paths implement: the plain form runs it. To run it on the fast "
        "paths, change dape_torch.py and dape_triton.py to compute it, then set dape_torch._SHARED and "
        "IMPLEMENTS to:\n" + text)
    assert dape_torch._SHARED == shared and text in open(dape_torch.__file__).read()  # the message prints the file's form
    for cls in (DAPEV1, DAPEV2):
        assert dape_paths.code_differs(cls(4)) is None


@pytest.mark.recorded_dape  # its copy of the repository is the unedited one, then the edited
def test_the_suite_on_an_edited_dape_py(tmp_path):
    """A reader's edit of dape.py (V1's LeakyReLU made a GELU), in a copy of the repository: the suite says so at
    its end, a model runs the edit (the plain form's warning is shown, not an error), the tests marked
    recorded_dape are skipped saying why, and the record test fails saying what to update. Unedited, none of it.
    In CI (CI=true) the committed dape.py is never an edit: the edited copy stops the suite at its start, naming
    what differs, and the unedited one passes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in glob.glob(os.path.join(root, "*.py")) + [os.path.join(root, "pytest.ini")]:
        shutil.copy(path, tmp_path)
    (tmp_path / "tests").mkdir()
    for name in ("conftest.py", "test_dape.py"):
        shutil.copy(os.path.join(root, "tests", name), tmp_path / "tests")
    (tmp_path / "tests" / "test_edit.py").write_text(
        "import pytest, torch\nfrom model import GPT, GPTConfig\n\n\n"
        "def test_a_model_runs():\n"
        "    cfg = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, pos='kerple', dape='v1')\n"
        "    GPT(cfg)(torch.zeros(1, 8, dtype=torch.long))\n\n\n"
        "@pytest.mark.recorded_dape\ndef test_a_fast_path():\n    pass\n")
    record = "tests/test_dape.py::test_the_fast_paths_record_the_dape_py_they_implement"

    def suite(ci=False):
        env = {k: v for k, v in os.environ.items() if k != "CI"}
        out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "tests/test_edit.py",
                              record], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                             env=dict(env, CI="true") if ci else env)
        return out.stdout + out.stderr

    text = suite(ci=True)
    assert "3 passed" in text and "dape.py is edited" not in text, text
    source = (tmp_path / "dape.py").read_text()
    assert source.count("nn.LeakyReLU(SLOPE),") == 1
    (tmp_path / "dape.py").write_text(source.replace("nn.LeakyReLU(SLOPE),", "nn.GELU(),"))
    text = suite()
    assert re.search(r"=+ dape\.py is edited =+\nDAPEV1\.__init__ is not the dape\.py that the fast paths implement "
                     r"\(edited\?\): the plain form ran it everywhere", text), text
    assert "1 failed, 1 passed, 1 skipped" in text, text
    assert "dape.py is not the version that the fast paths implement: the plain form runs it" in text
    assert "running the plain form (dape.py) for these calls" in text  # the warning, shown
    assert re.search(r"SKIPPED .*test_edit\.py:\d+: dape\.py is edited \(DAPEV1", text), text
    text = suite(ci=True)
    assert re.search(r"ERROR: CI=true and the committed dape\.py is taken for an edit: DAPEV1\.__init__ is not the "
                     r"dape\.py", text) and " passed" not in text, text
