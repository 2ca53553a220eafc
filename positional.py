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
    logits(q, k, qi, ki, state)
                          contextual: the logits A themselves [B, H, Tq, Tk] float32, scaled, computed by the
                          encoding from the (unscaled) queries and keys at sequence indices qi, ki (CoPE adds
                          a content-dependent term to q.k, PaTH transforms each key on its way to the query)
    state(x, k, prev)     reads_input: the encoding reads the layer's input x (its normalised residual
                          stream) and the keys k of every token; state gives what bias() and logits() read as
                          `state` for every key, the cached tokens' (prev, the state it gave before) included

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
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Terms(NamedTuple):
    """A bias given by its terms, B_ij = u_i - w_j: u [B, H, Tq], w [B, H, Tk]."""
    u: torch.Tensor
    w: torch.Tensor

    def map(self):
        """B itself, [B, H, Tq, Tk]."""
        return self.u[..., :, None] - self.w[..., None, :]


def as_map(bias):
    """A bias as a map (Terms expanded), for the paths that add it to the logits."""
    return bias.map() if isinstance(bias, Terms) else bias


def real(t):
    """t in float32, whatever the autocast dtype, or in float64 where it is float64 (a model in float64 computes
    its attention in float64: gradcheck, references)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


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
        x1, x2 = real(x)[..., :half], real(x)[..., half:]
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
    if kind == 'none':
        s = 1.0
    elif not s:
        if length is None:
            raise ValueError("rope_scale=0 derives s from the evaluation length, which was not given")
        s = max(1.0, length / model.config.block_size)
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
        return real(self.table(buckets)).permute(2, 0, 1)  # [H, Tq, Tk]


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
        r1, r2 = real(_clamp_forward(self.r1, 0.01)), real(_clamp_forward(self.r2, 0.01))
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
        a, p = real(_clamp_forward(self.a, 0.01)), real(_clamp_forward(self.p, 0.01, 2.0))
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
        c = real(self.c.abs())
        psi = lambda x: torch.log(c * x + 1)
        d = self.distance(pos_q, pos_k)
        threshold = real(self.L_mult.abs() * self.L0)
        denom = psi(torch.maximum(pos_q.float(), threshold))[:, None] + self.eps  # [Tq, 1]
        x = (psi(d) / denom)[..., None]  # [Tq, Tk, 1]
        # the MLP runs in float32 even under autocast: its input resolves distances 1/8192 apart
        with torch.autocast(device_type=x.device.type, enabled=False):
            b = self.mlp(real(x))
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

    def logits(self, q, k, qi, ki, state=None):
        # qi: key-index of each query [Q]; ki: [Tk]
        A = real((q * (1.0 / math.sqrt(self.head_size))) @ k.transpose(-2, -1))
        gates = torch.sigmoid(A)
        before = ki[None, :] <= qi[:, None]  # key j at or before query i
        if self.causal:
            gates = gates.masked_fill(~before, 0.0)  # future keys count for nothing
        csum = gates.cumsum(dim=-1)
        col = qi.view(1, 1, -1, 1).expand(*A.shape[:-1], 1)
        csum_i, gate_i = csum.gather(-1, col), gates.gather(-1, col)
        # gates summed over the keys between j and i, both ends included, whichever comes first
        p = torch.where(before, csum_i - csum + gates, csum - csum_i + gate_i)
        p = p.clamp(max=self.npos_max - 1)
        logits_int = real(q) @ real(self.pos_emb)  # [B, H, Q, npos_max]
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
            pos_term = (real(q) + self.v[:, None, :]) @ r.transpose(1, 2)  # [B, H, Q, Nd]
            pos_term = pos_term.gather(-1, (rel - lo).expand(B, H, Q, -1))
            content_term = (real(k) @ self.u[:, :, None]).transpose(-1, -2)  # [B, H, 1, Tk]
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

    def state(self, x, k=None, prev=None):
        """c [B, H, T0 + T] float32: the cached tokens' c (prev, [B, H, T0]), then the running sum of log f
        of the tokens x [B, T, C] continued from it (the keys k are not needed)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            log_f = F.logsigmoid(self.gate(real(x))).transpose(1, 2)
        c = log_f.cumsum(dim=-1)
        if prev is None or prev.shape[-1] == 0:
            return c
        return torch.cat((prev, c + prev[..., -1:]), dim=-1)

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        # FoX has no positions (rand_pos is refused for it), so a token's position is its index in the
        # sequence, and it picks the token's c out of state
        return Terms(state[..., pos_q], state[..., pos_k])


# PaTH (Yang et al. 2025) multiplies where the others add: between key j and query i every token t in
# j < t <= i applies H_t = I - beta_t w_t w_t^T to the key,
#
#     A_ij = q_i . (H_i H_{i-1} ... H_{j+1} k_j) / sqrt(hs),
#
# with w_t a unit vector and beta_t in (0, 2) computed from token t's input. It is computed in chunks of
# CHUNK tokens. Within a chunk, a product of consecutive H_t is I - sum over s <= t of w_t T_ts beta_s
# w_s^T, with T = (I + L)^-1 and L_ts = beta_t (w_t . w_s) for s < t (Schreiber and Van Loan's compact
# form of a product of Householder matrices, the "UT transform"); T is lower triangular, so the product
# over any run of consecutive tokens of the chunk is the same formula with T cut to that run. Across
# chunks, a key is brought to the end of its chunk (Kc), a query back to the start of its own, and in
# between each chunk's whole product P applies.
CHUNK = 32


class PaTHState(NamedTuple):
    """What PaTH keeps of every token so far (a layer's KV cache holds it between decoding steps): the
    projections z of the last tokens (the short convolution's window), w [B, H, N, hs] and beta [B, H, N],
    and per chunk TD = T diag(beta) [B, H, n, CHUNK, CHUNK], and for every chunk but the last the chunk's
    product P [B, H, n - 1, hs, hs] and its keys brought to the chunk's end, Kc [B, H, (n - 1) * CHUNK, hs];
    c: the forget gate's state (PaTH-FoX), else None."""
    z: torch.Tensor
    w: torch.Tensor
    beta: torch.Tensor
    TD: torch.Tensor
    P: torch.Tensor
    Kc: torch.Tensor
    c: torch.Tensor = None


def _chunks(x, n):
    """[B, H, N, ...] -> [B, H, n, CHUNK, ...], zero-padded at the end (a zero w is the identity)."""
    pad = n * CHUNK - x.shape[2]
    x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad)) if pad else x
    return x.reshape(*x.shape[:2], n, CHUNK, *x.shape[3:])


def path_state(w, beta, k, prev=None):
    """The chunk terms of PaTHState for tokens with directions w [B, H, N, hs], strengths beta [B, H, N] and
    keys k [B, H, N, hs], all float32. P and Kc are needed, and computed, for every chunk but the last: a
    query crosses only the chunks before its own. prev: a state whose first tokens are these (its chunks but
    the last are kept, the rest computed again)."""
    n = -(-w.shape[2] // CHUNK)
    done = 0 if prev is None else prev.P.shape[2]
    W, b, K = (_chunks(t[:, :, done * CHUNK:], n - done) for t in (w, beta[..., None], k))
    b = b[..., 0]
    G = W @ W.transpose(-1, -2)  # w_t . w_s
    eye = torch.eye(CHUNK, device=w.device)
    L = (b[..., :, None] * G).tril(-1)
    T = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    TD = T * b[..., None, :]
    W, K, TDc = W[:, :, :-1], K[:, :, :-1], TD[:, :, :-1]  # every chunk but the last
    P = torch.eye(w.shape[-1], device=w.device) - W.transpose(-1, -2) @ TDc @ W
    # key j brought to its chunk's end: minus sum over j < s <= t of w_t TD_ts (w_s . k_j)
    Kc = (K - (TDc @ (W @ K.transpose(-1, -2)).tril(-1)).transpose(-1, -2) @ W).flatten(2, 3)
    if done:
        TD, P = torch.cat((prev.TD[:, :, :done], TD), 2), torch.cat((prev.P, P), 2)
        Kc = torch.cat((prev.Kc, Kc), 2)
    return TD, P, Kc


def path_logits(q, k, qi, state):
    """PaTH's logits q_i . (H_i ... H_{j+1} k_j) [B, H, Q, Tk] float32 of the queries q [B, H, Q, hs] at
    consecutive sequence indices qi against the keys k [B, H, Tk, hs] of tokens 0..Tk-1 (state: theirs).
    Entries of keys after their query hold anything: attention masks them. float32 under any autocast: a
    product of many reflections loses its keys' precision in 16 bits."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _path_logits(real(q), k, qi, state)


def _path_logits(q, k, qi, state):
    Tk = k.shape[2]
    a, e = int(qi[0]), int(qi[-1]) + 1
    Kc = state.Kc.unflatten(2, (-(-Tk // CHUNK) - 1, CHUNK))
    t = torch.arange(CHUNK, device=q.device)
    blocks = []
    for c in range(a // CHUNK, (e - 1) // CHUNK + 1):  # the chunks the queries fall in
        lo, hi = max(a, c * CHUNK), min(e, (c + 1) * CHUNK)
        # w and the keys of this chunk only (a block of queries reads no other chunk's raw keys)
        Wc, Kk = (_chunks(real(x[:, :, c * CHUNK:(c + 1) * CHUNK]), 1)[:, :, 0] for x in (state.w, k))
        qc, TDc = q[:, :, lo - a:hi - a], state.TD[:, :, c]
        i = torch.arange(lo, hi, device=q.device) - c * CHUNK  # index within the chunk
        R = ((qc @ Wc.transpose(-1, -2)) * (t[None, :] <= i[:, None])) @ TDc  # over t <= i
        # keys of the query's own chunk: the product over j < s <= t <= i
        pieces = [qc @ Kk.transpose(-1, -2) - R @ (Wc @ Kk.transpose(-1, -2)).tril(-1)]
        r = qc - R @ Wc if c else None  # q_i^T H_i ... H_{chunk start}
        for c2 in range(c - 1, -1, -1):  # earlier chunks, nearest first
            pieces.append(r @ Kc[:, :, c2].transpose(-1, -2))
            if c2:
                r = r @ state.P[:, :, c2]
        A = torch.cat(pieces[::-1], dim=-1)[..., :Tk]
        blocks.append(F.pad(A, (0, Tk - A.shape[-1])))  # keys of later chunks: masked
    return torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]


class PaTH(PositionalEncoding):
    """Yang et al. 2025 (PaTH attention): logits q_i . (H_i ... H_{j+1} k_j) / sqrt(hs), H_t = I - beta_t
    w_t w_t^T (the products above). As the authors' layer (flash-linear-attention's PaTHAttention, its
    defaults): w from the layer's normalised input by a low-rank projection (width 32), a causal depthwise
    convolution of 3 tokens with SiLU and an L2 norm per head (eps 1e-6); beta_t = 2 sigmoid(a Linear of
    x_t), so H_t may reflect (a negative eigenvalue) as RoPE's rotations cannot. No positions at all:
    everything a key knows of where it is comes from the tokens after it. Weights N(0, 0.02), biases 0
    (beta = 1 at init), as the authors' model initialises its Linears and convolutions. Causal only;
    float32 under any autocast."""
    causal_only = True
    uses_positions = False
    needs_content = True
    rank, conv = 32, 3
    said_pytorch = False  # the warning on a GPU, once per process

    def __init__(self, config):
        super().__init__(config)
        C = config.n_embd
        self.w_proj = nn.Sequential(nn.Linear(C, self.rank, bias=False), nn.Linear(self.rank, C, bias=False))
        self.w_conv = nn.Conv1d(C, C, self.conv, groups=C, bias=False)
        self.beta_proj = nn.Linear(C, config.n_head, bias=True)
        PaTH.reset_parameters(self)  # PaTH's own: a subclass's may need parameters it has not made yet

    def reset_parameters(self):
        for m in (*self.w_proj, self.w_conv, self.beta_proj):
            nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.beta_proj.bias)

    def state(self, x, k, prev=None):
        """PaTHState of every token: prev's (the cached tokens'), then those of x [B, T, C]; k [B, H, N, hs]
        are the keys of all N tokens."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = real(x)
            z = self.w_proj(x)  # [B, T, C]
            window = torch.cat((prev.z, z), 1) if prev is not None else F.pad(z, (0, 0, self.conv - 1, 0))
            w = F.silu(self.w_conv(window.transpose(1, 2))).transpose(1, 2)
            w = w.unflatten(-1, (self.n_head, self.head_size)).transpose(1, 2)
            w = w * torch.rsqrt(w.square().sum(-1, keepdim=True) + 1e-6)
            beta = 2 * torch.sigmoid(self.beta_proj(x)).transpose(1, 2)
            if prev is not None:
                w, beta = torch.cat((prev.w, w), 2), torch.cat((prev.beta, beta), 2)
            chunk_terms = path_state(w, beta, real(k), prev)
        return PaTHState(window[:, -(self.conv - 1):], w, beta, *chunk_terms)

    def logits(self, q, k, qi, ki, state):
        if q.is_cuda and not PaTH.said_pytorch:
            PaTH.said_pytorch = True
            warnings.warn("PaTH runs in PyTorch on this GPU, not in a fused kernel (flash-linear-attention's "
                          "is not called): slower than the other encodings, with the same results")
        return path_logits(q * (1.0 / math.sqrt(self.head_size)), k, qi, state)


class PaTHFoX(PaTH):
    """PaTH with FoX's forget gate (the authors' PaTH-FoX): PaTH's logits plus the bias B_ij = (c_i - c_j) /
    sqrt(hs), FoX's (above) times the attention scale, as the authors' kernels scale it (FoX's own bias is
    not scaled). DAPE reads it as B."""

    def __init__(self, config):
        super().__init__(config)
        self.gate = nn.Linear(config.n_embd, config.n_head, bias=True)
        self.reset_parameters()

    def reset_parameters(self):
        super().reset_parameters()
        FoX.reset_parameters(self)  # the gate, as FoX's

    def state(self, x, k, prev=None):
        return super().state(x, k, prev)._replace(c=FoX.state(self, x, k, None if prev is None else prev.c))

    def bias(self, pos_q, pos_k, q=None, k=None, state=None):
        return FoX.bias(self, pos_q, pos_k, state=state.c / math.sqrt(self.head_size))

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
    "path": PaTH,
    "path_fox": PaTHFoX,
}
