"""The bidirectional attention path (causal=False, used by CHE) and the bias values of positional.py,
against formulas written here from the papers, in both modes and for keys on both sides of a query:

- every bias encoding's [H, Tq, Tk] bias (ALiBi, Kerple, Kerple-power, FIRE, T5, Transformer-XL),
  including the direction-aware distance of bidir_bias (Ruoss et al.'s ALiBi: a key on the left is
  half a step nearer, i.e. +0.5 x slope below the diagonal);
- the attention of a layer, SDPA fast path included, against plain softmax attention for every
  encoding, with and without DAPE;
- RoPE against a rotation in complex numbers; CoPE's contextual positions on a hand-computed example
  and past its npos_max table; Kerple-power's clamp of p at 2.
Nothing here reuses positional.py's own helpers (distance, sinusoid, bucketing)."""
import math

import numpy as np
import pytest
import torch

from model import GPT, GPTConfig
from positional import ENCODINGS

H, C = 4, 24  # heads, width: head size 6
# randomized-looking positions: gaps of several sizes, so that distances are not just 0..T-1
POS = torch.tensor([0, 1, 3, 4, 9, 16, 17, 30, 41])
# a bias from positions alone (FoX's comes from the layer's input: tests/test_fox.py)
BIAS_ENCODINGS = [name for name, E in ENCODINGS.items() if E.has_bias and not E.reads_input]
DISTANCE_BASED = ['alibi', 'kerple', 'kerple_power', 'fire']


def make_pe(pos, causal, bidir_bias='alibi', block_size=16):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block_size, vocab_size=8, n_layer=1, n_head=H, n_embd=C, pos=pos,
                    causal=causal, bidir_bias=bidir_bias)
    pe = ENCODINGS[pos](cfg)
    with torch.no_grad():  # parameters away from their initial values, so that every term counts
        for name, p in pe.named_parameters():
            if name in ('r1', 'r2', 'a'):
                p.copy_(torch.rand_like(p) * 1.5 + 0.2)
            elif name == 'p':
                p.copy_(torch.rand_like(p) * 1.5 + 0.3)
            elif name == 'c':
                p.fill_(0.3)
            elif name == 'L_mult':
                p.fill_(1.5)
            else:
                p.normal_(0, 0.5)
    return pe


def effective_distance(i, j, causal, left_half_step):
    """The distance a distance-based bias sees between query position i and key position j."""
    if causal:
        return float(max(i - j, 0))  # (read only where j <= i)
    return abs(i - j) - (0.5 if left_half_step and j < i else 0.0)


def t5_bucket(rel, bidirectional, num_buckets=32, max_distance=128):
    """T5's relative_position_bucket for rel = key - query, one int at a time (Raffel et al.)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            bucket += num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def sinusoid_row(d, dim):
    """[sin(d w_0), cos(d w_0), sin(d w_1), ...] with w_m = 10000^(-2m/dim) (Vaswani et al.)."""
    out = []
    for m in range(dim // 2):
        w = 10000 ** (-2 * m / dim)
        out += [math.sin(d * w), math.cos(d * w)]
    return np.array(out)


def expected_bias(pe, name, pos, causal, left_half_step, q=None, k=None):
    """[H, T, T] float64 from the papers' formulas, entry by entry."""
    P = [int(v) for v in pos]
    T = len(P)
    out = np.zeros((H, T, T))
    par = {n: p.detach().double().numpy() for n, p in pe.named_parameters()}
    for a, i in enumerate(P):
        for b, j in enumerate(P):
            d = effective_distance(i, j, causal, left_half_step)
            for h in range(H):
                if name == 'alibi':
                    out[h, a, b] = -2 ** (-8 * (h + 1) / H) * d
                elif name == 'kerple':
                    out[h, a, b] = -par['r1'][h, 0, 0] * math.log(1 + par['r2'][h, 0, 0] * d)
                elif name == 'kerple_power':
                    p = min(par['p'][h, 0, 0], 2.0)
                    out[h, a, b] = -par['a'][h, 0, 0] * d ** p
                elif name == 'fire':
                    c, L = abs(par['c']), abs(par['L_mult']) * pe.L0
                    x = math.log(c * d + 1) / (math.log(c * max(i, L) + 1) + pe.eps)
                    hidden = np.maximum(par['mlp.0.weight'][:, 0] * x + par['mlp.0.bias'], 0)
                    out[:, a, b] = par['mlp.2.weight'] @ hidden + par['mlp.2.bias']
                elif name == 't5':
                    out[h, a, b] = par['table.weight'][t5_bucket(j - i, not causal), h]
                elif name == 'xl':
                    hs = C // H
                    r = par['W_R.weight'] @ sinusoid_row(max(i - j, 0) if causal else i - j, C)
                    r_h = r[h * hs:(h + 1) * hs]
                    content = par['u'][h] @ k[0, h, b]
                    position = (q[0, h, a] + par['v'][h]) @ r_h
                    out[h, a, b] = (content + position) / math.sqrt(hs)
    return out


def _modes():
    for name in BIAS_ENCODINGS:
        yield name, True, 'alibi'
        for mode in (['alibi', 'all', 'none'] if name in DISTANCE_BASED else ['alibi']):
            yield name, False, mode


@pytest.mark.parametrize('name, causal, bidir_bias', list(_modes()))
def test_bias_against_formula(name, causal, bidir_bias):
    """Queries in the middle of the sequence see keys on both sides; causal mode is checked on and
    below the diagonal (the rest is masked)."""
    pe = make_pe(name, causal, bidir_bias)
    T = len(POS)
    q = torch.randn(1, H, T, C // H, dtype=torch.float64).float()
    k = torch.randn(1, H, T, C // H, dtype=torch.float64).float()
    with torch.no_grad():
        got = pe.bias(POS, POS, q, k)
    got = got[0] if got.dim() == 4 else got
    left_half_step = not causal and name in DISTANCE_BASED and (
        bidir_bias == 'all' or (bidir_bias == 'alibi' and name == 'alibi'))
    want = expected_bias(pe, name, POS, causal, left_half_step, q.double().numpy(), k.double().numpy())
    keep = np.tril(np.ones((T, T), dtype=bool)) if causal else np.ones((T, T), dtype=bool)
    np.testing.assert_allclose(got.double().numpy()[:, keep], want[:, keep], rtol=1e-5, atol=1e-5)
    if not causal and name in DISTANCE_BASED:  # the bias tells left from right exactly when asked to
        a, b = 4, 5  # POS 9 and 16: query 9 sees 16 on its right, query 16 sees 9 on its left
        assert bool(torch.isclose(got[:, a, b], got[:, b, a]).all()) != left_half_step


def reference_alibi(n_head, T):
    """Ruoss et al.'s bidirectional ALiBi (randomized_positional_encodings, models/
    positional_encodings.py), rebuilt from its construction: minus the distance in both triangles,
    plus 0.5 in the lower one (keys on the left), times the head's slope."""
    tri = lambda rows, cols, k: np.tri(rows, cols, k=k)
    alibi = np.zeros((T, T))
    alibi -= sum(tri(T, T, -i) for i in range(1, T))
    alibi -= sum(tri(T, T, -i).T for i in range(1, T))
    alibi += 0.5 * tri(T, T, -1)
    slopes = np.array([2 ** (-8 * h / n_head) for h in range(1, n_head + 1)])
    return alibi[None] * slopes[:, None, None]


def test_asymmetric_alibi_is_the_reference():
    T = 6
    pos = torch.arange(T)
    got = make_pe('alibi', causal=False, bidir_bias='alibi').bias(pos, pos).double().numpy()
    np.testing.assert_allclose(got, reference_alibi(H, T), rtol=0, atol=1e-6)
    slopes = np.array([2 ** (-8 * h / H) for h in range(1, H + 1)])
    i, j = np.triu_indices(T, 1)  # j right of i at distance j - i; mirrored, the key is on the left
    np.testing.assert_allclose(got[:, j, i] - got[:, i, j], 0.5 * slopes[:, None] * np.ones(len(i)), atol=1e-6)
    assert (got[:, range(T), range(T)] == 0).all()
    # 'none' is the plain symmetric |i - j|; causal attention is the same whatever the option
    sym = make_pe('alibi', causal=False, bidir_bias='none').bias(pos, pos).numpy()
    np.testing.assert_allclose(sym, sym.transpose(0, 2, 1))
    causal = [make_pe('alibi', causal=True, bidir_bias=m).bias(pos, pos) for m in ('alibi', 'all', 'none')]
    assert all(torch.equal(causal[0], c) for c in causal[1:])
    with pytest.raises(ValueError, match='bidir_bias'):
        GPTConfig(n_head=H, n_embd=C, bidir_bias='left')


def plain_attention(attn, x, pe, pos, causal):
    """softmax(mask(A + bias [+ f])) v, written out: no query blocks, no SDPA, DAPE's plain module."""
    B, T, _ = x.shape
    q, k, v = attn.qkv(x, pe, pos)
    idx = torch.arange(T)
    A = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
    if pe.contextual:
        A = pe.logits(q, k, idx, idx)
    bias = pe.bias(pos, pos, q, k) if pe.has_bias else None
    future = idx[None, :] > idx[:, None] if causal else None
    if attn.dape is not None:
        logits = attn.dape(A, None if bias is None else bias.expand_as(A), future)
    else:
        logits = A if bias is None else A + bias
    if future is not None:
        logits = logits.masked_fill(future, float('-inf'))
    y = torch.softmax(logits, dim=-1) @ v
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('dape', ['none', 'v1'])
@pytest.mark.parametrize('name', [n for n, E in ENCODINGS.items() if not E.reads_input])
def test_attention_equals_plain_attention(name, dape, causal):
    """The layer's attention (through SDPA where there is no DAPE and no content term) equals plain
    softmax attention, in both modes, with randomized-looking positions."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=8, n_layer=1, n_head=H, n_embd=C, pos=name, dape=dape,
                    dape_width=8, causal=causal)
    model = GPT(cfg).eval()
    pe, attn = model.pe[0], model.transformer.h[0].attn
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        if attn.dape is not None:  # DAPE's output layer starts at zero: make f count
            for p in attn.dape.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        x = torch.randn(2, len(POS), C)
        got = attn(x, pe, POS, POS)
        want = plain_attention(attn, x, pe, POS, causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rope_is_a_complex_rotation():
    """RoPE (GPT-NeoX layout): feature m and m + hs/2 are the real and imaginary parts of z_m, which
    turns by pos * base^(-2m/hs)."""
    hs = 8
    pe = ENCODINGS['rope'](GPTConfig(n_head=2, n_embd=2 * hs, pos='rope'))
    x = torch.randn(3, 2, len(POS), hs, dtype=torch.float64).float()
    got = pe.rotate(x, POS).double().numpy()
    xn = x.double().numpy()
    z = xn[..., :hs // 2] + 1j * xn[..., hs // 2:]
    theta = 10000.0 ** (-2 * np.arange(hs // 2) / hs)
    turned = z * np.exp(1j * POS.double().numpy()[:, None] * theta)
    np.testing.assert_allclose(got, np.concatenate([turned.real, turned.imag], axis=-1), atol=1e-5)
    # hence q.k depends on the positions only through their difference
    q, k = torch.randn(1, 1, 1, hs), torch.randn(1, 1, 1, hs)
    dot = lambda i, j: float((pe.rotate(q, torch.tensor([i])) * pe.rotate(k, torch.tensor([j]))).sum())
    assert dot(7, 3) == pytest.approx(dot(107, 103), abs=1e-4)


def cope_with_linear_table(causal, npos_max=64):
    """A CoPE layer whose interpolated position logit q . e[p] is p itself (one query feature, a
    table row counting 0, 1, 2, ...): logits(A) - A is then the contextual position p."""
    pe = ENCODINGS['cope'](GPTConfig(n_head=1, n_embd=4, pos='cope', causal=causal))
    with torch.no_grad():
        pe.pos_emb.zero_()
        pe.pos_emb[0] = torch.arange(float(npos_max))
    q = torch.zeros(1, 1, 1, 4)
    q[..., 0] = 1.0
    return pe, q


def keys_for(A):
    """Keys k [1, 1, Tk, 4] whose logits q . k / sqrt(4) with that query are A [1, 1, 1, Tk]."""
    k = torch.zeros(1, 1, A.shape[-1], 4)
    k[..., 0] = 2 * A[0, 0, 0]
    return k


@pytest.mark.parametrize('causal', [True, False])
def test_cope_positions_by_hand(causal):
    """Query 1 of 4 keys with gates sigmoid(A) = 1, 1/2, 0, 1: the position of key j is the sum of the
    gates from j to the query, both ends included. Bidirectional: to the left 1 + 1/2 and 1/2, to the
    right 1/2 + 0 and 1/2 + 0 + 1 (the query's own gate counts on both sides); causal: only the left."""
    pe, q = cope_with_linear_table(causal)
    A = torch.tensor([30.0, 0.0, -30.0, 30.0]).view(1, 1, 1, 4)
    p = (pe.logits(q, keys_for(A), torch.tensor([1]), torch.arange(4)) - A)[0, 0, 0]
    want = [1.5, 0.5, 0.5, 1.5]
    n = 4 if not causal else 2  # causal: keys right of the query are masked afterwards
    torch.testing.assert_close(p[:n], torch.tensor(want[:n]), rtol=0, atol=1e-5)


@pytest.mark.parametrize('causal', [True, False])
def test_cope_past_its_table(causal):
    """100 keys, every gate 1: key j's position is |i - j| + 1, capped at the last row (npos_max - 1)."""
    pe, q = cope_with_linear_table(causal)
    T = 100
    qi, ki = torch.arange(T), torch.arange(T)
    A = torch.full((1, 1, T, T), 30.0)
    p = (pe.logits(q.expand(1, 1, T, 4), keys_for(A[:, :, :1]), qi, ki) - A)[0, 0]
    want = ((qi[:, None] - ki[None, :]).abs() + 1).clamp(max=pe.npos_max - 1).float()
    keep = ki[None, :] <= qi[:, None] if causal else torch.ones(T, T, dtype=torch.bool)
    torch.testing.assert_close(p[keep], want[keep], rtol=0, atol=1e-4)
    # and a whole model runs at that length
    model = GPT(GPTConfig(block_size=16, vocab_size=8, n_layer=1, n_head=2, n_embd=8, pos='cope', causal=causal))
    logits, _ = model(torch.randint(0, 8, (1, T)), torch.randint(0, 8, (1, T)))
    assert logits.shape == (1, T, 8) and torch.isfinite(logits).all()


def test_kerple_power_clamps_p_at_two():
    """p set above 2 acts as 2, and the gradient still reaches p (the clamp is on the value only)."""
    pe = make_pe('kerple_power', causal=False, bidir_bias='none')
    with torch.no_grad():
        pe.p.fill_(3.0)
        pe.a.fill_(0.5)
    b = pe.bias(POS, POS)
    d = (POS[:, None] - POS[None, :]).abs().float()
    torch.testing.assert_close(b, (-0.5 * d ** 2).expand(H, -1, -1))
    b.sum().backward()
    assert torch.isfinite(pe.p.grad).all() and (pe.p.grad != 0).all()
