"""
Positional encodings, one small class each.

Every encoding answers the same few questions, so that the attention in model.py never needs to
know which one it is talking to. What an encoding does is which of these methods it defines (the base
class has them as None, and the flags of the same names, below, are derived from them):

    embed(pos)            absolute: [T, C] added to the token embeddings, once, below the first layer
    rotate(x, pos)        rotary: q and k rotated by their positions
    bias(pos_q, pos_k, q, k, state)
                          has_bias: a bias B added to the logits, [H, Tq, Tk] or [B, H, Tq, Tk], or Terms(u, w)
                          meaning B_ij = u_i - w_j (formed on chip by the fused kernel, expanded by the
                          PyTorch paths); this B is what DAPE reads as its second input
    logits(A, q, qi, ki)  contextual: a content-dependent term added to the logits A themselves
    state(x, prev)        reads_input: B depends on the layer's input x (its normalised residual stream);
                          state gives every key's state [B, H, Tk], the cached tokens' (prev) included, and
                          bias() reads it as `state`

and these flags:

    needs_content   B or the extra term depends on q/k, so it is computed per batch element
    causal_only     defined for causal attention only (GPTConfig refuses causal=False)
    per_layer       each layer has its own instance (False: one instance shared by all layers)
    uses_positions  False: randomized positions would change nothing (rand_pos is refused)
    distance_based  B is a function of distance() alone (see bidir_bias)

`pos` are absolute positions (int64, [T]); distances are pos_q - pos_k, built in float32 whatever
the autocast dtype (fp16 cannot hold every integer above 2048). Attention masks B after it is formed, so
what a bias holds above the diagonal in causal mode is never read (the distance encodings hold their
distance-0 value there, FoX's c_i - c_j whatever it is).

To add an encoding: write a class below that sets the flags it needs and implements the matching
method(s), and add it to ENCODINGS at the bottom of the file.
"""

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Terms(NamedTuple):
    """A bias given by its terms, B_ij = u_i - w_j: u [B, H, Tq], w [B, H, Tk]."""
    u: torch.Tensor
    w: torch.Tensor

    def rows(self, s, e):
        """The terms of query rows [s, e)."""
        return Terms(self.u[..., s:e], self.w)

    def map(self):
        """B itself, [B, H, Tq, Tk]."""
        return self.u[..., :, None] - self.w[..., None, :]


def as_map(bias):
    """A bias as a map (Terms expanded), for the paths that add it to the logits."""
    return bias.map() if isinstance(bias, Terms) else bias


class PositionalEncoding(nn.Module):
    embed = rotate = bias = logits = state = None  # the methods an encoding may define (see above)
    needs_content = False
    causal_only = False
    per_layer = True
    uses_positions = True
    distance_based = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # the flags that the methods a class defines already say, derived once so they cannot disagree
        cls.absolute, cls.rotary = cls.embed is not None, cls.rotate is not None
        cls.has_bias, cls.contextual, cls.reads_input = cls.bias is not None, cls.logits is not None, \
            cls.state is not None

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.head_size = config.n_embd // config.n_head
        self.causal = config.causal
        # Bidirectional attention with |i - j| gives a key on the left and a key on the right the same
        # bias, so a distance-based encoding cannot tell them apart. Ruoss et al.'s ALiBi breaks the tie
        # by adding 0.5 x slope below the diagonal, i.e. a key on the left is half a step nearer:
        # distance d - 0.5. config.bidir_bias says which encodings do so: 'alibi' (the reference), 'all'
        # the distance-based ones, 'none'. Causal attention sees only the left: nothing changes there.
        mode = config.bidir_bias
        asymmetric = mode == 'all' or (mode == 'alibi' and isinstance(self, ALiBi))
        self.left_offset = 0.5 if not self.causal and self.distance_based and asymmetric else 0.0

    def reset_parameters(self):
        pass

    def distance(self, pos_q, pos_k):
        """Float32 distances [Tq, Tk]: i - j clamped at 0 (causal) or |i - j| (bidirectional), where a
        key on the left (j before i) is left_offset nearer."""
        d = pos_q.float()[:, None] - pos_k.float()[None, :]
        if self.causal:
            return d.clamp(min=0)
        if self.left_offset:
            return torch.where(d > 0, d - self.left_offset, -d)
        return d.abs()


def _clamp_forward(p, lo, hi=None):
    # The value is clamped but the gradient passes as if it were not: a parameter that strays out of
    # range can still be pulled back in (a clamp alone would freeze it with a zero gradient), and no
    # in-place write to a parameter is needed inside the forward (which would break autograd).
    return p + (p.clamp(lo, hi) - p).detach()


def sinusoid(x, dim):
    """[..., dim] sin/cos features of float positions x (Vaswani et al.), float32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = x.float()[..., None] * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


# -----------------------------------------------------------------------------
# absolute encodings: added to the token embeddings


class NoPE(PositionalEncoding):
    """No positional information at all; in causal mode the mask alone carries position."""
    uses_positions = False


class Learned(PositionalEncoding):
    """GPT-2's learned absolute table. It has a row per position it was trained on and no more."""
    per_layer = False

    def __init__(self, config):
        super().__init__(config)
        self.n_positions = config.rand_pos_max if config.rand_pos else config.block_size
        self.wpe = nn.Embedding(self.n_positions, config.n_embd)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.wpe.weight, std=0.02)

    def embed(self, pos):
        if int(pos.max()) >= self.n_positions:
            raise ValueError(
                f"pos='learned' has a table of {self.n_positions} positions and cannot encode position "
                f"{int(pos.max())}: it cannot run past its training length. Evaluate it at lengths "
                f"<= {self.n_positions}, or use a relative encoding (alibi, kerple, fire, ...).")
        return self.wpe(pos)


class Sinusoidal(PositionalEncoding):
    """Vaswani et al.'s fixed sin/cos absolute encoding."""
    per_layer = False

    def __init__(self, config):
        super().__init__(config)
        self.n_embd = config.n_embd

    def embed(self, pos):
        return sinusoid(pos, self.n_embd)


# -----------------------------------------------------------------------------
# rotary


class RoPE(PositionalEncoding):
    """Su et al.: rotate pairs of q/k features by angle pos * theta_i, theta_i = base^(-2i/d) for
    i = 0 .. d/2 - 1 (d the head size); q.k then depends on i - j. Angles are computed from the
    positions at every call: no cached table, so no length cap.

    Context extension at evaluation, set_scaling(kind, s): a model trained at length L read at s x L.
    Nothing is trained; every method changes the frequencies theta_i (and YaRN the logits' scale):
      pi    position interpolation (Chen et al. 2023): positions m -> m / s, i.e. theta_i -> theta_i / s.
      ntk   "NTK-aware" scaling (bloc97 2023, as written in the YaRN paper): base -> base * s^(d/(d-2)),
            so theta_0 stays as it is and the lowest frequency theta_{d/2-1} becomes theta_{d/2-1} / s.
      yarn  YaRN (Peng et al. 2023), "NTK-by-parts" and a temperature. Dimension i has wavelength
            lambda_i = 2 pi / theta_i and turns r_i = L / lambda_i times over the training length;
            gamma(r) = 0 if r < alpha, 1 if r > beta, (r - alpha) / (beta - alpha) in between, and
            h(theta_i) = (1 - gamma(r_i)) theta_i / s + gamma(r_i) theta_i: dimensions that turned
            many times keep their frequency, those that turned less than alpha times are interpolated.
            The logits are divided by t with sqrt(1/t) = 0.1 ln(s) + 1: the rotated q and k are both
            multiplied by 0.1 ln(s) + 1, so q.k gains (0.1 ln(s) + 1)^2. The paper's alpha = 1,
            beta = 32 are for LLaMA; with a short L no dimension may reach beta (all are interpolated
            partly).
    s = 1 (or kind 'none') leaves RoPE exactly as trained.
    """
    per_layer = False
    SCALINGS = ('none', 'pi', 'ntk', 'yarn')

    def __init__(self, config, base=10000.0):
        super().__init__(config)
        if self.head_size % 2:
            raise ValueError(f"pos='rope' needs an even head size, got n_embd/n_head = {self.head_size}")
        self.base = base
        self.original_length = config.block_size  # L of the scalings: the training length
        self.set_scaling('none')

    def set_scaling(self, kind='none', s=1.0, alpha=1.0, beta=32.0):
        """Read the model at s times its training length with `kind` (see the class docstring)."""
        if kind not in self.SCALINGS:
            raise ValueError(f"unknown RoPE scaling {kind!r}; choose one of {', '.join(self.SCALINGS)}")
        if not (math.isfinite(s) and s >= 1):
            raise ValueError(f"the RoPE scale factor s must be >= 1 (it extends the context), got {s}")
        if kind == 'yarn' and not 0 <= alpha < beta:
            raise ValueError(f"YaRN needs 0 <= alpha < beta, got alpha={alpha}, beta={beta}")
        if kind == 'ntk' and self.head_size < 4:
            raise ValueError(f"NTK-aware scaling needs a head size >= 4 (base^(d/(d-2))), got {self.head_size}")
        self.scaling, self.scale, self.alpha, self.beta = kind, float(s), float(alpha), float(beta)

    def frequencies(self, device=None):
        """theta_i [d/2] float32, scaled as set_scaling says."""
        half = self.head_size // 2
        i = torch.arange(half, device=device, dtype=torch.float32)
        theta = self.base ** (-i / half)
        s, kind = self.scale, self.scaling
        if kind == 'none' or s == 1.0:  # exactly the trained frequencies
            return theta
        if kind == 'pi':
            return theta / s
        if kind == 'ntk':
            d = self.head_size
            return (self.base * s ** (d / (d - 2))) ** (-i / half)
        r = self.original_length * theta / (2 * math.pi)  # yarn: turns over the training length
        gamma = ((r - self.alpha) / (self.beta - self.alpha)).clamp(0.0, 1.0)
        return (1 - gamma) * theta / s + gamma * theta

    def rotate(self, x, pos):
        # x: [B, H, T, hs]; GPT-NeoX layout: feature i is paired with feature i + hs/2
        half = self.head_size // 2
        inv_freq = self.frequencies(x.device)
        angles = pos.float()[:, None] * inv_freq  # [T, hs/2] float32
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.scaling == 'yarn' and self.scale != 1.0:
            out = out * (0.1 * math.log(self.scale) + 1)  # sqrt(1/t), on q and on k
        return out.type_as(x)


def set_rope_scaling(model, kind, s=0.0, length=None, alpha=1.0, beta=32.0):
    """Apply a RoPE context extension (RoPE.set_scaling) to every RoPE module of a GPT, and return the
    factor s used. s = 0 derives it from the evaluation length: s = max(1, length / block_size).
    kind 'none' restores the trained RoPE (on any model). Asking to scale a model without RoPE is an
    error: the option would silently do nothing."""
    ropes = [pe for pe in model.pe if isinstance(pe, RoPE)]
    if kind != 'none' and not ropes:
        raise ValueError(f"rope_scaling={kind!r} applies to RoPE models only; this one has pos={model.config.pos!r}")
    block = model.config.block_size
    if kind == 'none':
        s = 1.0
    elif not s:
        if length is None:
            raise ValueError("rope_scale=0 derives s from the evaluation length, which was not given")
        s = max(1.0, length / block)
    for pe in ropes:
        pe.set_scaling(kind, s, alpha, beta)
    return s


def rope_scaling_label(kind, s, derived=False, block_size=None):
    """The suffix evaluations add to a RoPE model's label: '+yarn(s=8)', '+pi(s=L/64)' when s follows
    the evaluation length L, '' for the trained RoPE."""
    if kind == 'none':
        return ''
    return f"+{kind}(s=L/{block_size})" if derived else f"+{kind}(s={s:g})"


# -----------------------------------------------------------------------------
# additive biases B[h, i, j]


def t5_relative_bucket(relative_position, bidirectional, num_buckets=32, max_distance=128):
    """T5's bucketing of relative_position = key - query: half the buckets are exact small
    distances, the rest grow logarithmically up to max_distance; farther goes to the last bucket.
    Bidirectional mode spends half the buckets on each direction."""
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        n = relative_position.abs()
    else:
        n = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # float32 log of n (n >= max_exact here; the clamp only guards the branch not taken)
    log_ratio = torch.log(n.float().clamp(min=max_exact) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, n.long(), large)


class T5Bias(PositionalEncoding):
    """Raffel et al.: a learned scalar per (bucket of distance, head), one table for all layers."""
    per_layer = False

    def __init__(self, config, num_buckets=32, max_distance=128):
        super().__init__(config)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, config.n_head)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.table.weight, std=0.02)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        rel = pos_k[None, :] - pos_q[:, None]
        buckets = t5_relative_bucket(rel, not self.causal, self.num_buckets, self.max_distance)
        return self.table(buckets).float().permute(2, 0, 1)  # [H, Tq, Tk]


def alibi_slopes(n_head):
    """Press et al.'s head slopes: the geometric sequence 2^(-8h/n) for n a power of two; otherwise
    the slopes for the largest power of two below n_head, then every other slope of the next one."""
    def power_of_two_slopes(n):
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]
    closest = 2 ** math.floor(math.log2(n_head))
    slopes = power_of_two_slopes(closest)
    slopes += power_of_two_slopes(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(PositionalEncoding):
    """Press et al.: B = -m_h * d with fixed per-head slopes."""
    distance_based = True
    per_layer = False

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        return -self.slopes[:, None, None] * self.distance(pos_q, pos_k)


class Kerple(PositionalEncoding):
    """Chi et al., logarithmic variant: B = -r1 * log(1 + r2 * d), r1, r2 > 0 learned per head."""
    distance_based = True

    def __init__(self, config):
        super().__init__(config)
        self.r1 = nn.Parameter(torch.empty(config.n_head, 1, 1))
        self.r2 = nn.Parameter(torch.empty(config.n_head, 1, 1))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.r1, 0, 2)
        nn.init.uniform_(self.r2, 0, 1)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        r1, r2 = _clamp_forward(self.r1, 0.01).float(), _clamp_forward(self.r2, 0.01).float()
        return -r1 * torch.log1p(r2 * self.distance(pos_q, pos_k))


class KerplePower(PositionalEncoding):
    """Chi et al., power variant: B = -a * d^p, a > 0, 0 < p <= 2 learned per head."""
    distance_based = True

    def __init__(self, config):
        super().__init__(config)
        self.a = nn.Parameter(torch.empty(config.n_head, 1, 1))
        self.p = nn.Parameter(torch.empty(config.n_head, 1, 1))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.a, 0, 1)
        nn.init.uniform_(self.p, 0, 2)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        a, p = _clamp_forward(self.a, 0.01).float(), _clamp_forward(self.p, 0.01, 2.0).float()
        d = self.distance(pos_q, pos_k)
        # d^p has gradient d^p * log(d) in p, which is 0 * -inf at d = 0: keep d = 0 out of the power
        # (the smallest nonzero distance is 1/2, a key on the left with bidir_bias)
        d_pow = torch.where(d > 0, d.clamp(min=0.5).pow(p), torch.zeros_like(d))
        return -a * d_pow


class FIRE(PositionalEncoding):
    """Li et al.: B = f(psi(d) / psi(max(i, L))) with psi(x) = log(c*x + 1) and f an MLP 1 -> 32 -> H.
    Dividing by the query's own (progressive) position keeps the MLP's input in [0, 1] at any length;
    L = |L_mult| * L0 stops short queries from seeing huge normalised distances."""
    distance_based = True

    def __init__(self, config, width=32, eps=1e-6):
        super().__init__(config)
        self.L0 = float(config.fire_L0 or config.block_size)
        self.eps = eps
        self.mlp = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, config.n_head))
        self.c = nn.Parameter(torch.empty(()))
        self.L_mult = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self):
        for layer in (self.mlp[0], self.mlp[2]):
            layer.reset_parameters()
        nn.init.constant_(self.c, 0.1)
        nn.init.constant_(self.L_mult, 1.0)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        c = self.c.abs().float()
        psi = lambda x: torch.log(c * x + 1)
        d = self.distance(pos_q, pos_k)
        threshold = (self.L_mult.abs() * self.L0).float()
        denom = psi(torch.maximum(pos_q.float(), threshold))[:, None] + self.eps  # [Tq, 1]
        x = (psi(d) / denom)[..., None]  # [Tq, Tk, 1]
        # the MLP runs in float32 even under autocast: its input resolves distances 1/8192 apart
        with torch.autocast(device_type=x.device.type, enabled=False):
            b = self.mlp(x.float())
        return b.permute(2, 0, 1)  # [H, Tq, Tk]


# -----------------------------------------------------------------------------
# content-dependent encodings


class CoPE(PositionalEncoding):
    """Golovneva et al.: contextual positions. A gate g_ij = sigmoid(A_ij) decides whether key j counts
    for query i; p_ij = sum of the gates between j and i (fractional), and the logit gains q_i . e[p_ij],
    e interpolated between the two nearest integer positions. It has no bias B: DAPE reads A + this."""
    needs_content = True
    uses_positions = False

    def __init__(self, config, npos_max=64):
        super().__init__(config)
        self.npos_max = npos_max
        self.pos_emb = nn.Parameter(torch.zeros(self.head_size, npos_max))  # shared by heads

    def reset_parameters(self):
        nn.init.zeros_(self.pos_emb)

    def logits(self, A, q, qi, ki):
        # A: [B, H, Q, Tk] scaled logits; qi: key-index of each query [Q]; ki: [Tk]
        gates = torch.sigmoid(A.float())
        before = ki[None, :] <= qi[:, None]  # key j at or before query i
        if self.causal:
            gates = gates.masked_fill(~before, 0.0)  # future keys count for nothing
        csum = gates.cumsum(dim=-1)
        col = qi.view(1, 1, -1, 1).expand(*A.shape[:-1], 1)
        csum_i, gate_i = csum.gather(-1, col), gates.gather(-1, col)
        # gates summed over the keys between j and i, both ends included, whichever comes first
        p = torch.where(before, csum_i - csum + gates, csum - csum_i + gate_i)
        p = p.clamp(max=self.npos_max - 1)
        logits_int = q.float() @ self.pos_emb.float()  # [B, H, Q, npos_max]
        p_floor = p.floor()
        w = p - p_floor
        lo = logits_int.gather(-1, p_floor.long())
        hi = logits_int.gather(-1, p.ceil().long())
        return A + hi * w + lo * (1 - w)


class XLRelative(PositionalEncoding):
    """Dai et al. (Transformer-XL): B_ij = (u . k_j + (q_i + v) . W_R R_{i-j}) / sqrt(hs), with R the
    sinusoid of the relative distance and u, v learned content and position biases per head."""
    needs_content = True

    def __init__(self, config):
        super().__init__(config)
        self.n_embd = config.n_embd
        self.W_R = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.u = nn.Parameter(torch.zeros(config.n_head, self.head_size))
        self.v = nn.Parameter(torch.zeros(config.n_head, self.head_size))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.W_R.weight, std=0.02)
        nn.init.zeros_(self.u)
        nn.init.zeros_(self.v)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        B, H, Q, hs = q.shape
        rel = pos_q[:, None] - pos_k[None, :]  # signed distance i - j, int64
        if self.causal:
            rel = rel.clamp(min=0)
        lo = int(rel.min())
        dists = torch.arange(lo, int(rel.max()) + 1, device=q.device)
        with torch.autocast(device_type=q.device.type, enabled=False):
            r = self.W_R(sinusoid(dists, self.n_embd)).view(-1, H, hs).transpose(0, 1)  # [H, Nd, hs]
            pos_term = (q.float() + self.v[:, None, :]) @ r.transpose(1, 2)  # [B, H, Q, Nd]
            pos_term = pos_term.gather(-1, (rel - lo).expand(B, H, Q, -1))
            content_term = (k.float() @ self.u[:, :, None]).transpose(-1, -2)  # [B, H, 1, Tk]
        return (pos_term + content_term) / math.sqrt(hs)


class FoX(PositionalEncoding):
    """Lin et al. 2025 (the Forgetting Transformer): a forget gate per head and token, f_t = sigmoid(w_h .
    x_t + b_h) from the layer's normalised input x, and B_ij = sum of log f_t over j < t <= i = c_i - c_j,
    with c = cumsum(log f) along the sequence. A key fades by the gates of the tokens after it, as an RNN's
    state would: a bias that depends on the content, with no positions at all. Causal only (the sum runs
    from the key to the query). log f and c are float32 under any autocast, as in the reference. Gate and
    init as the reference's default ("full": data-dependent, a Linear of the input, weights N(0, 0.02),
    bias 0, so f = 1/2 at init): see docs/encodings.md."""
    causal_only = True
    uses_positions = False

    def __init__(self, config):
        super().__init__(config)
        self.gate = nn.Linear(config.n_embd, config.n_head, bias=True)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.gate.weight, std=0.02)
        nn.init.zeros_(self.gate.bias)

    def state(self, x, prev=None):
        """c [B, H, T0 + T] float32: the cached tokens' c (prev, [B, H, T0]), then the running sum of log f
        of the tokens x [B, T, C] continued from it."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            log_f = F.logsigmoid(self.gate(x.float())).transpose(1, 2)
        c = log_f.cumsum(dim=-1)
        if prev is None or prev.shape[-1] == 0:
            return c
        return torch.cat((prev, c + prev[..., -1:]), dim=-1)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        # FoX has no positions (rand_pos is refused for it), so a token's position is its index in the
        # sequence, and it picks the token's c out of state
        return Terms(state[..., pos_q], state[..., pos_k])


# -----------------------------------------------------------------------------

ENCODINGS = {
    "nope": NoPE,
    "learned": Learned,
    "sinusoidal": Sinusoidal,
    "rope": RoPE,
    "t5": T5Bias,
    "alibi": ALiBi,
    "kerple": Kerple,
    "kerple_power": KerplePower,
    "fire": FIRE,
    "cope": CoPE,
    "xl": XLRelative,
    "fox": FoX,
}
