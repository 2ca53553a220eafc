"""
A GPT (nanoGPT's, itself after GPT-2) whose attention takes its positional information from
positional.py and, optionally, a data-adaptive correction of its logits from dape.py.

Shapes: B batch, T sequence length (Tq queries, Tk keys in attention), C embedding width, H heads, hs
head size, V vocabulary.

Attention, for one layer, with A = q.k/sqrt(hs) and `bias` the encoding's positional bias (the paper's B):

    logits = A + bias                    (an additive encoding, no DAPE)
    logits = A + bias + f(A, bias)       (DAPE; f and its variants in dape.py)
    logits = s log(n_i) logits           (logn_scale: query i sees n_i keys; SSMax, Nakanishi 2025)
    y = softmax(mask(logits)) . v        (attn=softmax)
    y = stick_breaking(logits) . v       (attn=stickbreaking, Tan et al. 2025; these three: normalisation.py)

It is computed in blocks of queries when the [B, H, Tq, Tk] maps would be large: the same result (every
step is local to one query row) in memory bounded by the block, which lets a small model be evaluated at
8192 tokens on a CPU. Without DAPE or a content-dependent term, softmax attention goes through
F.scaled_dot_product_attention with the bias as a float mask, the same function faster. With DAPE,
dape_paths.py picks the code (dape.py's first screen says which runs).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import dape
import dape_paths
import normalisation
from dape import INITS, VARIANTS
from positional import ENCODINGS, as_map, real

# Attention probabilities of far-away keys (exp of very negative logits) underflow into float32
# denormals, which x86 CPUs process many times slower; flushing them to zero changes no result that
# matters. Set once here, for every script that builds a model.
torch.set_flush_denormal(True)

# Floats the attention of one layer may hold per query block, when it is not training (autograd keeps
# every block anyway). 2**26 float32 = 256 MB.
ATTN_BLOCK_BUDGET = 2 ** 26
# On the CPU, also floats of one [B, H, Tq, Tk] map of a block (8 MB): the bias, the mask and the softmax
# are each a pass over such maps, and passes within the last-level cache are several times faster than
# through memory (figures in docs/benchmark.md).
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
    dape_init: str = "default"  # f's initialisation: default (PyTorch's, the released code's) or zero (dape.py)
    dape_impl: str = "auto"  # the code that computes DAPE: auto, plain, torch or triton (dape_paths.py)
    causal: bool = True  # False: a bidirectional encoder (CHE)
    # causal=False: which distance biases put a key on the left half a step nearer, so that they tell left
    # from right: alibi (as Ruoss et al.'s reference), all (ALiBi, Kerple, Kerple-power, FIRE), none
    bidir_bias: str = "alibi"
    rand_pos: bool = False  # randomized positions while training (Ruoss et al. 2023)
    rand_pos_max: int = 0  # positions are drawn from [0, rand_pos_max); 0: 4 * block_size
    rand_pos_eval: bool = False  # draw them at evaluation too (Ruoss et al.'s CHE protocol); False: 0..T-1
    tie_weights: bool = True  # the output head is the token embedding (GPT-2); False: a head of its own
    fire_L0: int = 0  # FIRE's threshold L0; 0: block_size
    # queries per attention block where [Tq, Tk] maps are formed (DAPE's fused kernel forms none and takes all
    # at once); 0: chosen from ATTN_BLOCK_BUDGET (and the CPU's cache)
    attn_chunk: int = 0
    attn: str = "softmax"  # how logits become weights: softmax, or stickbreaking (Tan et al. 2025; causal only)
    sb_current: bool = False  # stickbreaking: the query's own key breaks the stick too (else it takes what is left)
    logn_scale: str = "none"  # logits times s log(n), n the keys a query sees (SSMax): none, fixed or learned s

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"GPTConfig: {msg}")
        if self.pos not in ENCODINGS:
            fail(f"unknown pos={self.pos!r}; choose one of {', '.join(ENCODINGS)}")
        if self.dape not in ("none", "v1", "v2"):
            fail(f"unknown dape={self.dape!r}; choose none, v1 or v2")
        if self.bidir_bias not in ("alibi", "all", "none"):
            fail(f"unknown bidir_bias={self.bidir_bias!r}; choose alibi, all or none")
        if self.dape_impl not in dape_paths.IMPLS:
            fail(f"unknown dape_impl={self.dape_impl!r}; choose one of {', '.join(dape_paths.IMPLS)}")
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
        if self.dape_init not in INITS:
            fail(f"unknown dape_init={self.dape_init!r}; choose one of {', '.join(INITS)}")
        if self.dape == "none" and self.dape_variant != "concat_residual":
            fail(f"dape_variant={self.dape_variant!r} has no effect with dape='none'; set dape=v1 or v2")
        if self.dape == "none" and self.dape_init != "default":
            fail(f"dape_init={self.dape_init!r} has no effect with dape='none'; set dape=v1 or v2")
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
        normalisation.check(self, fail)


class SelfAttention(nn.Module):

    def __init__(self, config, dape=dape):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.head_size = config.n_embd // config.n_head
        self.causal = config.causal
        self.dropout = config.dropout
        self.attn_chunk = config.attn_chunk
        self.dape_impl = config.dape_impl
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        has_bias = ENCODINGS[config.pos].has_bias
        if config.dape == "v1":  # dape: the module that defines f (a checkpoint's own, common.dape_module)
            self.dape = dape.DAPEV1(config.n_head, config.dape_width, config.dape_variant, has_bias, config.dape_init)
        elif config.dape == "v2":
            self.dape = dape.DAPEV2(config.n_head, config.dape_width, config.dape_kernel, config.dape_variant,
                                    has_bias, config.dape_init)
        else:
            self.dape = None
        self.normalisation = normalisation.Normalisation(config)  # softmax or stick-breaking, log-length scaling

    def forward(self, x, pe, pos_q, pos_k, cache=None, layer=0):
        q, k, v = self.qkv(x, pe, pos_q)
        t0 = len(cache) if cache is not None else 0
        if t0:  # keys and values of earlier tokens come first
            k, v = torch.cat((cache.k[layer], k), dim=2), torch.cat((cache.v[layer], v), dim=2)
        # an encoding that reads the layer's input (FoX's forget gates, PaTH's transforms): every key's state
        state = pe.state(x, k, cache.state[layer] if t0 else None) if pe.reads_input else None
        if cache is not None:
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

    def query_block(self, B, Tq, Tk, device):
        if self.attn_chunk:
            return self.attn_chunk
        if torch.is_grad_enabled():
            return Tq  # autograd keeps every block's tensors anyway
        width = self.dape.width if self.dape is not None else 0
        maps = 4 + (4 if self.normalisation.stickbreaking else 0)  # A, bias, logits, probs (+ the stick's log maps)
        per_query = B * Tk * (maps * self.n_head + 2 * width)  # and f's hidden map
        step = ATTN_BLOCK_BUDGET // per_query
        if device.type == "cpu":
            step = min(step, ATTN_BLOCK_CACHE_CPU // (B * self.n_head * Tk))
        return max(1, min(Tq, step))

    def attend(self, q, k, v, pe, pos_q, pos_k, t0, state=None):
        """Attention of the queries q (the tokens t0, t0 + 1, ... of the sequence) to the keys k, v, in
        blocks of queries. state: every key's state of an encoding that reads the layer's input."""
        Tq, Tk = q.shape[2], k.shape[2]
        step = self.query_block(q.shape[0], Tq, Tk, q.device)
        dropout_p = self.dropout if self.training else 0.0
        ki = torch.arange(Tk, device=q.device)  # index of each key in the sequence

        def scores(s, e, logits=True):  # query rows [s, e): their logits A and the bias
            qi = torch.arange(t0 + s, t0 + e, device=q.device)
            return self.scores(q[:, :, s:e], k, pe, pos_q[s:e], pos_k, qi, ki, state, logits)

        if self.dape is not None:  # dape_paths.py picks the code that computes it
            normalise = None if self.normalisation.what is None else (
                self.normalisation.what, lambda logits, qi, future: self.normalise(logits, v, qi, future, dropout_p))
            return dape_paths.attention(self.dape, q, k, v, scores, self.causal, t0, step, self.dape_impl,
                                        dropout_p, pe, normalise)
        ys = []
        for s in range(0, Tq, step):
            e = min(s + step, Tq)
            qi = torch.arange(t0 + s, t0 + e, device=q.device)
            future = ki[None, :] > qi[:, None] if self.causal else None  # [Tq, Tk], True = masked
            ys.append(self.attend_block(q[:, :, s:e], k, v, pe, future, dropout_p,
                                         lambda logits=True: scores(s, e, logits), qi))
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)

    def scores(self, q, k, pe, pos_q, pos_k, qi, ki, state=None, logits=True):
        """The logits' terms of the queries at sequence indices qi: A [B, H, Tq, Tk] in float32 or float64
        (positional.real; None without `logits`; a contextual encoding's own, CoPE's or PaTH's) and the encoding's
        bias (None, [H, Tq, Tk], [B, H, Tq, Tk] or Terms)."""
        bias = pe.bias(pos_q, pos_k, q, k, state) if pe.has_bias else None
        if not logits:
            return None, bias
        if pe.contextual:
            return pe.logits(q, k, qi, ki, state), bias
        # q is scaled rather than A: scaling the [B, H, Tq, Tk] map costs a pass over it, and another in backward
        return real((q * (1.0 / math.sqrt(self.head_size))) @ k.transpose(-2, -1)), bias

    def attend_block(self, q, k, v, pe, future, dropout_p, scores, qi):
        """Attention without DAPE of one block of queries, at sequence indices qi; scores(logits) gives their
        logits A (when asked for) and the bias."""
        if not pe.needs_content and not self.normalisation.stickbreaking:
            # the same function through PyTorch's fused attention: the bias (if any) goes in as a float mask,
            # and log-length scaling into q and the bias, c_i (q.k/sqrt(hs) + B) = (c_i q).k/sqrt(hs) + c_i B
            c = self.normalisation.logn_factor(qi, k.shape[2]) if self.normalisation.logn_s is not None else None
            if c is not None:
                q = (q * c).to(q.dtype)
            if not pe.has_bias:
                if future is None:
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
                if q.shape[2] == k.shape[2]:  # then the ordinary square causal mask
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=~future, dropout_p=dropout_p)
            bias = as_map(scores(logits=False)[1])
            if c is not None:
                bias = bias * c
            if future is not None:
                bias = bias.masked_fill(future, float("-inf"))
            # as [1, H, Tq, Tk] (or [B, H, Tq, Tk]): PyTorch's CPU kernel is much slower with a 3-D [H, Tq, Tk]
            # mask (docs/benchmark.md). Under autocast SDPA wants the mask in q's dtype: the float32 bias is
            # rounded once, as the logits themselves are
            bias = bias.to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias if bias.dim() == 4 else bias[None],
                                                  dropout_p=dropout_p)
        A, bias = scores()
        return self.normalise(A if bias is None else A + as_map(bias), v, qi, future, dropout_p)

    def normalise(self, logits, v, qi, future, dropout_p=0.0):
        """The output [B, H, R, hs] of the queries at sequence indices qi from their final logits [B, H, R, Tk]
        (after bias and DAPE; -inf or anything where future [R, Tk] is True), against the values v [B, H, Tk,
        hs]: the weights of normalisation.py, and with stick-breaking what is left of the stick."""
        return self.mix(*self.normalisation(logits, qi, future), v, qi, dropout_p)

    def mix(self, weights, rem, v, qi, dropout_p=0.0):
        """The output [B, H, R, hs] from the weights and the stick left over that self.normalisation gives."""
        y = F.dropout(weights, dropout_p).to(v.dtype) @ v
        if rem is None:
            return y
        # the stick left over goes to the query's own value (Tan et al.'s model), v at its index in the sequence
        return y + (F.dropout(rem, dropout_p)[..., None] * v[:, :, qi]).to(y.dtype)


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

    def __init__(self, config, dape=dape):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config, dape)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, pe, pos_q, pos_k, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), pe, pos_q, pos_k, cache, layer)
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """Keys, values and positions of the tokens seen so far, for incremental decoding (and the state of an
    encoding that reads the layer's input: FoX's running sum of log forget gates, PaTH's transforms)."""

    def __init__(self, n_layer):
        self.k, self.v, self.state = [None] * n_layer, [None] * n_layer, [None] * n_layer
        self.pos = None

    def __len__(self):
        return 0 if self.pos is None else self.pos.numel()


class GPT(nn.Module):

    def __init__(self, config, dape=dape):
        """dape: the module whose DAPEV1 and DAPEV2 define f (dape.py, or a checkpoint's own: common.py)."""
        super().__init__()
        assert isinstance(config, GPTConfig), "GPT takes a GPTConfig"
        self.config = config
        PE = ENCODINGS[config.pos]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, dape) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
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
            loss = F.cross_entropy(real(logits.reshape(-1, logits.size(-1))), targets.reshape(-1), ignore_index=-1)
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
        """AdamW with weight decay on the weights of Linear, conv and embedding layers only (the encodings' and
        DAPE's among them). nanoGPT's rule, decay every parameter of 2 or more dimensions, would also pull
        Kerple's [H, 1, 1] slopes towards their clamp, XL's [H, hs] biases u, v and CoPE's position table
        (zero at init, like a bias) towards 0; log-length scaling's learned s is not decayed either."""
        matrices = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding))}
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if id(p) in matrices]
        no_decay = [p for p in params if id(p) not in matrices]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True if device_type == "cuda" else None)

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

