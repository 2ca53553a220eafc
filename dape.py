"""
DAPE: data-adaptive positional encoding (Zheng et al., NeurIPS 2024).

The pre-softmax logits of a layer become A + B + f(A, B), where A = q.k/sqrt(hs) are the logits of all
H heads, B the positional bias of all H heads, and f a small network that mixes the 2H channels at
every (query, key) pair into H new ones:

    DAPEV1  f is an MLP applied independently at each (i, j)              (paper eq. 2/3, Appendix J)
    DAPEV2  f is two (1, k) convolutions along the key axis of each row   (DAPE V2, "1xk")

Variants (`dape_variant`), for an encoding with a bias B:
    concat_residual   A + B + f(cat(A, B))   (default; eq. 3, Appendix J)
    concat            A + f(cat(A, B))       (eq. 2)
    add_residual      A + B + f(A + B)       (Fig. 5)
    bias_only         A + B + f(B)           (ablation: no semantic input)
For an encoding without a bias (nope, rope, learned, sinusoidal, cope) it is A + f(A).

`future` is the causal mask [Tq, Tk] (True where key j is after query i) or None (bidirectional). f
never sees -inf: the caller masks after f, or asks forward(..., mask_future=True) for the masked logits
directly (what attention uses: then f is not computed where it would be masked). V2 zeroes the future
before each convolution, so a row's result is the same whatever number of future columns the map
happens to have (prefix consistency).

How it is computed (the function is the same either way; tests check both against Appendix J):
- f's first layer is linear, so it is split into a logits half and a bias half:
  W1 . cat(A, B) = W1_A . A + W1_B . B. B has no batch axis for static encodings, so W1_B . B is
  computed once per layer instead of once per sequence, and the concatenation is never built.
- Both layers contract over the channel axis of the [batch, channel, query, key] maps (a matmul with
  the heads as the inner dimension): nothing is permuted to channels-last and back.
- On the CPU (_Tiled below) f runs tile by tile: a tile is a block of query rows of a group of
  sequences, small enough that its hidden map [G, D, rows x keys] stays in cache. The [B, D, T, T]
  hidden map (8x the logits at D = 32, H = 4) never exists at once. V1's backward pass recomputes a
  tile's hidden map from A and B instead of saving it; V2, whose first layer costs k times more, keeps
  it for the computed pairs only. In causal attention a block of rows only needs the keys up to its
  last query, so the masked half of f is never computed, and probs() applies the mask and the softmax
  in the tile too, so the logits never exist as a whole either. A (1, k) convolution is one matmul on
  k shifted views of a row-padded tile (im2col along the key axis).
- Elsewhere (CUDA, torch.compile) the same math runs on whole maps, which the GPU and the compiler do
  best with.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = ("concat_residual", "concat", "add_residual", "bias_only")
SLOPE = 0.01  # LeakyReLU's negative slope (PyTorch's default, as in Appendix J)
# (query, key) pairs per CPU tile, over the sequences it groups: its hidden map is D * TILE_PAIRS floats
# (2 MB at D = 32), which stays in cache; smaller tiles spend more time in Python than in arithmetic.
TILE_PAIRS = 16384


def dape_in_channels(n_head, variant, has_bias):
    return 2 * n_head if has_bias and variant in ("concat_residual", "concat") else n_head


def _use_tiles(x):
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


class _DAPE(nn.Module):
    """The variant logic shared by V1 and V2. Subclasses give their weights as
    (w1 [D, C_in, k], b1 [D], w2 [H, D, k], b2 [H]) in weights() and k in self.kernel."""

    zero_future = False  # V2: zero the future before each layer
    # keep the hidden map of the computed pairs for the backward pass (D floats per pair) rather than
    # recompute it: worth it only for V2, whose first layer costs k times more (measured, bench.py)
    save_hidden = False

    def __init__(self, n_head, width, variant, has_bias):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"dape_variant must be one of {VARIANTS}, got {variant!r}")
        self.n_head, self.width, self.variant, self.has_bias = n_head, width, variant, has_bias
        self.in_channels = dape_in_channels(n_head, variant, has_bias)

    def forward(self, A, B, future=None, mask_future=False):
        """A: [B, H, Tq, Tk]; B: [H, Tq, Tk], [1 or B, H, Tq, Tk] or None. Returns the logits
        [B, H, Tq, Tk]; with mask_future, the same logits with -inf where future is True."""
        return self._run(A, B, future, "masked" if mask_future and future is not None else "logits")

    def probs(self, A, B, future=None):
        """softmax(forward(A, B, future, mask_future=True), dim=-1): the attention probabilities, which
        on the CPU are computed tile by tile without the full logits ever being stored."""
        return self._run(A, B, future, "probs")

    def _run(self, A, B, future, out):
        if B is not None and B.dim() == 4 and B.shape[0] == 1:
            B = B[0]  # one map for the whole batch
        if B is None:
            x, y, res_y = A, None, False  # A + f(A)
        elif self.variant == "concat_residual":
            x, y, res_y = A, B, True  # A + B + f(A, B)
        elif self.variant == "concat":
            x, y, res_y = A, B, False  # A + f(A, B)
        elif self.variant == "add_residual":
            x, y, res_y = A + B, None, False  # S + f(S)
        else:  # bias_only: A + (B + f(B)), f computed once for the whole batch when B has no batch axis
            logits = A + self.residual_f(B if B.dim() == 4 else B[None], None, False, future, "logits")
            return _finish(logits, future, out)
        return self.residual_f(x, y, res_y, future, out)

    def residual_f(self, x, y, res_y, future, out):
        """x + (y if res_y) + f(cat(x, y)), then as `out` asks: "logits", "masked" or "probs".
        x: [B, C, Tq, Tk] (C = H); y: None, [Cy, Tq, Tk] (shared by the batch) or [B, Cy, Tq, Tk]."""
        w1, b1, w2, b2 = self.weights()
        C = x.shape[-3]
        if _use_tiles(x):
            # im2col column order: tap t, then channel c  ->  [D, k * C]
            cols = lambda w: w.permute(0, 2, 1).reshape(w.shape[0], -1)
            w1x, w1y = cols(w1[:, :C]), (cols(w1[:, C:]) if y is not None else None)
            spec = _Spec(self.kernel, self.zero_future, res_y, future, out, self.save_hidden)
            return _Tiled.apply(x, y, w1x, w1y, b1, w2.permute(2, 0, 1).contiguous(), b2, spec)
        logits = self.f_whole(x, y, future, w1, b1, w2, b2)
        logits = logits + x if y is None or not res_y else logits + (x + y)
        return _finish(logits, future, out)

    def reset_parameters(self):
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _finish(logits, future, out):
    if out != "logits" and future is not None:
        logits = logits.masked_fill(future, float("-inf"))
    return F.softmax(logits, dim=-1) if out == "probs" else logits


def _mix(w, x):
    """Apply w [D, C] to the channel axis of x [..., C, Tq, Tk] -> [..., D, Tq, Tk], as one matmul
    with C as the contraction axis."""
    return torch.matmul(w, x.flatten(-2)).unflatten(-1, x.shape[-2:])


class DAPEV1(_DAPE):
    """f = Linear(C_in -> D) -> LeakyReLU -> Linear(D -> H) at every (i, j). The parameters are named
    like Appendix J's `mlp` (Sequential), so state dicts interchange with the paper's module."""

    kernel = 1

    def __init__(self, n_head, width=32, variant="concat_residual", has_bias=True):
        super().__init__(n_head, width, variant, has_bias)
        self.mlp = nn.Sequential(nn.Linear(self.in_channels, width), nn.LeakyReLU(SLOPE),
                                 nn.Linear(width, n_head))

    def weights(self):
        fc1, fc2 = self.mlp[0], self.mlp[2]
        return fc1.weight[:, :, None], fc1.bias, fc2.weight[:, :, None], fc2.bias

    def f_whole(self, x, y, future, w1, b1, w2, b2):
        C = x.shape[-3]
        h = _mix(w1[:, :C, 0], x)
        if y is not None:
            h = h + _mix(w1[:, C:, 0], y)  # y without a batch axis broadcasts over it
        h = F.leaky_relu(h + b1[:, None, None], SLOPE, inplace=True)  # in place: autograd keeps one copy
        return _mix(w2[:, :, 0], h) + b2[:, None, None]


class DAPEV2(_DAPE):
    """f = Conv2d(C_in -> D, (1, k)) -> LeakyReLU -> Conv2d(D -> H, (1, k)): each (i, j) also sees its
    k - 1 neighbouring keys in the same query row, across all heads."""

    zero_future = True
    save_hidden = True

    def __init__(self, n_head, width=32, kernel=3, variant="concat_residual", has_bias=True):
        super().__init__(n_head, width, variant, has_bias)
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"dape_kernel must be a positive odd number (the conv is centred), got {kernel}")
        self.kernel = kernel
        self.conv1 = nn.Conv2d(self.in_channels, width, (1, kernel), padding=(0, kernel // 2))
        self.act = nn.LeakyReLU(SLOPE)
        self.conv2 = nn.Conv2d(width, n_head, (1, kernel), padding=(0, kernel // 2))

    def weights(self):
        return self.conv1.weight[:, :, 0], self.conv1.bias, self.conv2.weight[:, :, 0], self.conv2.bias

    def f_whole(self, x, y, future, w1, b1, w2, b2):
        pad = (0, self.kernel // 2)
        zero_future = (lambda t: t.masked_fill(future, 0.0)) if future is not None else (lambda t: t)
        C = x.shape[-3]
        h = F.conv2d(zero_future(x), w1[:, :C, None], b1, padding=pad)
        if y is not None:
            y = zero_future(y)
            h = h + F.conv2d(y if y.dim() == 4 else y[None], w1[:, C:, None], padding=pad)
        h = zero_future(F.leaky_relu(h, SLOPE))
        return F.conv2d(h, w2[:, :, None], b2, padding=pad)


# -----------------------------------------------------------------------------
# the CPU path: f tile by tile, recomputed in the backward pass



class _Spec:
    """What _Tiled computes besides its tensors, and how it cuts the maps into tiles."""

    def __init__(self, kernel, zero_future, res_y, future, out, save_hidden=False):
        self.kernel, self.zero_future, self.res_y, self.save_hidden = kernel, zero_future, res_y, save_hidden
        self.future = future
        self.out = out if future is not None or out != "masked" else "logits"
        self.skip = future is not None and out != "logits"  # keys masked for a whole block: not computed

    def tiles(self, Bn, Tq, Tk):
        """Tiles (a block of query rows [s, e) of a group of sequences [b0, b1)) holding about
        TILE_PAIRS (query, key) pairs in all. A block of rows takes all Tk keys, or when the mask is
        applied only the keys up to its last unmasked one: the rest is -inf (zero after the softmax),
        and for V2 zero, which is what the conv's zero padding gives. Rows are padded by k // 2 on each
        side, and counted with their padding."""
        p = self.kernel // 2
        if self.skip:
            keys = torch.arange(1, Tk + 1, device=self.future.device)
            need = torch.where(self.future, 0, keys).amax(dim=1).clamp(min=1).tolist()
        else:
            need = [Tk] * Tq
        row_budget = max(1, TILE_PAIRS // Bn)  # every sequence of the batch in one tile where it fits
        s = 0
        while s < Tq:
            e, ne = s + 1, need[s]
            while e < Tq and (e + 1 - s) * (max(ne, need[e]) + 2 * p) <= row_budget:
                ne = max(ne, need[e])
                e += 1
            tile = _Tile(s, e, ne, p, self.future if self.zero_future or self.skip else None,
                         self.zero_future)
            G = max(1, min(Bn, TILE_PAIRS // tile.N))
            for b0 in range(0, Bn, G):
                yield tile, b0, min(b0 + G, Bn)
            s = e


class _Tile:
    """A block of Q query rows and their first ne keys, laid out as rows padded with p = k // 2 zeros
    on each side: a [..., C, Q, L] map, L = ne + 2p, flat [..., C, N], in buffers of width W = M + 2p
    (zeros after N). A (1, k) conv's outputs at the flat positions [p, p + M) read its inputs at
    t + [0, M) for tap t = 0..k-1; outputs at the padding positions read across rows and are never used.
    M = N - 2p rounded up to a multiple of 16, so that every matmul column goes through the same MKL
    kernel (no tail): a pair's value is then the same bits whatever tile it falls in, which keeps
    blocked, unblocked and cached attention equal to the last bit of f."""

    def __init__(self, s, e, ne, p, future, zero_future):
        self.s, self.e, self.ne, self.p = s, e, ne, p
        self.Q, self.L = e - s, ne + 2 * p
        self.N = self.Q * self.L
        self.M = -(-(self.N - 2 * p) // 16) * 16
        self.W = self.M + 2 * p
        self.fut = future[s:e, :ne] if future is not None else None  # [Q, ne], True = future
        if self.fut is not None and not self.fut.any():
            self.fut = None
        self.zmask = None  # [M]: where V2 zeroes its maps (padding, future, past N), flat positions [p, p + M)
        if zero_future or p:
            z = torch.ones(self.W, dtype=torch.bool, device=future.device if future is not None else "cpu")
            zq = z[:self.N].view(self.Q, self.L)
            zq[:, p:p + ne] = self.fut if (zero_future and self.fut is not None) else False
            self.zmask = z[p:p + self.M]
            if not self.zmask.any():
                self.zmask = None

    def view(self, t):
        """The tile of a [..., Tq, Tk] map: [..., Q, ne] (a strided view)."""
        return t[..., self.s:self.e, :self.ne]

    def padded(self, t, zero_future):
        """A [G, C, Q, ne] tile -> [G, C, W]: rows padded with zeros, the future zeroed if asked."""
        G, C = t.shape[:2]
        if self.p == 0 and not (zero_future and self.fut is not None) and self.N == self.W:
            return t.reshape(G, C, self.N)
        buf = t.new_zeros(G, C, self.W)
        inner = self.valid(buf)
        inner.copy_(t)
        if zero_future and self.fut is not None:
            inner.masked_fill_(self.fut, 0.0)
        return buf

    def im2col(self, t, k, shift=0):
        """[G, C, W] -> [G, k C, M]: block i is t[..., shift + i : shift + i + M]. shift=0: the inputs
        of the conv's outputs; the backward pass reads the transposed conv's with shift 2p, taps reversed."""
        if k == 1:
            return t
        if shift:
            return torch.cat([t[..., shift - i:shift - i + self.M] for i in range(k)], dim=1)
        return torch.cat([t[..., i:i + self.M] for i in range(k)], dim=1)

    def valid(self, t):
        """[G, C, W] -> [G, C, Q, ne]: the positions that are real (query, key) pairs."""
        return t[..., :self.N].view(*t.shape[:2], self.Q, self.L)[..., self.p:self.p + self.ne]


class _Tiled(torch.autograd.Function):
    """x + (y if res_y) + f(x, y), masked and soft-maxed if spec.out asks, tile by tile.
    x [B, Cx, Tq, Tk]; y None, [Cy, Tq, Tk] (shared by the batch) or [B, Cy, Tq, Tk];
    w1x [D, k Cx], w1y [D, k Cy] (im2col columns); b1 [D]; w2 [k, H, D] (one [H, D] per tap); b2 [H].
    Each op works on a whole tile [G, C, ...] of G sequences (bmm with the weights broadcast).
    Saved for the backward pass: x, y, the probabilities (which attention keeps anyway) and, with
    spec.save_hidden, the hidden map of the computed pairs only; without it, the backward pass recomputes it."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, y, w1x, w1y, b1, w2, b2, spec):
        Bn, _, Tq, Tk = x.shape
        k, H, D = w2.shape
        shared = y is not None and y.dim() == 3
        save_hidden = spec.save_hidden and any(ctx.needs_input_grad)
        ctx.hidden = []
        out = x.new_empty(Bn, H, Tq, Tk)
        fill = 0.0 if spec.out == "probs" else float("-inf")
        last = None
        for tile, b0, b1_ in spec.tiles(Bn, Tq, Tk):
            if tile is not last:  # a new block of rows: what all sequences share
                last = tile
                if tile.ne < Tk:  # keys after every query of the block
                    out[:, :, tile.s:tile.e, tile.ne:] = fill
                res = b2[:, None, None]
                hy, ycols = _shared_first_layer(tile, y, w1y, b1, k, spec) if shared else (b1[:, None], None)
                if shared and spec.res_y:
                    res = res + tile.view(y)
            xt = tile.view(x[b0:b1_])
            yt = tile.view(y[b0:b1_]) if y is not None and not shared else None
            act = _first_layer(tile, xt, yt, w1x, w1y, hy, k, spec)
            _activation_(act, tile)
            if save_hidden:
                ctx.hidden.append(act)
            if yt is not None and spec.res_y:
                xt = xt + yt
            logits = tile.valid(_conv_taps(w2, act, tile)).add_(xt).add_(res)
            if spec.out != "logits" and tile.fut is not None:
                logits.masked_fill_(tile.fut, float("-inf"))
            if spec.out == "probs":
                logits = torch.softmax(logits, dim=-1)
            tile.view(out[b0:b1_]).copy_(logits)
        ctx.save_for_backward(x, y, w1x, w1y, b1, w2, out if spec.out == "probs" else None)
        ctx.spec = spec
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, y, w1x, w1y, b1, w2, probs = ctx.saved_tensors
        spec, hidden = ctx.spec, ctx.hidden[::-1]
        ctx.hidden = None
        Bn, Cx, Tq, Tk = x.shape
        k, H, D = w2.shape
        p = k // 2
        shared = y is not None and y.dim() == 3
        dx = torch.empty_like(x)
        dy = None if y is None else torch.empty_like(y)
        # weight gradients are summed per sequence of a tile group ([G, ...], baddbmm_ adds in place),
        # then over the group at the end
        Gmax = max(b1_ - b0 for _, b0, b1_ in spec.tiles(Bn, Tq, Tk))
        dw1x_g, dw2_g = w1x.new_zeros(Gmax, *w1x.shape), w2.new_zeros(Gmax, k * H, D)
        dw1y_g = None if y is None or shared else w1y.new_zeros(Gmax, *w1y.shape)
        dw1y = None if y is None else torch.zeros_like(w1y)
        db1, db2 = torch.zeros_like(b1), g.new_zeros(H)
        w2_stack = w2.view(k * H, D)
        last = None
        for tile, b0, b1_ in spec.tiles(Bn, Tq, Tk):
            M = tile.M
            if tile is not last:
                if shared and last is not None:
                    _shared_grads(last, ycols, dh_sum, g_sum, w1y, dw1y, db1, dy, k, spec.zero_future)
                last = tile
                if tile.ne < Tk:  # pairs that were not computed (masked) get no gradient
                    dx[..., tile.s:tile.e, tile.ne:] = 0.0
                    if dy is not None:
                        dy[..., tile.s:tile.e, tile.ne:] = 0.0
                hy, ycols = _shared_first_layer(tile, y, w1y, b1, k, spec) if shared else (b1[:, None], None)
                if shared:
                    dh_sum = g.new_zeros(D, M)
                    g_sum = g.new_zeros(H, tile.Q, tile.ne) if spec.res_y else None
            xt = tile.view(x[b0:b1_])
            yt = tile.view(y[b0:b1_]) if y is not None and not shared else None
            xcols = tile.im2col(tile.padded(xt, spec.zero_future), k)
            ycols_b = tile.im2col(tile.padded(yt, spec.zero_future), k) if yt is not None else None
            if hidden:
                act = hidden.pop()  # [G, D, N]: the activation, zero at the ends and where V2 zeroes
                pre, pre_is_act = act[..., p:p + M], True  # LeakyReLU keeps the sign: act > 0 iff h > 0
            else:  # recompute the first layer
                h = _first_layer(tile, xt, yt, w1x, w1y, hy, k, spec, cols=(xcols, ycols_b))
                act = F.leaky_relu(h, SLOPE)
                if tile.zmask is not None:
                    act[..., p:p + M].masked_fill_(tile.zmask, 0.0)
                pre, pre_is_act = h[..., p:p + M], False

            gt = tile.view(g[b0:b1_])  # gradient of the logits:
            if spec.out == "probs":  # through the softmax
                gt = torch._softmax_backward_data(gt, tile.view(probs[b0:b1_]), -1, gt.dtype)
            elif spec.out == "masked" and tile.fut is not None:  # through masked_fill
                gt = gt.masked_fill(tile.fut, 0.0)
            db2 += gt.sum(dim=(0, 2, 3))
            gcols = tile.im2col(tile.padded(gt, False), k, shift=2 * p)  # the transposed conv's inputs
            G = gcols.shape[0]
            dw2_g[:G].baddbmm_(gcols, act[..., p:p + M].transpose(1, 2))
            dact = torch.bmm(_batched(w2_stack.t(), gcols), gcols)  # [G, D, M]
            if tile.zmask is not None:
                dact.masked_fill_(tile.zmask, 0.0)
            dh = torch.ops.aten.leaky_relu_backward(dact, pre, SLOPE, pre_is_act)

            dw1x_g[:G].baddbmm_(dh, xcols.transpose(1, 2))
            dxt = _col2im(torch.bmm(_batched(w1x.t(), dh), dh), tile, k, spec.zero_future)
            tile.view(dx[b0:b1_]).copy_(dxt.add_(gt))
            if shared:
                dh_sum += dh.sum(0)
                if g_sum is not None:
                    g_sum += gt.sum(0)
            else:
                db1 += dh.sum(dim=(0, 2))
            if yt is not None:
                dw1y_g[:G].baddbmm_(dh, ycols_b.transpose(1, 2))
                dyt = _col2im(torch.bmm(_batched(w1y.t(), dh), dh), tile, k, spec.zero_future)
                if spec.res_y:
                    dyt += gt
                tile.view(dy[b0:b1_]).copy_(dyt)
        if shared:
            _shared_grads(last, ycols, dh_sum, g_sum, w1y, dw1y, db1, dy, k, spec.zero_future)
        if dw1y_g is not None:
            dw1y = dw1y_g.sum(0)
        return dx, dy, dw1x_g.sum(0), dw1y, db1, dw2_g.sum(0).view(k, H, D), db2, None


def _batched(w, like):
    """A weight [m, n] as a batch [G, m, n] for bmm (a view: matmul's broadcasting would copy the tile)."""
    return w.expand(like.shape[0], -1, -1)


def _shared_first_layer(tile, y, w1y, b1, k, spec):
    """The first layer's part from a y shared by the batch, plus its bias: [D, M], and y's columns."""
    ycols = tile.im2col(tile.padded(tile.view(y)[None], spec.zero_future), k)[0]
    return torch.addmm(b1[:, None], w1y, ycols), ycols


def _first_layer(tile, xt, yt, w1x, w1y, hy, k, spec, cols=None):
    """The first layer before its activation, [G, D, N]: real at the flat positions [p, N - p), zero
    at the p positions before and after (what the second conv pads with)."""
    xcols, ycols = cols or (tile.im2col(tile.padded(xt, spec.zero_future), k),
                            tile.im2col(tile.padded(yt, spec.zero_future), k) if yt is not None else None)
    G, D, p = xcols.shape[0], w1x.shape[0], tile.p
    if p == 0:
        h = mid = torch.baddbmm(hy, _batched(w1x, xcols), xcols)
    else:
        h = xcols.new_empty(G, D, tile.W)
        h[..., :p] = 0.0
        h[..., p + tile.M:] = 0.0
        mid = torch.baddbmm(hy, _batched(w1x, xcols), xcols, out=h[..., p:p + tile.M])
    if ycols is not None:
        mid.baddbmm_(_batched(w1y, ycols), ycols)
    return h


def _activation_(h, tile):
    """LeakyReLU in place, then zeros where V2 zeroes the hidden map (future and padding)."""
    mid = h[..., tile.p:tile.p + tile.M]
    F.leaky_relu(mid, SLOPE, inplace=True)
    if tile.zmask is not None:
        mid.masked_fill_(tile.zmask, 0.0)


def _shared_grads(tile, ycols, dh_sum, g_sum, w1y, dw1y, db1, dy, k, zero_future):
    """A shared y's part of the gradients, from the first layer's gradient summed over the batch."""
    db1 += dh_sum.sum(dim=1)
    dw1y.addmm_(dh_sum, ycols.t())
    dyt = _col2im(torch.mm(w1y.t(), dh_sum)[None], tile, k, zero_future)[0]
    if g_sum is not None:
        dyt += g_sum
    tile.view(dy).copy_(dyt)


def _conv_taps(w2, act, tile):
    """Second layer: sum over taps t of w2[t] @ act[..., t : t + M], at the flat positions [p, p + M)
    of a [G, H, W] result (the rest is never read)."""
    k, H, _ = w2.shape
    if k == 1:
        return torch.bmm(_batched(w2[0], act), act)
    o = act.new_empty(act.shape[0], H, tile.W)
    om = o[..., tile.p:tile.p + tile.M]
    torch.bmm(_batched(w2[0], act), act[..., :tile.M], out=om)
    for t in range(1, k):
        om.baddbmm_(_batched(w2[t], act), act[..., t:t + tile.M])
    return o


def _col2im(dcols, tile, k, zero_future):
    """The adjoint of padded() then im2col(): gradients [G, k C, M] of the k shifted views -> the
    gradient [G, C, Q, ne] of the tile."""
    G, C = dcols.shape[0], dcols.shape[1] // k
    if k == 1 and tile.p == 0 and tile.N == tile.M:
        d = dcols.view(G, C, tile.Q, tile.ne)
    else:
        flat = dcols.new_zeros(G, C, tile.W)
        for t in range(k):
            flat[..., t:t + tile.M] += dcols[:, t * C:(t + 1) * C]
        d = tile.valid(flat)
    if zero_future and tile.fut is not None:
        d = d.masked_fill(tile.fut, 0.0)
    return d
