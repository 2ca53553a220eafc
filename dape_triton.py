"""
DAPE attention fused into one Triton kernel (forward) and one (backward), FlashAttention-2 style:

    y = softmax(mask(A + [B] + f(A, B))) @ v,    A = scale q k^T,  all H heads of a layer at once

with f the two-layer channel mixer of dape.py (V1: per pair; V2: (1, k) convolutions along the keys of a
row). Neither the [B, H, Tq, Tk] logits / probabilities nor f's [B, D, Tq, Tk] hidden map is ever written
to memory: the forward pass keeps per (head, query) only the running max and sum of the online softmax
and saves the log-sum-exp; the backward pass recomputes every tile from q, k, v, the bias and the weights.

Forward. One program per (batch, block of BLOCK_M queries), holding all heads (f mixes them), loops over
blocks of BLOCK_N keys (in causal attention, up to the last key its last query sees). Per key block:
    A       one batched tl.dot [HP, M, hs] x [HP, hs, N] for all heads;
    f       on the tile flattened to [channels, M N]: z = Wa A + Wb B + b1 as tl.dots [DP, HP] x [HP, M N],
            h = LeakyReLU(z), f = W2 h + b2 as [HP, DP] x [DP, M N]. The channel counts (16 to 64 once
            padded) are natural tl.dot sizes, so the mixing runs on tensor cores; a broadcast-FMA version
            would need one [M, N] reduction per output channel instead;
    softmax per (head, row) online (running max m, sum l, rescaled accumulator), acc += P @ v as one
            batched tl.dot; finally y = acc / l and lse = m + log l.
V2's halo: f at key j needs h at j - p .. j + p (p = k // 2), which needs A and B at j - 2p .. j + 2p. The
kernel recomputes them with shifted key and bias loads (masked outside [0, Tk) and, causal, after the
query: exactly V2's zero padding and future zeroing): for each of the k hidden shifts u, z_u sums its k
taps, reading the inputs at shifts u + t - 2p. A V2 tile therefore costs k^2 + 1 QK^T products (10 at
k = 3; the extra one is the residual's unshifted A) where V1 does one, 2 k^2 first-layer products (A's half
and B's) and k second-layer ones; the backward pass, which needs the logits, then z_u, then the taps'
inputs again, does 3 k^2 + 1 (28 at k = 3). In exchange nothing but the running z and f is live across
shifts, so register use stays close to V1's; the shifts are runtime loops rather than unrolled ones for the
same reason (unrolled, the compiler hoists every shifted load and holds them all). Keeping the 4p + 1
shifted inputs instead would cut the QK^T products to 4p + 1, at the price of 4p + 1 more [HP, M, N] tiles
live at once.

Backward. One program per (batch, query block) again, over the same key blocks: recompute the tile's
logits, P = exp(s - lse), dP = dy v^T, dL = P (dP - Delta) with Delta = rowsum(dy * y). Then, per hidden
shift u: recompute z_u, dW2_u += dL h_u^T, dz = LeakyReLU'(z_u) * (W2_u^T dL), zeroed where V2 zeroed h;
and per tap t: dW1_t += dz X^T and dX = W1_t^T dz, which belongs to key shift w = u + t - 2p (scatter
form). The residual's share dL is added to the w = 0 term. dX's logits half dA gives dq in registers (rows
belong to the program) and dk = scale dA^T q by fp32 atomic adds at the shifted key rows; its bias half
(plus dL when the bias is added) goes to the bias gradient by atomic adds; dv = P^T dy likewise. Scatter
rather than gather: dk at key j needs dL at keys j - 2p .. j + 2p, each of which needs the logits at
j - 4p .. j + 4p, so a key-owning (gather) program would recompute the forward 4p + 1 times; the scatter
form recomputes each tile twice (logits, then the hidden shifts) and pays in atomics. The weight
gradients go to a [programs, ...] float32 buffer, each program adding its tiles' sums to its own row (no
register holds them across the loop; one writer per row keeps them deterministic), summed in torch. dk,
dv and the bias gradient are sums of fp32 atomic adds from many programs, whose order (hence last bits)
varies between runs on a GPU.

Variants (f's first layer split into a half Wa applied to A and a half Wb applied to B; RES_B: B is added):
    concat_residual   A + B + f(cat(A, B))   Wa = w1[:, :H], Wb = w1[:, H:], RES_B    (dw1 = cat(dWa, dWb))
    concat            A + f(cat(A, B))       Wa = w1[:, :H], Wb = w1[:, H:]           (dw1 = cat(dWa, dWb))
    add_residual      A + B + f(A + B)       Wa = Wb = w1, RES_B                      (dw1 = dWa + dWb)
    bias_only         A + B + f(B)           Wa = 0 (skipped), Wb = w1, RES_B         (dw1 = dWb)
    no bias           A + f(A)               Wa = w1, no B                            (dw1 = dWa)

Block sizes. Every tile holds all heads: [HP, M, N] for A, B, the logits and P, [DP, M N] for z and h,
where HP and DP are the head count and f's width padded to powers of two >= 16 (and the head size to
HSP), which makes every tl.dot operand dimension >= 16 (zero-padded weights and masked loads keep the
padding inert). That is many registers per (query, key) pair, so the blocks are small: BLOCK_M = BLOCK_N =
16 by default (powers of two >= 16; attention() takes others for tuning), with NUM_WARPS = 8 warps to hold
them. NUM_STAGES = 1: the key loop is bound by arithmetic, not loads, and software pipelining would keep
several copies of each of V2's shifted key and bias tiles in shared memory. Holding all heads also bounds
the shapes on CUDA: H <= 32, H x hs <= 1024 padded (512 in float32), D <= 64 (MAX_* below); unavailable(q)
names what is too large, and the model falls back to its torch path.

Dtypes. float32 inputs: every tl.dot in IEEE float32 (exact to float32 rounding; no TF32). float16 /
bfloat16 inputs (autocast): tile operands are rounded to that dtype for tl.dot, with float32
accumulation; softmax statistics, the residual A + B, LeakyReLU and all gradient accumulators are
float32. The bias and the weights are used as float32. y and the gradients of q, k, v are returned in
the inputs' dtype.

The kernels run compiled on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, as
the tests do). triton.jit reads TRITON_INTERPRET when it decorates a function, so the functions below
are decorated on first use (_build) rather than at import: a process that imports this module early
(model.py does) and sets the variable later still gets interpreted kernels.
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
BLOCK_M = 16
BLOCK_N = 16
NUM_WARPS = 8
NUM_STAGES = 1
# One program holds every head: [HP, BLOCK_M, HSP] tiles of q, dy and the accumulators, [HP, M N] and
# [DP, M N] ones of the logits and f's hidden map. Past these padded sizes (HP, HP * HSP, DP) they no
# longer fit in an H100's registers and shared memory (found by compiling for sm_90), so on CUDA the
# kernels refuse them rather than fail at launch; unavailable(q) says so, for the model to fall back.
MAX_HEADS = 32
MAX_HEAD_TILE = {torch.float32: 512, torch.float16: 1024, torch.bfloat16: 1024}
MAX_WIDTH = 64
# The shared memory a program needs leaves room for one per SM anyway: let ptxas use every register
# rather than spill to fit a second.
MAX_REGISTERS = 255
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
def _valid(qpos, jw, Tk, CAUSAL: tl.constexpr):
    """Where f's inputs and hidden map at keys jw [1, 1, N] exist for the queries at positions qpos
    [1, M, 1]: inside [0, Tk) (V2's zero padding) and, causal, not after the query (V2's future zeroing;
    for V1 those pairs are masked anyway, so zeroing them there changes nothing)."""
    ok = (jw >= 0) & (jw < Tk)
    if CAUSAL:
        ok = ok & (jw <= qpos)
    return ok


@_jit
def _inputs(q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jw, Tk, scale,
            NEED_A: tl.constexpr, HAS_B: tl.constexpr, CAUSAL: tl.constexpr,
            DT: tl.constexpr, PREC: tl.constexpr):
    """f's inputs at keys jw [1, 1, N]: A and B [HP, M, N] in float32, zero where not _valid; and the key
    tile k^T [HP, HSP, N] that A came from (dq needs it)."""
    inside = (jw >= 0) & (jw < Tk)
    ok = _valid(qpos, jw, Tk, CAUSAL)
    kt = tl.load(k_b + koff + jw * skn, mask=kmask & inside, other=0.0)
    if HAS_B:
        xb = tl.load(bias_b + boff + jw * sbn, mask=bmask & ok, other=0.0).to(tl.float32)
    if NEED_A:
        xa = tl.where(ok, tl.dot(q.to(DT), kt.to(DT), input_precision=PREC) * scale, 0.0)
    else:
        xa = tl.zeros_like(xb)
    if not HAS_B:
        xb = tl.zeros_like(xa)
    return xa, xb, kt


@_jit
def _hidden(u, a0, b0, q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jn, Tk, scale,
            WA, WB, b1, w_dh,
            HP: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            KS: tl.constexpr, PAD: tl.constexpr, A_IN: tl.constexpr, HAS_B: tl.constexpr,
            CAUSAL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """f's first layer before the activation, z [DP, M N], at keys jn + u - PAD: its tap t reads the inputs
    at key shift u + t - 2 PAD (V1: the tile's own, a0 and b0; V2 recomputes them)."""
    MN: tl.constexpr = BLOCK_M * BLOCK_N
    z = tl.zeros([DP, MN], tl.float32) + b1[:, None]
    for t in tl.range(0, KS):
        if KS == 1:
            xa = a0
            xb = b0
        else:
            xa, xb, kt = _inputs(q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jn + (u + t - 2 * PAD),
                                 Tk, scale, A_IN, HAS_B, CAUSAL, DT, PREC)
        if A_IN:
            wa = tl.load(WA + t * DP * HP + w_dh)
            z = tl.dot(wa.to(DT), tl.reshape(xa, [HP, MN]).to(DT), z, input_precision=PREC)
        if HAS_B:
            wb = tl.load(WB + t * DP * HP + w_dh)
            z = tl.dot(wb.to(DT), tl.reshape(xb, [HP, MN]).to(DT), z, input_precision=PREC)
    return z


@_jit
def _hidden_mask(qpos, jn, Tk, u, PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """_valid at keys jn + u - PAD, flat like z: [1, M N]."""
    ok = tl.broadcast_to(_valid(qpos, jn + (u - PAD), Tk, CAUSAL), [1, BLOCK_M, BLOCK_N])
    return tl.reshape(ok, [1, BLOCK_M * BLOCK_N])


@_jit
def _logits(q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jn, Tk, scale,
            WA, WB, W2, b1, b2, w_dh, w2_hd,
            HP: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            KS: tl.constexpr, PAD: tl.constexpr, A_IN: tl.constexpr, HAS_B: tl.constexpr, RES_B: tl.constexpr,
            CAUSAL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SLOPE: tl.constexpr):
    """The logits A + [B] + f [HP, M, N] at keys jn, -inf where masked; and the shift-0 A, B, k^T."""
    a0, b0, kt0 = _inputs(q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jn, Tk, scale,
                          True, HAS_B, CAUSAL, DT, PREC)
    f = tl.zeros([HP, BLOCK_M * BLOCK_N], tl.float32)
    for u in tl.range(0, KS):
        z = _hidden(u, a0, b0, q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jn, Tk, scale,
                    WA, WB, b1, w_dh, HP, DP, BLOCK_M, BLOCK_N, KS, PAD, A_IN, HAS_B, CAUSAL, DT, PREC)
        ok = _hidden_mask(qpos, jn, Tk, u, PAD, BLOCK_M, BLOCK_N, CAUSAL)
        h = tl.where(ok, tl.where(z > 0, z, z * SLOPE), 0.0)
        w2 = tl.load(W2 + u * HP * DP + w2_hd)
        f = tl.dot(w2.to(DT), h.to(DT), f, input_precision=PREC)
    s = a0 + tl.reshape(f, [HP, BLOCK_M, BLOCK_N]) + b2[:, None, None]
    if RES_B:
        s = s + b0
    s = tl.where(_valid(qpos, jn, Tk, CAUSAL), s, float("-inf"))
    return s, a0, b0, kt0


@_jit
def _forward(Q, K, V, Bias, WA, WB, W2, B1, B2, Y, LSE,
             sqb, sqh, sqm, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
             sbb, sbh, sbm, sbn, syb, syh, sym, sye,
             H, HS, Tq, Tk, q_offset, scale,
             HP: tl.constexpr, HSP: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             KS: tl.constexpr, PAD: tl.constexpr, A_IN: tl.constexpr, HAS_B: tl.constexpr, RES_B: tl.constexpr,
             CAUSAL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SLOPE: tl.constexpr):
    """y [B, H, Tq, HS] (Y's dtype) and the log-sum-exp of each row, LSE [B, H, Tq] (float32)."""
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the blocks with the most keys start first
    b = tl.program_id(1)
    m0 = mb * BLOCK_M
    hq = tl.arange(0, HP)[:, None, None]
    iq = m0 + tl.arange(0, BLOCK_M)[None, :, None]
    jr = tl.arange(0, BLOCK_N)[None, None, :]  # keys on the last axis (logits)
    nr = tl.arange(0, BLOCK_N)[None, :, None]  # keys on the middle axis (v)
    e_mid = tl.arange(0, HSP)[None, :, None]
    e_last = tl.arange(0, HSP)[None, None, :]
    dd = tl.arange(0, DP)
    cc = tl.arange(0, HP)
    w_dh = dd[:, None] * HP + cc[None, :]  # a tap of Wa or Wb, [DP, HP]
    w2_hd = cc[:, None] * DP + dd[None, :]  # a tap of W2, [HP, DP]

    qmask = (hq < H) & (iq < Tq) & (e_last < HS)
    q = tl.load(Q + b * sqb + hq * sqh + iq * sqm + e_last * sqe, mask=qmask, other=0.0)
    k_b = K + b * skb
    koff = hq * skh + e_mid * ske
    kmask = (hq < H) & (e_mid < HS)
    bias_b = Bias + b * sbb
    boff = hq * sbh + iq * sbm
    bmask = (hq < H) & (iq < Tq)
    qpos = q_offset + iq
    v_b = V + b * svb
    voff = hq * svh + e_last * sve
    vmask = (hq < H) & (e_last < HS)
    b1 = tl.load(B1 + dd)
    b2 = tl.load(B2 + cc)

    m_i = tl.full([HP, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HP, BLOCK_M], tl.float32)
    acc = tl.zeros([HP, BLOCK_M, HSP], tl.float32)
    n_end = Tk
    if CAUSAL:
        n_end = tl.minimum(Tk, q_offset + m0 + BLOCK_M)
    # key 0 is masked for no row, so m_i is finite from the first block on
    for n0 in tl.range(0, n_end, BLOCK_N):
        s, a0, b0, kt0 = _logits(q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, n0 + jr, Tk, scale,
                                 WA, WB, W2, b1, b2, w_dh, w2_hd, HP, DP, BLOCK_M, BLOCK_N, KS, PAD,
                                 A_IN, HAS_B, RES_B, CAUSAL, DT, PREC, SLOPE)
        m_new = tl.maximum(m_i, tl.max(s, 2))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        vt = tl.load(v_b + voff + (n0 + nr) * svn, mask=vmask & (n0 + nr < Tk), other=0.0)
        acc = tl.dot(p.to(DT), vt.to(DT), acc * alpha[:, :, None], input_precision=PREC)
        m_i = m_new

    y = acc / l_i[:, :, None]
    tl.store(Y + b * syb + hq * syh + iq * sym + e_last * sye, y.to(Y.dtype.element_ty), mask=qmask)
    hm = tl.arange(0, HP)[:, None]
    im = m0 + tl.arange(0, BLOCK_M)[None, :]
    tl.store(LSE + (b * H + hm) * Tq + im, m_i + tl.log(l_i), mask=(hm < H) & (im < Tq))


@_jit
def _backward(Q, K, V, Bias, WA, WB, W2, B1, B2, Y, DY, LSE,
              DQ, DK, DV, DBIAS, DWA, DWB, DW2, DB1, DB2,
              sqb, sqh, sqm, sqe, skb, skh, skn, ske, svb, svh, svn, sve,
              sbb, sbh, sbm, sbn, syb, syh, sym, sye, sdyb, sdyh, sdym, sdye,
              sgb, sgh, sgm, sgn,
              H, HS, Tq, Tk, q_offset, scale,
              HP: tl.constexpr, HSP: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              KS: tl.constexpr, PAD: tl.constexpr, A_IN: tl.constexpr, HAS_B: tl.constexpr,
              RES_B: tl.constexpr, NEED_DB: tl.constexpr, CAUSAL: tl.constexpr,
              DT: tl.constexpr, PREC: tl.constexpr, SLOPE: tl.constexpr):
    """The gradients. DQ [B, H, Tq, HS]: stored (float32). DK, DV [B, H, Tk, HS] and the bias gradient
    DBIAS (strides sg*, batch stride 0 when shared): zeroed float32 buffers, added to atomically. The
    weights' gradients: this program's sums, in its own row (b * programs + query block) of zeroed float32
    buffers DWA, DWB [P, KS, DP, HP], DW2 [P, KS, HP, DP] (added to tile by tile: the program is alone on
    its row, so the sums are deterministic, and no register holds them across the loop), DB1 [P, DP] and
    DB2 [P, HP]."""
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    m0 = mb * BLOCK_M
    MN: tl.constexpr = BLOCK_M * BLOCK_N
    hq = tl.arange(0, HP)[:, None, None]
    iq = m0 + tl.arange(0, BLOCK_M)[None, :, None]
    jr = tl.arange(0, BLOCK_N)[None, None, :]
    nr = tl.arange(0, BLOCK_N)[None, :, None]
    e_mid = tl.arange(0, HSP)[None, :, None]
    e_last = tl.arange(0, HSP)[None, None, :]
    dd = tl.arange(0, DP)
    cc = tl.arange(0, HP)
    w_dh = dd[:, None] * HP + cc[None, :]  # a tap of Wa or Wb, [DP, HP]
    w_hd = cc[:, None] + dd[None, :] * HP  # its transpose, [HP, DP]
    w2_hd = cc[:, None] * DP + dd[None, :]  # a tap of W2, [HP, DP]
    w2_dh = cc[None, :] * DP + dd[:, None]  # its transpose, [DP, HP]

    qmask = (hq < H) & (iq < Tq) & (e_last < HS)
    q = tl.load(Q + b * sqb + hq * sqh + iq * sqm + e_last * sqe, mask=qmask, other=0.0)
    dy = tl.load(DY + b * sdyb + hq * sdyh + iq * sdym + e_last * sdye, mask=qmask, other=0.0)
    y = tl.load(Y + b * syb + hq * syh + iq * sym + e_last * sye, mask=qmask, other=0.0)
    delta = tl.sum(dy.to(tl.float32) * y.to(tl.float32), 2)
    hm = tl.arange(0, HP)[:, None]
    im = m0 + tl.arange(0, BLOCK_M)[None, :]
    # +inf on padded heads and rows: their P is 0, so they add nothing to any gradient
    lse = tl.load(LSE + (b * H + hm) * Tq + im, mask=(hm < H) & (im < Tq), other=float("inf"))
    k_b = K + b * skb
    koff = hq * skh + e_mid * ske
    kmask = (hq < H) & (e_mid < HS)
    bias_b = Bias + b * sbb
    boff = hq * sbh + iq * sbm
    bmask = (hq < H) & (iq < Tq)
    qpos = q_offset + iq
    v_b = V + b * svb
    voff = hq * svh + e_last * sve
    vmask = (hq < H) & (e_last < HS)
    kv_b = b * H * Tk * HS + hq * (Tk * HS) + e_last  # into DK and DV, [B, H, Tk, HS]
    g_b = DBIAS + b * sgb
    goff = hq * sgh + iq * sgm
    b1 = tl.load(B1 + dd)
    b2 = tl.load(B2 + cc)

    pid = b * tl.num_programs(0) + mb
    dwa_p = DWA + pid * (KS * DP * HP) + w_dh  # this program's row, tap 0
    dwb_p = DWB + pid * (KS * DP * HP) + w_dh
    dw2_p = DW2 + pid * (KS * HP * DP) + w2_hd
    dq = tl.zeros([HP, BLOCK_M, HSP], tl.float32)
    db1 = tl.zeros([DP], tl.float32)
    db2 = tl.zeros([HP], tl.float32)
    n_end = Tk
    if CAUSAL:
        n_end = tl.minimum(Tk, q_offset + m0 + BLOCK_M)
    for n0 in tl.range(0, n_end, BLOCK_N):
        jn = n0 + jr
        rows = n0 + nr
        # the logits again, then dL = P (dP - Delta): the gradient of the logits
        s, a0, b0, kt0 = _logits(q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jn, Tk, scale,
                                 WA, WB, W2, b1, b2, w_dh, w2_hd, HP, DP, BLOCK_M, BLOCK_N, KS, PAD,
                                 A_IN, HAS_B, RES_B, CAUSAL, DT, PREC, SLOPE)
        p = tl.exp(s - lse[:, :, None])
        vt = tl.load(v_b + voff + rows * svn, mask=vmask & (rows < Tk), other=0.0)
        dp = tl.dot(dy.to(DT), tl.permute(vt, (0, 2, 1)).to(DT), input_precision=PREC)
        dl = p * (dp - delta[:, :, None])
        dv = tl.dot(tl.permute(p, (0, 2, 1)).to(DT), dy.to(DT), input_precision=PREC)
        tl.atomic_add(DV + kv_b + rows * HS, dv, mask=vmask & (rows < Tk), sem="relaxed")
        db2 += tl.sum(tl.sum(dl, 2), 1)
        dl2 = tl.reshape(dl, [HP, MN])
        if not A_IN:  # bias_only: A's gradient is the residual's alone (with A_IN it joins f's, below)
            dq = tl.dot(dl.to(DT), tl.permute(kt0, (0, 2, 1)).to(DT), dq, input_precision=PREC)
            dk = tl.dot(tl.permute(dl, (0, 2, 1)).to(DT), q.to(DT), input_precision=PREC)
            tl.atomic_add(DK + kv_b + rows * HS, dk * scale, mask=vmask & (rows < Tk), sem="relaxed")
        # through f: its hidden map at each key shift u - PAD, then each tap t of the first layer, whose
        # inputs (and the gradient they get) sit at key shift w = u + t - 2 PAD
        for u in tl.range(0, KS):
            z = _hidden(u, a0, b0, q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos, jn, Tk, scale,
                        WA, WB, b1, w_dh, HP, DP, BLOCK_M, BLOCK_N, KS, PAD, A_IN, HAS_B, CAUSAL, DT, PREC)
            ok = _hidden_mask(qpos, jn, Tk, u, PAD, BLOCK_M, BLOCK_N, CAUSAL)
            h = tl.where(ok, tl.where(z > 0, z, z * SLOPE), 0.0)
            g_w2 = tl.dot(dl2.to(DT), tl.trans(h).to(DT), input_precision=PREC)
            tl.atomic_add(dw2_p + u * HP * DP, g_w2, sem="relaxed")
            w2t = tl.load(W2 + u * HP * DP + w2_dh)
            dh = tl.dot(w2t.to(DT), dl2.to(DT), input_precision=PREC)
            dz = tl.where(ok, tl.where(z > 0, dh, dh * SLOPE), 0.0)
            db1 += tl.sum(dz, 1)
            for t in tl.range(0, KS):
                if KS == 1:  # V1: the tile's own inputs (V2 recomputes them rather than hold them in the loop)
                    xa = a0
                    xb = b0
                    kt = kt0
                else:
                    xa, xb, kt = _inputs(q, k_b, koff, kmask, skn, bias_b, boff, bmask, sbn, qpos,
                                         jn + (u + t - 2 * PAD), Tk, scale, A_IN, HAS_B, CAUSAL, DT, PREC)
                ok_w = _valid(qpos, jn + (u + t - 2 * PAD), Tk, CAUSAL)
                rows_w = rows + (u + t - 2 * PAD)
                if A_IN:
                    g_wa = tl.dot(dz.to(DT), tl.trans(tl.reshape(xa, [HP, MN])).to(DT), input_precision=PREC)
                    tl.atomic_add(dwa_p + t * DP * HP, g_wa, sem="relaxed")
                    wat = tl.load(WA + t * DP * HP + w_hd)
                    da = tl.reshape(tl.dot(wat.to(DT), dz.to(DT), input_precision=PREC), [HP, BLOCK_M, BLOCK_N])
                    da = tl.where(ok_w, da, 0.0)
                    if (u == PAD) & (t == PAD):
                        da = da + dl  # the residual A
                    dq = tl.dot(da.to(DT), tl.permute(kt, (0, 2, 1)).to(DT), dq, input_precision=PREC)
                    dk = tl.dot(tl.permute(da, (0, 2, 1)).to(DT), q.to(DT), input_precision=PREC)
                    tl.atomic_add(DK + kv_b + rows_w * HS, dk * scale,
                                  mask=vmask & (rows_w >= 0) & (rows_w < Tk), sem="relaxed")
                if HAS_B:
                    g_wb = tl.dot(dz.to(DT), tl.trans(tl.reshape(xb, [HP, MN])).to(DT), input_precision=PREC)
                    tl.atomic_add(dwb_p + t * DP * HP, g_wb, sem="relaxed")
                    if NEED_DB:
                        wbt = tl.load(WB + t * DP * HP + w_hd)
                        dbias = tl.dot(wbt.to(DT), dz.to(DT), input_precision=PREC)
                        dbias = tl.where(ok_w, tl.reshape(dbias, [HP, BLOCK_M, BLOCK_N]), 0.0)
                        if RES_B:
                            if (u == PAD) & (t == PAD):
                                dbias = dbias + dl  # the residual B
                        tl.atomic_add(g_b + goff + (jn + (u + t - 2 * PAD)) * sgn, dbias, mask=bmask & ok_w,
                                      sem="relaxed")

    tl.store(DQ + b * H * Tq * HS + hq * (Tq * HS) + iq * HS + e_last, dq * scale, mask=qmask)
    tl.store(DB1 + pid * DP + dd, db1)
    tl.store(DB2 + pid * HP + cc, db2)


# ---------------------------------------------------------------------------------------------------------
# the Python side


def unavailable(x=None):
    """Why the kernels cannot run on x, or None when they can. x: q [B, H, T, hs] (then its device, and
    whether its heads fit one program), or a device (None: CUDA). They run compiled on CUDA, or on any
    tensors under Triton's interpreter (TRITON_INTERPRET=1, on host copies)."""
    if triton is None:
        return _IMPORT_ERROR
    device = x.device if isinstance(x, torch.Tensor) else torch.device(x if x is not None else "cuda")
    if _interpreting():
        return None
    if device.type != "cuda":
        return (f"tensors on {device.type} (the compiled kernels need CUDA; Triton's interpreter, "
                f"TRITON_INTERPRET=1, runs them on the CPU)")
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype in MAX_HEAD_TILE:
        H, hs = x.shape[1], x.shape[3]
        if _pow2(H) > MAX_HEADS or _pow2(H) * _pow2(hs) > MAX_HEAD_TILE[x.dtype]:
            return (f"{H} heads of size {hs} in {x.dtype} (padded {_pow2(H)} x {_pow2(hs)}: one program holds "
                    f"all heads, and past {MAX_HEADS} heads or {MAX_HEAD_TILE[x.dtype]} padded the tiles do not "
                    f"fit on chip)")
    return None


def available(x=None):
    """True when the kernels can run on x's device (see unavailable)."""
    return unavailable(x) is None


def _pow2(n, least=16):
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def _check(q, k, v, bias, w1, b1, w2, b2, variant, causal, q_offset, scale, block_m, block_n):
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
    else:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise ValueError("bias must be a floating-point tensor or None")
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
    tensors = [("q", q), ("k", k), ("v", v), ("bias", bias), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)]
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
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    why = unavailable(q)
    if why is not None:
        raise ValueError(f"dape_triton cannot run here: {why}")
    if not _interpreting() and _pow2(D) > MAX_WIDTH:
        raise ValueError(f"f's width D = {D} is more than the compiled kernels hold on chip (at most {MAX_WIDTH})")


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


class _Config:
    def __init__(self, variant, causal, q_offset, scale, block_m, block_n):
        self.variant, self.causal, self.q_offset, self.scale = variant, causal, q_offset, scale
        self.block_m, self.block_n = block_m, block_n


def _params(q, bias, w1, b1, w2, b2, cfg):
    """The padded weights and the constexprs shared by both kernels."""
    Bn, H, Tq, hs = q.shape
    D, _, ks = w1.shape
    HP, DP, HSP = _pow2(H), _pow2(D), _pow2(hs)
    has_b = bias is not None
    wa, wb = _split(w1, cfg.variant, H, has_b)
    zero = torch.zeros(ks, DP, HP, dtype=torch.float32, device=q.device)
    WA = _pad(wa, DP, HP) if wa is not None else zero
    WB = _pad(wb, DP, HP) if wb is not None else zero
    W2 = _pad(w2, HP, DP)
    B1 = torch.zeros(DP, dtype=torch.float32, device=q.device)
    B1[:D] = b1.detach()
    B2 = torch.zeros(HP, dtype=torch.float32, device=q.device)
    B2[:H] = b2.detach()
    const = dict(HP=HP, HSP=HSP, DP=DP, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KS=ks, PAD=ks // 2,
                 A_IN=wa is not None, HAS_B=has_b, RES_B=has_b and cfg.variant != "concat",
                 CAUSAL=cfg.causal, SLOPE=SLOPE, **_dot_dtype(q.dtype))
    return (WA, WB, W2, B1, B2), const


def _dot_dtype(dtype):
    """The kernels' tl.dot operand dtype DT and input_precision PREC: exact float32 products for float32
    inputs (no TF32); for float16 / bfloat16 PREC has no effect."""
    if dtype == torch.float32:
        return dict(DT=tl.float32, PREC="ieee")
    return dict(DT=tl.float16 if dtype == torch.float16 else tl.bfloat16, PREC="tf32")


def _bias_strides(bias, Bn):
    """Strides (batch, head, query, key) of a bias map; batch stride 0 when the batch shares it."""
    if bias.dim() == 3:
        return (0,) + tuple(bias.stride())
    sb = 0 if bias.shape[0] == 1 else bias.stride(0)
    return (sb,) + tuple(bias.stride()[1:])


class _Attention(torch.autograd.Function):

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, q, k, v, bias, w1, b1, w2, b2, cfg):
        Bn, H, Tq, hs = q.shape
        Tk = k.shape[2]
        weights, const = _params(q, bias, w1, b1, w2, b2, cfg)
        y = torch.empty(Bn, H, Tq, hs, dtype=v.dtype, device=q.device)
        lse = torch.empty(Bn, H, Tq, dtype=torch.float32, device=q.device)
        bias_arg = bias if bias is not None else q  # never read without HAS_B
        sb = _bias_strides(bias, Bn) if bias is not None else (0, 0, 0, 0)
        grid = (triton.cdiv(Tq, cfg.block_m), Bn)
        _forward[grid](q, k, v, bias_arg, *weights, y, lse,
                       *q.stride(), *k.stride(), *v.stride(), *sb, *y.stride(),
                       H, hs, Tq, Tk, cfg.q_offset, cfg.scale, num_warps=NUM_WARPS,
                       num_stages=NUM_STAGES, maxnreg=MAX_REGISTERS, **const)
        ctx.save_for_backward(q, k, v, bias, w1, b1, w2, b2, y, lse)
        ctx.cfg = cfg
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        q, k, v, bias, w1, b1, w2, b2, y, lse = ctx.saved_tensors
        cfg = ctx.cfg
        Bn, H, Tq, hs = q.shape
        Tk = k.shape[2]
        D, _, ks = w1.shape
        weights, const = _params(q, bias, w1, b1, w2, b2, cfg)
        HP, DP = const["HP"], const["DP"]
        n_m = triton.cdiv(Tq, cfg.block_m)
        progs = n_m * Bn
        f32 = dict(dtype=torch.float32, device=q.device)
        dq = torch.empty(Bn, H, Tq, hs, **f32)
        dk = torch.zeros(Bn, H, Tk, hs, **f32)
        dv = torch.zeros(Bn, H, Tk, hs, **f32)
        need_db = bias is not None and ctx.needs_input_grad[3]
        shared = bias is not None and (bias.dim() == 3 or bias.shape[0] == 1)
        if need_db:
            dbias = torch.zeros(bias.shape, **f32)
            sg = (0,) + tuple(dbias.stride()[-3:]) if shared else tuple(dbias.stride())
        else:
            dbias, sg = dq, (0, 0, 0, 0)  # never written
        dwa = torch.zeros(progs, ks, DP, HP, **f32)
        dwb = torch.zeros(progs, ks, DP, HP, **f32)
        dw2 = torch.zeros(progs, ks, HP, DP, **f32)
        db1 = torch.empty(progs, DP, **f32)
        db2 = torch.empty(progs, HP, **f32)
        bias_arg = bias if bias is not None else q
        sb = _bias_strides(bias, Bn) if bias is not None else (0, 0, 0, 0)
        _backward[(n_m, Bn)](q, k, v, bias_arg, *weights, y, dy, lse,
                             dq, dk, dv, dbias, dwa, dwb, dw2, db1, db2,
                             *q.stride(), *k.stride(), *v.stride(), *sb, *y.stride(), *dy.stride(), *sg,
                             H, hs, Tq, Tk, cfg.q_offset, cfg.scale, num_warps=NUM_WARPS,
                             num_stages=NUM_STAGES, maxnreg=MAX_REGISTERS, NEED_DB=need_db, **const)
        # the weights' gradients, back from the padded (Wa, Wb) split to w1's layout
        g_wa = dwa.sum(0)[:, :D, :H].permute(1, 2, 0)
        g_wb = dwb.sum(0)[:, :D, :H].permute(1, 2, 0)
        if bias is None:
            dw1 = g_wa
        elif cfg.variant in ("concat_residual", "concat"):
            dw1 = torch.cat((g_wa, g_wb), dim=1)
        elif cfg.variant == "add_residual":
            dw1 = g_wa + g_wb
        else:  # bias_only
            dw1 = g_wb
        dw2_ = dw2.sum(0)[:, :H, :D].permute(1, 2, 0)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias if need_db else None,
                dw1.to(w1.dtype), db1.sum(0)[:D].to(b1.dtype), dw2_.to(w2.dtype), db2.sum(0)[:H].to(b2.dtype),
                None)


def attention(q, k, v, bias, w1, b1, w2, b2, variant, causal, q_offset=0, scale=None, *,
              block_m=BLOCK_M, block_n=BLOCK_N):
    """softmax(mask(A + [B] + f(A, B))) @ v for all heads of a layer, f being DAPE's (dape.py), fused.

    q [B, H, Tq, hs]; k, v [B, H, Tk, hs] (float32, or float16 / bfloat16 under autocast; one dtype).
    bias: None (an encoding without a bias: f sees A alone, variant 'concat_residual'), or float32 maps
    [H, Tq, Tk] (shared by the batch), [1, H, Tq, Tk] or [B, H, Tq, Tk]. w1 [D, C_in, k], b1 [D], w2 [H, D, k],
    b2 [H]: DAPEV1 / DAPEV2.weights() (k = 1 for V1, odd), C_in = 2H for concat_residual / concat with a
    bias, else H. variant: one of VARIANTS. causal: key j is masked for query row i when j > q_offset + i
    (q_offset: the position of the first query, for blocks of queries and KV-cache steps). scale: of A,
    1 / sqrt(hs) by default. Returns y [B, H, Tq, hs] in v's dtype; differentiable in q, k, v, bias and
    the weights. block_m, block_n: the tile (powers of two >= 16)."""
    _check(q, k, v, bias, w1, b1, w2, b2, variant, causal, q_offset, scale, block_m, block_n)
    _build()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    cfg = _Config(variant, causal, int(q_offset), float(scale), block_m, block_n)
    # float32 bias and weights outside the Function, so that autograd casts their gradients back
    bias = bias.float() if bias is not None else None
    return _Attention.apply(q, k, v, bias, w1.float(), b1.float(), w2.float(), b2.float(), cfg)
