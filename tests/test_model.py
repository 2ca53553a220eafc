"""The core: every encoding x DAPE in model.py, against independent references and its own invariants."""

import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dape import DAPEV1, DAPEV2, VARIANTS
from common import load_checkpoint
from model import GPT, GPTConfig, KVCache
from positional import ENCODINGS, alibi_slopes, as_map, t5_relative_bucket

POS = list(ENCODINGS)
DAPE = ["none", "v1", "v2"]
BIAS_POS = [p for p, E in ENCODINGS.items() if E.has_bias]


def tiny(pos="kerple", dape="none", seed=0, **kw):
    """A small model whose parameters are pushed well away from their (often near-zero) inits, so that
    every encoding term and the DAPE correction visibly move the logits."""
    args = dict(block_size=16, vocab_size=37, n_layer=2, n_head=3, n_embd=24, pos=pos, dape=dape)
    args.update(kw)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def tokens(B, T, V=37, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def full_logits(model, idx):
    return model(idx, idx)[0]  # targets given -> logits at every position


def set_block(model, n):
    for block in model.transformer.h:
        block.attn.attn_chunk = n


# ---------------------------------------------------------------------------------------------
# causality, prefix consistency, blocking, KV cache: every encoding x every DAPE


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("dape", DAPE)
def test_prefix_consistency(pos, dape):
    model = tiny(pos, dape)
    idx = tokens(2, 13)
    logits = full_logits(model, idx)
    for t in (0, 5, 12):
        prefix = full_logits(model, idx[:, : t + 1])
        torch.testing.assert_close(prefix, logits[:, : t + 1], atol=1e-5, rtol=1e-5)
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 37
    logits2 = full_logits(model, changed)
    torch.testing.assert_close(logits2[:, :7], logits[:, :7], atol=1e-5, rtol=1e-5)
    assert (logits2[:, 7:] - logits[:, 7:]).abs().max() > 1e-3  # and the change did reach later ones


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dape", ["v1", "v2"])
def test_prefix_consistency_variants(variant, dape):
    model = tiny("fire", dape, dape_variant=variant, dape_kernel=5)
    idx = tokens(2, 11)
    logits = full_logits(model, idx)
    torch.testing.assert_close(full_logits(model, idx[:, :6]), logits[:, :6], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("dape", DAPE)
def test_blocked_equals_unblocked(pos, dape):
    model = tiny(pos, dape)
    idx = tokens(2, 15)
    ref = full_logits(model, idx)
    for n in (1, 4, 7, 15):  # 4 and 7 do not divide 15
        set_block(model, n)
        torch.testing.assert_close(full_logits(model, idx), ref, atol=1e-5, rtol=1e-5)


def record_query_blocks(monkeypatch):
    """The list that every attention block's number of queries is appended to, from now on."""
    import model as model_module
    seen = []
    scores = model_module.SelfAttention.scores

    def spy(self, q, *args, **kw):  # every block of queries, with DAPE or without, asks for its scores
        seen.append(q.shape[2])
        return scores(self, q, *args, **kw)
    monkeypatch.setattr(model_module.SelfAttention, "scores", spy)
    return seen


def test_automatic_blocks_bound_memory(monkeypatch):
    import model as model_module
    model = tiny("kerple", "v2")
    idx = tokens(1, 40)
    ref = full_logits(model, idx)
    seen = record_query_blocks(monkeypatch)
    monkeypatch.setattr(model_module, "ATTN_BLOCK_BUDGET", 40 * (4 * 3 + 2 * 32) * 6)  # ~6 query rows
    with torch.no_grad():
        out = full_logits(model, idx)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert max(seen) == 6 and len(seen) == 2 * 7  # 2 layers x ceil(40 / 6) blocks


def test_stick_breaking_blocks_count_its_extra_maps(monkeypatch):
    """Stick-breaking keeps 8 maps of [B, H, Tk] per query, softmax 4: at the same budget its blocks take half
    the query rows (the memory the budget bounds)."""
    import model as model_module
    monkeypatch.setattr(model_module, "ATTN_BLOCK_CACHE_CPU", 2 ** 40)  # the budget alone binds
    monkeypatch.setattr(model_module, "ATTN_BLOCK_BUDGET", 40 * 8 * 3 * 5)  # 5 stick-breaking rows, 10 softmax
    rows = {}
    for attn in ("softmax", "stickbreaking"):
        model = tiny("kerple", "none", attn=attn)
        seen = record_query_blocks(monkeypatch)
        with torch.no_grad():
            full_logits(model, tokens(1, 40))
        rows[attn] = max(seen)
    assert rows == {"softmax": 10, "stickbreaking": 5}


@pytest.mark.parametrize("pos", ["kerple", "cope"])
def test_cpu_blocks_fit_the_cache(monkeypatch, pos):
    """On the CPU a block's [B, H, Q, Tk] map stays within ATTN_BLOCK_CACHE_CPU floats; same logits."""
    import model as model_module
    model = tiny(pos, "none")
    idx = tokens(2, 40)
    ref = full_logits(model, idx)
    seen = record_query_blocks(monkeypatch)
    n_head = model.config.n_head
    monkeypatch.setattr(model_module, "ATTN_BLOCK_CACHE_CPU", 2 * n_head * 40 * 5)  # 5 query rows
    with torch.no_grad():
        out = full_logits(model, idx)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert max(seen) == 5 and len(seen) == 2 * 8  # 2 layers x 40 / 5 blocks


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("dape", DAPE)
def test_kv_cache_generation_equals_full_forward(pos, dape):
    model = tiny(pos, dape, block_size=8)
    prompt = tokens(2, 5)
    n = 3 if pos == "learned" else 7  # 12 tokens: past block_size, except for the one that cannot
    out = model.generate(prompt, max_new_tokens=n, temperature=0)  # greedy
    # greedy decoding recomputed from scratch with the full forward, one token at a time
    idx = prompt
    for _ in range(n):
        logits = full_logits(model, idx)[:, -1]
        idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, idx)
    # and the cached logits themselves equal the full forward's
    cache = KVCache(model.config.n_layer)
    steps = [model(out[:, :5], cache=cache)[0]] + [model(out[:, t : t + 1], cache=cache)[0] for t in range(5, 5 + n)]
    ref = full_logits(model, out)
    # one token at a time sums in another order than the full map: float32 rounding, nothing more
    torch.testing.assert_close(torch.cat(steps, dim=1), ref[:, 4:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pos", [p for p in POS if p != "learned"])
def test_runs_past_training_length(pos):
    model = tiny(pos, "v1", block_size=8)
    logits, loss = model(tokens(1, 50), tokens(1, 50))
    assert logits.shape == (1, 50, 37) and torch.isfinite(loss)


def test_learned_refuses_positions_past_its_table():
    model = tiny("learned", block_size=8)
    model(tokens(1, 8), tokens(1, 8))
    with pytest.raises(ValueError, match="table of 8 positions.*cannot run past its training length"):
        model(tokens(1, 9), tokens(1, 9))
    assert model.generate(tokens(1, 6), max_new_tokens=3).shape == (1, 9)  # positions 0..7 were enough
    with pytest.raises(ValueError, match="learned"):
        model.generate(tokens(1, 6), max_new_tokens=4)


@pytest.mark.parametrize("pos", [p for p in POS if ENCODINGS[p].has_bias or ENCODINGS[p].absolute or ENCODINGS[p].rotary])
def test_fast_path_computes_the_manual_path(pos):
    """Without DAPE, static encodings go through scaled_dot_product_attention; the explicit path
    (logits, + B, mask, softmax) must give the same logits."""
    model = tiny(pos, block_size=32)
    idx = tokens(2, 21)
    fast = full_logits(model, idx)
    for pe in model.pe:
        pe.needs_content = True  # instance flag: forces the explicit path
    torch.testing.assert_close(full_logits(model, idx), fast, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", [p for p in POS if not ENCODINGS[p].causal_only])
@pytest.mark.parametrize("dape", DAPE)
def test_bidirectional_encoder(pos, dape):
    model = tiny(pos, dape, causal=False)
    idx = tokens(2, 9)
    logits = full_logits(model, idx)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 37
    assert (full_logits(model, changed)[:, 0] - logits[:, 0]).abs().max() > 1e-4  # sees the future
    set_block(model, 4)
    # blocks change the matrix products' shapes, hence their rounding: logits are O(5) here, and one of
    # 666 differed by 1.4e-5 once (3e-6 of the scale); a wrong block would differ by O(1)
    torch.testing.assert_close(full_logits(model, idx), logits, atol=5e-5, rtol=1e-5)


def test_odd_sizes_and_backward():
    model = tiny("fire", "v2", n_head=5, n_embd=35, dape_width=7, dape_kernel=5, vocab_size=37)
    model.train()
    idx = tokens(3, 17)
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 17, 37)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_every_parameter_learns():
    """Each encoding's and DAPE's parameters receive a gradient (nothing is computed and dropped)."""
    for pos in POS:
        for dape in DAPE:
            model = tiny(pos, dape)
            model.train()
            model(tokens(2, 12), tokens(2, 12))[1].backward()
            dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
            assert not dead, f"{pos}/{dape}: no gradient for {dead}"


def test_ignore_index_and_last():
    model = tiny("alibi", "v1")
    idx = tokens(2, 12)
    targets = idx.clone()
    targets[:, :-4] = -1
    logits, loss = model(idx, targets)
    ref = F.cross_entropy(logits[:, -4:].reshape(-1, 37), idx[:, -4:].reshape(-1))
    torch.testing.assert_close(loss, ref)
    logits_last, loss_last = model(idx, idx, last=4)
    assert logits_last.shape == (2, 4, 37)
    torch.testing.assert_close(logits_last, logits[:, -4:])
    torch.testing.assert_close(loss_last, ref)
    assert model(idx)[0].shape == (2, 1, 37)


# ---------------------------------------------------------------------------------------------
# DAPE against the paper's reference module


class AppendixJ(nn.Module):
    """The paper's Appendix J module, transcribed (with its num_heads typo fixed)."""

    def __init__(self, head_number=12, mlp_width=32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * head_number, mlp_width), nn.LeakyReLU(),
                                 nn.Linear(mlp_width, head_number))

    def forward(self, attention, bias):
        bias_tile = bias.expand(attention.shape[0], -1, -1, -1)
        x = torch.cat((attention, bias_tile), dim=1).permute(0, 2, 3, 1)  # b h T T -> b T T h
        x = self.mlp(x).permute(0, 3, 1, 2)
        return attention + bias + x


def test_dape_v1_equals_appendix_j():
    torch.manual_seed(0)
    H, D, T = 6, 16, 11
    ref = AppendixJ(H, D)
    ours = DAPEV1(H, D)
    ours.load_state_dict(ref.state_dict())  # the state dicts interchange
    A = torch.randn(3, H, T, T)
    B = torch.randn(1, H, T, T)
    torch.testing.assert_close(ours(A, B[0]), ref(A, B), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(A, B), ref(A, B), atol=1e-5, rtol=1e-5)


def test_dape_variants_by_hand():
    torch.manual_seed(0)
    H, D, T = 4, 8, 5
    A, B = torch.randn(2, H, T, T), torch.randn(H, T, T)

    def mlp(m, x):  # channels-last MLP, written independently of dape.py
        return m.mlp(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    Bb = B.expand(2, -1, -1, -1)
    cases = {"concat": lambda m: A + mlp(m, torch.cat((A, Bb), 1)),
             "add_residual": lambda m: A + B + mlp(m, A + B),
             "bias_only": lambda m: A + B + mlp(m, Bb)}
    for variant, expected in cases.items():
        m = DAPEV1(H, D, variant=variant)
        torch.testing.assert_close(m(A, B), expected(m), atol=1e-5, rtol=1e-5)
    m = DAPEV1(H, D, has_bias=False)
    torch.testing.assert_close(m(A, None), A + mlp(m, A), atol=1e-5, rtol=1e-5)


def test_dape_v2_kernel1_equals_v1():
    torch.manual_seed(0)
    H, D, T = 4, 8, 9
    v1, v2 = DAPEV1(H, D), DAPEV2(H, D, kernel=1)
    with torch.no_grad():
        v2.conv1.weight.copy_(v1.mlp[0].weight[:, :, None, None])
        v2.conv1.bias.copy_(v1.mlp[0].bias)
        v2.conv2.weight.copy_(v1.mlp[2].weight[:, :, None, None])
        v2.conv2.bias.copy_(v1.mlp[2].bias)
    A, B = torch.randn(2, H, T, T), torch.randn(H, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    keep = ~future
    torch.testing.assert_close(v2(A, B, future)[..., keep], v1(A, B, future)[..., keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v2(A, B, None), v1(A, B, None), atol=1e-5, rtol=1e-5)


def test_dape_v2_zeroes_the_future_before_each_conv():
    """Reference: a row i computed from only its own i + 1 columns, with the conv's zero padding;
    V2 on the full masked map must give the same numbers on and below the diagonal."""
    torch.manual_seed(0)
    H, D, T, k = 3, 5, 8, 3
    v2 = DAPEV2(H, D, kernel=k)
    A, B = torch.randn(1, H, T, T), torch.randn(H, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    out = v2(A, B, future)
    for i in range(T):
        Ai, Bi = A[:, :, i : i + 1, : i + 1], B[None, :, i : i + 1, : i + 1]
        x = torch.cat((Ai, Bi), 1)
        h = F.leaky_relu(v2.conv1(x), 0.01)
        row = Ai + Bi + v2.conv2(h)
        torch.testing.assert_close(out[:, :, i : i + 1, : i + 1], row, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# encodings against known values and their defining properties


def test_alibi_slopes():
    expected_12 = [2 ** -i for i in range(1, 9)] + [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected_12))
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2.0 ** (-2 * i) for i in range(1, 5)]))


def test_t5_buckets():
    d = torch.tensor([0, 15, 16, 20, 32, 64, 100, 127, 1000])
    got = t5_relative_bucket(-d, bidirectional=False, num_buckets=32, max_distance=128)
    assert got.tolist() == [0, 15, 16, 17, 21, 26, 30, 31, 31]
    # bidirectional: 16 buckets a side, keys after the query in the upper half
    both = t5_relative_bucket(torch.tensor([-3, 0, 3, 200]), bidirectional=True)
    assert both.tolist() == [3, 0, 19, 31]


def test_t5_table_is_shared_by_layers():
    model = tiny("t5", n_layer=3)
    assert len(model.pe) == 1
    assert sum("table" in n for n, _ in model.named_parameters()) == 1


def test_rope_depends_only_on_relative_position():
    model = tiny("rope", n_head=2, n_embd=16)
    rope = model.pe[0]
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)

    def score(i, j):
        qi = rope.rotate(q, torch.tensor([i]))
        kj = rope.rotate(k, torch.tensor([j]))
        return (qi * kj).sum(-1)
    for i, j, shift in [(5, 2, 100), (0, 0, 7), (30, 1, 5000)]:
        torch.testing.assert_close(score(i, j), score(i + shift, j + shift), atol=1e-4, rtol=1e-4)
    assert (score(5, 2) - score(5, 3)).abs().max() > 1e-3


def test_bias_formulas():
    cfg = GPTConfig(block_size=16, n_head=2, n_embd=8, vocab_size=10)
    pos = torch.arange(6)
    d = (pos[:, None] - pos[None, :]).clamp(min=0).float()
    kerple = ENCODINGS["kerple"](cfg)
    torch.testing.assert_close(kerple.bias(pos, pos), -kerple.r1 * torch.log(1 + kerple.r2 * d))
    power = ENCODINGS["kerple_power"](cfg)
    torch.testing.assert_close(power.bias(pos, pos), -power.a * d ** power.p)
    alibi = ENCODINGS["alibi"](cfg)
    torch.testing.assert_close(alibi.bias(pos, pos), -alibi_slopes(2)[:, None, None] * d)
    fire = ENCODINGS["fire"](GPTConfig(block_size=4, n_head=2, n_embd=8, vocab_size=10, pos="fire"))
    psi = lambda x: torch.log(0.1 * x + 1)
    x = psi(d) / (psi(torch.maximum(pos.float(), torch.tensor(4.0)))[:, None] + 1e-6)
    torch.testing.assert_close(fire.bias(pos, pos), fire.mlp(x[..., None]).permute(2, 0, 1))


def test_kerple_parameters_are_kept_above_floor_but_still_learn():
    cfg = GPTConfig(block_size=16, n_head=2, n_embd=8, vocab_size=10)
    kerple = ENCODINGS["kerple"](cfg)
    with torch.no_grad():
        kerple.r1.fill_(-0.5)
        kerple.r2.fill_(0.5)
    pos = torch.arange(4)
    d = (pos[:, None] - pos[None, :]).clamp(min=0).float()
    b = kerple.bias(pos, pos)
    torch.testing.assert_close(b, (-0.01 * torch.log(1 + 0.5 * d)).expand(2, 4, 4))
    b.sum().backward()
    assert kerple.r1.grad.abs().sum() > 0  # a straying parameter can still be pulled back


def test_cope_positions_count_gates():
    """Independent check of CoPE's contextual positions on one row: p_ij = sum_{t=j..i} sigmoid(A_it)."""
    cfg = GPTConfig(block_size=16, n_head=1, n_embd=4, vocab_size=10, pos="cope")
    cope = ENCODINGS["cope"](cfg)
    with torch.no_grad():
        cope.pos_emb.copy_(torch.randn(4, 64))
    T = 6
    q, k = torch.randn(1, 1, T, 4), torch.randn(1, 1, T, 4)
    A = q @ k.transpose(-1, -2) / 2  # the logits q . k / sqrt(4)
    out = cope.logits(q, k, torch.arange(T), torch.arange(T))
    E = q[0, 0] @ cope.pos_emb  # [T, 64]
    for i in range(T):
        for j in range(i + 1):
            p = torch.sigmoid(A[0, 0, i, j : i + 1]).sum()
            lo, w = int(p.floor()), p - p.floor()
            expected = A[0, 0, i, j] + E[i, lo] * (1 - w) + E[i, min(lo + 1, 63)] * w
            torch.testing.assert_close(out[0, 0, i, j], expected, atol=1e-5, rtol=1e-5)


def test_distances_and_biases_stay_float32_under_autocast():
    idx = tokens(1, 10)
    for pos in BIAS_POS:
        model = tiny(pos, "v1")
        pe = model.pe[0]
        p = torch.arange(3000, 3005)
        q = k = torch.randn(1, 3, 5, 8, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            # FoX's bias reads its state from the layer's input
            state = pe.state(torch.randn(1, 5, 24), k) if pe.reads_input else None
            b = as_map(pe.bias(p - 3000, p - 3000, q, k, state) if pe.reads_input else pe.bias(p, p, q, k))
            logits, _ = model(idx, idx)
        assert b.dtype == torch.float32, pos
        assert torch.isfinite(logits).all()


def test_randomized_positions():
    model = tiny("rope", rand_pos=True, block_size=8)
    assert model.config.rand_pos_max == 32
    model.train()
    torch.manual_seed(0)
    pos = model.positions(8)
    assert pos.tolist() == sorted(pos.tolist()) and len(set(pos.tolist())) == 8 and pos.max() < 32
    assert pos.tolist() != list(range(8))
    model.eval()
    assert model.positions(8).tolist() == list(range(8))
    model.train()
    logits, loss = model(tokens(2, 8), tokens(2, 8))
    loss.backward()
    model.eval()
    assert model(tokens(1, 40), tokens(1, 40))[0].shape == (1, 40, 37)  # tested past the training range


def test_learned_with_randomized_positions_covers_the_random_range():
    model = tiny("learned", rand_pos=True, block_size=8, rand_pos_max=20)
    model(tokens(1, 20), tokens(1, 20))
    with pytest.raises(ValueError, match="table of 20 positions"):
        model(tokens(1, 21), tokens(1, 21))


def test_randomized_positions_at_evaluation():
    """rand_pos_eval: evaluation draws positions as training does (one sorted subset of
    [0, rand_pos_max) per forward); a KV cache cannot continue them, which generate says."""
    model = tiny("rope", rand_pos=True, block_size=8, rand_pos_max=64).eval()
    assert torch.equal(model.positions(10), torch.arange(10))
    model = tiny("rope", rand_pos=True, block_size=8, rand_pos_max=64, rand_pos_eval=True).eval()
    drawn = [model.positions(10) for _ in range(5)]
    assert all((p.diff() > 0).all() and 0 <= p.min() and p.max() < 64 for p in drawn)
    assert any(not torch.equal(p, torch.arange(10)) for p in drawn)
    with pytest.raises(ValueError, match="cannot continue a KV cache"):
        model.generate(tokens(1, 3), 2)


def test_untied_output_head():
    tied, untied = tiny("alibi"), tiny("alibi", tie_weights=False)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    n_embd = untied.transformer.wte.weight.numel()
    assert untied.get_num_params() == tied.get_num_params() + n_embd


# ---------------------------------------------------------------------------------------------
# configuration errors, optimizer, flops, checkpoints


@pytest.mark.parametrize("kwargs, message", [
    (dict(pos="rotary"), "unknown pos='rotary'; choose one of nope, learned"),
    (dict(dape="v3"), "unknown dape='v3'"),
    (dict(dape="v1", dape_variant="concatenate"), "unknown dape_variant='concatenate'"),
    (dict(dape="v2", dape_kernel=4), "dape_kernel must be odd"),
    (dict(dape_variant="concat"), "has no effect with dape='none'"),
    (dict(pos="rope", dape="v1", dape_variant="bias_only"), "needs a positional bias B, and pos='rope' has none"),
    (dict(pos="nope", rand_pos=True), "rand_pos has no effect with pos='nope'"),
    (dict(pos="rope", rand_pos_max=64), "rand_pos_max=64 has no effect without rand_pos=True"),
    (dict(pos="rope", rand_pos_eval=True), "rand_pos_eval has no effect without rand_pos=True"),
    (dict(pos="rope", rand_pos=True, rand_pos_max=8), "must be >= block_size"),
    (dict(pos="alibi", fire_L0=64), "fire_L0 has no effect with pos='alibi'"),
    (dict(n_embd=30, n_head=4), "must be divisible by n_head"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(pos="rope", n_embd=15, n_head=3), "even head size"),
])
def test_config_errors(kwargs, message):
    args = dict(block_size=16, vocab_size=10, n_layer=1, n_head=2, n_embd=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPT(GPTConfig(**args))


def test_generate_needs_a_causal_model():
    with pytest.raises(ValueError, match="causal=False"):
        tiny("alibi", causal=False).generate(tokens(1, 3), 2)


@pytest.mark.parametrize("pos, pe_decayed", [
    ("kerple", set()), ("kerple_power", set()), ("xl", {"W_R.weight"}), ("cope", set()),
    ("fire", {"mlp.0.weight", "mlp.2.weight"}), ("t5", {"table.weight"}), ("fox", {"gate.weight"}),
    ("path_fox", {"w_proj.0.weight", "w_proj.1.weight", "w_conv.weight", "beta_proj.weight", "gate.weight"})])
def test_optimizer_decays_layer_weights_only(pos, pe_decayed):
    """Weight decay on Linear, conv and embedding weights (the encodings' Linear layers among them: FoX's
    gate, FIRE's MLP, XL's W_R); never on biases, norms or the encodings' own parameter tensors, whatever
    their shape (Kerple's [H, 1, 1] slopes, XL's [H, hs] biases u and v)."""
    model = tiny(pos, "v2")
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    assert decayed | {names[id(p)] for p in no_decay["params"]} == set(names.values())
    assert {n.split(".", 2)[2] for n in decayed if n.startswith("pe.")} == pe_decayed
    assert {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
            "transformer.h.0.attn.dape.conv1.weight", "transformer.h.0.attn.dape.conv2.weight"} <= decayed
    assert not any(n.endswith("bias") or ".ln_" in n for n in decayed), decayed


def test_flops_count_dape():
    base, v1, v2 = tiny("kerple"), tiny("kerple", "v1"), tiny("kerple", "v2", dape_kernel=3)
    extra_v1 = v1.flops_per_token(100) - base.flops_per_token(100) - 6 * (v1.get_num_params() - base.get_num_params())
    assert extra_v1 == 3 * 2 * 100 * 2 * (6 * 32 + 32 * 3)  # layers x T x 2 x (2H*D + D*H), x3 for fwd+bwd
    assert v2.flops_per_token(100) > v1.flops_per_token(100)


def test_load_checkpoint(tmp_path):
    model = tiny("fire", "v2")
    from dataclasses import asdict
    torch.save({"model": {"_orig_mod." + k: v for k, v in model.state_dict().items()},
                "model_args": asdict(model.config)}, tmp_path / "ckpt.pt")
    loaded, ckpt = load_checkpoint(str(tmp_path))
    idx = tokens(1, 9)
    torch.testing.assert_close(full_logits(loaded.eval(), idx), full_logits(model, idx))
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*train one first"):
        load_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "ckpt.pt").write_bytes(open(tmp_path / "ckpt.pt", "rb").read()[:1000])
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(str(tmp_path / "bad"))
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a train.py checkpoint"):
        load_checkpoint(str(tmp_path / "other.pt"))


def test_weights_that_do_not_fit_model_args_are_refused(tmp_path):
    """A readable checkpoint whose weights are not those of its model_args' model is a ValueError naming the
    file, from load_checkpoint (sample.py, the evaluations; train.py's resume checks its own model alike), not a
    size-mismatch traceback from loading the state dict; the file is only read."""
    from dataclasses import asdict
    model = tiny("kerple", "v1")
    state = model.state_dict()
    state["transformer.wte.weight"] = torch.zeros(40, 24)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": state, "model_args": asdict(model.config), "optimizer": {}}, path)
    before = path.read_bytes()
    message = (r"ckpt\.pt does not match its own model_args \(shape: transformer\.wte\.weight is \(40, 24\), "
               r"not \(37, 24\)\): retrain it, or use another checkpoint")
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path))
    assert path.read_bytes() == before
    # options this model.py does not know are named too
    torch.save({"model": state, "model_args": {**asdict(model.config), "future_opt": 1}}, path)
    with pytest.raises(ValueError, match=r"model options this model.py does not know: \['future_opt'\]; use it "
                                         r"with the code that wrote it"):
        load_checkpoint(str(path))
    torch.save({"model": state, "model_args": list(asdict(model.config).items())}, path)
    with pytest.raises(ValueError, match=r"ckpt\.pt is not a train.py checkpoint: its model_args is a list, not a "
                                         r"dict of options"):
        load_checkpoint(str(path))


@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("c++"), reason="torch.compile needs a C++ compiler")
def test_compiled_model_equals_eager():
    """torch.compile (train.py --compile=True) runs DAPE on whole maps, the path CUDA takes, where eager
    CPU runs it tile by tile: the loss and every gradient agree. One layer of Kerple + DAPE V2 (causal
    masking and zeroing of the future before each conv), ~20 s to compile on 2 cores."""
    model = tiny("kerple", "v2", n_layer=1)
    x, y = tokens(2, 16), tokens(2, 16)
    _, loss = model(x, y)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _, compiled_loss = torch.compile(model)(x, y)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=1e-4, atol=1e-5, msg=n)
