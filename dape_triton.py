"""
DAPE attention fused into Triton kernels, FlashAttention-2 style: one kernel for the forward pass, one for
the backward pass, computing for all H heads of a layer

    y = softmax(mask(A + [B] + f(A, B))) @ v,    A = scale q k^T,

with f the two-layer channel mixer of dape.py (V1: at each (query, key) pair; V2: (1, k) convolutions
along the keys of a row). Neither the [B, H, Tq, Tk] logits or probabilities nor f's [B, D, Tq, Tk] hidden
map is ever written to memory: the forward pass keeps per (head, query) only the running max and sum of
the online softmax and saves the log-sum-exp; the backward pass recomputes every tile from q, k, v, the
bias and the weights.

Programs. f mixes the heads, so every (query, key) pair needs the logits of all heads. A program owns a
block of BLOCK_M queries of one sequence and a group of HG heads (all heads, padded to HP = 16, when there
are at most 16; groups of 16 when there are 32), and loops over blocks of BLOCK_N keys (causal: up to the
last key its last query sees). Per key block:
    A       of all heads, [HP, M, N]: batched tl.dots over chunks of EC channels of the head size; each chunk
            of q and k is loaded where it is used, so no [heads, M, head size] tile is held across the loop
            (q held whole is 32 KB of shared memory at 16 heads of 64, and k and dy as much again);
    z       f's first layer on the tile flattened to [channels, M N]: z = Wa A + Wb B + b1 as tl.dots
            [DC, HP] x [HP, M N], DC of f's hidden channels at a time (V1; V2 takes all DP at once, so that
            it recomputes its shifted inputs once), and h = LeakyReLU(z). The channel counts (16 to 64 once
            padded) are natural tl.dot sizes, so f runs on tensor cores;
    f       for the program's own heads, W2 h as [HG, DC] x [DC, M N] summed over the blocks; their logits
            A + [B] + f (A and B of the own heads recomputed when there are several groups: QK^T costs a
            group's share more);
    softmax per (head, query) online (running max m, sum l, rescaled accumulator), acc += P v for the
            own heads and a chunk of EV channels of v (several programs share a query block when the head
            size is over EV: each recomputes the logits, which at those model sizes cost little of a step).
V2's halo: f at key j needs h at j - p .. j + p (p = k // 2), which needs A and B at j - 2p .. j + 2p. The
kernels recompute them with shifted key and bias loads (masked outside [0, Tk) and, causal, after the
query: exactly V2's zero padding and future zeroing): for each of the k hidden shifts u, z_u sums its k taps,
reading the inputs at shifts u + t - 2p. A V2 tile therefore costs k^2 + 1 QK^T products where V1 does one;
the backward pass, which needs the logits, then z_u, then the taps' inputs again, does 3 k^2 + 1. In exchange
nothing but the running z and f is live across shifts, so V2 needs hardly more registers or shared memory
than V1.

Backward. The same programs, over the same key blocks: recompute the own heads' logits, P = exp(s - lse),
dP = dy v^T, dL = P (dP - Delta) with Delta = rowsum(dy * y) (computed beforehand in PyTorch), dv += P^T dy.
Then, per hidden shift u: recompute z_u, dW2_u += dL h_u^T, dz = LeakyReLU'(z_u) * (W2_u^T dL), zeroed where
V2 zeroed h; and per tap t: dW1_t += dz X^T and dX = W1_t^T dz, for all heads, at key shift w = u + t - 2p
(scatter form). A's half of dX gives dq = scale dA k and dk = scale dA^T q, its bias half the bias gradient.
The residual's share (dL itself, for the own heads) joins the w = 0 term, or, with several groups, is
scattered on its own. dq, dk, dv and the bias gradient are float32 atomic adds (several programs reach
each), so their last bits vary between runs on a GPU. Scatter rather than gather: dk at key j needs dL at
keys j - 2p .. j + 2p, each of which needs the logits at j - 4p .. j + 4p, so a key-owning program would
recompute the forward 4p + 1 times. The weights' gradients go to a [programs, ...] float32 buffer, each
program adding its tiles' sums to its own row (one writer per row keeps them deterministic), summed in
PyTorch.

The bias B comes as a map (shared by the batch, or per sequence) or, for FoX, as terms: B_ij = u_i - w_j from
two [B, H, T] vectors (B_TERMS), formed on chip, whose gradients are the map gradient's row sums and minus
its column sums.

Variants (f's first layer split into a half Wa applied to A and a half Wb applied to B; RES_B: B is added):
    concat_residual   A + B + f(cat(A, B))   Wa = w1[:, :H], Wb = w1[:, H:], RES_B    (dw1 = cat(dWa, dWb))
    concat            A + f(cat(A, B))       Wa = w1[:, :H], Wb = w1[:, H:]           (dw1 = cat(dWa, dWb))
    add_residual      A + B + f(A + B)       Wa = Wb = w1, RES_B                      (dw1 = dWa + dWb)
    bias_only         A + B + f(B)           Wa = 0 (skipped), Wb = w1, RES_B         (dw1 = dWb)
    no bias           A + f(A)               Wa = w1, no B                            (dw1 = dWa)

Tiles and architectures. Every tile holds all heads, [HP, M, N] for A and B, [DP, M N] for z and h, with HP
and DP (f's width) padded to powers of two >= 16 so that every tl.dot has K >= 16 (zero-padded weights and
masked loads keep the padding inert). That is many registers per (query, key) pair, so the tiles are small:
16 x 16 pairs. The shared memory a program needs differs little between architectures, but what a block
may use does: 163 KB on an A100 (sm_80), 99 KB on the A10, A40, RTX 30xx/40xx, L4 and L40S (sm_86, sm_89),
227 KB on an H100 (sm_90). CONFIG holds the launch settings, chosen by compiling every kernel for every
architecture on a CPU (Triton's compiler and ptxas need no GPU: bench.py --sections=fit prints the shared
memory, registers and spills of every combination, docs/gpu.md lists them, and tests/test_dape_triton.py
compiles the tightest shapes for sm_86 and asserts that they fit). The limits of the kernels' shapes are
MAX_* below; unavailable(q) says what is too large, and the model then uses its PyTorch path.

Dtypes. float32 inputs: every tl.dot in IEEE float32 (exact to float32 rounding; no TF32). float16 /
bfloat16 inputs (autocast): every tl.dot operand is rounded to that dtype (_lo), with float32 accumulation;
the softmax statistics, the residual A + B, LeakyReLU and every gradient accumulator are float32. The bias
and the weights are read as float32. y and the gradients of q, k, v come back in the inputs' dtype.

The kernels run compiled on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, as the
tests do). The interpreter cannot multiply bfloat16 (and truncates when it converts to it), so there the
bfloat16 path is emulated exactly: operands rounded to the nearest bfloat16 by hand and multiplied in
float32, which is what a tensor core computes from them (LO = "bf16-emulated"). triton.jit reads
TRITON_INTERPRET when it decorates a function, so the functions below are decorated on first use (_build)
rather than at import: a process that imports this module early (model.py does) and sets the variable
later still gets interpreted kernels.

Whether the kernels can be trusted on a GPU no session has run them on is decided outside this file:
whether they may run a DAPE module at all by its code (dape_paths.py), and whether they compute it on this
device by dape_check.py, which compares them with dape.py's plain form in float64 at the first call of each
kind (binary() tells the kinds apart); where they fail or disagree, then or at a later launch, the model
takes the PyTorch path with one warning naming the cause. compile_for() compiles them for any NVIDIA
architecture without a GPU (shared memory, registers, spills).
"""

from __future__ import annotations  # the kernels' tl.constexpr annotations stay strings without triton

import math
import numbers

import torch

try:
    import triton
    import triton.language as tl
except ImportError as _e:  # model.py asks unavailable() and falls back to its torch path
    triton = tl = None
    _IMPORT_ERROR = f"Triton is not installed ({_e})"
else:
    _IMPORT_ERROR = None

VARIANTS = ("concat_residual", "concat", "add_residual", "bias_only")  # as in dape.py
SLOPE = 0.01  # LeakyReLU's negative slope (dape.py, PyTorch's default)

# Launch settings: tile (block_m queries x block_n keys), the chunk of the head size that each QK^T / dP / dq /
# dk / dv product takes (ec), the chunk of v a forward program accumulates (ev), the heads per group (hg), f's
# hidden channels per block (dc, V1), warps, pipeline stages and the register cap (without one, ptxas capped
# V2's backward at 128 registers and spilled twice as much). Found by compiling for sm_80, sm_86, sm_89 and
# sm_90 on the CPU (bench.py --sections=fit; docs/gpu.md has the table): every kernel at every shape the
# models use fits each architecture's shared memory per block, and these settings spilled least on every one
# of them (warps 4, 8, 16 and chunks 16, 32, 64 tried at the 125M shape), so one setting serves all. One
# stage: the key loop is bound by arithmetic rather than loads, and pipelining would keep several copies of
# V2's shifted key and bias tiles in shared memory.
CONFIG = dict(block_m=16, block_n=16, ec=16, ev=64, hg=16, dc=16, warps=8, stages=1, maxnreg=255)
INTERPRETER_CONFIG = dict(block_m=16, block_n=16, ec=16, ev=64, hg=16, dc=16, warps=1, stages=1, maxnreg=None)
# Shared memory per block of each architecture, KB (CUDA's limits for an opt-in allocation).
SHARED_KB = {80: 163, 86: 99, 89: 99, 90: 227}
# Shape limits on CUDA: padded heads, padded head size, padded width of f. Past them the tiles no longer fit
# on chip (or were never compiled and checked), and unavailable() refuses them.
MAX_HEADS = 32
MAX_HEAD_SIZE = 256
MAX_WIDTH = 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------------------------------------
# the kernels (plain functions until _build decorates them with triton.jit)

_JIT_NAMES = []


def _jit(fn):
    _JIT_NAMES.append(fn.__name__)
    return fn


def _build():
    """Decorate the kernels with triton.jit, once; returns the mode they were built in."""
    global _built
    if _built is None:
        g = globals()
        for name in _JIT_NAMES:
            g[name] = triton.jit(g[name])
        _built = "interpret" if triton.knobs.runtime.interpret else "compile"
    return _built


_built = None


def _interpreting():
    """Whether the kernels run (or, not built yet, will run) under Triton's interpreter."""
    if _built is not None:
        return _built == "interpret"
    return bool(triton.knobs.runtime.interpret)


@_jit
def _lo(x, LO: tl.constexpr):
    """x as a tl.dot operand: rounded to the products' dtype LO (float32 x passes unchanged)."""
    if LO == "bf16-emulated":  # the interpreter: round to nearest even by hand, keep float32 (see above)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        y = bits.to(tl.float32, bitcast=True)
    elif LO == "bf16":
        y = x.to(tl.bfloat16)
    elif LO == "fp16":
        y = x.to(tl.float16)
    else:
        y = x
    return y


@_jit
def _valid(qpos, jw, Tk, CAUSAL: tl.constexpr):
    """Where f's inputs and hidden map at keys jw [1, 1, N] exist for the queries at positions qpos
    [1, M, 1]: inside [0, Tk) (V2's zero padding) and, causal, not after the query (V2's future zeroing;
    for V1 those pairs are masked anyway, so zeroing them there changes nothing)."""
    ok = (jw >= 0) & (jw < Tk)
    if CAUSAL:
        ok = ok & (jw <= qpos)
    return ok


@_jit
def _qk(q_rows, k_b, heads, jw, sqh, sqe, skh, skn, ske, H, HS, Tq, iq, Tk, scale,
        HX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EC: tl.constexpr, LO: tl.constexpr):
    """scale q k^T [HX, M, N] (float32) of the heads `heads` [HX, 1, 1] at the query rows q_rows (pointers
    [1, M, 1], indices iq) and keys jw [1, 1, N]; zero outside the tensors. Summed over chunks of EC channels."""
    e_last = tl.arange(0, EC)[None, None, :]
    nw = tl.reshape(jw, [1, BLOCK_N, 1])  # keys on the middle axis: k is loaded along its rows, then transposed
    qmask = (heads < H) & (iq < Tq)
    kmask = (heads < H) & (nw >= 0) & (nw < Tk)
    a = tl.zeros([HX, BLOCK_M, BLOCK_N], tl.float32)
    for e0 in tl.range(0, HS, EC):
        emask = e0 + e_last < HS
        qe = tl.load(q_rows + heads * sqh + (e0 + e_last) * sqe, mask=qmask & emask, other=0.0)
        ke = tl.load(k_b + heads * skh + nw * skn + (e0 + e_last) * ske, mask=kmask & emask, other=0.0)
        a = tl.dot(_lo(qe, LO), _lo(tl.permute(ke, (0, 2, 1)), LO), a, input_precision="ieee")
    return a * scale


@_jit
def _inputs(q_rows, k_b, bd, heads, jw, qpos, iq, sqh, sqe, skh, skn, ske, H, HS, Tq, Tk, scale,
            HX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EC: tl.constexpr,
            NEED_A: tl.constexpr, HAS_B: tl.constexpr, B_TERMS: tl.constexpr, CAUSAL: tl.constexpr,
            LO: tl.constexpr):
    """f's inputs A and B [HX, M, N] (float32) of the heads `heads` at keys jw, zero where not _valid. bd: the
    bias, (pointers of the query rows, head stride, key stride) of a map, and, B_TERMS, (pointers of the
    sequence's w, head stride, key stride) of B_ij = u_i - w_j, u's rows taking the map's place."""
    ok = _valid(qpos, jw, Tk, CAUSAL)
    if NEED_A:
        xa = tl.where(ok, _qk(q_rows, k_b, heads, jw, sqh, sqe, skh, skn, ske, H, HS, Tq, iq, Tk, scale,
                              HX, BLOCK_M, BLOCK_N, EC, LO), 0.0)
    else:
        xa = tl.zeros([HX, BLOCK_M, BLOCK_N], tl.float32)
    if HAS_B:
        bias_rows, sbh, sbn, w_b, swh, swn = bd
        if B_TERMS:  # u of the query rows minus w of the keys
            ui = tl.load(bias_rows + heads * sbh, mask=(heads < H) & (iq < Tq), other=0.0)
            wj = tl.load(w_b + heads * swh + jw * swn, mask=(heads < H) & (jw >= 0) & (jw < Tk), other=0.0)
            xb = tl.where((heads < H) & (iq < Tq) & ok, ui - wj, 0.0)
        else:
            xb = tl.load(bias_rows + heads * sbh + jw * sbn, mask=(heads < H) & (iq < Tq) & ok, other=0.0)
        xb = xb.to(tl.float32)
    else:
        xb = tl.zeros([HX, BLOCK_M, BLOCK_N], tl.float32)
    return xa, xb


@_jit
def _hidden(u, c0, a0, b0, q_rows, k_b, bd, heads, jn, qpos, iq, sqh, sqe, skh, skn, ske,
            H, HS, Tq, Tk, scale, WA, WB, B1, w_dh,
            HP: tl.constexpr, DP: tl.constexpr, DC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            EC: tl.constexpr, KS: tl.constexpr, PAD: tl.constexpr, A_IN: tl.constexpr, HAS_B: tl.constexpr,
            B_TERMS: tl.constexpr, CAUSAL: tl.constexpr, LO: tl.constexpr):
    """f's first layer before the activation at its hidden channels c0 .. c0 + DC - 1, z [DC, M N], at keys
    jn + u - PAD: its tap t reads the inputs of all heads at key shift u + t - 2 PAD (V1: the tile's own, a0
    and b0; V2 recomputes them). w_dh: a [DC, HP] block of a tap of Wa or Wb, at channel 0."""
    MN: tl.constexpr = BLOCK_M * BLOCK_N
    z = tl.zeros([DC, MN], tl.float32) + tl.load(B1 + c0 + tl.arange(0, DC))[:, None]
    w_dh = w_dh + c0 * HP
    for t in tl.range(0, KS):
        if KS == 1:
            xa = a0
            xb = b0
        else:
            xa, xb = _inputs(q_rows, k_b, bd, heads, jn + (u + t - 2 * PAD), qpos, iq, sqh, sqe, skh, skn, ske,
                             H, HS, Tq, Tk, scale, HP, BLOCK_M, BLOCK_N, EC, A_IN, HAS_B, B_TERMS, CAUSAL, LO)
        if A_IN:
            wa = tl.load(WA + t * DP * HP + w_dh)
            z = tl.dot(_lo(wa, LO), _lo(tl.reshape(xa, [HP, MN]), LO), z, input_precision="ieee")
        if HAS_B:
            wb = tl.load(WB + t * DP * HP + w_dh)
            z = tl.dot(_lo(wb, LO), _lo(tl.reshape(xb, [HP, MN]), LO), z, input_precision="ieee")
    return z


@_jit
def _hidden_mask(qpos, jn, Tk, u, PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """_valid at keys jn + u - PAD, flat like z: [1, M N]."""
    ok = tl.broadcast_to(_valid(qpos, jn + (u - PAD), Tk, CAUSAL), [1, BLOCK_M, BLOCK_N])
    return tl.reshape(ok, [1, BLOCK_M * BLOCK_N])


@_jit
def _logits(q_rows, k_b, bd, ha, hg, jn, qpos, iq, sqh, sqe, skh, skn, ske, H, HS, Tq, Tk, scale,
            WA, WB, W2, B1, b2g, w_dh, w2_own,
            HP: tl.constexpr, HG: tl.constexpr, DP: tl.constexpr, DC: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            EC: tl.constexpr, KS: tl.constexpr, PAD: tl.constexpr, A_IN: tl.constexpr, HAS_B: tl.constexpr,
            B_TERMS: tl.constexpr, RES_B: tl.constexpr, CAUSAL: tl.constexpr, LO: tl.constexpr,
            SLOPE: tl.constexpr):
    """The own heads' logits A + [B] + f [HG, M, N] at keys jn, -inf where masked; and the shift-0 inputs of
    all heads, a0 and b0 [HP, M, N] (V1's f reads them; otherwise zeros)."""
    GROUPS: tl.constexpr = HP // HG
    if (KS == 1) | (GROUPS == 1):
        a0, b0 = _inputs(q_rows, k_b, bd, ha, jn, qpos, iq, sqh, sqe, skh, skn, ske, H, HS, Tq, Tk,
                         scale, HP, BLOCK_M, BLOCK_N, EC, True, HAS_B, B_TERMS, CAUSAL, LO)
    else:
        a0 = tl.zeros([HP, BLOCK_M, BLOCK_N], tl.float32)
        b0 = tl.zeros([HP, BLOCK_M, BLOCK_N], tl.float32)
    f = tl.zeros([HG, BLOCK_M * BLOCK_N], tl.float32)
    for u in tl.range(0, KS):
        ok = _hidden_mask(qpos, jn, Tk, u, PAD, BLOCK_M, BLOCK_N, CAUSAL)
        for c0 in tl.range(0, DP, DC):  # f's hidden channels DC at a time: fewer registers live
            z = _hidden(u, c0, a0, b0, q_rows, k_b, bd, ha, jn, qpos, iq, sqh, sqe, skh, skn, ske,
                        H, HS, Tq, Tk, scale, WA, WB, B1, w_dh, HP, DP, DC, BLOCK_M, BLOCK_N, EC, KS, PAD, A_IN,
                        HAS_B, B_TERMS, CAUSAL, LO)
            h = tl.where(ok, tl.where(z > 0, z, z * SLOPE), 0.0)
            w2 = tl.load(W2 + u * HP * DP + c0 + w2_own)
            f = tl.dot(_lo(w2, LO), _lo(h, LO), f, input_precision="ieee")
    if GROUPS == 1:
        ag = a0
        bg = b0
    else:
        ag, bg = _inputs(q_rows, k_b, bd, hg, jn, qpos, iq, sqh, sqe, skh, skn, ske, H, HS, Tq, Tk,
                         scale, HG, BLOCK_M, BLOCK_N, EC, True, HAS_B, B_TERMS, CAUSAL, LO)
    s = ag + tl.reshape(f, [HG, BLOCK_M, BLOCK_N]) + b2g[:, None, None]
    if RES_B:
        s = s + bg
    s = tl.where(_valid(qpos, jn, Tk, CAUSAL), s, float("-inf"))
    return s, a0, b0


@_jit
def _forward(Q, K, V, Bias, BW, WA, WB, W2, B1, B2, Y, LSE,
             sqb, sqh, sqm, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
             sbb, sbh, sbm, sbn, swb, swh, swn, syb, syh, sym, sye,
             H, HS, Tq, Tk, q_offset, scale,
             HP: tl.constexpr, HG: tl.constexpr, EC: tl.constexpr, EV: tl.constexpr, DP: tl.constexpr,
             DC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KS: tl.constexpr, PAD: tl.constexpr,
             A_IN: tl.constexpr, HAS_B: tl.constexpr, B_TERMS: tl.constexpr, RES_B: tl.constexpr,
             CAUSAL: tl.constexpr, LO: tl.constexpr, SLOPE: tl.constexpr):
    """y [B, H, Tq, HS] (Y's dtype) and the log-sum-exp of each row, LSE [B, H, Tq] (float32). Grid: (query
    blocks, B, groups x chunks of v)."""
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the blocks with the most keys start first
    b = tl.program_id(1)
    n_v = tl.cdiv(HS, EV)
    g = tl.program_id(2) // n_v
    e0 = (tl.program_id(2) % n_v) * EV
    m0 = mb * BLOCK_M
    ha = tl.arange(0, HP)[:, None, None]  # all heads
    hg = g * HG + tl.arange(0, HG)[:, None, None]  # this program's heads
    iq = m0 + tl.arange(0, BLOCK_M)[None, :, None]
    jr = tl.arange(0, BLOCK_N)[None, None, :]  # keys on the last axis (logits)
    nr = tl.arange(0, BLOCK_N)[None, :, None]  # keys on the middle axis (v)
    ev = e0 + tl.arange(0, EV)[None, None, :]
    dc = tl.arange(0, DC)
    w_dh = dc[:, None] * HP + tl.arange(0, HP)[None, :]  # DC rows of a tap of Wa or Wb, [DC, HP]
    w2_own = (g * HG + tl.arange(0, HG))[:, None] * DP + dc[None, :]  # the own rows of a tap of W2, DC columns

    q_rows = Q + b * sqb + iq * sqm
    k_b = K + b * skb
    bd = (Bias + b * sbb + iq * sbm, sbh, sbn, BW + b * swb, swh, swn)
    qpos = q_offset + iq
    b2g = tl.load(B2 + g * HG + tl.arange(0, HG))
    v_b = V + b * svb + hg * svh + ev * sve
    vmask = (hg < H) & (ev < HS)

    m_i = tl.full([HG, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HG, BLOCK_M], tl.float32)
    acc = tl.zeros([HG, BLOCK_M, EV], tl.float32)
    n_end = Tk
    if CAUSAL:
        n_end = tl.minimum(Tk, q_offset + m0 + BLOCK_M)
    # key 0 is masked for no row, so m_i is finite from the first block on
    for n0 in tl.range(0, n_end, BLOCK_N):
        s, a0, b0 = _logits(q_rows, k_b, bd, ha, hg, n0 + jr, qpos, iq, sqh, sqe, skh, skn, ske,
                            H, HS, Tq, Tk, scale, WA, WB, W2, B1, b2g, w_dh, w2_own, HP, HG, DP, DC, BLOCK_M,
                            BLOCK_N, EC, KS, PAD, A_IN, HAS_B, B_TERMS, RES_B, CAUSAL, LO, SLOPE)
        m_new = tl.maximum(m_i, tl.max(s, 2))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        vt = tl.load(v_b + (n0 + nr) * svn, mask=vmask & (n0 + nr < Tk), other=0.0)
        acc = tl.dot(_lo(p, LO), _lo(vt, LO), acc * alpha[:, :, None], input_precision="ieee")
        m_i = m_new

    y = acc / l_i[:, :, None]
    tl.store(Y + b * syb + hg * syh + iq * sym + ev * sye, y.to(Y.dtype.element_ty), mask=vmask & (iq < Tq))
    hm = g * HG + tl.arange(0, HG)[:, None]
    im = m0 + tl.arange(0, BLOCK_M)[None, :]
    if e0 == 0:  # one of the programs that share the heads writes their log-sum-exp
        tl.store(LSE + (b * H + hm) * Tq + im, m_i + tl.log(l_i), mask=(hm < H) & (im < Tq))


@_jit
def _scatter_qk(da, heads, q_rows, k_b, dq_rows, dk_b, iq, jw, nw, sqh, sqe, skh, skn, ske, H, HS, Tq, Tk, scale,
                EC: tl.constexpr, LO: tl.constexpr):
    """The gradient da [HX, M, N] of A at the heads `heads`, query rows iq, keys jw (last axis; nw: the same
    on the middle axis): dq += scale da k and dk += scale da^T q, added atomically into the float32 buffers
    (dq_rows: pointers [1, M, 1] of rows iq; dk_b: the sequence's [H, Tk, HS] block)."""
    e_last = tl.arange(0, EC)[None, None, :]
    da_lo = _lo(da, LO)
    dat_lo = _lo(tl.permute(da, (0, 2, 1)), LO)
    qmask = (heads < H) & (iq < Tq)
    kmask = (heads < H) & (nw >= 0) & (nw < Tk)
    for e0 in tl.range(0, HS, EC):
        emask = e0 + e_last < HS
        ke = tl.load(k_b + heads * skh + nw * skn + (e0 + e_last) * ske, mask=kmask & emask, other=0.0)
        dq = tl.dot(da_lo, _lo(ke, LO), input_precision="ieee")
        tl.atomic_add(dq_rows + heads * (Tq * HS) + e0 + e_last, dq * scale, mask=qmask & emask, sem="relaxed")
        qe = tl.load(q_rows + heads * sqh + (e0 + e_last) * sqe, mask=qmask & emask, other=0.0)
        dk = tl.dot(dat_lo, _lo(qe, LO), input_precision="ieee")
        tl.atomic_add(dk_b + heads * (Tk * HS) + nw * HS + e0 + e_last, dk * scale, mask=kmask & emask, sem="relaxed")


@_jit
def _add_dbias(gd, heads, iq, jw, g, H, Tq, Tk, B_TERMS: tl.constexpr):
    """Add g [HX, M, N], the gradient of the bias at the heads `heads`, query rows iq and keys jw (zero where
    the bias is not used), atomically: into the map (gd's first three) or, B_TERMS, into u's rows (its sum over
    the keys) and w's keys (minus its sum over the rows)."""
    g_rows, sgh, sgn, gw_b, sgwh, sgwn = gd
    if B_TERMS:
        tl.atomic_add(g_rows + heads * sgh, tl.sum(g, 2, keep_dims=True), mask=(heads < H) & (iq < Tq),
                      sem="relaxed")
        tl.atomic_add(gw_b + heads * sgwh + jw * sgwn, -tl.sum(g, 1, keep_dims=True),
                      mask=(heads < H) & (jw >= 0) & (jw < Tk), sem="relaxed")
    else:
        tl.atomic_add(g_rows + heads * sgh + jw * sgn, g, mask=(heads < H) & (iq < Tq) & (jw >= 0) & (jw < Tk),
                      sem="relaxed")


@_jit
def _backward(Q, K, V, Bias, BW, WA, WB, W2, B1, B2, DY, LSE, DELTA,
              DQ, DK, DV, DBIAS, DBW, DWA, DWB, DW2, DB1, DB2,
              sqb, sqh, sqm, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
              sbb, sbh, sbm, sbn, swb, swh, swn, sdyb, sdyh, sdym, sdye, sgb, sgh, sgm, sgn, sgwb, sgwh, sgwn,
              H, HS, Tq, Tk, q_offset, scale,
              HP: tl.constexpr, HG: tl.constexpr, EC: tl.constexpr, DP: tl.constexpr, DC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KS: tl.constexpr, PAD: tl.constexpr,
              A_IN: tl.constexpr, HAS_B: tl.constexpr, B_TERMS: tl.constexpr, RES_B: tl.constexpr,
              NEED_DB: tl.constexpr, CAUSAL: tl.constexpr, LO: tl.constexpr, SLOPE: tl.constexpr):
    """The gradients. DQ, DK, DV [B, H, T, HS] and the bias gradient DBIAS (strides sg*, batch stride 0 when
    shared; B_TERMS: u's, and DBW w's, strides sgw*): zeroed float32 buffers, added to atomically. The weights' gradients: this program's sums, in its
    own row ((b * groups + g) * query blocks + query block) of zeroed float32 buffers DWA, DWB [P, KS, DP, HP],
    DW2 [P, KS, HP, DP], DB1 [P, DP] and DB2 [P, HP] (added to tile by tile: the program is alone on its row,
    so the sums are deterministic, and no register holds them across the loop). Grid: (query blocks, B,
    groups)."""
    GROUPS: tl.constexpr = HP // HG
    MN: tl.constexpr = BLOCK_M * BLOCK_N
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    g = tl.program_id(2)
    m0 = mb * BLOCK_M
    ha = tl.arange(0, HP)[:, None, None]
    hg = g * HG + tl.arange(0, HG)[:, None, None]
    iq = m0 + tl.arange(0, BLOCK_M)[None, :, None]
    jr = tl.arange(0, BLOCK_N)[None, None, :]
    nr = tl.arange(0, BLOCK_N)[None, :, None]
    e_last = tl.arange(0, EC)[None, None, :]
    dc = tl.arange(0, DC)
    cc = tl.arange(0, HP)
    og = g * HG + tl.arange(0, HG)  # the own heads, as a vector
    w_dh = dc[:, None] * HP + cc[None, :]  # DC rows of a tap of Wa or Wb, [DC, HP]
    w_hd = cc[:, None] + dc[None, :] * HP  # their transpose, [HP, DC]
    w2_own = og[:, None] * DP + dc[None, :]  # the own rows of a tap of W2, DC columns: [HG, DC]
    w2_own_t = og[None, :] * DP + dc[:, None]  # their transpose, [DC, HG]

    q_rows = Q + b * sqb + iq * sqm
    k_b = K + b * skb
    bd = (Bias + b * sbb + iq * sbm, sbh, sbn, BW + b * swb, swh, swn)
    qpos = q_offset + iq
    dq_rows = DQ + b * H * Tq * HS + iq * HS
    dk_b = DK + b * H * Tk * HS
    gd = (DBIAS + b * sgb + iq * sgm, sgh, sgn, DBW + b * sgwb, sgwh, sgwn)
    dy_rows = DY + b * sdyb + hg * sdyh + iq * sdym
    v_b = V + b * svb + hg * svh
    dv_b = DV + b * H * Tk * HS + hg * (Tk * HS)
    ymask = (hg < H) & (iq < Tq)
    hm = g * HG + tl.arange(0, HG)[:, None]
    im = m0 + tl.arange(0, BLOCK_M)[None, :]
    # +inf on padded heads and rows: their P is 0, so they add nothing to any gradient
    lse = tl.load(LSE + (b * H + hm) * Tq + im, mask=(hm < H) & (im < Tq), other=float("inf"))
    delta = tl.load(DELTA + (b * H + hm) * Tq + im, mask=(hm < H) & (im < Tq), other=0.0)
    b2g = tl.load(B2 + og)

    pid = (b * GROUPS + g) * tl.num_programs(0) + mb
    dwa_p = DWA + pid * (KS * DP * HP) + w_dh  # this program's row, tap 0, channels 0 .. DC - 1
    dwb_p = DWB + pid * (KS * DP * HP) + w_dh
    dw2_p = DW2 + pid * (KS * HP * DP) + w2_own
    db1_p = DB1 + pid * DP + dc
    db2 = tl.zeros([HG], tl.float32)
    n_end = Tk
    if CAUSAL:
        n_end = tl.minimum(Tk, q_offset + m0 + BLOCK_M)
    for n0 in tl.range(0, n_end, BLOCK_N):
        jn = n0 + jr
        rows = n0 + nr
        # the logits again, then dL = P (dP - Delta), the gradient of the own heads' logits; dv += P^T dy
        s, a0, b0 = _logits(q_rows, k_b, bd, ha, hg, jn, qpos, iq, sqh, sqe, skh, skn, ske,
                            H, HS, Tq, Tk, scale, WA, WB, W2, B1, b2g, w_dh, w2_own, HP, HG, DP, DC, BLOCK_M,
                            BLOCK_N, EC, KS, PAD, A_IN, HAS_B, B_TERMS, RES_B, CAUSAL, LO, SLOPE)
        p = tl.exp(s - lse[:, :, None])
        pt_lo = _lo(tl.permute(p, (0, 2, 1)), LO)
        dp = tl.zeros([HG, BLOCK_M, BLOCK_N], tl.float32)
        vmask = (hg < H) & (rows < Tk)
        for e0 in tl.range(0, HS, EC):
            emask = e0 + e_last < HS
            dye = tl.load(dy_rows + (e0 + e_last) * sdye, mask=ymask & emask, other=0.0)
            ve = tl.load(v_b + rows * svn + (e0 + e_last) * sve, mask=vmask & emask, other=0.0)
            dp = tl.dot(_lo(dye, LO), _lo(tl.permute(ve, (0, 2, 1)), LO), dp, input_precision="ieee")
            dv = tl.dot(pt_lo, _lo(dye, LO), input_precision="ieee")
            tl.atomic_add(dv_b + rows * HS + e0 + e_last, dv, mask=vmask & emask, sem="relaxed")
        dl = p * (dp - delta[:, :, None])
        db2 += tl.sum(tl.sum(dl, 2), 1)
        dl2 = tl.reshape(dl, [HG, MN])
        # The residual: dL is also the gradient of the own heads' A (and B). With one group it joins f's
        # share at shift 0 below; otherwise (or without A in f: bias_only) it is scattered on its own
        if (GROUPS > 1) | (not A_IN):
            _scatter_qk(dl, hg, q_rows, k_b, dq_rows, dk_b, iq, jn, rows, sqh, sqe, skh, skn, ske, H, HS, Tq, Tk,
                        scale, EC, LO)
        if RES_B & NEED_DB & (GROUPS > 1):
            _add_dbias(gd, hg, iq, jn, dl, H, Tq, Tk, B_TERMS)
        # Through f: its hidden map at each key shift u - PAD, DC channels at a time, then each tap t of the
        # first layer, whose inputs (and the gradient they get) sit at key shift w = u + t - 2 PAD. V1 (one
        # shift, one tap) sums dA and dB over the channel blocks and scatters them once; V2 takes its hidden
        # channels in one block (constexprs() sees to it), so that it recomputes each tap's inputs only once
        for u in tl.range(0, KS):
            ok = _hidden_mask(qpos, jn, Tk, u, PAD, BLOCK_M, BLOCK_N, CAUSAL)
            if KS == 1:
                da1 = tl.zeros([HP, BLOCK_M, BLOCK_N], tl.float32)
                db1_ = tl.zeros([HP, BLOCK_M, BLOCK_N], tl.float32)
            for c0 in tl.range(0, DP, DC):
                z = _hidden(u, c0, a0, b0, q_rows, k_b, bd, ha, jn, qpos, iq, sqh, sqe, skh, skn, ske,
                            H, HS, Tq, Tk, scale, WA, WB, B1, w_dh, HP, DP, DC, BLOCK_M, BLOCK_N, EC, KS, PAD,
                            A_IN, HAS_B, B_TERMS, CAUSAL, LO)
                h = tl.where(ok, tl.where(z > 0, z, z * SLOPE), 0.0)
                g_w2 = tl.dot(_lo(dl2, LO), _lo(tl.trans(h), LO), input_precision="ieee")
                tl.atomic_add(dw2_p + u * HP * DP + c0, g_w2, sem="relaxed")
                w2t = tl.load(W2 + u * HP * DP + c0 + w2_own_t)
                dh = tl.dot(_lo(w2t, LO), _lo(dl2, LO), input_precision="ieee")
                dz = tl.where(ok, tl.where(z > 0, dh, dh * SLOPE), 0.0)
                tl.atomic_add(db1_p + c0, tl.sum(dz, 1), sem="relaxed")
                for t in tl.range(0, KS):
                    if KS == 1:  # V1: the tile's own inputs (V2 recomputes them rather than hold them)
                        xa = a0
                        xb = b0
                    else:
                        xa, xb = _inputs(q_rows, k_b, bd, ha, jn + (u + t - 2 * PAD), qpos, iq, sqh, sqe, skh,
                                         skn, ske, H, HS, Tq, Tk, scale, HP, BLOCK_M, BLOCK_N, EC, A_IN, HAS_B,
                                         B_TERMS, CAUSAL, LO)
                    w = u + t - 2 * PAD
                    ok_w = _valid(qpos, jn + w, Tk, CAUSAL)
                    own = (u == PAD) & (t == PAD)  # the residual's term (once: other taps reach w = 0 too)
                    wt = t * DP * HP + c0 * HP
                    if A_IN:
                        g_wa = tl.dot(_lo(dz, LO), _lo(tl.trans(tl.reshape(xa, [HP, MN])), LO), input_precision="ieee")
                        tl.atomic_add(dwa_p + wt, g_wa, sem="relaxed")
                        wat = tl.load(WA + wt + w_hd)
                        da = tl.reshape(tl.dot(_lo(wat, LO), _lo(dz, LO), input_precision="ieee"), [HP, BLOCK_M, BLOCK_N])
                        if KS == 1:
                            da1 += da
                        else:
                            da = tl.where(ok_w, da, 0.0)
                            if GROUPS == 1:
                                if own:
                                    da = da + dl  # the residual A
                            _scatter_qk(da, ha, q_rows, k_b, dq_rows, dk_b, iq, jn + w, rows + w, sqh, sqe, skh, skn,
                                        ske, H, HS, Tq, Tk, scale, EC, LO)
                    if HAS_B:
                        g_wb = tl.dot(_lo(dz, LO), _lo(tl.trans(tl.reshape(xb, [HP, MN])), LO), input_precision="ieee")
                        tl.atomic_add(dwb_p + wt, g_wb, sem="relaxed")
                        if NEED_DB:
                            wbt = tl.load(WB + wt + w_hd)
                            dbias = tl.reshape(tl.dot(_lo(wbt, LO), _lo(dz, LO), input_precision="ieee"),
                                               [HP, BLOCK_M, BLOCK_N])
                            if KS == 1:
                                db1_ += dbias
                            else:
                                dbias = tl.where(ok_w, dbias, 0.0)
                                if RES_B & (GROUPS == 1):
                                    if own:
                                        dbias = dbias + dl  # the residual B
                                _add_dbias(gd, ha, iq, jn + w, dbias, H, Tq, Tk, B_TERMS)
            if KS == 1:  # V1: f's share of dA and dB, summed over the channel blocks, and the residual's
                ok_w = _valid(qpos, jn, Tk, CAUSAL)
                if A_IN:
                    da1 = tl.where(ok_w, da1, 0.0)
                    if GROUPS == 1:
                        da1 = da1 + dl
                    _scatter_qk(da1, ha, q_rows, k_b, dq_rows, dk_b, iq, jn, rows, sqh, sqe, skh, skn, ske, H, HS,
                                Tq, Tk, scale, EC, LO)
                if HAS_B & NEED_DB:
                    db1_ = tl.where(ok_w, db1_, 0.0)
                    if RES_B & (GROUPS == 1):
                        db1_ = db1_ + dl
                    _add_dbias(gd, ha, iq, jn, db1_, H, Tq, Tk, B_TERMS)

    tl.store(DB2 + pid * HP + og, db2)


# ---------------------------------------------------------------------------------------------------------
# the Python side


def unavailable(x=None, width=None, kernel_size=1):
    """Why the kernels cannot run on x, or None when they can. x: q [B, H, T, hs] (then its device, dtype
    and head shape count), or a device (None: CUDA); width and kernel_size: f's hidden width D and kernel k,
    when known. They run compiled on CUDA, or on any tensors under Triton's interpreter (TRITON_INTERPRET=1,
    on host copies)."""
    if triton is None:
        return _IMPORT_ERROR
    device = x.device if isinstance(x, torch.Tensor) else torch.device(x if x is not None else "cuda")
    if _interpreting():
        return None
    if device.type != "cuda":
        return (f"tensors on {device.type} (the compiled kernels need CUDA; Triton's interpreter, "
                f"TRITON_INTERPRET=1, runs them on the CPU)")
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        major, minor = torch.cuda.get_device_capability(device)
        return refused(10 * major + minor, x.dtype, x.shape[1], x.shape[3], width, kernel_size)
    return None


def refused(arch, dtype, n_head, head_size, width=None, kernel_size=1):
    """Why the compiled kernels decline heads of this shape (and f of this width and kernel) in dtype on a
    GPU of compute capability arch (86 for 8.6), or None. Past MAX_* the tiles were never compiled and
    checked; float32 tiles take twice the shared memory of 16-bit ones, and with more than 16 heads, or V2
    with f wider than 32, no longer fit a block of the GPUs that have less than 160 KB per block (compiled
    for each: bench.py --sections=fit)."""
    if _pow2(n_head) > MAX_HEADS or _pow2(head_size) > MAX_HEAD_SIZE:
        return (f"{n_head} heads of size {head_size} (one program holds the logits of every head: at most "
                f"{MAX_HEADS} heads of size up to {MAX_HEAD_SIZE})")
    if width is not None and _pow2(width) > MAX_WIDTH:
        return f"f's width D = {width} (the compiled kernels hold at most {MAX_WIDTH} on chip)"
    limit = SHARED_KB.get(arch, min(SHARED_KB.values()))
    too_big = _pow2(n_head) > 16 or (kernel_size > 1 and _pow2(width or 1) > 32)
    if dtype == torch.float32 and limit < 160 and too_big:
        return (f"float32 with {n_head} heads{f', V2 and D = {width}' if kernel_size > 1 else ''} on sm_{arch}, "
                f"whose {limit} KB of shared memory per block it does not fit (bfloat16 or float16 does)")
    return None


def available(x=None):
    """True when the kernels can run on x's device (see unavailable)."""
    return unavailable(x) is None


def specialization(n):
    """How Triton specializes an integer argument: its value when 1, divisible by 16, or neither."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def same_class(n, most):
    """A length of n's specialization (1, a multiple of 16, or neither), at most max(most, 32): n itself
    when it is at most `most`."""
    return n if n <= most else 32 if n % 16 == 0 else 16 + n % 16


def binary(q, k, v, bias, w1, variant, causal, q_offset):
    """What tells the binaries of attention()'s launches apart (with bias a map or a pair (u, w)): the
    dtypes, the constexprs, and how Triton specializes the lengths, the strides and the pointers."""
    tensors = [q, k, v] + ([] if bias is None else list(bias) if isinstance(bias, tuple) else [bias])
    form = None if bias is None else "terms" if isinstance(bias, tuple) else \
        "shared" if bias.dim() == 3 or bias.shape[0] == 1 else "per sequence"
    return (str(q.device), q.dtype, variant, form, causal, q.shape[3], tuple(w1.shape),  # w1 [D, H or 2H, k]
            specialization(q.shape[2]), specialization(k.shape[2]), specialization(q_offset),
            tuple(specialization(s) for t in tensors for s in t.stride()), tuple(t.data_ptr() % 16 for t in tensors))


def _pow2(n, least=16):
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def launch_config(device=None):
    """The launch settings for a CUDA device, or the interpreter's."""
    if _interpreting() or device is None or torch.device(device).type != "cuda":
        return dict(INTERPRETER_CONFIG)
    return dict(CONFIG)


def _check(q, k, v, bias, w1, b1, w2, b2, variant, causal, q_offset, scale, config):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, T, head_size], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    Bn, H, Tq, hs = q.shape
    if k.shape[:2] != (Bn, H) or k.shape[3] != hs or v.shape != k.shape:
        raise ValueError(f"k and v must be [B, H, Tk, head_size] = [{Bn}, {H}, Tk, {hs}] like q, got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    Tk = k.shape[2]
    if min(Bn, H, Tq, Tk, hs) < 1:
        raise ValueError(f"empty attention: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if bias is None:
        if variant != "concat_residual":
            raise ValueError(f"variant {variant!r} needs a bias; without one (bias=None) f sees A alone and "
                             f"the variant must be 'concat_residual'")
    elif isinstance(bias, tuple):
        if len(bias) != 2 or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in bias):
            raise ValueError("bias terms must be a pair (u, w) of floating-point tensors")
        u, w = bias
        if u.shape != (Bn, H, Tq) or w.shape != (Bn, H, Tk):
            raise ValueError(f"bias terms must be u [B, H, Tq] = [{Bn}, {H}, {Tq}] and w [B, H, Tk] = [{Bn}, {H}, "
                             f"{Tk}], got {tuple(u.shape)} and {tuple(w.shape)}")
    else:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise ValueError("bias must be a floating-point tensor, a pair (u, w) or None")
        if not (bias.shape == (H, Tq, Tk) or (bias.dim() == 4 and bias.shape[0] in (1, Bn)
                                              and bias.shape[1:] == (H, Tq, Tk))):
            raise ValueError(f"bias must be [H, Tq, Tk] = [{H}, {Tq}, {Tk}] or [B or 1, H, Tq, Tk], got "
                             f"{tuple(bias.shape)}")
    for name, t, dim in (("w1", w1, 3), ("b1", b1, 1), ("w2", w2, 3), ("b2", b2, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim or not t.is_floating_point():
            raise ValueError(f"{name} must be a {dim}-D floating-point tensor")
    D, C, ks = w1.shape
    c_in = 2 * H if bias is not None and variant in ("concat_residual", "concat") else H
    if C != c_in:
        raise ValueError(f"w1 must be [D, C_in, k] with C_in = {c_in} for H = {H}, variant {variant!r} "
                         f"and {'a' if bias is not None else 'no'} bias, got {tuple(w1.shape)}")
    if ks % 2 == 0:
        raise ValueError(f"f's kernel size k must be odd (centred (1, k) convolutions), got {ks}")
    if b1.shape != (D,) or w2.shape != (H, D, ks) or b2.shape != (H,):
        raise ValueError(f"expected b1 [{D}], w2 [{H}, {D}, {ks}], b2 [{H}] for w1 {tuple(w1.shape)}, got b1 "
                         f"{tuple(b1.shape)}, w2 {tuple(w2.shape)}, b2 {tuple(b2.shape)}")
    tensors = [("q", q), ("k", k), ("v", v), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)]
    tensors += list(zip(("u", "w"), bias)) if isinstance(bias, tuple) else [("bias", bias)]
    devices = {t.device for _, t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError("all tensors must be on one device, got "
                         + ", ".join(f"{n} on {t.device}" for n, t in tensors if t is not None))
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if not isinstance(q_offset, numbers.Integral) or isinstance(q_offset, bool) or q_offset < 0:
        raise ValueError(f"q_offset must be an int >= 0 (the position of the first query), got {q_offset!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if config is not None:
        unknown = set(config) - set(INTERPRETER_CONFIG)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; known: {sorted(INTERPRETER_CONFIG)}")
        for key in ("block_m", "block_n", "ec", "ev", "hg", "dc"):
            val = config.get(key, 16)
            if not isinstance(val, int) or val < 16 or val & (val - 1):
                raise ValueError(f"config[{key!r}] must be a power of two >= 16, got {val!r}")
    why = unavailable(q, D, ks)
    if why is not None:
        raise ValueError(f"dape_triton cannot run here: {why}")


def _split(w1, variant, H, has_bias):
    """f's first layer as (Wa, Wb) [D, H, k], the halves applied to A and B (None where absent)."""
    if not has_bias:
        return w1, None
    if variant in ("concat_residual", "concat"):
        return w1[:, :H], w1[:, H:]
    if variant == "add_residual":
        return w1, w1
    return None, w1  # bias_only


def _pad(w, R, C):
    """A weight [rows, cols, k] as its taps [k, R, C]: float32, zero-padded, contiguous."""
    out = torch.zeros(w.shape[2], R, C, dtype=torch.float32, device=w.device)
    out[:, :w.shape[0], :w.shape[1]] = w.detach().permute(2, 0, 1)
    return out


def lowering(dtype):
    """The kernels' LO constexpr for inputs of this dtype: the products' operand dtype (see _lo)."""
    if dtype == torch.float32:
        return "fp32"
    if dtype == torch.float16:
        return "fp16"
    return "bf16-emulated" if _interpreting() else "bf16"


def constexprs(H, hs, D, ks, variant, has_bias, causal, dtype, config, terms=False):
    """The compile-time constants of both kernels (the backward's NEED_DB aside) for these shapes, the
    variant, a bias (terms: as a pair u, w) and a launch config; with the number of head groups and of v
    chunks (the grid's third axis)."""
    HP, DP, HSP = _pow2(H), _pow2(D), _pow2(hs)
    HG = min(HP, config["hg"])
    EV = min(HSP, config["ev"])
    # V2 recomputes each tap's inputs per block of hidden channels: one block
    DC = DP if ks > 1 else min(DP, config["dc"])
    const = dict(HP=HP, HG=HG, EC=min(HSP, config["ec"]), EV=EV, DP=DP, DC=DC, BLOCK_M=config["block_m"],
                 BLOCK_N=config["block_n"], KS=ks, PAD=ks // 2, A_IN=not (has_bias and variant == "bias_only"),
                 HAS_B=has_bias, B_TERMS=has_bias and terms, RES_B=has_bias and variant != "concat",
                 CAUSAL=causal, LO=lowering(dtype), SLOPE=SLOPE)
    return const, HP // HG, -(-hs // EV)


class _Config:
    def __init__(self, variant, causal, q_offset, scale, launch, on_backward_failure=None):
        self.variant, self.causal, self.q_offset, self.scale = variant, causal, q_offset, scale
        self.launch, self.on_backward_failure = launch, on_backward_failure


def _params(q, bias, w1, b1, w2, b2, cfg):
    """The padded weights and the constexprs shared by both kernels."""
    Bn, H, Tq, hs = q.shape
    D, _, ks = w1.shape
    has_b = bias is not None
    const, groups, n_v = constexprs(H, hs, D, ks, cfg.variant, has_b, cfg.causal, q.dtype, cfg.launch,
                                    terms=isinstance(bias, tuple))
    HP, DP = const["HP"], const["DP"]
    wa, wb = _split(w1, cfg.variant, H, has_b)
    zero = torch.zeros(ks, DP, HP, dtype=torch.float32, device=q.device)
    WA = _pad(wa, DP, HP) if wa is not None else zero
    WB = _pad(wb, DP, HP) if wb is not None else zero
    W2 = _pad(w2, HP, DP)
    B1 = torch.zeros(DP, dtype=torch.float32, device=q.device)
    B1[:D] = b1.detach()
    B2 = torch.zeros(HP, dtype=torch.float32, device=q.device)
    B2[:H] = b2.detach()
    return (WA, WB, W2, B1, B2), const, groups, n_v


def _bias_args(bias, q):
    """The kernels' bias arguments: (Bias, BW) and their strides ((batch, head, query, key), (batch, head,
    key)). A map: Bias, batch stride 0 when the batch shares it. Terms (u, w): Bias = u (no key stride), BW
    = w. None: nothing read."""
    if bias is None:
        return q, q, (0, 0, 0, 0), (0, 0, 0)
    if isinstance(bias, tuple):
        u, w = bias
        return u, w, (*u.stride(), 0), tuple(w.stride())
    sb = (0,) + tuple(bias.stride()) if bias.dim() == 3 else \
        (0 if bias.shape[0] == 1 else bias.stride(0),) + tuple(bias.stride()[1:])
    return bias, q, sb, (0, 0, 0)


def _launch_options(cfg):
    """num_warps, num_stages, maxnreg (None: ptxas chooses); FMA contraction as Triton has always done
    (stated, so that Triton 3.9 does not warn about its default)."""
    opts = dict(num_warps=cfg.launch["warps"], num_stages=cfg.launch["stages"], enable_fp_fusion=True)
    if cfg.launch["maxnreg"]:
        opts["maxnreg"] = cfg.launch["maxnreg"]
    return opts


def _host_dtype(t, const):
    """Under the bfloat16 emulation the kernels read and write float32 (the values stay bfloat16's)."""
    return t.float() if const["LO"] == "bf16-emulated" else t


def _forward_launch(q, k, v, bias, w1, b1, w2, b2, cfg):
    """The forward kernel's grid, arguments and keywords, and its outputs y and lse (filled by the launch)."""
    Bn, H, Tq, hs = q.shape
    Tk = k.shape[2]
    weights, const, groups, n_v = _params(q, bias, w1, b1, w2, b2, cfg)
    qx, kx, vx = (_host_dtype(t, const) for t in (q, k, v))
    y = torch.empty(Bn, H, Tq, hs, dtype=vx.dtype, device=q.device)
    lse = torch.empty(Bn, H, Tq, dtype=torch.float32, device=q.device)
    Bias, BW, sb, sw = _bias_args(bias, q)
    grid = (triton.cdiv(Tq, const["BLOCK_M"]), Bn, groups * n_v)
    args = (qx, kx, vx, Bias, BW, *weights, y, lse, *qx.stride(), *kx.stride(), *vx.stride(), *sb, *sw,
            *y.stride(), H, hs, Tq, Tk, cfg.q_offset, cfg.scale)
    return grid, args, dict(_launch_options(cfg), **const), (y, lse)


def _backward_launch(q, k, v, bias, w1, b1, w2, b2, y, lse, dy, need_db, cfg):
    """The backward kernel's grid, arguments and keywords, and the float32 buffers it adds the gradients to:
    dq, dk, dv, dbias (without need_db None; for terms, the pair du, dw), and the per-program rows of dwa,
    dwb, dw2, db1, db2."""
    Bn, H, Tq, hs = q.shape
    Tk = k.shape[2]
    D, _, ks = w1.shape
    weights, const, groups, _ = _params(q, bias, w1, b1, w2, b2, cfg)
    HP, DP = const["HP"], const["DP"]
    delta = (dy.float() * y.float()).sum(-1)  # [B, H, Tq], FlashAttention-2's D
    qx, kx, vx, dyx = (_host_dtype(t, const) for t in (q, k, v, dy))
    n_m = triton.cdiv(Tq, const["BLOCK_M"])
    progs = n_m * Bn * groups
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.zeros(Bn, H, Tq, hs, **f32)
    dk = torch.zeros(Bn, H, Tk, hs, **f32)
    dv = torch.zeros(Bn, H, Tk, hs, **f32)
    dbias = None
    if need_db:  # zeros shaped like the bias; the kernel adds with the same strides as it reads
        dbias = tuple(torch.zeros(t.shape, **f32) for t in bias) if isinstance(bias, tuple) else \
            torch.zeros(bias.shape, **f32)
    rows = [torch.zeros(progs, ks, DP, HP, **f32), torch.zeros(progs, ks, DP, HP, **f32),
            torch.zeros(progs, ks, HP, DP, **f32), torch.zeros(progs, DP, **f32), torch.zeros(progs, HP, **f32)]
    Bias, BW, sb, sw = _bias_args(bias, q)
    DBias, DBW, sg, sgw = _bias_args(dbias, dq) if need_db else (dq, dq, (0, 0, 0, 0), (0, 0, 0))
    args = (qx, kx, vx, Bias, BW, *weights, dyx, lse, delta, dq, dk, dv, DBias, DBW, *rows,
            *qx.stride(), *kx.stride(), *vx.stride(), *sb, *sw, *dyx.stride(), *sg, *sgw,
            H, hs, Tq, Tk, cfg.q_offset, cfg.scale)
    const = {name: val for name, val in const.items() if name != "EV"}
    return (n_m, Bn, groups), args, dict(_launch_options(cfg), NEED_DB=need_db, **const), (dq, dk, dv, dbias, *rows)


class _Attention(torch.autograd.Function):
    """The kernels with autograd. The bias comes as a map (bias; u = w = None), as terms (bias None; u, w)
    or not at all."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, q, k, v, bias, u, w, w1, b1, w2, b2, cfg):
        terms = (u, w) if u is not None else bias
        grid, args, kw, (y, lse) = _forward_launch(q, k, v, terms, w1, b1, w2, b2, cfg)
        _forward[grid](*args, **kw)
        y = y.to(v.dtype)
        ctx.save_for_backward(q, k, v, bias, u, w, w1, b1, w2, b2, y, lse)
        ctx.cfg = cfg
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        q, k, v, bias, u, w, w1, b1, w2, b2, y, lse = ctx.saved_tensors
        cfg = ctx.cfg
        H, D = q.shape[1], w1.shape[0]
        terms = (u, w) if u is not None else bias
        need_db = terms is not None and any(ctx.needs_input_grad[3:6])
        # contiguous: the incoming gradient's layout is the caller's (a transposed view, from model.py's
        # rearrange), and Triton compiles a binary per layout; this way the check runs the model's binary
        dy = dy.to(v.dtype).contiguous()
        try:
            grid, args, kw, out = _backward_launch(q, k, v, terms, w1, b1, w2, b2, y, lse, dy, need_db, cfg)
            _backward[grid](*args, **kw)
        except Exception as e:
            if cfg.on_backward_failure is None:
                raise
            return cfg.on_backward_failure(e, ctx.saved_tensors[:10], ctx.needs_input_grad[:10], dy)
        dq, dk, dv, dbias, dwa, dwb, dw2, db1, db2 = out
        du, dw = dbias if u is not None and need_db else (None, None)
        dbias = dbias if u is None else None
        # the weights' gradients, back from the padded (Wa, Wb) split to w1's layout
        g_wa = dwa.sum(0)[:, :D, :H].permute(1, 2, 0)
        g_wb = dwb.sum(0)[:, :D, :H].permute(1, 2, 0)
        if terms is None:
            dw1 = g_wa
        elif cfg.variant in ("concat_residual", "concat"):
            dw1 = torch.cat((g_wa, g_wb), dim=1)
        elif cfg.variant == "add_residual":
            dw1 = g_wa + g_wb
        else:  # bias_only
            dw1 = g_wb
        dw2_ = dw2.sum(0)[:, :H, :D].permute(1, 2, 0)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, du, dw,
                dw1.to(w1.dtype), db1.sum(0)[:D].to(b1.dtype), dw2_.to(w2.dtype), db2.sum(0)[:H].to(b2.dtype),
                None)


def attention(q, k, v, bias, w1, b1, w2, b2, variant, causal, q_offset=0, scale=None, *, config=None,
              on_backward_failure=None):
    """softmax(mask(A + [B] + f(A, B))) @ v for all heads of a layer, f being DAPE's (dape.py), fused.

    q [B, H, Tq, hs]; k, v [B, H, Tk, hs] (float32, or float16 / bfloat16 under autocast; one dtype).
    bias: None (an encoding without a bias: f sees A alone, variant 'concat_residual'); float32 maps
    [H, Tq, Tk] (shared by the batch), [1, H, Tq, Tk] or [B, H, Tq, Tk]; or terms, a pair (u [B, H, Tq],
    w [B, H, Tk]) meaning B_ij = u_i - w_j (FoX's forget gates: formed on chip, no map in memory).
    w1 [D, C_in, k], b1 [D], w2 [H, D, k], b2 [H]: DAPEV1 / DAPEV2.weights() (k = 1 for V1, odd), C_in = 2H
    for concat_residual / concat with a bias, else H. variant: one of VARIANTS. causal: key j is masked for
    query row i when j > q_offset + i (q_offset: the position of the first query, for blocks of queries and
    KV-cache steps). scale: of A, 1 / sqrt(hs) by default. Returns y [B, H, Tq, hs] in v's dtype;
    differentiable in q, k, v, the bias (or u and w) and the weights. config: launch settings overriding
    launch_config(q.device)'s (keys of CONFIG). on_backward_failure(error, inputs, needs_input_grad, dy): what
    returns the gradients (as _Attention.backward does) where the backward launch raises; None: raise."""
    _check(q, k, v, bias, w1, b1, w2, b2, variant, causal, q_offset, scale, config)
    _build()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    launch = dict(launch_config(q.device), **(config or {}))
    cfg = _Config(variant, causal, int(q_offset), float(scale), launch, on_backward_failure)
    # float32 bias and weights outside the Function, so that autograd casts their gradients back
    u = w = None
    if isinstance(bias, tuple):
        (u, w), bias = (t.float() for t in bias), None
    elif bias is not None:
        bias = bias.float()
    return _Attention.apply(q, k, v, bias, u, w, w1.float(), b1.float(), w2.float(), b2.float(), cfg)


# ---------------------------------------------------------------------------------------------------------
# compiling for a GPU without one: what each kernel needs of an architecture


def compile_for(arch, dtype, n_head, head_size, width, kernel_size, variant="concat_residual", bias=True,
                causal=True, config=None, T=256, batch=2):
    """Compile both kernels for an NVIDIA architecture (arch: 80, 86, 89, 90) with Triton's compiler and
    ptxas, which need no GPU, specialized exactly as a launch of the model's attention on [batch, n_head, T,
    head_size] inputs of dtype would be (q and k, v transposed views of [batch, T, n_head, head_size]; bias:
    True, a map [H, T, T] shared by the batch, "terms", FoX's pair u, w [batch, H, T], or False). config:
    launch settings (default: CONFIG). Returns
    {"forward": ..., "backward": ...}, each with shared (bytes of shared memory per block), registers (per
    thread), spill_stores and spill_loads (bytes per thread) as ptxas reports them, and mma (tensor-core
    instructions in the SASS). Needs the kernels compiled, not interpreted: run without TRITON_INTERPRET."""
    import contextlib
    import io
    import os
    import re
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if triton is None:
        raise RuntimeError(_IMPORT_ERROR)
    if _build() != "compile":
        raise RuntimeError("compile_for needs the kernels compiled: run it without TRITON_INTERPRET=1")
    launch = dict(CONFIG, **(config or {}))
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(batch, T, n_head, head_size, generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    q, k, v = qkv
    if bias == "terms":
        B = (torch.randn(batch, n_head, T, generator=g), torch.randn(batch, n_head, T, generator=g))
    else:
        B = torch.randn(n_head, T, T, generator=g) if bias else None
    c_in = 2 * n_head if bias and variant in ("concat_residual", "concat") else n_head
    w1, b1 = torch.randn(width, c_in, kernel_size, generator=g), torch.randn(width, generator=g)
    w2, b2 = torch.randn(n_head, width, kernel_size, generator=g), torch.randn(n_head, generator=g)
    cfg = _Config(variant, causal, 0, 1.0 / math.sqrt(head_size), launch)
    y, lse = torch.empty_like(q), torch.empty(batch, n_head, T)
    launches = {"forward": (_forward, _forward_launch(q, k, v, B, w1, b1, w2, b2, cfg)[:3]),
                "backward": (_backward,
                             _backward_launch(q, k, v, B, w1, b1, w2, b2, y, lse, y.clone(), bool(bias), cfg)[:3])}
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    out = {}
    for name, (kernel, (_, args, kw)) in launches.items():
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kw)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
        log = io.StringIO()
        with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), contextlib.redirect_stdout(log):
            triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed
            triton.knobs.compilation.always_compile = True  # a cached kernel would print nothing
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        report = log.getvalue()
        regs = re.search(r"Used (\d+) registers", report)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        if regs is None or spills is None:
            raise RuntimeError(f"no ptxas report for {name} kernel: {report[-2000:]}")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        mma = len(re.findall(r"\b(?:HMMA|HGMMA)\b", sass))
        out[name] = dict(shared=compiled.metadata.shared, registers=int(regs.group(1)),
                         spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)), mma=mma)
    return out



def source_hash():
    """A fingerprint of everything that decides what the compiled kernels are: their code, the launch settings
    and how the launches are built, and Triton's version; not their comments or docstrings, which compile to
    nothing. Tables of compiled kernels (bench.py --sections=fit) record it, so that a test can tell when they
    describe other kernels."""
    import ast
    import hashlib
    import inspect
    import textwrap

    from fingerprint import without_docstrings

    def code(fn):  # comments never reach the tree
        return ast.dump(without_docstrings(ast.parse(textwrap.dedent(inspect.getsource(getattr(fn, "fn", fn))))))

    parts = [code(globals()[name]) for name in _JIT_NAMES]
    parts += [code(f) for f in (constexprs, _launch_options, _forward_launch, _backward_launch, _params)]
    parts += [repr(CONFIG), triton.__version__ if triton is not None else ""]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
