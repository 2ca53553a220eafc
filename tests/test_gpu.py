"""What only a GPU can show: the fused DAPE kernels of dape_triton.py compiled and run on it, at every
variant in bfloat16, float16 and float32; the model's fused path training like its PyTorch path; KV-cache
decoding through the kernels. `python gpu_check.py` runs them, in one process per CPU core, then measures
speed and memory; alone: `python -m pytest -m gpu tests/test_gpu.py`. Without CUDA each test is skipped
and says why.

Tolerances. float32: every product in IEEE float32, so the kernels match the float64 reference to float32
rounding (1e-4 of each tensor's scale). float16 / bfloat16: against reference_rounded (rounded where the
kernels round; under Triton's interpreter they agree to the last bit but for rare ties), allowing 5% of the
rounded outputs to differ in their last bit, since tensor cores do not add in IEEE order; and against the
exact float64 reference within 3e-2 (float16) and 1e-1 (bfloat16) of each tensor's scale. Training: the
losses of 20 AdamW steps of the fused and PyTorch paths, from the same weights and batches in bfloat16
autocast, within 2% of each other at every step."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU here: these tests run the compiled Triton kernels (the interpreter runs them on the "
           "CPU in tests/test_dape_triton.py and tests/test_model_fused.py)")]

if torch.cuda.is_available():
    triton = pytest.importorskip("triton")
    import dape_triton
    from model import GPT, GPTConfig, KVCache
    from test_dape_triton import NAMES, make, outputs_and_grads, reference, reference_rounded

CASES = [(ks, variant, bias, causal) for ks in (1, 3)
         for variant, bias in (("concat_residual", "shared"), ("concat", "batch"), ("add_residual", "shared"),
                               ("bias_only", "one"), ("concat_residual", None))
         for causal in (True, False)]


def case_id(case):
    ks, variant, bias, causal = case
    return f"{'v1' if ks == 1 else 'v2'}-{variant}-{bias or 'nobias'}-{'causal' if causal else 'bidirectional'}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compiled_kernels_match_the_reference(case, dtype):
    ks, variant, bias, causal = case
    inputs = make(Bn=2, H=12, hs=64, D=32, Tq=70, ks=ks, variant=variant, bias=bias)
    inputs = [None if t is None else t.cuda() for t in inputs]
    G = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).cuda()
    exact = outputs_and_grads(reference, inputs, torch.float64, G, variant, causal)
    if dtype == torch.float32:
        got = outputs_and_grads(dape_triton.attention, inputs, torch.float32, G, variant, causal)
    else:  # q, k, v in the 16-bit dtype (as under autocast), the bias and f's weights in float32
        qkv = [t.to(dtype) for t in inputs[:3]]
        rest = [None if t is None else t.float() for t in inputs[3:]]
        xs = [t if t is None else t.clone().requires_grad_() for t in qkv + rest]
        y = dape_triton.attention(*xs, variant, causal)
        dy = G.to(dtype)
        grads = iter(torch.autograd.grad(y, [x for x in xs if x is not None], dy))
        got = [y.detach()] + [None if x is None else next(grads) for x in xs]
    top = max(w.abs().max().item() for w in exact if w is not None)
    tol = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 1e-1}[dtype]
    for name, g, w in zip(NAMES, got, exact):
        if w is None:
            assert g is None
            continue
        err = (g.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-2 * top)
        assert err < tol, f"{name}: {err:.2e} of its scale from the float64 reference (tolerance {tol})"
    if dtype != torch.float32 and ks == 1 and bias in ("shared", None):  # what reference_rounded covers
        want = reference_rounded(*[None if t is None else t.double().cpu() for t in qkv + rest], variant, causal,
                                 dy.cpu(), dtype)
        for name, g, w in zip(NAMES[:4], got[:4], want[:4]):
            off = ((g.double().cpu() - w).abs() > 1e-5 * w.abs().max()).double().mean().item()
            assert off < 0.05, f"{name}: {100 * off:.1f}% of elements differ from reference_rounded"


@pytest.mark.parametrize("pos", ["kerple", "fox"])
@pytest.mark.parametrize("dape_name", ["v1", "v2"])
def test_the_models_fused_path_trains_like_its_pytorch_path(dape_name, pos):
    """20 AdamW steps in bfloat16 autocast, dape_impl='auto' (the kernels, once they have matched dape.py)
    against dape_impl='torch', from the same weights and batches: the same losses within 2%, and the kernels
    used; with Kerple's bias map and with FoX's terms."""
    cfg = dict(block_size=128, vocab_size=256, n_layer=2, n_head=12, n_embd=768, pos=pos, dape=dape_name)
    torch.manual_seed(0)
    models = {impl: GPT(GPTConfig(**cfg, dape_impl=impl)).cuda() for impl in ("auto", "torch")}
    models["torch"].load_state_dict(models["auto"].state_dict())
    opts = {impl: m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda") for impl, m in models.items()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (8, 129), generator=g).cuda() for _ in range(20)]
    losses = {impl: [] for impl in models}
    calls = []
    real = dape_triton.attention
    dape_triton.attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for batch in batches:
            for impl, m in models.items():
                with torch.autocast("cuda", torch.bfloat16):
                    _, loss = m(batch[:, :-1], batch[:, 1:])
                opts[impl].zero_grad(set_to_none=True)
                loss.backward()
                opts[impl].step()
                losses[impl].append(loss.item())
    finally:
        dape_triton.attention = real
    assert calls, "the fused kernels were not used (see the warning: the check against dape.py failed?)"
    for step, (a, b) in enumerate(zip(losses["auto"], losses["torch"])):
        assert abs(a - b) <= 0.02 * abs(b), (step, losses)


def test_kv_cache_decoding_through_the_kernels():
    """Token by token against the KV cache (one query per call, q_offset at the cached length) gives the
    logits of the whole sequence at once, in float32."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=12, n_embd=384, pos="alibi", dape="v2",
                      dape_impl="triton")).cuda().eval()
    x = torch.randint(0, 256, (2, 90)).cuda()
    with torch.no_grad():
        full, _ = m(x, x)  # the logits of every position
        cache = KVCache(2)
        steps = [m(x[:, :10], cache=cache)[0]] + [m(x[:, t:t + 1], cache=cache)[0] for t in range(10, 90)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 9:], rtol=1e-4, atol=1e-4)  # positions 9 .. 89


def test_the_check_passes_here():
    """dape_impl='auto' keeps the kernels on this GPU: the check against dape.py runs and agrees for the kinds
    of calls the 125M configs make (bfloat16, V1 and V2, Kerple's bias map and FoX's terms with their
    gradients, causal), and again at a ragged length."""
    import dape_paths
    dape_paths.VERDICTS.clear()
    for pos in ("kerple", "fox"):
        for dape_name in ("v1", "v2"):
            m = GPT(GPTConfig(block_size=128, vocab_size=256, n_layer=1, n_head=12, n_embd=768, pos=pos,
                              dape=dape_name)).cuda()
            for T in (128, 77):
                x = torch.randint(0, 256, (2, T)).cuda()
                with torch.autocast("cuda", torch.bfloat16):
                    m(x, x)[1].backward()
    kernel = dict(dape_paths.VERDICTS)
    assert len(kernel) >= 8, "the check did not run for every kind of call"
    failed = {k: v for k, v in kernel.items() if v is not None}
    assert not failed, failed
    assert math.isfinite(sum(p.grad.float().sum().item() for p in m.parameters() if p.grad is not None))
