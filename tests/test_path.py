"""PaTH (positional.PaTH, PaTH-FoX, DAPE on PaTH): its logits against the product of Householder-like
matrices applied token by token in float64, and its attention against the authors' reference
(flash-linear-attention's naive_path_attn, which test.sh installs; fla-core is the package that holds it);
gradients against float64; its state across a KV cache; the model's prefix consistency, cached decoding,
query blocks and evaluation at 16x its training length; the causal-only and rand_pos errors. (Causality,
prefix consistency and cached decoding also run over every encoding in tests/test_model.py.)"""

import os

import pytest
import torch
import torch.nn.functional as F

import positional
from model import GPT, GPTConfig, KVCache
from positional import CHUNK, PaTHState, path_logits, path_state

# lengths below, at and past the chunk, a multiple of it and not
LENGTHS = [1, 5, CHUNK - 1, CHUNK, CHUNK + 6, 2 * CHUNK, 2 * CHUNK + 3]


def inputs(T, B=2, H=3, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=dtype) for _ in range(3))
    w = F.normalize(torch.randn(B, H, T, d, generator=g, dtype=dtype), dim=-1)
    beta = 2 * torch.rand(B, H, T, generator=g, dtype=dtype)  # (0, 2): reflections included
    return q, k, v, w, beta


def logits(q, k, w, beta, qi=None):
    T = k.shape[2]
    state = PaTHState(None, w, beta, *path_state(w, beta, k))
    return path_logits(q, k, torch.arange(T) if qi is None else qi, state)


def product_logits(q, k, w, beta):
    """q_i . (H_i ... H_{j+1} k_j), the key carried through one token at a time, in float64."""
    q, k, w, beta = (t.double() for t in (q, k, w, beta))
    B, H, T, _ = q.shape
    A = torch.zeros(B, H, T, T, dtype=torch.float64)
    for j in range(T):
        x = k[:, :, j]
        A[:, :, j, j] = (q[:, :, j] * x).sum(-1)
        for t in range(j + 1, T):  # key j as token t sees it
            x = x - beta[:, :, t, None] * (w[:, :, t] * x).sum(-1, keepdim=True) * w[:, :, t]
            A[:, :, t, j] = (q[:, :, t] * x).sum(-1)
    return A


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


@pytest.mark.parametrize("T", LENGTHS)
def test_logits_are_the_product_of_the_transforms(T):
    q, k, _, w, beta = inputs(T)
    got = logits(q, k, w, beta)
    want = product_logits(q, k, w, beta)
    keep = causal(T)
    torch.testing.assert_close(got.double()[..., keep], want[..., keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [CHUNK + 6, 2 * CHUNK + 3])
@pytest.mark.parametrize("rows", [1, 7, CHUNK, CHUNK + 5])
def test_any_block_of_queries_gives_its_rows(T, rows):
    """Query blocks that start and end anywhere, across chunk boundaries, give the rows of the whole map."""
    q, k, _, w, beta = inputs(T)
    whole = logits(q, k, w, beta)
    state = PaTHState(None, w, beta, *path_state(w, beta, k))
    for s in range(0, T, rows):
        e = min(T, s + rows)
        part = path_logits(q[:, :, s:e], k, torch.arange(s, e), state)
        keep = causal(T)[s:e]
        torch.testing.assert_close(part[..., keep], whole[:, :, s:e][..., keep], rtol=1e-5, atol=1e-5)


def test_a_reflection_reverses_and_a_projection_removes():
    """beta = 2 with w along the key reflects it (the logit changes sign); beta = 1 projects it out (0)."""
    d = 4
    q = torch.zeros(1, 1, 2, d)
    q[..., 0] = 1.0
    k = q.clone()
    w = torch.zeros(1, 1, 2, d)
    w[..., 0] = 1.0
    for beta, want in ((2.0, -1.0), (1.0, 0.0), (0.0, 1.0)):
        A = logits(q, k, w, torch.full((1, 1, 2), beta))
        assert abs(A[0, 0, 1, 0].item() - want) < 1e-6, beta


def reference():
    """flash-linear-attention's naive_path_attn; installed by test.sh, so CI never skips it."""
    if os.environ.get("CI"):
        from fla.ops.path_attn.naive import naive_path_attn
        return naive_path_attn
    return pytest.importorskip("fla.ops.path_attn.naive").naive_path_attn


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("T", [5, CHUNK, 64, 70, 131])  # the reference's chunk is 64
def test_attention_equals_the_authors_reference(T, gate):
    """The same q, k, v, w, beta (and log forget gates g) into PaTH's attention as the model computes it
    (positional.py's logits, FoX's gate bias times the scale) and into naive_path_attn (its own chunk of 64,
    [B, T, H, D] layout, float32): equal to float32 rounding, at lengths that are and are not multiples of
    the chunk."""
    naive_path_attn = reference()
    q, k, v, w, beta = inputs(T, d=16, seed=T)
    g = F.logsigmoid(torch.randn(2, 3, T, generator=torch.Generator().manual_seed(1)) + 2) if gate else \
        torch.zeros(2, 3, T)
    scale = 16 ** -0.5
    want = naive_path_attn(*(t.transpose(1, 2) for t in (q, k, v, w, beta, g)), scale).transpose(1, 2)
    A = logits(q * scale, k, w, beta)
    if gate:
        c = g.cumsum(-1) * scale
        A = A + positional.Terms(c, c).map()
    got = F.softmax(A.masked_fill(~causal(T), float("-inf")), -1) @ v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gradients_against_float64():
    """Every input's gradient through the chunked form in float32 equals the token-by-token product's in
    float64 (and so the chunk terms' solve and masks carry gradients where they should)."""
    T = CHUNK + 9
    x32 = [t.requires_grad_() for t in inputs(T, B=1, H=2, d=6, seed=3)]
    x64 = [t.detach().double().requires_grad_() for t in x32]
    G = torch.randn(1, 2, T, T, generator=torch.Generator().manual_seed(2)).masked_fill(~causal(T), 0)
    q, k, _, w, beta = x32
    (logits(q, k, w, beta) * G).sum().backward()
    q, k, _, w, beta = x64
    (product_logits(q, k, w, beta) * G.double()).sum().backward()
    for name, a, b in zip("qk_wb", x32, x64):
        if name != "_":
            torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4, msg=name)


def model(pos="path", dape="none", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(block_size=16, vocab_size=11, n_layer=2, n_head=2, n_embd=16, pos=pos, dape=dape, dape_width=8)
    m = GPT(GPTConfig(**{**cfg, **kw}))
    with torch.no_grad():  # PaTH's and DAPE's weights away from their init, so that each token's H_t differs
        for pe in m.pe:
            for p in pe.parameters():
                p.normal_(0, 0.5)
        for block in m.transformer.h:
            if block.attn.dape is not None:
                for p in block.attn.dape.parameters():
                    p.normal_(0, 0.3)
    return m.eval()


@pytest.mark.parametrize("pos,dape", [("path", "none"), ("path_fox", "none"), ("path", "v1"), ("path_fox", "v2")])
def test_cached_decoding_equals_the_full_forward(pos, dape):
    """A prompt that ends inside a chunk, then a token at a time across the next chunk boundary: every
    position's logits equal the full forward's (the state's finished chunks are reused, the last recomputed)."""
    m = model(pos, dape)
    T = 2 * CHUNK + 5
    idx = torch.randint(0, 11, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = m(idx, idx)
        cache = KVCache(2)
        got = [m(idx[:, :CHUNK - 3], cache=cache, last=CHUNK - 3)[0]]
        for t in range(CHUNK - 3, T):
            got.append(m(idx[:, t:t + 1], cache=cache)[0])
    got = torch.cat(got, 1)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    state = cache.state[0]
    assert state.w.shape[2] == T and state.Kc.shape[2] == 2 * CHUNK and state.z.shape[1] == 2


@pytest.mark.parametrize("pos,dape", [("path", "none"), ("path_fox", "v1")])
def test_prefix_consistency_and_query_blocks(pos, dape):
    """Logits of a prefix do not depend on what follows; blocks of 7 queries give the same logits."""
    m = model(pos, dape)
    idx = torch.randint(0, 11, (1, CHUNK + 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, _ = m(idx, idx)
        prefix, _ = m(idx[:, :CHUNK + 3], idx[:, :CHUNK + 3])
        for block in m.transformer.h:
            block.attn.attn_chunk = 7
        blocked, _ = m(idx, idx)
    torch.testing.assert_close(prefix, whole[:, :CHUNK + 3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-5)


def test_trains_and_reads_16x_its_training_length():
    """A few steps at 16 tokens move the loss down, every PaTH parameter gets a gradient, and the model
    then reads 256 tokens in query blocks (finite logits, the first 16 positions as at 16)."""
    m = model("path_fox", "v1").train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    idx = torch.arange(17).repeat(4, 1) % 11
    losses = []
    for _ in range(8):
        _, loss = m(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.pe.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    m.eval()
    long = torch.randint(0, 11, (1, 256), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, _ = m(long, long)
        short, _ = m(long[:, :16], long[:, :16])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :16], short, rtol=1e-5, atol=1e-5)


def test_dape_reads_paths_logits():
    """DAPE's f is fed PaTH's logits as A (not q.k), and with the gate FoX's scaled bias as B."""
    m = model("path_fox", "v1")
    attn, pe = m.transformer.h[0].attn, m.pe[0]
    attn.dape_impl = "plain"  # the spy below replaces a method of dape.py, which the fast paths would not run
    seen, probs = {}, attn.dape.probs
    attn.dape.probs = lambda A, bias, *a: seen.update(A=A, B=bias) or probs(A, bias, *a)
    x = torch.randn(1, 20, 16)
    pos = torch.arange(20)
    with torch.no_grad():
        attn(x, pe, pos, pos)
        q, k, _ = attn.qkv(x, pe, pos)
        state = pe.state(x, k)
        want = path_logits(q / 8 ** 0.5, k, pos, state)
        c = state.c / 8 ** 0.5
    keep = causal(20)
    torch.testing.assert_close(seen["A"][..., keep], want[..., keep])
    torch.testing.assert_close(seen["B"][..., keep], (c[..., :, None] - c[..., None, :])[..., keep])
    assert not torch.allclose(seen["A"][..., keep], (q @ k.transpose(-1, -2) / 8 ** 0.5)[..., keep], atol=1e-3)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="pos=path is defined for causal attention only"):
        GPTConfig(pos="path", causal=False)
    with pytest.raises(ValueError, match="rand_pos has no effect with pos='path_fox'"):
        GPTConfig(pos="path_fox", rand_pos=True)


def carried_logits(q, k, w, beta):
    """product_logits for long sequences: every key carried through token t at once, in float64."""
    q, X, w, beta = (t.double() for t in (q, k.clone(), w, beta))
    A = torch.zeros(*q.shape[:3], q.shape[2], dtype=torch.float64)
    for t in range(q.shape[2]):
        wt = w[:, :, t, None]
        X[:, :, :t] -= beta[:, :, t, None, None] * (X[:, :, :t] * wt).sum(-1, keepdim=True) * wt
        A[:, :, t, :t + 1] = (X[:, :, :t + 1] @ q[:, :, t, :, None])[..., 0]
    return A


def test_logits_are_float32_under_bfloat16_autocast():
    """At 1024 tokens the product of the transforms in bfloat16 is off by about 1 (the keys' precision lost
    over many reflections); PaTH's logits leave autocast, as its state does."""
    T = 1024
    q, k, _, w, beta = inputs(T, B=1, H=2)
    state = PaTHState(None, w, beta, *path_state(w, beta, k))
    with torch.autocast("cpu", torch.bfloat16):
        got = path_logits(q, k, torch.arange(T), state)
    assert got.dtype == torch.float32
    keep = causal(T)
    assert (got.double() - carried_logits(q, k, w, beta))[..., keep].abs().max() < 1e-3


def test_the_model_runs_paths_transforms_in_float32_under_autocast():
    """Keys come out of the attention projection in bfloat16 under autocast; PaTH's state and logits take
    them in float32 past a chunk, as without autocast."""
    m = model()
    x = torch.randint(0, 11, (1, 2 * CHUNK + 3))
    with torch.no_grad():
        want = m(x)[0]
        with torch.autocast("cpu", torch.bfloat16):
            got = m(x)[0]
    assert (got.float() - want).abs().max() < 0.1


def test_strengths_are_twice_a_sigmoid_and_directions_unit_vectors():
    """beta_t = 2 sigmoid(Linear(x_t)), in (0, 2); w_t of norm 1 per head (to the 1e-6 of its L2 norm)."""
    m = model()
    pe = m.pe[0]
    x = torch.randn(2, 40, 16)
    k = torch.randn(2, 2, 40, 8)
    with torch.no_grad():
        state = pe.state(x, k)
        torch.testing.assert_close(state.beta, 2 * torch.sigmoid(pe.beta_proj(x)).transpose(1, 2))
    norms = state.w.norm(dim=-1)
    assert norms.shape == (2, 2, 40) and (norms - 1).abs().max() < 1e-4
