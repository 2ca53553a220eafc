"""dape_check.py, the fused kernel's check at its first call of each kind, on planted kernels (the plain form
with one error each, standing in for dape_triton.attention): the incoming gradient is random, the queries'
offset is cut with the keys, a float32 call under autocast is checked in the autocast dtype too, a decoding
call (one query) keeps its keys, and a gradient that is zero in truth is held to a floor of the largest
tensor's size, not of the output's."""

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest.py has set TRITON_INTERPRET=1 before this import

import dape  # noqa: E402
import dape_check  # noqa: E402


class FlipGradient(torch.autograd.Function):
    """The identity, whose backward flips the incoming gradient along the head's channels: invisible to an
    incoming gradient that is the same everywhere."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy.flip(-1)


def call(B=2, H=2, Tq=7, Tk=7, hs=4, q_offset=0):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, hs, generator=g).requires_grad_() for T in (Tq, Tk, Tk))
    torch.manual_seed(0)
    return dape.DAPEV1(H, 4, has_bias=False), q, k, v, None, True, q_offset


def plant(monkeypatch, kernel):
    """dape_check's kernel replaced by kernel(module, x, causal, q_offset); the shapes of x it ran, in a list."""
    seen = []
    monkeypatch.setattr(dape_check, "fused", lambda m, x, causal, q_offset: seen.append(
        {n: t.shape for n, t in x.items()}) or kernel(m, x, causal, q_offset))
    return seen


def test_the_plain_form_as_the_kernel_passes(monkeypatch):
    plant(monkeypatch, dape_check.attend)
    assert dape_check.check(*call()) == (None, None)


@pytest.mark.recorded_dape
def test_an_error_that_a_constant_incoming_gradient_hides(monkeypatch):
    plant(monkeypatch, lambda *a: FlipGradient.apply(dape_check.attend(*a)))
    why, below = dape_check.check(*call())
    assert why.startswith("the fused kernel's dq differs") and why.endswith("the PyTorch path agrees on this call")
    assert below == "torch"


def test_the_offset_is_cut_with_the_keys(monkeypatch):
    """Queries 50.. of 54 keys: cut to 22 keys, the offset must be cut too (to 18), or no key is in the
    queries' future and a kernel that ignores the mask passes."""
    plant(monkeypatch, lambda m, x, causal, q_offset: dape_check.attend(m, x, False, q_offset))
    why, _ = dape_check.check(*call(Tq=4, Tk=54, q_offset=50))
    assert why is not None and why.startswith("the fused kernel's y differs")


def test_a_float32_call_under_autocast_is_checked_in_its_dtype_too(monkeypatch):
    plant(monkeypatch, lambda *a: (1.5 if torch.is_autocast_enabled("cpu") else 1.0) * dape_check.attend(*a))
    with torch.autocast("cpu", torch.bfloat16):
        why, _ = dape_check.check(*call())
    assert why is not None and "(in bfloat16)" in why


def test_a_decoding_call_keeps_its_keys(monkeypatch):
    seen = plant(monkeypatch, dape_check.attend)
    assert dape_check.check(*call(Tq=1, Tk=30, q_offset=29)) == (None, None)
    assert seen[0]["q"][2] == 1 and seen[0]["k"][2] == 30


def test_a_gradient_zero_in_truth_is_held_to_the_largest_tensors_floor():
    want = {"y": torch.full((4, 4), 1e-3, dtype=torch.float64), "dq": torch.ones(4, 4, dtype=torch.float64),
            "db2": torch.zeros(2, dtype=torch.float64)}
    got = dict(want, db2=torch.full((2,), 1e-6, dtype=torch.float64))  # 1e-4 of the floor, 1e-3 of y's size
    assert dape_check.disagreement(got, want, 1e-3) is None
    assert dape_check.disagreement(dict(want, db2=torch.full((2,), 1e-4, dtype=torch.float64)), want, 1e-3)
