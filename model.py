"""
A GPT (nanoGPT's, itself after GPT-2) whose attention takes its positional information from
positional.py and, optionally, a data-adaptive correction of its logits from dape.py.

Shapes: B batch, T sequence length (Tq queries, Tk keys in attention), C embedding width, H heads, hs
head size, V vocabulary.

Attention, for one layer, with A = q.k/sqrt(hs) and `bias` the encoding's positional bias (the paper's B):

    logits = A + bias                    (an additive encoding, no DAPE)
    logits = A + bias + f(A, bias)       (DAPE; f and its variants in dape.py)
    softmax(mask(logits)) . v

It is computed in blocks of queries when the [batch, channel, query, key] maps would be large, which
gives exactly the same result (every step is local to one query row) with memory bounded by the block:
this is what lets a small model be evaluated at 8192 tokens on a CPU. Where no DAPE and no
content-dependent term is involved, each block goes through F.scaled_dot_product_attention with the
bias as a float mask, which computes the same function faster.
"""

import inspect
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from dape import DAPEV1, DAPEV2, VARIANTS
from positional import ENCODINGS

# Attention probabilities of far-away keys (exp of very negative logits) underflow into float32
# denormals, which x86 CPUs process many times slower; flushing them to zero changes no result that
# matters. Set once here, for every script that builds a model.
torch.set_flush_denormal(True)

# Floats the attention of one layer may hold per query block, when it is not training (autograd keeps
# every block anyway). 2**26 float32 = 256 MB.
ATTN_BLOCK_BUDGET = 2 ** 26
# On the CPU, also floats of one [B, H, Tq, Tk] map of a block (8 MB): the bias, the mask and the softmax
# are each a pass over such maps, and passes within the last-level cache are several times faster than
# through memory (figures in the README, "Benchmark").
ATTN_BLOCK_CACHE_CPU = 2 ** 21


@dataclass
class GPTConfig:
    block_size: int = 1024  # training length
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False  # biases in Linears and LayerNorms
    pos: str = "kerple"  # one of positional.ENCODINGS
    dape: str = "none"  # none, v1, v2
    dape_variant: str = "concat_residual"  # see dape.py
    dape_width: int = 32  # hidden width D of f
    dape_kernel: int = 3  # V2's kernel (1, k) along the key axis
    dape_impl: str = "auto"  # auto: dape_triton.py's fused kernel on CUDA, else dape_torch.py; triton; torch
    causal: bool = True  # False: a bidirectional encoder (CHE)
    # causal=False: which distance biases put a key on the left half a step nearer, so that they tell left
    # from right: alibi (as Ruoss et al.'s reference), all (ALiBi, Kerple, Kerple-power, FIRE), none
    bidir_bias: str = "alibi"
    rand_pos: bool = False  # randomized positions while training (Ruoss et al. 2023)
    rand_pos_max: int = 0  # positions are drawn from [0, rand_pos_max); 0: 4 * block_size
    rand_pos_eval: bool = False  # draw them at evaluation too (Ruoss et al.'s CHE protocol); False: 0..T-1
    tie_weights: bool = True  # the output head is the token embedding (GPT-2); False: a head of its own
    fire_L0: int = 0  # FIRE's threshold L0; 0: block_size
    attn_chunk: int = 0  # queries per attention block; 0: chosen from ATTN_BLOCK_BUDGET (and the CPU's cache)

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"GPTConfig: {msg}")
        if self.pos not in ENCODINGS:
            fail(f"unknown pos={self.pos!r}; choose one of {', '.join(ENCODINGS)}")
        if self.dape not in ("none", "v1", "v2"):
            fail(f"unknown dape={self.dape!r}; choose none, v1 or v2")
        if self.bidir_bias not in ("alibi", "all", "none"):
            fail(f"unknown bidir_bias={self.bidir_bias!r}; choose alibi, all or none")
        if self.dape_impl not in ("auto", "triton", "torch"):
            fail(f"unknown dape_impl={self.dape_impl!r}; choose auto, triton or torch")
        if self.dape_variant not in VARIANTS:
            fail(f"unknown dape_variant={self.dape_variant!r}; choose one of {', '.join(VARIANTS)}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dape_width", "dape_kernel"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            fail(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            fail(f"dropout must be in [0, 1), got {self.dropout}")
        if self.dape_kernel % 2 == 0:
            fail(f"dape_kernel must be odd (the (1, k) conv is centred on the key), got {self.dape_kernel}")
        PE = ENCODINGS[self.pos]
        if PE.causal_only and not self.causal:
            fail(f"pos={self.pos} is defined for causal attention only; use causal=True or another encoding")
        if self.dape == "none" and self.dape_variant != "concat_residual":
            fail(f"dape_variant={self.dape_variant!r} has no effect with dape='none'; set dape=v1 or v2")
        if self.dape != "none" and not PE.has_bias and self.dape_variant != "concat_residual":
            fail(f"dape_variant={self.dape_variant!r} needs a positional bias B, and pos={self.pos!r} has none "
                 f"(its DAPE computes A + f(A)); use the default variant or an additive encoding "
                 f"({', '.join(n for n, E in ENCODINGS.items() if E.has_bias)})")
        if self.rand_pos:
            if not PE.uses_positions:
                fail(f"rand_pos has no effect with pos={self.pos!r}, which does not use positions")
            self.rand_pos_max = self.rand_pos_max or 4 * self.block_size
            if self.rand_pos_max < self.block_size:
                fail(f"rand_pos_max={self.rand_pos_max} must be >= block_size={self.block_size}")
        elif self.rand_pos_max or self.rand_pos_eval:
            what = f"rand_pos_max={self.rand_pos_max}" if self.rand_pos_max else "rand_pos_eval"
            fail(f"{what} has no effect without rand_pos=True")
        if self.fire_L0 and self.pos != "fire":
            fail(f"fire_L0 has no effect with pos={self.pos!r}; it is FIRE's threshold")
        if self.attn_chunk < 0:
            fail(f"attn_chunk must be >= 0 (0: automatic), got {self.attn_chunk}")


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1's elementwise flag)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class SelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.head_size = config.n_embd // config.n_head
        self.causal = config.causal
        self.dropout = config.dropout
        self.attn_chunk = config.attn_chunk
        self.pos, self.dape_impl = config.pos, config.dape_impl
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        has_bias = ENCODINGS[config.pos].has_bias
        if config.dape == "v1":
            self.dape = DAPEV1(config.n_head, config.dape_width, config.dape_variant, has_bias)
        elif config.dape == "v2":
            self.dape = DAPEV2(config.n_head, config.dape_width, config.dape_kernel, config.dape_variant, has_bias)
        else:
            self.dape = None

    def forward(self, x, pe, pos_q, pos_k, cache=None, layer=0):
        q, k, v = self.qkv(x, pe, pos_q)
        t0 = len(cache) if cache is not None else 0
        # an encoding that reads the layer's input (FoX's forget gates): its state for every key
        state = pe.state(x, cache.state[layer] if t0 else None) if pe.reads_input else None
        if cache is not None:  # keys and values (and states) of earlier tokens come first
            if t0:
                k, v = torch.cat((cache.k[layer], k), dim=2), torch.cat((cache.v[layer], v), dim=2)
                state = torch.cat((cache.state[layer], state), dim=-1) if state is not None else None
            cache.k[layer], cache.v[layer], cache.state[layer] = k, v, state
        y = self.attend(q, k, v, pe, pos_q, pos_k, t0, state)
        y = rearrange(y, "b h t d -> b t (h d)")  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def qkv(self, x, pe, pos):
        """Queries, keys and values [B, H, T, hs] of x [B, T, C] (rotated, for RoPE)."""
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (rearrange(t, "b t (h d) -> b h t d", h=self.n_head) for t in (q, k, v))
        if pe.rotary:
            q, k = pe.rotate(q, pos), pe.rotate(k, pos)
        return q, k, v

    def query_block(self, B, Tq, Tk, device, fused):
        if self.attn_chunk:
            return self.attn_chunk
        if torch.is_grad_enabled() or fused:
            return Tq  # autograd keeps every block's tensors anyway; the fused kernel holds no [Tq, Tk] map
        width = self.dape.width if self.dape is not None else 0
        per_query = B * Tk * (4 * self.n_head + 2 * width)  # A, bias, logits, probs, f's hidden map
        step = ATTN_BLOCK_BUDGET // per_query
        if device.type == "cpu":
            step = min(step, ATTN_BLOCK_CACHE_CPU // (B * self.n_head * Tk))
        return max(1, min(Tq, step))

    def attend(self, q, k, v, pe, pos_q, pos_k, t0, state=None):
        """state: the state of every key, [B, H, Tk], of an encoding that reads the layer's input
        (pe.reads_input), else None; its bias reads (the queries' state, the keys' state)."""
        Tq, Tk = q.shape[2], k.shape[2]
        fused = self.fused(q, pe)
        step = self.query_block(q.shape[0], Tq, Tk, q.device, fused)
        ki = torch.arange(Tk, device=q.device)  # index of each key in the sequence
        ys = []
        for s in range(0, Tq, step):
            e = min(s + step, Tq)
            st = None if state is None else (state[..., t0 + s:t0 + e], state)  # the queries are the last keys
            if fused:  # softmax(mask(A + bias + f)) . v in one kernel, A and f never in memory
                if pe.separable:  # B_ij = u_i - w_j, formed on chip
                    bias = pe.bias_terms(pos_q[s:e], pos_k, st)
                else:
                    bias = pe.bias(pos_q[s:e], pos_k, state=st) if pe.has_bias else None
                ys.append(dape_triton.attention(q[:, :, s:e], k, v, bias, *self.dape.weights(), self.dape.variant,
                                                self.causal, q_offset=t0 + s))
                continue
            qi = torch.arange(t0 + s, t0 + e, device=q.device)
            ys.append(self.attend_block(q[:, :, s:e], k, v, pe, pos_q[s:e], pos_k, qi, ki, st))
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)

    def fused(self, q, pe):
        """Whether DAPE runs in dape_triton.py's fused kernel. dape_impl='auto': on the devices of FUSED_DEVICES
        (CUDA) when Triton imports, for the encodings whose bias does not depend on the content, without
        attention dropout in training, outside torch.compile, and once the kernel has passed its self-check
        for this kind of call (dape_triton.self_check: a tiny run against the PyTorch path); anything else
        takes the PyTorch path, saying why once. 'triton': the kernel or an error; 'torch': never."""
        if self.dape is None or self.dape_impl == "torch" or (self.dape_impl == "auto"
                                                              and q.device.type not in FUSED_DEVICES):
            return False
        why = fused_unsupported(self.pos, self.dropout if self.training else 0.0, torch.compiler.is_compiling())
        if why is None:
            why = _triton_missing(q, self.dape.width, self.dape.kernel)
        if why is not None:
            warning = f"DAPE's fused kernel does not cover {why}: using the PyTorch path"
        else:
            bias_grad = pe.has_bias and torch.is_grad_enabled() and any(p.requires_grad for p in pe.parameters())
            kind = ("terms" if pe.separable else "map") if pe.has_bias else None
            failed = dape_triton.self_check(self.dape, q, kind, bias_grad, self.causal)
            if failed is None:
                return True
            why = f"its self-check failed on this device ({failed})"
            warning = (f"DAPE's fused kernel failed its self-check on this device ({failed}): using the PyTorch "
                       f"path for these calls")
        if self.dape_impl == "triton":
            raise ValueError(f"dape_impl='triton' cannot run here: {why}; use dape_impl='auto' or 'torch'")
        warn_once(warning)
        return False

    def scores(self, q, k, pe, pos_q, pos_k, qi, ki, state=None):
        """The logits' terms [B, H, Tq, Tk] of the queries at sequence indices qi: A with CoPE's
        contextual term added, the encoding's bias ([H, Tq, Tk] or [B, H, Tq, Tk], or None), and the
        content logits A alone."""
        # q is scaled rather than A: scaling the [B, H, Tq, Tk] map costs a pass over it, and another in backward
        A = ((q * (1.0 / math.sqrt(self.head_size))) @ k.transpose(-2, -1)).float()
        A_pe = pe.logits(A, q, qi, ki) if pe.contextual else A
        return A_pe, (pe.bias(pos_q, pos_k, q, k, state) if pe.has_bias else None), A

    def attend_block(self, q, k, v, pe, pos_q, pos_k, qi, ki, state=None):
        """Attention of the queries at sequence indices qi to all keys (indices ki)."""
        future = ki[None, :] > qi[:, None] if self.causal else None  # [Tq, Tk], True = masked
        dropout_p = self.dropout if self.training else 0.0

        if self.dape is None and not pe.needs_content:
            # the same function through the fused kernel: the bias (if any) goes in as a float mask
            if not pe.has_bias:
                if future is None:
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
                if q.shape[2] == k.shape[2]:  # then qi == ki: the ordinary square causal mask
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=~future, dropout_p=dropout_p)
            bias = pe.bias(pos_q, pos_k, state=state)
            if future is not None:
                bias = bias.masked_fill(future, float("-inf"))
            # as [1, H, Tq, Tk] (or [B, H, Tq, Tk]): PyTorch's CPU kernel is much slower with a 3-D [H, Tq, Tk]
            # mask (README, "Benchmark"). Under autocast SDPA wants the mask in q's dtype: the float32 bias is
            # rounded once, as the logits themselves are
            bias = bias.to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias if bias.dim() == 4 else bias[None],
                                                  dropout_p=dropout_p)

        A, bias, _ = self.scores(q, k, pe, pos_q, pos_k, qi, ki, state)
        if self.dape is not None:  # softmax(mask(A + bias + f)), without f where the mask hides it
            att = self.dape.probs(A, bias, future)
        else:
            logits = A if bias is None else A + bias
            if future is not None:
                logits = logits.masked_fill(future, float("-inf"))
            att = F.softmax(logits, dim=-1)
        att = F.dropout(att, dropout_p, self.training)
        return att.to(v.dtype) @ v

    @torch.no_grad()
    def terms(self, x, pe, pos, rows):
        """What this layer adds up for the query rows `rows` (sequence indices) of x [1, T, C], as
        visualize.py draws it: A, bias, f (DAPE's term), the pre-softmax logits and the probabilities,
        each [H, R, T] float32 (None where the model has none), and `out` [R, C], the layer's output at
        those rows computed from them (equal to forward's: the test of this function)."""
        T = x.shape[1]
        q, k, v = self.qkv(x, pe, pos)
        qi = torch.as_tensor(rows, device=x.device)
        ki = torch.arange(T, device=x.device)
        state = pe.state(x) if pe.reads_input else None
        state = None if state is None else (state[..., qi], state)
        A, bias, content = self.scores(q[:, :, qi], k, pe, pos[qi], pos, qi, ki, state)
        if bias is not None:
            bias = bias.expand_as(A)
        future = ki[None, :] > qi[:, None] if self.causal else None
        logits = A if bias is None else A + bias
        f = None
        if self.dape is not None:  # logits = A + bias + f, except for 'concat' (A + f) and no bias (A + f)
            logits = self.dape(A, bias, future)
            f = logits - A - (bias if bias is not None and self.dape.variant != "concat" else 0.0)
        att = F.softmax(logits if future is None else logits.masked_fill(future, float("-inf")), dim=-1)
        y = rearrange(att.to(v.dtype) @ v, "b h r d -> b r (h d)")
        # for CoPE the position term drawn as the bias is its contextual term, and A the content logits
        position = bias if bias is not None else (A - content if pe.contextual else None)
        sq = lambda t: None if t is None else t[0].float().cpu()
        return {'A': sq(content), 'B': sq(position), 'f': sq(f), 'logits': sq(logits), 'att': sq(att),
                'out': self.c_proj(y)[0].float().cpu()}


dape_triton = None  # imported when first needed: Triton is a CUDA-only dependency
# Where dape_impl='auto' puts DAPE in the fused kernel: CUDA. (Under Triton's interpreter the kernel also
# runs on CPU tensors, slowly: the tests add "cpu" here to check what auto does.)
FUSED_DEVICES = ("cuda",)


def fused_unsupported(pos, dropout, compiling):
    """Why the fused kernel cannot compute attention with the encoding `pos` (a name of ENCODINGS), attention
    dropout (training) and under torch.compile, whatever the device, or None."""
    if ENCODINGS[pos].contextual or ENCODINGS[pos].needs_content:
        return f"pos={pos} (its logits depend on the content)"
    if dropout:
        return "attention dropout in training"
    if compiling:
        return "torch.compile (the kernel runs in eager mode)"
    return None


def _triton_missing(q, width, kernel_size):
    """Why dape_triton.py cannot run on q (its device, dtype and heads) with f of this width and kernel, or None."""
    global dape_triton
    if dape_triton is None:
        try:
            import dape_triton
        except ImportError as e:
            return f"a machine without Triton ({e})"
    return dape_triton.unavailable(q, width, kernel_size)


def fused_kernel_problem(config, device, dtype, compiling=False):
    """Why dape_impl='triton' cannot train this model on device in dtype (torch.compile'd or not), or None:
    what train.py checks before it starts. (The kernel's self-check runs at its first call.)"""
    if config.dape == "none" or config.dape_impl != "triton":
        return None
    why = fused_unsupported(config.pos, config.dropout, compiling)
    if why is None:
        q = torch.empty(1, config.n_head, 1, config.n_embd // config.n_head, dtype=dtype, device=device)
        why = _triton_missing(q, config.dape_width, config.dape_kernel if config.dape == "v2" else 1)
    return why


_warned = set()


def warn_once(message):
    """warnings.warn, once per message for the process (Python's own filter forgets under pytest)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, pe, pos_q, pos_k, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), pe, pos_q, pos_k, cache, layer)
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """Keys, values and positions of the tokens seen so far, for incremental decoding (and the state of an
    encoding that reads the layer's input, FoX's running sum of log forget gates)."""

    def __init__(self, n_layer):
        self.k, self.v, self.state = [None] * n_layer, [None] * n_layer, [None] * n_layer
        self.pos = None

    def __len__(self):
        return 0 if self.pos is None else self.pos.numel()


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert isinstance(config, GPTConfig), "GPT takes a GPTConfig"
        self.config = config
        PE = ENCODINGS[config.pos]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        # one encoding per layer (Kerple, FIRE, ...) or one for the whole model (T5's table, ALiBi, RoPE)
        self.pe = nn.ModuleList([PE(config) for _ in range(config.n_layer if PE.per_layer else 1)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        # positional and DAPE modules keep the initialisation their papers give them, not GPT-2's
        for block in self.transformer.h:
            if block.attn.dape is not None:
                block.attn.dape.reset_parameters()
        for pe in self.pe:
            pe.reset_parameters()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Parameters; non_embedding leaves out learned positions (the token embedding stays in: with
        tie_weights it is also the output head's weight, as in nanoGPT)."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.pos == "learned":
            n_params -= self.pe[0].wpe.weight.numel()
        return n_params

    def positions(self, T, t0=0, device=None):
        """Positions of T new tokens after t0 earlier ones: 0, 1, 2, ... or, while training with
        rand_pos (and at evaluation too with rand_pos_eval), a sorted random subset of
        [0, rand_pos_max), one for the whole batch (so that at evaluation the model has already seen
        positions far beyond its training length)."""
        if self.config.rand_pos and (self.training or self.config.rand_pos_eval):
            if t0:
                raise ValueError("randomized positions are drawn afresh for every forward, so they cannot "
                                 "continue a KV cache: generate with rand_pos_eval=False")
            if t0 + T > self.config.rand_pos_max:
                raise ValueError(f"cannot draw {t0 + T} randomized positions from [0, {self.config.rand_pos_max}); "
                                 f"raise rand_pos_max")
            return torch.randperm(self.config.rand_pos_max, device=device)[:T].sort().values
        return torch.arange(t0, t0 + T, device=device)

    def forward(self, idx, targets=None, cache=None, last=None):
        """idx [B, T] -> (logits, loss). Logits cover every position when targets [B, T] are given (loss
        ignores targets of -1), only the last position otherwise; with `last`, only the last `last`
        positions and their targets (evaluation at long lengths need not hold [B, T, vocab] logits)."""
        B, T = idx.shape
        t0 = len(cache) if cache is not None else 0
        pos_q = self.positions(T, t0, idx.device)
        pos_k = pos_q if not t0 else torch.cat((cache.pos, pos_q))

        x = self.transformer.wte(idx)
        if self.pe[0].absolute:
            x = x + self.pe[0].embed(pos_q)
        x = self.transformer.drop(x)
        for layer, block in enumerate(self.transformer.h):
            pe = self.pe[layer if len(self.pe) > 1 else 0]
            x = block(x, pe, pos_q, pos_k, cache, layer)
        x = self.transformer.ln_f(x)
        if cache is not None:
            cache.pos = pos_k

        if last is not None:
            x = x[:, -last:]
            targets = targets[:, -last:] if targets is not None else None
        elif targets is None:
            x = x[:, [-1]]  # inference: only the last position is needed
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def flops_per_token(self, T):
        """Training FLOPs (forward + backward) per token at sequence length T: PaLM's 6N + 12 L H Q T
        (nanoGPT's estimate_mfu), plus DAPE's f at each of the T (query, key) pairs per token."""
        cfg = self.config
        N = self.get_num_params()
        L, H, Q = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
        flops = 6 * N + 12 * L * H * Q * T
        if cfg.dape != "none":
            dape = self.transformer.h[0].attn.dape
            k = cfg.dape_kernel if cfg.dape == "v2" else 1
            flops += 3 * L * T * 2 * k * (dape.in_channels * cfg.dape_width + cfg.dape_width * H)
        return flops

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on the weights of Linear, conv and embedding layers only. Biases, norms
        and the encodings' own parameters are not decayed, whatever their shape: Kerple's r1, r2 (and
        a, p) are [H, 1, 1] and XL's biases u, v are [H, hs], so nanoGPT's rule (decay every parameter
        of 2 or more dimensions) would pull the slopes towards their clamp, and u, v towards 0.
        CoPE's position table is not decayed either (zero at init, like a bias)."""
        matrices = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding))}
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if id(p) in matrices]
        no_decay = [p for p in params if id(p) not in matrices]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        use_fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if use_fused else {}))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Continue idx [B, T] by max_new_tokens sampled tokens, feeding one token at a time through a
        KV cache; the length is not capped (except by `learned`, whose table ends at block_size)."""
        if not self.config.causal:
            raise ValueError("generate needs a causal model; this one was built with causal=False")
        cache = KVCache(self.config.n_layer)
        for step in range(max_new_tokens):
            # the prompt once, then only the newest token: the cache holds the keys and values of the rest
            logits, _ = self(idx if step == 0 else idx[:, -1:], cache=cache)
            logits = logits[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

