"""What runs when dape.py's f is edited, and when it is not: dape.py's own lines on blocks of query rows against
the keys they see (dape_torch.own_code) compute what dape.py computes on the whole map; an edit runs there under
auto, at every variant and mode; --dape_impl=plain runs these lines for an unedited file too (a breakpoint in f is
hit); dape_init='zero' zeroes f whatever its layers, and says so where it cannot."""

import sys
import warnings

import pytest
import torch
import torch.nn as nn

import dape
import dape_paths
import dape_torch
from model import GPT, GPTConfig
from dape import DAPEV1, DAPEV2, VARIANTS


def maps(B, H, Tq, Tk, shared, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, H, Tq, Tk, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(*(() if shared else (B,)), H, Tq, Tk, generator=g, dtype=torch.float64, requires_grad=True)
    return A, bias


@pytest.mark.parametrize("cls", [DAPEV1, DAPEV2])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out", ["probs", "masked", "logits"])
@pytest.mark.parametrize("Tq,Tk,shared", [(19, 19, True), (5, 23, False), (1, 7, True), (13, 13, False)])
def test_own_code_on_blocks_is_dape_py_on_the_whole_map(cls, variant, out, Tq, Tk, shared, monkeypatch):
    """Output and every gradient, float64, causal with the queries last (as in a KV-cache step or a query block),
    at block counts that do and do not divide the rows."""
    monkeypatch.setattr(dape_torch, "OWN_BLOCKS", 3)
    torch.manual_seed(0)
    mod = cls(3, width=5, variant=variant).double()
    future = torch.arange(Tk)[None, :] > torch.arange(Tk - Tq, Tk)[:, None]
    A, bias = maps(2, 3, Tq, Tk, shared)
    call = (lambda **kw: mod.probs(A, bias, future, **kw)) if out == "probs" else \
        (lambda **kw: mod(A, bias, future, mask_future=out == "masked", **kw))
    want = call()
    got = call(residual_f=lambda *a: dape_torch.own_code(mod, *a))
    visible = ~future if out == "logits" else torch.ones_like(future)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[..., visible], want[..., visible], rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want).masked_fill(future if out != "logits" else torch.zeros_like(future), 0.0)
    inputs = [A, bias, *mod.parameters()]
    fin = lambda t: torch.where(torch.isinf(t), torch.zeros_like(t), t)
    want_g = torch.autograd.grad(fin(want), inputs, g, allow_unused=True)
    got_g = torch.autograd.grad(fin(got), inputs, g, allow_unused=True)
    for a, b in zip(got_g, want_g):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-10, atol=1e-12))


@pytest.mark.parametrize("cls", [DAPEV1, DAPEV2])
@pytest.mark.parametrize("out", ["probs", "masked"])
@pytest.mark.parametrize("Tq,Tk", [(19, 19), (5, 23)])
def test_own_code_without_autograd_is_dape_py_on_the_whole_map(cls, out, Tq, Tk, monkeypatch):
    """Without autograd own_code writes blocks of about TILE_PAIRS pairs straight into its output: the same map,
    -inf (or 0 after softmax) beyond each block's last key, at block sizes that do not divide the rows."""
    monkeypatch.setattr(dape_torch, "TILE_PAIRS", 2 * 3 * Tk)  # 3 rows a block: 7 blocks of 19, 2 of 5
    torch.manual_seed(0)
    mod = cls(3, width=5).double()
    future = torch.arange(Tk)[None, :] > torch.arange(Tk - Tq, Tk)[:, None]
    A, bias = (t.detach() for t in maps(2, 3, Tq, Tk, False))
    call = (lambda **kw: mod.probs(A, bias, future, **kw)) if out == "probs" else \
        (lambda **kw: mod(A, bias, future, mask_future=True, **kw))
    with torch.no_grad():
        want = call()
        got = call(residual_f=lambda *a: dape_torch.own_code(mod, *a))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


def test_own_code_computes_f_only_at_the_keys_a_block_sees(monkeypatch):
    """At 16 causal rows in 4 blocks, f sees 4, 8, 12, 16 keys: 40 of 64 columns, not 4 x 16."""
    monkeypatch.setattr(dape_torch, "OWN_BLOCKS", 4)
    mod, seen = DAPEV1(2, width=4), []
    real_f = mod.f
    monkeypatch.setattr(mod, "f", lambda X, future=None: seen.append(X.shape[-2:]) or real_f(X, future))
    A, bias = maps(1, 2, 16, 16, True)
    future = torch.arange(16)[None, :] > torch.arange(16)[:, None]
    mod.probs(A.float(), bias.float(), future, residual_f=lambda *a: dape_torch.own_code(mod, *a))
    assert seen == [(4, 4), (4, 8), (4, 12), (4, 16)]


def model(impl="auto", edit=None, **kw):
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16, pos="kerple", dape="v1",
                      dape_width=8, dape_impl=impl, **kw))
    for block in m.transformer.h:
        if edit:
            edit(block.attn.dape)
    return m


SILU = lambda f: f.mlp.__setitem__(1, nn.SiLU())  # noqa: E731
DEEPER = lambda f: f.mlp.insert(2, nn.Linear(f.width, f.width)).insert(3, nn.LeakyReLU(f.slope))  # noqa: E731


@pytest.mark.parametrize("edit", [SILU, DEEPER], ids=["silu", "deeper"])
@pytest.mark.parametrize("attn", ["softmax", "stickbreaking"])
def test_an_edited_f_runs_its_own_code_under_auto(edit, attn, monkeypatch):
    """The edit runs through own_code (not the tiles, not the whole map), and the model's loss and gradients are
    the whole map's (dape.py's own code on the whole map, OWN_BLOCKS = 1) to rounding."""
    calls = []
    real = dape_torch.own_code
    monkeypatch.setattr(dape_torch, "own_code", lambda mod, *a: calls.append(mod) or real(mod, *a))
    monkeypatch.setattr(dape_torch, "residual_f", lambda *a: pytest.fail("the tiles ran an edited f"))
    dape_paths._warned.clear()
    idx = torch.randint(0, 32, (3, 16))
    got_model = model("auto", edit, attn=attn)
    with pytest.warns(UserWarning, match="running the plain form"):
        _, got = got_model(idx, idx)
    got.backward()
    assert len(calls) == 2
    monkeypatch.setattr(dape_torch, "OWN_BLOCKS", 1)
    want_model = model("plain", edit, attn=attn)
    _, want = want_model(idx, idx)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    for (n, a), b in zip(got_model.named_parameters(), want_model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), n


@pytest.mark.parametrize("impl,hit", [("plain", True), ("auto", False)])
def test_dape_impl_plain_runs_dape_py_s_lines(impl, hit):
    """A breakpoint in f, as a tracer sees it: hit with --dape_impl=plain on an unedited file, not under auto on
    the CPU (the tiles run there), in training and evaluation alike."""
    m, idx, lines = model(impl), torch.randint(0, 32, (2, 16)), set()
    code = DAPEV1.f.__code__

    def tracer(frame, event, arg):
        if frame.f_code is code:
            lines.add(frame.f_lineno)
        return tracer if frame.f_code is code else None
    sys.settrace(tracer)
    try:
        m(idx, idx)[1].backward()
        with torch.no_grad():
            m.eval()(idx)
    finally:
        sys.settrace(None)
    assert bool(lines) == hit


def f_at_step_0(mod):
    X = torch.randn(2, mod.in_channels, 3, 9)
    return mod.f(X, torch.arange(9)[None, :] > torch.arange(6, 9)[:, None]).abs().max().item()


@pytest.mark.parametrize("build", [
    lambda: DAPEV1(4, init="zero"),
    lambda: DAPEV2(4, kernel=5, init="zero"),
    lambda: DAPEV1(4, variant="add_residual", init="zero"),
], ids=["v1", "v2", "v1-add_residual"])
def test_zero_init_zeroes_f(build):
    assert f_at_step_0(build()) == 0.0


@pytest.mark.parametrize("cls,deepen", [
    (DAPEV1, DEEPER),
    (DAPEV2, lambda f: setattr(f, "act", nn.Sequential(f.act, nn.Conv2d(f.width, f.width, 1), nn.LeakyReLU()))),
], ids=["v1", "v2"])
def test_zero_init_finds_the_output_layer_of_a_deeper_f(cls, deepen):
    """One more layer: the output layer is zeroed, whatever its index (V1's was mlp[2], now the middle one)."""
    mod = cls(4)
    deepen(mod)
    mod.init = "zero"
    mod.init_last_layer()
    assert f_at_step_0(mod) == 0.0
    assert all(p.abs().sum() > 0 for n, p in mod.named_parameters() if not n.startswith(("mlp.4", "conv2")))


def test_zero_init_that_cannot_zero_f_is_an_error_naming_the_layer():
    """A layer registered after the output layer (a gate f never reads): zeroing it leaves f as it was."""
    mod = DAPEV1(4)
    mod.gate = nn.Linear(3, 3)
    mod.init = "zero"
    with pytest.raises(ValueError, match=r"zeroed gate, the last layer with parameters that DAPEV1 registers, but "
                                         r"f is not zero at step 0 .*register f's output layer last in __init__"):
        mod.init_last_layer()


def test_zero_init_in_a_model_starts_as_the_encoding_alone():
    """DAPE-Kerple with f zero computes Kerple at step 0: the same logits, given the same other weights."""
    idx = torch.randint(0, 32, (2, 16))
    dape_model = model(dape_init="zero")
    torch.manual_seed(0)
    kerple = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16, pos="kerple"))
    kerple.load_state_dict({k: v for k, v in dape_model.state_dict().items() if ".dape." not in k})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.allclose(dape_model(idx, idx)[0], kerple(idx, idx)[0], atol=1e-5)
