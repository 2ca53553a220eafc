"""Stick-breaking attention (attn='stickbreaking', Tan et al. 2025) and log-length scaling of the logits
(logn_scale, SSMax). The layer's stick-breaking against flash-linear-attention's reference
(naive_stickbreaking_attn, which test.sh installs), outputs and the gradients of q, k, v in float32 and
float64, with and without the query's own key, and against the stick broken by hand, key by key, in float64;
log-length scaling against softmax (and the stick) of s log(n_i) z_i written out row by row, with s's
gradient, and the fixed s leaving the last query at the training length as it is; then the model with either
option, with and without DAPE V1 and V2, on several encodings: causality, cached decoding against the full
forward, query blocks, DAPE's plain and torch paths, DAPE with f = 0 against the encoding alone, PyTorch's
fused softmax with the scale folded into q and the bias against the explicit path, bfloat16 autocast; the
configuration errors, the fused kernel's refusal, and a training step."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

import dape_paths
import dape_torch
from model import GPT, GPTConfig, KVCache, SelfAttention
from normalisation import stick_breaking
from positional import ENCODINGS

# the options under test, by name
OPTIONS = {
    "sb": dict(attn="stickbreaking"),
    "sb_current": dict(attn="stickbreaking", sb_current=True),
    "logn": dict(logn_scale="learned"),
    "sb_logn": dict(attn="stickbreaking", logn_scale="fixed"),
}
# (pos, dape, option): every option with and without DAPE on Kerple; two options on the others
CASES = [("kerple", d, o) for d in ("none", "v1", "v2") for o in OPTIONS] + [
    (p, d, o) for p, dape in (("alibi", "v1"), ("rope", "v2"), ("nope", "v1"), ("fox", "v2"))
    for d in ("none", dape) for o in ("sb", "logn")]
CAUSAL = list(ENCODINGS)  # every encoding runs causally


def reference():
    """flash-linear-attention's naive_stickbreaking_attn; installed by test.sh, so CI never skips it."""
    if os.environ.get("CI"):
        from fla.ops.stickbreaking_attn.naive import naive_stickbreaking_attn
        return naive_stickbreaking_attn
    return pytest.importorskip("fla.ops.stickbreaking_attn.naive").naive_stickbreaking_attn


def layer(H=3, d=8, block_size=16, **kw):
    """One attention layer without an encoding (nope: the logits are q.k / sqrt(d)), and its encoding."""
    cfg = GPTConfig(block_size=block_size, vocab_size=11, n_layer=1, n_head=H, n_embd=H * d, pos="nope", **kw)
    return SelfAttention(cfg), ENCODINGS["nope"](cfg)


def inputs(T, B=2, H=3, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(B, H, T, d, generator=g, dtype=dtype)).requires_grad_() for _ in range(3)]


def causal_future(T):
    i = torch.arange(T)
    return i[None, :] > i[:, None]


def ours(q, k, v, current):
    """The layer's stick-breaking attention of q, k, v [B, H, T, d]."""
    attn, pe = layer(q.shape[1], q.shape[-1], attn="stickbreaking", sb_current=current)
    pos = torch.arange(q.shape[2])
    if q.dtype == torch.float32:  # the layer's whole path: its logits, then stick-breaking
        return attn.attend(q, k, v, pe, pos, pos, 0)
    # the layer rounds A to float32 (as under autocast): float64 from A on
    A = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return attn.normalise(A, v, pos, causal_future(q.shape[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_equals_flash_linear_attentions_reference(T, current, dtype):
    """The same q, k, v into the layer and into naive_stickbreaking_attn ([B, T, H, K] layout; it returns the
    weighted values o and the stick left over, rem): ours is o + rem v_i without the current key (what Tan et
    al.'s model computes), o with it. Outputs and the gradients of q, k and v."""
    naive_stickbreaking_attn = reference()
    q, k, v = inputs(T, dtype=dtype, seed=T)
    G = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    got = ours(q, k, v, current)
    (got * G).sum().backward()
    mine = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    o, rem = naive_stickbreaking_attn(*(t.transpose(1, 2) for t in (q, k, v)), attend_current=current)
    want = (o if current else o + rem[..., None] * v.transpose(1, 2)).transpose(1, 2)
    (want * G).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, want, **tol)
    for name, a, t in zip("qkv", mine, (q, k, v)):
        torch.testing.assert_close(a, t.grad, **(tol if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)),
                                   msg=name)


def broken_by_hand(z, v, current):
    """Each query breaks its stick key by key, from the nearest back to the first, in float64; the rest of the
    stick goes to the query's own value unless its key took part."""
    z, v = z.double(), v.double()
    B, H, T, _ = z.shape
    y = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for i in range(T):
        left = torch.ones(B, H, dtype=torch.float64)
        for j in range(i if current else i - 1, -1, -1):
            beta = torch.sigmoid(z[:, :, i, j])
            y[:, :, i] += (left * beta)[..., None] * v[:, :, j]
            left = left * (1 - beta)
        if not current:
            y[:, :, i] += left[..., None] * v[:, :, i]
    return y


@pytest.mark.parametrize("current", [False, True])
def test_equals_the_stick_broken_by_hand(current):
    """Logits from -30 to 30 (saturated sigmoids), in float64 through the layer and as weights and remainder:
    the loop's output, and the weights and what is left sum to 1."""
    T = 9
    g = torch.Generator().manual_seed(3)
    z = (8 * torch.randn(2, 3, T, T, generator=g, dtype=torch.float64)).clamp(-30, 30)
    v = torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64)
    attn, _ = layer(attn="stickbreaking", sb_current=current)
    future = causal_future(T)
    got = attn.normalise(z.masked_fill(future, float("-inf")), v, torch.arange(T), future)
    torch.testing.assert_close(got, broken_by_hand(z, v, current), rtol=1e-10, atol=1e-10)
    weights, rem = stick_breaking(z, future, current)
    torch.testing.assert_close(weights.sum(-1) + rem, torch.ones(2, 3, T, dtype=torch.float64))
    assert (weights.diagonal(dim1=-2, dim2=-1) == 0).all() != current  # the query's own key: only with current


Z = torch.tensor([[0.5, 0.0, 0.0, 0.0], [1.0, -2.0, 0.0, 0.0], [0.3, 2.0, -1.0, 0.0], [-1.5, 0.7, 1.2, 0.4]])


@pytest.mark.parametrize("attn", ["softmax", "stickbreaking"])
@pytest.mark.parametrize("mode", ["fixed", "learned"])
def test_log_length_scaling_by_hand(attn, mode):
    """T = 4, one head, known logits z; v the identity, so that the output's rows are the weights (plus the
    remainder on the diagonal): softmax(s log(n_i) z_i) with n_i = i + 1 keys, or the stick broken from
    s log(n_i) z_i with n_i = i keys (the query's own takes no share), n at least 2. Fixed s = 1 / log(n at the
    last query of the training length, 4); learned s gets the gradient that the formula gives it."""
    sb = attn == "stickbreaking"
    att, _ = layer(H=1, d=4, block_size=4, attn=attn, logn_scale=mode)
    s = torch.tensor(1 / math.log(3 if sb else 4), requires_grad=True)
    if mode == "learned":
        with torch.no_grad():
            att.normalisation.logn_s.fill_(0.7)
        s = torch.tensor(0.7, requires_grad=True)
    torch.testing.assert_close(att.normalisation.logn_s.detach(), s.detach().expand(1))
    future = causal_future(4)
    got = att.normalise(Z.masked_fill(future, float("-inf"))[None, None], torch.eye(4)[None, None], torch.arange(4),
                        future)[0, 0]
    rows = []
    for i in range(4):
        n = i if sb else i + 1
        z = s * math.log(max(n, 2)) * Z[i]
        rows.append(broken_by_hand(z.expand(1, 1, 4, 4), torch.eye(4)[None, None], False)[0, 0, i].float() if sb
                    else torch.cat((torch.softmax(z[:i + 1], -1), torch.zeros(3 - i))))
    want = torch.stack(rows)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    G = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    if mode == "learned":
        (got * G).sum().backward()
        (want * G).sum().backward()
        assert att.normalisation.logn_s.grad.abs().item() > 1e-3
        torch.testing.assert_close(att.normalisation.logn_s.grad[0], s.grad, rtol=1e-5, atol=1e-6)
    # rows 2..3 alone, as a block or a cache gives them: their n from their index in the sequence
    part = att.normalise(Z[2:][None, None], torch.eye(4)[None, None], torch.arange(2, 4), future[2:])[0, 0]
    torch.testing.assert_close(part, want[2:], rtol=1e-6, atol=1e-6)


def test_bidirectional_queries_see_every_key():
    """causal=False: every query's logits times s log(Tk), with s = 1 / log(block_size)."""
    att, _ = layer(H=1, d=4, block_size=8, causal=False, logn_scale="fixed")
    got = att.normalise(Z[None, None], torch.eye(4)[None, None], torch.arange(4), None)[0, 0]
    torch.testing.assert_close(got, torch.softmax(Z * math.log(4) / math.log(8), -1))


def tiny(pos="kerple", dape="none", seed=0, **kw):
    """As tests/test_model.py's: parameters pushed away from their inits, so that every term moves the logits."""
    args = dict(block_size=8, vocab_size=37, n_layer=2, n_head=3, n_embd=24, pos=pos, dape=dape)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**args, **kw}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def tokens(B, T, seed=1):
    return torch.randint(0, 37, (B, T), generator=torch.Generator().manual_seed(seed))


def full_logits(model, idx):
    return model(idx, idx)[0]


@pytest.mark.parametrize("attn", ["softmax", "stickbreaking"])
def test_fixed_scale_leaves_the_training_length_as_it_is(attn):
    """With the fixed s the last query at the training length computes what it would without scaling (one
    layer: its row alone); earlier queries and queries past the training length differ."""
    plain = tiny("alibi", n_layer=1, attn=attn, block_size=16)
    scaled = tiny("alibi", n_layer=1, attn=attn, block_size=16, logn_scale="fixed")
    scaled.load_state_dict(plain.state_dict())  # the fixed s is no parameter: the same weights
    idx = tokens(2, 32)
    with torch.no_grad():
        a, b = full_logits(plain, idx), full_logits(scaled, idx)
    torch.testing.assert_close(b[:, 15], a[:, 15], rtol=1e-5, atol=1e-5)
    assert (b[:, 8] - a[:, 8]).abs().max() > 1e-3 and (b[:, 31] - a[:, 31]).abs().max() > 1e-3


@pytest.mark.parametrize("pos,dape,option", CASES)
def test_causal(pos, dape, option):
    """Changing tokens from position 7 on changes no earlier output, and does change later ones."""
    model = tiny(pos, dape, **OPTIONS[option])
    idx = tokens(2, 13)
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 37
    with torch.no_grad():
        a, b = full_logits(model, idx), full_logits(model, changed)
    torch.testing.assert_close(b[:, :7], a[:, :7], atol=1e-5, rtol=1e-5)
    assert (b[:, 7:] - a[:, 7:]).abs().max() > 1e-3


def decode(model, idx, prompt):
    """Every position's logits from a prompt, then one token at a time through a KV cache."""
    cache = KVCache(model.config.n_layer)
    with torch.no_grad():
        steps = [model(idx[:, :prompt], cache=cache, last=prompt)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(prompt, idx.shape[1])]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("pos,dape,option", CASES)
def test_cached_decoding_equals_the_full_forward(pos, dape, option):
    """A prompt of 5, then a token at a time past the training length (8): each query's n and its own value
    come from its index in the sequence, not in the new tokens."""
    model = tiny(pos, dape, **OPTIONS[option])
    idx = tokens(2, 13)
    with torch.no_grad():
        full = full_logits(model, idx)
    torch.testing.assert_close(decode(model, idx, 5), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pos", CAUSAL)
def test_every_encoding_decodes_as_it_reads(pos):
    """Stick-breaking with a learned log-length scale on every encoding: cached decoding equals the full
    forward (learned: within its table)."""
    model = tiny(pos, attn="stickbreaking", logn_scale="learned")
    idx = tokens(2, 8 if pos == "learned" else 13)
    with torch.no_grad():
        full = full_logits(model, idx)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(decode(model, idx, 5), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pos,dape,option", CASES)
def test_query_blocks_equal_one_block(pos, dape, option):
    model = tiny(pos, dape, **OPTIONS[option])
    idx = tokens(2, 15)
    with torch.no_grad():
        whole = full_logits(model, idx)
        for n in (1, 4, 7):  # 4 and 7 do not divide 15
            for block in model.transformer.h:
                block.attn.attn_chunk = n
            torch.testing.assert_close(full_logits(model, idx), whole, atol=1e-5, rtol=1e-5)


def loss_and_grads(model, idx):
    model.zero_grad()
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.recorded_dape
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("dape", ["v1", "v2"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_dape_plain_path_equals_torch_path(monkeypatch, option, dape, tiles):
    """DAPE's logits from dape.py as written and from dape_torch.py (its CPU tiles, or the whole maps that a GPU
    and torch.compile run; masked output), then the same normalisation: the loss and every gradient."""
    if not tiles:
        monkeypatch.setattr(dape_torch, "use_tiles", lambda x: False)
    idx = tokens(2, 11)
    plain = tiny("kerple", dape, dape_impl="plain", **OPTIONS[option])
    fast = tiny("kerple", dape, dape_impl="torch", **OPTIONS[option])
    (a, ga), (b, gb) = loss_and_grads(plain, idx), loss_and_grads(fast, idx)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("dape", ["v1", "v2"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_dape_with_f_zero_is_the_encodings_attention(dape, option):
    """DAPE whose f is zero (dape_init='zero') computes its encoding's logits, and then the same scaling and
    normalisation as the model without DAPE: the DAPE path normalises as the other does."""
    base = tiny("kerple", **OPTIONS[option])
    with_dape = tiny("kerple", dape, dape_init="zero", **OPTIONS[option])
    with_dape.load_state_dict(base.state_dict(), strict=False)
    for block in with_dape.transformer.h:
        block.attn.dape.init_last_layer()  # f = 0 again (tiny moved every parameter)
    idx = tokens(2, 13)
    with torch.no_grad():
        torch.testing.assert_close(full_logits(with_dape, idx), full_logits(base, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos", ["alibi", "kerple", "t5", "rope", "nope", "fox"])
def test_scaled_fused_softmax_equals_the_explicit_path(pos):
    """Without DAPE, softmax with log-length scaling runs through PyTorch's fused attention with c_i folded into
    q's rows and the bias's; the explicit path (logits, + bias, times c_i, mask, softmax) gives the same, at
    once and through a KV cache (queries that are not the keys' first rows)."""
    model = tiny(pos, logn_scale="learned")
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.normalisation.logn_s.uniform_(0.3, 1.5)
    idx = tokens(2, 13)
    with torch.no_grad():
        fast, fast_cached = full_logits(model, idx), decode(model, idx, 5)
        for pe in model.pe:
            pe.needs_content = True  # instance flag: forces the explicit path
        explicit, explicit_cached = full_logits(model, idx), decode(model, idx, 5)
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_cached, explicit_cached, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos,dape,option", [("kerple", "v1", "sb_logn"), ("alibi", "none", "sb"),
                                             ("rope", "none", "logn"), ("kerple", "none", "logn")])
def test_runs_under_bfloat16_autocast(pos, dape, option):
    """Under bfloat16 autocast (a GPU's training), with DAPE and without, stick-breaking and PyTorch's fused
    softmax with the scale folded in: forward and backward run, and the logits are float32's to bfloat16's
    rounding (within 5% of the largest: softmax alone comes to 2% here)."""
    model = tiny(pos, dape, **dict(OPTIONS[option], logn_scale="learned") if "logn" in option else OPTIONS[option])
    idx = tokens(2, 13)
    want = full_logits(model, idx)
    with torch.autocast("cpu", torch.bfloat16):
        got, loss = model(idx, idx)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("kwargs, message", [
    (dict(attn="stickbreaking", causal=False), "attn=stickbreaking is defined for causal attention only"),
    (dict(sb_current=True), "sb_current has no effect with attn='softmax'"),
    (dict(attn="sigmoid"), "unknown attn='sigmoid'; choose one of softmax, stickbreaking"),
    (dict(logn_scale="ssmax"), "unknown logn_scale='ssmax'; choose one of none, fixed, learned"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match="GPTConfig: " + message):
        GPTConfig(block_size=16, vocab_size=10, n_layer=1, n_head=2, n_embd=8, **kwargs)


@pytest.mark.recorded_dape
@pytest.mark.parametrize("option, what", [("sb", "stick-breaking attention"),
                                          ("logn", "log-length scaling of the logits")])
def test_the_fused_kernel_is_refused_with_the_reason(monkeypatch, option, what):
    """The fused kernel computes softmax only: dape_impl='triton' is an error that says why and names the fix,
    'auto' where the kernel could run says so once and takes the torch path (the same result), and train.py's
    check before training says why too."""
    import train
    idx = tokens(1, 9)
    forced = tiny("kerple", "v1", dape_impl="triton", **OPTIONS[option])
    with pytest.raises(ValueError, match=f"dape_impl='triton' cannot run here: {what} "
                                         r"\(the kernel computes softmax\(logits\) only\); use dape_impl='auto'"):
        full_logits(forced, idx)
    monkeypatch.setattr(dape_paths, "KERNEL_DEVICES", ("cuda", "cpu"))  # auto tries the kernel here, as on a GPU
    monkeypatch.setattr(dape_paths, "_warned", set())
    auto = tiny("kerple", "v1", **OPTIONS[option])
    with pytest.warns(UserWarning, match=f"fused kernel does not cover {what}.*PyTorch path"):
        got = full_logits(auto, idx)
    with torch.no_grad():
        torch.testing.assert_close(got, full_logits(tiny("kerple", "v1", dape_impl="torch", **OPTIONS[option]), idx))
    config = SimpleNamespace(**GPTConfig(dape="v1", dape_impl="triton", **OPTIONS[option]).__dict__)
    with pytest.raises(train.ConfigError, match=f"dape_impl=triton cannot run here: {what}"):
        train.check_dape_impl(config, "cpu", torch.float32, False)


@pytest.mark.parametrize("dape", ["none", "v1"])
@pytest.mark.parametrize("option", ["sb", "sb_logn", "logn"])
def test_a_training_step(option, dape):
    """With dropout: the loss is finite, every parameter gets a finite gradient (the learned s too, and not
    NaN where DAPE's path hands over -inf logits), s is not weight-decayed, and a step moves it."""
    options = dict(OPTIONS[option], **({"logn_scale": "learned"} if "logn" in option else {}))
    model = tiny("kerple", dape, dropout=0.1, **options).train()
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    idx = tokens(4, 8)
    _, loss = model(idx, idx)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    scales = [b.attn.normalisation.logn_s for b in model.transformer.h
              if isinstance(b.attn.normalisation.logn_s, torch.nn.Parameter)]
    assert len(scales) == (0 if option == "sb" else 2)
    no_decay = {id(p) for p in opt.param_groups[1]["params"]}
    assert opt.param_groups[1]["weight_decay"] == 0.0 and all(id(s) in no_decay for s in scales)
    before = [s.detach().clone() for s in scales]
    opt.step()
    assert all((s - b).abs().max() > 0 for s, b in zip(scales, before))


def test_a_checkpoint_from_before_normalisation_py_loads():
    """The learned s was attention's own parameter (`...attn.logn_s`) until it moved into normalisation.py
    (`...attn.normalisation.logn_s`): a checkpoint written before still loads, with its s."""
    import common
    model = tiny("kerple", "v1", logn_scale="learned")
    old = {k.replace(".attn.normalisation.logn_s", ".attn.logn_s"): v for k, v in model.state_dict().items()}
    assert any(k.endswith(".attn.logn_s") for k in old)
    fresh = tiny("kerple", "v1", seed=1, logn_scale="learned")
    fresh.load_state_dict(common.check_weights("ckpt.pt", old, fresh))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b)
