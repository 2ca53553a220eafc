"""FoX (the Forgetting Transformer's forget-gate bias, positional.FoX): its bias against a direct sum of log
gates, its state across a KV cache, the layer's attention against softmax written out, the gate's gradients
through DAPE's fast paths against its plain form, and the bidirectional error. (The model-wide invariants,
causality, prefix consistency, blocked and cached decoding, run over every encoding in tests/test_model.py;
the fused kernel with FoX's bias in tests/test_dape_triton.py and tests/test_model_fused.py.)"""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig
from positional import FoX

H, C = 3, 24


def fox(seed=0):
    torch.manual_seed(seed)
    pe = FoX(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=H, n_embd=C, pos="fox"))
    with torch.no_grad():  # gates away from their init (f = 1/2 everywhere), so that each token's differs
        pe.gate.weight.normal_(0, 0.5)
        pe.gate.bias.uniform_(-1, 3)
    return pe


def test_bias_is_the_sum_of_log_gates_between_key_and_query():
    """B_ij = sum over j < t <= i of log sigmoid(w_h . x_t + b_h), summed here token by token in float64."""
    pe = fox()
    x = torch.randn(2, 9, C)
    state = pe.state(x)
    pos = torch.arange(9)
    got = pe.bias(pos, pos, state=state).map()
    w, b = pe.gate.weight.double(), pe.gate.bias.double()
    for n in range(2):
        for h in range(H):
            for i in range(9):
                for j in range(i + 1):
                    want = sum(math.log(torch.sigmoid(w[h] @ x[n, t].double() + b[h]).item()) for t in range(j + 1, i + 1))
                    assert abs(got[n, h, i, j].item() - want) < 1e-5, (n, h, i, j)
    assert got.dtype == torch.float32 and got.shape == (2, H, 9, 9)


def test_state_continues_across_a_cache():
    """The state of tokens that come after cached ones continues the cached running sum: c of the whole
    sequence, in pieces."""
    pe = fox()
    x = torch.randn(2, 11, C)
    whole = pe.state(x)
    first = pe.state(x[:, :4])
    second = pe.state(x[:, 4:5], prev=first)
    third = pe.state(x[:, 5:], prev=second)  # every key's state so far, the cached ones first
    torch.testing.assert_close(third, whole, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(second, whole[..., :5], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dape", ["none", "v1"])
def test_layer_attention_is_softmax_of_logits_plus_the_bias(dape):
    """Without DAPE the layer runs scaled_dot_product_attention with the [B, H, T, T] bias as its mask: the
    same as softmax(q k^T / sqrt(hs) + B (+ f), masked) v written out, and the same gradient in the layer's
    input, which reaches it through q, k, v and through the gates (the residual stream below depends on
    both)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=8, n_layer=1, n_head=H, n_embd=C, pos="fox", dape=dape))
    pe, attn = model.pe[0], model.transformer.h[0].attn
    with torch.no_grad():
        pe.gate.weight.normal_(0, 0.5)
    x = torch.randn(2, 10, C)
    pos = torch.arange(10)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    got = attn(xs[0], pe, pos, pos)
    q, k, v = attn.qkv(xs[1], pe, pos)
    w, b = pe.gate.weight, pe.gate.bias
    c = F.logsigmoid(xs[1] @ w.t() + b).transpose(1, 2).cumsum(-1)  # [B, H, T], the gate read afresh
    A = q @ k.transpose(-1, -2) / math.sqrt(C // H)
    D = c[..., :, None] - c[..., None, :]
    future = torch.ones(10, 10, dtype=torch.bool).triu(1)
    logits = A + D if attn.dape is None else attn.dape(A, D, future)
    logits = logits.masked_fill(future, float("-inf"))
    y = (F.softmax(logits, -1) @ v).transpose(1, 2).reshape(2, 10, C)
    want = attn.c_proj(y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    G = torch.randn(got.shape)
    grads = [torch.autograd.grad((out * G).sum(), x_)[0] for out, x_ in ((got, xs[0]), (want, xs[1]))]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


@pytest.mark.recorded_dape
@pytest.mark.parametrize("dape", ["v1", "v2"])
def test_gate_gradients_through_dape_match_the_plain_form(dape):
    """A + D + f(A, D), D per sequence: DAPE's fast path (on the CPU, tile by tile with its own backward)
    gives every parameter, the forget gate's and those of the layers below it, the gradients that autograd
    gives dape.py's plain form."""
    grads = []
    for impl in ("torch", "plain"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=H, n_embd=C, pos="fox", dape=dape,
                              dape_width=8, dape_impl=impl))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        x = torch.randint(0, 32, (2, 19))
        model(x, x)[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
    assert all(g.abs().sum() > 0 for n, g in grads[0].items() if n.startswith("pe."))


def test_bidirectional_fox_is_an_error():
    with pytest.raises(ValueError, match="pos=fox is defined for causal attention only; use causal=True"):
        GPTConfig(pos="fox", causal=False)
