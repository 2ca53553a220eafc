"""
What a trained model's attention does, measured on its own layers: visualize.py draws the terms of the logits
(A, the bias, DAPE's f) at chosen query rows, and eval_extrapolate.py --far_mass records, beside each
perplexity, how much attention every head puts on keys farther back than the training length and what the
encoding has learned per head. They test the usual explanation of length extrapolation (a head whose bias
decays slowly spreads its attention over the many far keys a long window adds) instead of assuming it.

Every term comes from the layer's own code (its qkv, its scores, its DAPE module), fed with the layer's actual
input captured by a hook, so what is measured is what the model computes.
"""

import math

import torch
from einops import rearrange

from positional import as_map


class _Stop(Exception):
    """Raised by the hook once the last wanted layer ran: the later layers are not needed."""


def capture_layers(model, idx, layer_ids):
    """Run the model on idx [B, T] up to the last of layer_ids; return {layer: dict(x, pe, pos_q, pos_k,
    out)} with each layer's attention input (after ln_1), its arguments and its output."""
    captured, last = {}, max(layer_ids)

    def hook(layer):
        def record(module, args, kwargs, output):
            names = ('x', 'pe', 'pos_q', 'pos_k')
            captured[layer] = {n: kwargs.get(n, args[i] if i < len(args) else None) for i, n in enumerate(names)}
            captured[layer]['out'] = output
            if layer == last:
                raise _Stop
        return record

    handles = [model.transformer.h[layer].attn.register_forward_hook(hook(layer), with_kwargs=True)
               for layer in layer_ids]
    try:
        with torch.no_grad():
            model(idx)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def layer_terms(attn, x, pe, pos, rows):
    """What the attention layer attn (model.SelfAttention) adds up for the query rows `rows` (sequence
    indices) of x [1, T, C]: A, bias, f (DAPE's term, by dape.py's plain form), the logits before softmax (or
    stick-breaking, and before log-length scaling) and the attention weights, each [H, R, T] float32 (None
    where the model has none), and `out` [R, C], the layer's output at those rows computed from them (equal to
    its forward's: the test of this function)."""
    q, k, v = attn.qkv(x, pe, pos)
    qi = torch.as_tensor(rows, device=x.device)
    ki = torch.arange(x.shape[1], device=x.device)
    state = pe.state(x, k) if pe.reads_input else None
    A, bias = attn.scores(q[:, :, qi], k, pe, pos[qi], pos, qi, ki, state)
    content = (q[:, :, qi] @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if bias is not None:
        bias = as_map(bias).expand_as(A)
    future = ki[None, :] > qi[:, None] if attn.causal else None
    logits = A if bias is None else A + bias
    f = None
    if attn.dape is not None:  # logits = A + bias + f, except for 'concat' (A + f) and no bias (A + f)
        logits = attn.dape(A, bias, future)
        f = logits - A - (bias if bias is not None and attn.dape.variant != "concat" else 0.0)
    # the layer's own normalisation: softmax or stick-breaking, after log-length scaling where the model has it
    att, rem = attn.normalisation(logits, qi, future)
    y = rearrange(attn.mix(att, rem, v, qi), "b h r d -> b r (h d)")
    # for CoPE and PaTH the position term drawn as the bias is what they make of the content logits A
    position = bias if bias is not None else (A - content if pe.contextual else None)
    sq = lambda t: None if t is None else t[0].float().cpu()
    return {'A': sq(content), 'B': sq(position), 'f': sq(f), 'logits': sq(logits), 'att': sq(att),
            'out': attn.c_proj(y)[0].float().cpu()}


@torch.no_grad()
def far_mass(model, x, K, distance):
    """The attention mass each head puts on keys at least `distance` tokens before its query (the training
    length: keys no query saw while training), averaged over the last K queries of the windows x [N, L]:
    [n_layer][n_head] floats. The queries are the ones eval_extrapolate.py scores."""
    n_layer, L = model.config.n_layer, x.shape[1]
    total = torch.zeros(n_layer, model.config.n_head, dtype=torch.float64)
    rows = torch.arange(L - K, L)
    far = (rows[:, None] - torch.arange(L)[None, :]) >= distance  # [K, L]
    for i in range(len(x)):
        caps = capture_layers(model, x[i:i + 1], list(range(n_layer)))
        for layer, c in caps.items():
            att = layer_terms(model.transformer.h[layer].attn, c['x'], c['pe'], c['pos_q'], rows.to(x.device))['att']
            total[layer] += (att * far).sum(-1).mean(-1).double()
    return [[round(float(v), 6) for v in row] for row in total / len(x)]


@torch.no_grad()
def head_values(model, distances):
    """What each layer's encoding has learned, per head: every parameter or buffer with one value per head
    (Kerple's r1 and r2 as stored, ALiBi's slopes, ...), and, for a bias that depends on positions alone, the
    bias itself at each of `distances` (a query at position d, the key at 0: clamps and all, as the model
    adds it). A list with one dict per encoding module (one per layer, or one shared by all layers)."""
    out = []
    for pe in model.pe:
        vals = {name: [round(float(v), 6) for v in t.flatten()]
                for name, t in [*pe.named_parameters(), *pe.named_buffers()] if t.numel() == pe.n_head}
        if pe.has_bias and not pe.needs_content and not pe.reads_input:
            dev = next(model.parameters()).device
            vals['bias_at'] = {}
            for d in distances:
                b = as_map(pe.bias(torch.tensor([d], device=dev), torch.tensor([0], device=dev))).float()
                vals['bias_at'][str(d)] = [round(float(v), 6) for v in b.reshape(-1, pe.n_head).mean(0)]
        out.append(vals)
    return out
