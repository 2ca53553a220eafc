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
    got = pe.bias(pos, pos, state=(state, state))
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
    third = pe.state(x[:, 5:], prev=torch.cat((first, second), -1))
    torch.testing.assert_close(torch.cat((first, second, third), -1), whole, rtol=1e-6, atol=1e-5)


def test_layer_attention_is_softmax_of_logits_plus_the_bias():
    """Without DAPE the layer runs scaled_dot_product_attention with the [B, H, T, T] bias as its mask: the
    same as softmax(q k^T / sqrt(hs) + B, masked) v written out."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=8, n_layer=1, n_head=H, n_embd=C, pos="fox")).eval()
    pe, attn = model.pe[0], model.transformer.h[0].attn
    with torch.no_grad():
        pe.gate.weight.normal_(0, 0.5)
        x = torch.randn(2, 10, C)
        pos = torch.arange(10)
        got = attn(x, pe, pos, pos)
        q, k, v = attn.qkv(x, pe, pos)
        c = pe.state(x)
        logits = q @ k.transpose(-1, -2) / math.sqrt(C // H) + (c[..., :, None] - c[..., None, :])
        logits = logits.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
        y = (F.softmax(logits, -1) @ v).transpose(1, 2).reshape(2, 10, C)
        want = attn.c_proj(y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dape", ["v1", "v2"])
def test_gate_gradients_through_dape_match_the_plain_form(dape):
    """A + D + f(A, D), D per sequence: DAPE's fast paths (on the CPU, tile by tile with their own backward)
    give the forget gate's parameters the gradients that autograd gives dape.py's plain form."""
    grads = []
    for fast in (True, False):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=H, n_embd=C, pos="fox", dape=dape,
                              dape_width=8))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        for block in model.transformer.h:
            block.attn.dape.fast = fast
        x = torch.randint(0, 32, (2, 19))
        model(x, x)[1].backward()
        grads.append([p.grad.clone() for pe in model.pe for p in pe.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert all(g.abs().sum() > 0 for g in grads[0])


def test_bidirectional_fox_is_an_error():
    with pytest.raises(ValueError, match="pos=fox is defined for causal attention only; use causal=True"):
        GPTConfig(pos="fox", causal=False)
