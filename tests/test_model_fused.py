"""model.py with DAPE in the fused kernel (dape_triton.py, dape_impl='triton'), run on the CPU through
Triton's interpreter: the same losses, gradients, blocked evaluation and KV-cache decoding as with the
PyTorch path (dape_impl='torch'); 'auto' keeps the CPU on the PyTorch path; what the kernel does not cover
is an error when it is forced."""

import warnings

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest.py has set TRITON_INTERPRET=1 before this import

import dape_triton  # noqa: E402
import model as model_module  # noqa: E402
from model import GPT, GPTConfig, KVCache  # noqa: E402
from triton.runtime.errors import OutOfResources, PTXASError  # noqa: E402

TINY = dict(block_size=8, vocab_size=32, n_layer=2, n_head=3, n_embd=12, dape_width=6)


def pair(**kw):
    """The same weights with the kernel and with the PyTorch path (weights moved off their init, so that
    f matters)."""
    torch.manual_seed(0)
    fused = GPT(GPTConfig(**TINY, dape_impl="triton", **kw))
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(0.1 * torch.randn_like(p))
    plain = GPT(GPTConfig(**TINY, dape_impl="torch", **kw))
    plain.load_state_dict(fused.state_dict())
    return fused, plain


@pytest.mark.parametrize("kw", [dict(pos="kerple", dape="v1"), dict(pos="alibi", dape="v2"),
                                dict(pos="rope", dape="v1"), dict(pos="t5", dape="v2", dape_variant="concat"),
                                dict(pos="fire", dape="v1", dape_variant="add_residual"),
                                dict(pos="fox", dape="v1"), dict(pos="fox", dape="v2", dape_variant="bias_only")])
def test_training_step_equals_the_pytorch_path(kw):
    fused, plain = pair(**kw)
    x = torch.randint(0, 32, (2, 19))  # past the training length and over two 16-key tiles
    losses = []
    for m in (fused, plain):
        _, loss = m(x, x)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        scale = max(b.grad.abs().max().item(), 1e-3)
        assert (a.grad - b.grad).abs().max().item() / scale < 1e-3, name


def test_blocked_evaluation_and_kv_cache_use_the_kernel(monkeypatch):
    fused, plain = pair(pos="kerple", dape="v2")
    fused.eval(), plain.eval()
    x = torch.randint(0, 32, (1, 20))
    with torch.no_grad():
        fused(x[:, :3])  # the kernel's self-check for this kind of call runs first, once
    calls = []
    real = dape_triton.attention
    monkeypatch.setattr(dape_triton, "attention", lambda *a, **k: calls.append(k["q_offset"]) or real(*a, **k))
    for m in (fused, plain):
        for block in m.transformer.h:
            block.attn.attn_chunk = 7  # blocks of queries: 0, 7, 14
    with torch.no_grad():
        a, _ = fused(x, x)
        b, _ = plain(x, x)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert sorted(set(calls)) == [0, 7, 14]
    calls.clear()
    cache_f, cache_p = KVCache(2), KVCache(2)
    with torch.no_grad():
        for t in range(4):  # a prompt, then one token at a time against the cache
            step = x[:, :5] if t == 0 else x[:, 4 + t:5 + t]
            a, _ = fused(step, cache=cache_f)
            b, _ = plain(step, cache=cache_p)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert 5 in calls and 7 in calls  # the cache steps' queries sit after the cached keys


def test_auto_keeps_the_cpu_on_the_pytorch_path(monkeypatch):
    monkeypatch.setattr(dape_triton, "attention", lambda *a, **k: pytest.fail("the kernel ran on the CPU"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, pos="kerple", dape="v1"))
    model(torch.randint(0, 32, (1, 9)), torch.randint(0, 32, (1, 9)))


@pytest.mark.parametrize("kw,why", [(dict(pos="cope", dape="v1"), "depend on the content"),
                                    (dict(pos="xl", dape="v1"), "depend on the content"),
                                    (dict(pos="kerple", dape="v1", dropout=0.1), "dropout")])
def test_forcing_the_kernel_where_it_does_not_apply_is_an_error(kw, why):
    model = GPT(GPTConfig(**TINY, dape_impl="triton", **kw))
    x = torch.randint(0, 32, (1, 5))
    with pytest.raises(ValueError, match=f"dape_impl='triton' cannot run here: .*{why}"):
        model(x, x)


def test_a_model_with_dropout_uses_the_kernel_in_eval(monkeypatch):
    """Attention dropout keeps training on the PyTorch path; evaluation, which has none, takes the kernel."""
    fused, plain = pair(pos="kerple", dape="v1", dropout=0.1)
    calls = []
    real = dape_triton.attention
    monkeypatch.setattr(dape_triton, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused.eval(), plain.eval()
    x = torch.randint(0, 32, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(fused(x, x)[1], plain(x, x)[1], rtol=1e-5, atol=1e-6)
    assert calls


@pytest.fixture
def auto_on_cpu(monkeypatch):
    """dape_impl='auto' as on a GPU: the kernel (here under Triton's interpreter) once it passes its
    self-check; fresh self-check results and warnings."""
    monkeypatch.setattr(model_module, "FUSED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(dape_triton, "_CHECKS", {})
    monkeypatch.setattr(model_module, "_warned", set())


def counting(monkeypatch, fn=None):
    """Replace dape_triton.attention by fn (default: itself), counting the calls."""
    calls = []
    fn = fn or dape_triton.attention
    monkeypatch.setattr(dape_triton, "attention", lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def train_step(m, x):
    _, loss = m(x, x)
    loss.backward()
    return loss


def test_auto_uses_the_kernel_once_it_passes_its_self_check(auto_on_cpu, monkeypatch):
    fused, plain = pair(pos="alibi", dape="v2")
    fused.config.dape_impl = "auto"
    for block in fused.transformer.h:
        block.attn.dape_impl = "auto"
    calls = counting(monkeypatch)
    x = torch.randint(0, 32, (2, 19))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        torch.testing.assert_close(train_step(fused, x), train_step(plain, x), rtol=1e-5, atol=1e-6)
    checks = len(calls)
    assert checks >= 3  # the self-check's runs (a KV-cache step, a sequence), then the model's layers
    train_step(fused, x)
    assert len(calls) == checks + fused.config.n_layer  # checked once: later steps only run the layers
    assert len(dape_triton._CHECKS) == 1 and None in dape_triton._CHECKS.values()


def auto_pair(**kw):
    fused, plain = pair(**kw)
    for block in fused.transformer.h:
        block.attn.dape_impl = "auto"
    return fused, plain


FAILURES = {  # how the kernels can fail on a GPU, and what the warning then names
    "shared memory": (OutOfResources(232448, 101376, "shared memory"), r"OutOfResources: out of resource: shared "
                                                                       r"memory"),
    "compile": (PTXASError("ptxas fatal: Unresolved extern function"), r"PTXASError: PTXAS error: ptxas fatal"),
    "launch": (RuntimeError("CUDA error: an illegal memory access was encountered"), r"RuntimeError: CUDA error"),
}


def out_of_shared_memory(monkeypatch, failure="shared memory"):
    """Every launch fails, by default as it would on a GPU with less shared memory than the kernel needs."""
    def launch(*a, **k):
        raise FAILURES[failure][0]
    monkeypatch.setattr(dape_triton, "_forward_launch", launch)


def falls_back_once(fused, plain, x, message):
    """Two training steps of each model: equal losses, and exactly one warning matching message."""
    with pytest.warns(UserWarning, match=message) as seen:
        for _ in range(2):
            torch.testing.assert_close(train_step(fused, x), train_step(plain, x), rtol=1e-6, atol=1e-7)
    assert len([w for w in seen if "fused kernel" in str(w.message)]) == 1


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_kernel_that_cannot_run_falls_back_with_one_warning(auto_on_cpu, monkeypatch, failure):
    """Kernels that fail (more shared memory than the GPU has, a compile error, a failed launch) send every call
    of that kind to the PyTorch path, with one warning naming the cause; the results are the PyTorch path's."""
    out_of_shared_memory(monkeypatch, failure)
    calls = counting(monkeypatch)
    fused, plain = auto_pair(pos="kerple", dape="v1")
    falls_back_once(fused, plain, torch.randint(0, 32, (2, 19)),
                    rf"failed its self-check on this device \({FAILURES[failure][1]}.*: using the PyTorch path")
    assert len(calls) == 1  # the self-check's first run, and nothing after it
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_kernel_that_disagrees_falls_back_with_one_warning(auto_on_cpu, monkeypatch):
    """Kernels that run but compute something else (a miscompile) fail the comparison with the PyTorch path."""
    real = dape_triton.attention
    calls = counting(monkeypatch, lambda *a, **k: 1.1 * real(*a, **k))
    fused, plain = auto_pair(pos="t5", dape="v2")
    falls_back_once(fused, plain, torch.randint(0, 32, (1, 19)),
                    r"failed its self-check on this device \(y \(one KV-cache step\) differs from the PyTorch "
                    r"path by 0.1 of its size")
    assert len(calls) == 1


def test_forcing_a_kernel_that_fails_its_self_check_is_an_error(auto_on_cpu, monkeypatch):
    out_of_shared_memory(monkeypatch)
    fused, _ = pair(pos="kerple", dape="v1")  # dape_impl='triton'
    x = torch.randint(0, 32, (1, 5))
    with pytest.raises(ValueError, match=r"dape_impl='triton' cannot run here: its self-check failed on this "
                                         r"device \(OutOfResources"):
        fused(x, x)
