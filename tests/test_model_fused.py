"""How model.py's DAPE attention picks its code (dape_paths.py), run on the CPU, the fused kernel under
Triton's interpreter: the kernel computes what the PyTorch path computes (losses, gradients, KV-cache
decoding); the kernel is trusted for a kind of call only once it has matched dape.py's plain form there,
output and every gradient, and a failure or a mismatch, at the check or at a later launch, forward or
backward, sends that kind of call to the PyTorch path with one warning (an error where the kernel was
forced); frozen parameters keep the kernel; ranks agree. tests/test_dape_paths.py: edits of dape.py."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest.py has set TRITON_INTERPRET=1 before this import

import dape_paths  # noqa: E402
import dape_triton  # noqa: E402
from model import GPT, GPTConfig, KVCache  # noqa: E402
from triton.runtime.errors import OutOfResources, PTXASError  # noqa: E402

# the model's paths against each other and the kernel's check, on the dape.py that the fast paths implement
pytestmark = pytest.mark.recorded_dape
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(block_size=8, vocab_size=32, n_layer=2, n_head=3, n_embd=12, dape_width=6)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Every test starts with no verdicts and no warnings given."""
    monkeypatch.setattr(dape_paths, "VERDICTS", {})
    monkeypatch.setattr(dape_paths, "_warned", set())


@pytest.fixture
def auto_on_cpu(monkeypatch):
    """dape_impl='auto' as on a GPU: the kernel (here under Triton's interpreter) where it matches."""
    monkeypatch.setattr(dape_paths, "KERNEL_DEVICES", ("cuda", "cpu"))


def models(impls=("triton", "torch"), **kw):
    """The same weights, one model per dape_impl (weights moved off their init, so that f matters)."""
    out = []
    for impl in impls:
        torch.manual_seed(0)
        m = GPT(GPTConfig(**TINY, dape_impl=impl, **kw))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
        if out:
            m.load_state_dict(out[0].state_dict())
        out.append(m)
    return out


def counting(monkeypatch, fn=None):
    """Replace dape_triton.attention by fn (default: itself), counting the calls."""
    calls = []
    fn = fn or dape_triton.attention
    monkeypatch.setattr(dape_triton, "attention", lambda *a, **k: calls.append(k.get("q_offset", 0)) or fn(*a, **k))
    return calls


def train_step(m, x):
    _, loss = m(x, x)
    loss.backward()
    return loss


def assert_same_training(a, b, x, rtol=1e-5):
    torch.testing.assert_close(train_step(a, x), train_step(b, x), rtol=rtol, atol=1e-6)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is None:
            continue
        scale = max(q.grad.abs().max().item(), 1e-3)
        assert (p.grad - q.grad).abs().max().item() / scale < 1e-3, name


def no_warnings():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error")
    return ctx


@pytest.mark.parametrize("kw", [dict(pos="kerple", dape="v1"), dict(pos="alibi", dape="v2"),
                                dict(pos="rope", dape="v1"), dict(pos="t5", dape="v2", dape_variant="concat"),
                                dict(pos="fire", dape="v1", dape_variant="add_residual"),
                                dict(pos="fox", dape="v1"), dict(pos="fox", dape="v2", dape_variant="bias_only")])
def test_training_step_equals_the_pytorch_path(kw):
    fused, torch_path = models(**kw)
    assert_same_training(fused, torch_path, torch.randint(0, 32, (2, 19)))  # over two 16-key tiles


def test_blocked_evaluation_and_kv_cache_decoding_through_the_kernel(monkeypatch):
    fused, torch_path = models(pos="kerple", dape="v2")
    fused.eval(), torch_path.eval()
    x = torch.randint(0, 32, (1, 20))
    for m in (fused, torch_path):
        for block in m.transformer.h:
            block.attn.attn_chunk = 7  # the PyTorch path in blocks of 7 queries; the kernel takes all at once
    calls = counting(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, x)[0], torch_path(x, x)[0], rtol=1e-4, atol=1e-5)
        cache_f, cache_p = KVCache(2), KVCache(2)
        for t in range(4):  # a prompt, then one token at a time against the cache
            step = x[:, :5] if t == 0 else x[:, 4 + t:5 + t]
            torch.testing.assert_close(fused(step, cache=cache_f)[0], torch_path(step, cache=cache_p)[0],
                                       rtol=1e-4, atol=1e-5)
    assert 5 in calls and 7 in calls  # the cache steps' queries sit after the cached keys


def test_auto_keeps_the_cpu_on_the_pytorch_path(monkeypatch):
    monkeypatch.setattr(dape_triton, "attention", lambda *a, **k: pytest.fail("the kernel ran on the CPU"))
    m, = models(("auto",), pos="kerple", dape="v1")
    train_step(m, torch.randint(0, 32, (1, 9)))


def test_auto_is_not_refused_where_triton_cannot_run():
    """Without Triton's interpreter (a CPU machine as it is, not as the tests set it), 'auto' trains on the
    PyTorch path and train.py accepts it; 'triton' is the one-line error."""
    script = """
import warnings, torch
warnings.simplefilter("error")
from model import GPT, GPTConfig
import train
from types import SimpleNamespace
cfg = dict(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=8, pos="kerple", dape="v1")
m = GPT(GPTConfig(**cfg))
x = torch.randint(0, 32, (1, 9))
m(x, x)[1].backward()
train.check_dape_impl(SimpleNamespace(**GPTConfig(**cfg).__dict__), "cpu", torch.float32, False)
try:
    train.check_dape_impl(SimpleNamespace(**GPTConfig(**cfg, dape_impl="triton").__dict__), "cpu", torch.float32, False)
except train.ConfigError as e:
    print("refused:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("refused: dape_impl=triton cannot run here: tensors on cpu"), p.stdout


def test_auto_where_the_kernel_cannot_run_says_so_and_trains(auto_on_cpu, monkeypatch):
    """A GPU where the kernel cannot run (no Triton, a shape it refuses): auto warns once and trains on the
    PyTorch path, where 'triton' is an error."""
    monkeypatch.setattr(dape_triton, "unavailable", lambda *a: "a machine without Triton (planted)")
    auto, torch_path, forced = models(("auto", "torch", "triton"), pos="kerple", dape="v1")
    x = torch.randint(0, 32, (2, 19))
    with pytest.warns(UserWarning, match=r"DAPE's fused kernel does not cover a machine without Triton"):
        assert_same_training(auto, torch_path, x)
    with pytest.raises(ValueError, match=r"dape_impl='triton' cannot run here: a machine without Triton"):
        train_step(forced, x)


@pytest.mark.parametrize("kw,why", [(dict(pos="cope", dape="v1"), "CoPE, whose logits depend on the content"),
                                    (dict(pos="xl", dape="v1"), "XLRelative, whose logits depend on the content"),
                                    (dict(pos="kerple", dape="v1", dropout=0.1), "dropout")])
def test_forcing_the_kernel_where_it_does_not_apply_is_an_error(kw, why):
    model = GPT(GPTConfig(**TINY, dape_impl="triton", **kw))
    x = torch.randint(0, 32, (1, 5))
    with pytest.raises(ValueError, match=f"dape_impl='triton' cannot run here: .*{why}"):
        model(x, x)


def test_a_model_with_dropout_uses_the_kernel_in_eval(monkeypatch):
    """Attention dropout keeps training on the PyTorch path; evaluation, which has none, takes the kernel."""
    fused, torch_path = models(pos="kerple", dape="v1", dropout=0.1)
    calls = counting(monkeypatch)
    fused.eval(), torch_path.eval()
    x = torch.randint(0, 32, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(fused(x, x)[1], torch_path(x, x)[1], rtol=1e-5, atol=1e-6)
    assert calls


def test_auto_uses_the_kernel_once_it_has_matched_the_plain_form(auto_on_cpu, monkeypatch):
    fused, torch_path = models(("auto", "torch"), pos="alibi", dape="v2")
    calls = counting(monkeypatch)
    x = torch.randint(0, 32, (2, 19))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        assert_same_training(fused, torch_path, x)
    assert len(calls) == 1 + fused.config.n_layer  # the check's run, then the model's layers
    train_step(fused, x)
    assert len(calls) == 1 + 2 * fused.config.n_layer  # checked once: later steps only run the layers
    assert list(dape_paths.VERDICTS.values()) == [None]


FAILURES = {  # how the kernels can fail on a GPU, and what the warning then names
    "shared memory": (OutOfResources(232448, 101376, "shared memory"), r"OutOfResources: out of resource: shared "
                                                                       r"memory"),
    "compile": (PTXASError("ptxas fatal: Unresolved extern function"), r"PTXASError: PTXAS error: ptxas fatal"),
    "launch": (RuntimeError("CUDA error: an illegal memory access was encountered"), r"RuntimeError: CUDA error"),
}


def failing_launches(monkeypatch, failure="shared memory"):
    """Every launch fails, by default as it would on a GPU with less shared memory than the kernel needs."""
    def launch(*a, **k):
        raise FAILURES[failure][0]
    monkeypatch.setattr(dape_triton, "_forward_launch", launch)


def falls_back_once(fused, torch_path, x, message):
    """Two training steps of each model: the same results, and exactly one warning matching message."""
    with pytest.warns(UserWarning, match=message) as seen:
        for _ in range(2):
            for m in (fused, torch_path):
                m.zero_grad(set_to_none=True)
            assert_same_training(fused, torch_path, x, rtol=1e-6)
    assert len([w for w in seen if "DAPE" in str(w.message)]) == 1, [str(w.message) for w in seen]


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_kernel_that_cannot_run_falls_back_with_one_warning(auto_on_cpu, monkeypatch, failure):
    """Kernels that fail (more shared memory than the GPU has, a compile error, a failed launch) send every call
    of that kind to the PyTorch path, with one warning naming the cause."""
    failing_launches(monkeypatch, failure)
    calls = counting(monkeypatch)
    fused, torch_path = models(("auto", "torch"), pos="kerple", dape="v1")
    falls_back_once(fused, torch_path, torch.randint(0, 32, (2, 19)),
                    rf"DAPE: the fused kernel failed in float32 at its check \({FAILURES[failure][1]}.*: running "
                    r"the PyTorch path")
    assert len(calls) == 1  # the check's run, and nothing after it


def test_a_kernel_that_disagrees_falls_back_with_one_warning(auto_on_cpu, monkeypatch):
    """Kernels that run but compute something else (a miscompile) fail the comparison with the plain form; the
    PyTorch path, run on the same inputs, agrees, so the calls take it, and the warning names both causes."""
    real = dape_triton.attention
    calls = counting(monkeypatch, lambda *a, **k: 1.1 * real(*a, **k))
    fused, torch_path = models(("auto", "torch"), pos="t5", dape="v2")
    falls_back_once(fused, torch_path, torch.randint(0, 32, (1, 19)),
                    r"DAPE: the fused kernel's y differs from the plain form by 0.1 of its size .*: the compiler "
                    r"\(dape_triton.py, on this device\) or a change of dape.py that dape_paths.py cannot see; the "
                    r"PyTorch path agrees on this call: running the PyTorch path")
    assert len(calls) == 1


def fails_after_the_first(monkeypatch, name):
    """dape_triton.<name> (a launch) runs once, then raises as a GPU would: the calls, in a list."""
    real, runs = getattr(dape_triton, name), []

    def launch(*a, **k):
        runs.append(1)
        if len(runs) > 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*a, **k)
    monkeypatch.setattr(dape_triton, name, launch)
    return runs


def raises_when_forced(runs, pos):
    """The same failure with dape_impl='triton': the error itself."""
    runs.clear()
    forced, = models(("triton",), pos=pos, dape="v1")
    dape_paths.VERDICTS.clear()
    with pytest.raises(RuntimeError, match="CUDA error"):
        train_step(forced, torch.randint(0, 32, (2, 19)))


def test_a_later_launch_that_fails_falls_back_or_raises(auto_on_cpu, monkeypatch):
    """A real launch that raises after the check passed: under auto the same as a failed check, and
    remembered; forced, the error itself."""
    runs = fails_after_the_first(monkeypatch, "attention")
    fused, torch_path = models(("auto", "torch"), pos="kerple", dape="v1")
    falls_back_once(fused, torch_path, torch.randint(0, 32, (2, 19)),
                    r"DAPE: the fused kernel failed \(RuntimeError: CUDA error.*: running the PyTorch path")
    assert len(runs) == 2  # the check's, then the launch that failed: remembered, not tried again
    raises_when_forced(runs, "kerple")


def test_a_backward_launch_that_fails_falls_back_or_raises(auto_on_cpu, monkeypatch):
    """The backward launch raises after the check passed: under auto, loss.backward() still returns the
    PyTorch path's gradients, one warning says why, and later calls of that kind take the PyTorch path;
    forced, the error itself."""
    launches = fails_after_the_first(monkeypatch, "_backward_launch")
    calls = counting(monkeypatch)
    fused, torch_path = models(("auto", "torch"), pos="fox", dape="v1")
    falls_back_once(fused, torch_path, torch.randint(0, 32, (2, 19)),
                    r"DAPE: the fused kernel's backward pass failed \(RuntimeError: CUDA error.*: running the "
                    r"PyTorch path")
    assert len(calls) == 1 + fused.config.n_layer  # the check's run, then the first step's forward passes only
    raises_when_forced(launches, "fox")


def test_the_check_runs_the_backward_binary_the_model_runs(auto_on_cpu, monkeypatch):
    """The model hands the backward pass its gradient as rearrange's transposed view; the kernel takes it
    contiguous, so the check (whose gradient is contiguous) launched the same binary: the same strides."""
    real, seen = dape_triton._backward_launch, []
    monkeypatch.setattr(dape_triton, "_backward_launch", lambda *a, **k: seen.append(a[10].stride()) or real(*a, **k))
    fused, = models(("auto",), pos="kerple", dape="v1")
    train_step(fused, torch.randint(0, 32, (2, 19)))
    assert len(seen) == 1 + 2 and len(set(seen)) == 1, seen  # the check's launch, then the model's two


def test_forcing_a_kernel_that_fails_its_check_is_an_error(monkeypatch):
    failing_launches(monkeypatch)
    fused, = models(("triton",), pos="kerple", dape="v1")
    x = torch.randint(0, 32, (1, 5))
    with pytest.raises(ValueError, match=r"dape_impl='triton' cannot run here: the fused kernel failed in "
                                         r"float32 at its check \(OutOfResources"):
        fused(x, x)


# An error in one gradient of the kernel's backward pass: (its position in _Attention.backward's outputs,
# the model, the name the check reports)
GRADIENT_ERRORS = {
    "dk": (1, dict(pos="kerple", dape="v1"), "dk"),
    "dbias": (3, dict(pos="kerple", dape="v1"), "dbias"),
    "du": (4, dict(pos="fox", dape="v1"), "du"),
    "dw": (5, dict(pos="fox", dape="v2"), "dw"),
    "dw1": (6, dict(pos="kerple", dape="v1"), r"df\.mlp\.0\.weight"),
    "db1": (7, dict(pos="alibi", dape="v2"), r"df\.conv1\.bias"),
}


def plant_gradient_error(monkeypatch, index, when=lambda ctx: True):
    real = dape_triton._Attention.backward

    def backward(ctx, dy):
        grads = list(real(ctx, dy))
        if when(ctx) and grads[index] is not None:
            grads[index] = 1.5 * grads[index]
        return tuple(grads)
    monkeypatch.setattr(dape_triton._Attention, "backward", staticmethod(backward))


@pytest.mark.parametrize("case", list(GRADIENT_ERRORS))
def test_an_error_that_only_a_gradient_shows_is_caught(auto_on_cpu, monkeypatch, case):
    """The check compares every gradient, each under its own name: an error in one alone is named, and the
    model then trains as the PyTorch path does."""
    index, kw, name = GRADIENT_ERRORS[case]
    plant_gradient_error(monkeypatch, index)
    fused, torch_path = models(("auto", "torch"), **kw)
    falls_back_once(fused, torch_path, torch.randint(0, 32, (2, 19)), rf"the fused kernel's {name} differs")


@pytest.mark.parametrize("pos", ["kerple", "fox"])
def test_frozen_f_and_frozen_encoding_keep_the_kernel(auto_on_cpu, monkeypatch, pos):
    """The first ablations anyone tries: f frozen, or the encoding's parameters frozen (FoX's gate: its bias
    still needs a gradient, which flows into the residual stream). The kernel stays in use with no warning,
    and trains as the PyTorch path does."""
    fused, torch_path = models(("auto", "torch"), pos=pos, dape="v1")
    for m in (fused, torch_path):
        m.transformer.h[0].attn.dape.requires_grad_(False)
        m.pe.requires_grad_(False)
    calls = counting(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training(fused, torch_path, torch.randint(0, 32, (2, 19)))
    assert len(calls) > fused.config.n_layer
    assert fused.transformer.h[0].attn.dape.mlp[0].weight.grad is None


def test_a_frozen_gate_still_has_its_bias_gradient_checked(auto_on_cpu, monkeypatch):
    plant_gradient_error(monkeypatch, GRADIENT_ERRORS["du"][0])
    fused, torch_path = models(("auto", "torch"), pos="fox", dape="v1")
    for m in (fused, torch_path):
        m.pe.requires_grad_(False)
    falls_back_once(fused, torch_path, torch.randint(0, 32, (2, 19)), r"the fused kernel's du differs")


def test_a_check_without_gradients_does_not_vouch_for_training(auto_on_cpu, monkeypatch):
    """An evaluation call first (no gradients to compare), then training: training is a kind of its own."""
    plant_gradient_error(monkeypatch, GRADIENT_ERRORS["dk"][0])
    fused, torch_path = models(("auto", "torch"), pos="kerple", dape="v1")
    x = torch.randint(0, 32, (2, 19))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        fused(x, x)
    falls_back_once(fused, torch_path, x, r"the fused kernel's dk differs")


def test_a_float32_check_does_not_vouch_for_bfloat16(auto_on_cpu, monkeypatch):
    real = dape_triton.attention
    counting(monkeypatch, lambda q, *a, **k: (1.5 if q.dtype == torch.bfloat16 else 1.0) * real(q, *a, **k))
    fused, = models(("auto",), pos="kerple", dape="v1")
    x = torch.randint(0, 32, (1, 9))
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fused(x, x)
        with pytest.warns(UserWarning, match=r"the fused kernel's y differs"), torch.autocast("cpu", torch.bfloat16):
            fused(x, x)


def test_the_check_runs_float64_against_float32_and_the_calls_dtype(auto_on_cpu, monkeypatch):
    """The plain form in float64 is the reference; the kernel runs in float32 (held to float32 rounding) and,
    for a bfloat16 call, in bfloat16 too."""
    import dape_check
    seen = {"reference": [], "kernel": []}
    attend, fused = dape_check.attend, dape_check.fused
    monkeypatch.setattr(dape_check, "attend", lambda m, x, *a: seen["reference"].append(x["q"].dtype) or attend(m, x, *a))
    monkeypatch.setattr(dape_check, "fused", lambda m, x, *a: seen["kernel"].append(x["q"].dtype) or fused(m, x, *a))
    m, = models(("auto",), pos="kerple", dape="v1")
    x = torch.randint(0, 32, (1, 9))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        m(x, x)
    assert seen == {"reference": [torch.float64], "kernel": [torch.float32, torch.bfloat16]}


@pytest.mark.parametrize("pos,form", [("kerple", "map"), ("fox", "terms")])
def test_the_check_runs_the_bias_as_the_model_gives_it(auto_on_cpu, monkeypatch, pos, form):
    """A kernel wrong only for one form of the bias (a map, or FoX's terms) is caught by a model whose
    encoding gives that form."""
    real = dape_triton.attention
    wrong = lambda q, k, v, bias, *a, **kw: (1.5 if isinstance(bias, tuple) == (form == "terms") else 1.0) * \
        real(q, k, v, bias, *a, **kw)
    counting(monkeypatch, wrong)
    fused, torch_path = models(("auto", "torch"), pos=pos, dape="v1")
    falls_back_once(fused, torch_path, torch.randint(0, 32, (2, 19)), r"the fused kernel's y differs")


# -----------------------------------------------------------------------------
# ranks agree


DDP_SCRIPT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import dape_paths, dape_triton
from model import GPT, GPTConfig
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=rank, world_size=2)
dape_paths.KERNEL_DEVICES = ("cuda", "cpu")
if rank == 1:  # this rank's kernel disagrees
    real = dape_triton.attention
    dape_triton.attention = lambda *a, **k: 1.5 * real(*a, **k)
torch.manual_seed(0)
m = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=8, pos="kerple", dape="v1",
                  dape_impl={impl!r}))
x = torch.randint(0, 32, (1, 9))
try:
    m(x, x)[1].backward()
    print("ran", [v is None for v in dape_paths.VERDICTS.values()])
except ValueError as e:
    print("error", str(e)[:60])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_ranks_agree_on_the_path(tmp_path, impl):
    """Two ranks, one of whose kernel disagrees: under auto both step down (neither waits for the other in
    a collective the other never makes); forced, both raise."""
    script = DDP_SCRIPT.format(root=ROOT, store=str(tmp_path / "store"), impl=impl)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    lines = [o[0].strip().splitlines()[-1] for o in outs]
    want = "ran [False]" if impl == "auto" else "error dape_impl='triton' cannot run here: the"
    assert all(line.startswith(want) for line in lines), lines
