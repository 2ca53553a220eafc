"""A model in float64 computes in float64 end to end (A, the bias, DAPE's f, the logits, the loss), so that
torch.autograd.gradcheck can check every gradient of a DAPE block against finite differences: the CPU tiles'
hand-written backward (dape_torch.py) and dape.py's own code (the plain path), with softmax and with
stick-breaking attention."""

import pytest
import torch
from torch.func import functional_call

from model import Block, GPT, GPTConfig


def config(**kw):
    return GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, pos="kerple", **kw)


@pytest.mark.parametrize("attn", ["softmax", "stickbreaking"])
@pytest.mark.parametrize("impl", ["auto", "plain"])
@pytest.mark.parametrize("dape", ["v1", "v2"])
def test_gradcheck_of_a_dape_block_in_float64(dape, impl, attn):
    """Every gradient of a block (its input, f's weights, Kerple's r1 and r2) against finite differences."""
    torch.manual_seed(0)
    cfg = config(dape=dape, dape_impl=impl, attn=attn, dape_width=4)
    model = GPT(cfg).double()
    block, pe = model.transformer.h[0], model.pe[0]
    pos = torch.arange(5)
    x = torch.randn(2, 5, cfg.n_embd, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in block.attn.dape.named_parameters()]
    pe_names = [n for n, _ in pe.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in block.attn.dape.parameters()]
    pe_params = [p.detach().clone().requires_grad_() for p in pe.parameters()]

    def fn(x, *ps):
        dape_p = dict(zip(names, ps[:len(names)]))
        pe_p = dict(zip(pe_names, ps[len(names):]))
        with torch.nn.utils.stateless._reparametrize_module(block.attn.dape, dape_p), \
                torch.nn.utils.stateless._reparametrize_module(pe, pe_p):
            return block(x, pe, pos, pos)

    assert fn(x, *params, *pe_params).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (x, *params, *pe_params), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_a_float64_model_computes_its_logits_and_loss_in_float64():
    """A, the logits of every layer and the loss in float64 (they were float32 whatever the model)."""
    torch.manual_seed(0)
    model = GPT(config(dape="v1", attn="stickbreaking", logn_scale="learned")).double()
    seen = []
    attn = model.transformer.h[0].attn
    real_scores = attn.scores

    def scores(*a, **k):
        out = real_scores(*a, **k)
        seen.append(out[0])
        return out
    attn.scores = scores
    idx = torch.randint(0, 16, (2, 7))
    logits, loss = model(idx, idx)
    assert seen and all(A.dtype == torch.float64 for A in seen)
    assert logits.dtype == torch.float64 and loss.dtype == torch.float64
