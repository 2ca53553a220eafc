"""
DAPE's f (dape.py) computed fast in plain PyTorch, without the plain form's intermediate maps. The
function is the same: tests/test_dape.py checks outputs and every gradient of both paths against an
independent float64 reference and against dape.py's plain form.

Shapes: B batch, H heads, Tq and Tk query and key lengths, C channels of f's input, D hidden width, k
taps along the key axis (1 for V1), N pairs of a tile. f's weights come as dape.py's weights() gives
them: w1 [D, C, k], b1 [D], w2 [H, D, k], b2 [H].

- Elsewhere than the CPU (CUDA without the fused kernel of dape_triton.py, torch.compile) f runs on
  whole maps, which the GPU and the compiler do best with. Its first layer is split into a logits half
  and a bias half, W1 . cat(x, y) = W1_x . x + W1_y . y, so that W1_y . y is computed once for the batch
  when y has no batch axis, and both layers contract over the channel axis of the [B, C, Tq, Tk] maps as
  one batched product written straight into its output: nothing is permuted and back.
- On the CPU (_Tiled below) f runs tile by tile, with a backward pass of its own: a tile is a block of
  query rows of a group of sequences (about TILE_PAIRS pairs), so the [B, D, Tq, Tk] hidden map never
  exists at once. In causal attention a block of rows only needs the keys up to its last query, so the
  masked half of f is never computed. A tile runs f's products alone: the residual, the mask and the
  softmax (and their gradients) are one call each on the whole maps. Each layer of f is one matrix
  product over the tile's pairs, with the hidden map pairs-major and a (1, k) convolution as im2col
  along the key axis (details below). Where the mask hides a pair, f is skipped when the pair's key is
  masked for a whole block of rows; elsewhere the -inf added to finite logits hides it. Under bfloat16
  autocast the tiles compute f in float32, where the plain form computes f's layers in bfloat16: the two
  then differ by that rounding, about 0.5% of a gradient's size and 1e-4 of the loss
  (tests/test_dape_paths.py bounds it), so there numbers alone cannot tell an edit from rounding.
"""

import threading

import numpy as np
import torch
import torch.nn.functional as F

# The version of dape.py that this file and dape_triton.py implement, class by class and part by part
# (fingerprint.definition): dape_paths.py runs a fast path only on a module whose code, as it is in memory,
# has these fingerprints, no more and no fewer. Update it together with the fast paths, once their equality
# tests pass (tests/test_dape.py pins it and prints what it should be, each class whole; the entries both
# classes share, their base class's parts and the globals both read, are written once here: _SHARED).
_SHARED = {
    "_DAPE.__init__": "32b947ef65370945",
    "_DAPE._run": "b0668ca1f397ccec",
    "_DAPE.forward": "b4f4f2d3547b076f",
    "_DAPE.init_last_layer": "e806fb2e59693ecd",
    "_DAPE.kernel": "1",
    "_DAPE.probs": "a2732b54553d7917",
    "_DAPE.reset_parameters": "41eb6fb991c4bf45",
    "_DAPE.residual_f": "6e5e432fc3cbc976",
    "_DAPE.slope": "0.01",
    "_DAPE.zero_future": "False",
    "dape_in_channels": "278401735baa085b",
    "F": "module torch.nn.functional",
    "F.softmax": "function torch.softmax",
    "finish": "25eaccea3a5f4b49",
    "float": "type builtins.float",
    "hasattr": "builtin_function_or_method builtins.hasattr",
    "INITS": "('default', 'zero')",
    "list": "type builtins.list",
    "next": "builtin_function_or_method builtins.next",
    "nn": "module torch.nn",
    "nn.LeakyReLU": "type torch.LeakyReLU",
    "SLOPE": "0.01",
    "super": "type builtins.super",
    "torch": "module torch",
    "torch.cat": "builtin_function_or_method torch.cat",
    "torch.linspace": "builtin_function_or_method torch.linspace",
    "torch.no_grad": "type torch.no_grad",
    "type": "type builtins.type",
    "ValueError": "type builtins.ValueError",
    "VARIANTS": "('concat_residual', 'concat', 'add_residual', 'bias_only')",
}
IMPLEMENTS = {
    "DAPEV1": {
        **_SHARED,
        "DAPEV1.__init__": "7237765a52773e94",
        "DAPEV1.f": "c89d1a6c8dff654d",
        "DAPEV1.weights": "7ec36c1ebaceaf32",
        "nn.Linear": "type torch.Linear",
        "nn.Sequential": "type torch.Sequential",
        "rearrange": "function einops.rearrange",
    },
    "DAPEV2": {
        **_SHARED,
        "DAPEV2.__init__": "f162c317cd96d284",
        "DAPEV2.f": "3919d80257cc6dc6",
        "DAPEV2.weights": "4af632a5fde322bb",
        "DAPEV2.zero_future": "True",
        "nn.Conv2d": "type torch.Conv2d",
    },
}
# (query, key) pairs per CPU tile, over the sequences it groups: its hidden map is D * TILE_PAIRS floats,
# which stays in cache; smaller tiles spend more time in Python than in arithmetic.
TILE_PAIRS = 16384
# CPU training: keep each tile's hidden map for the backward pass rather than recompute it (faster, costs
# D floats per computed pair and layer)
SAVE_HIDDEN = True
# dape.py's own code (own_code): blocks of query rows a call is cut into. n blocks compute (n + 1) / 2n of the
# causal square's pairs; more blocks skip little more and cost more calls
OWN_BLOCKS = 8


def own_code(mod, x, y, res_y, future, out):
    """dape.py's own mod.residual_f, the lines a reader edits, on blocks of query rows against only the keys those
    rows see (dape_impl='plain', and auto's path for an edited f): a block needs no key after its last query, so
    about half of f is never computed in causal attention; without autograd a block holds about TILE_PAIRS pairs,
    so f's maps take what the tiles' take. The same function as on the whole map for any f under which a key after
    a query cannot change that query's logits (V1 at each pair; V2 zeroes the future before each layer); an f that
    lets it breaks causality, which the suite's prefix tests catch."""
    if future is None or out == "logits" or x.shape[-2] == 1:
        return mod.residual_f(x, y, res_y, future, out)
    R, Tk = future.shape
    rows, grad = -(-R // min(OWN_BLOCKS, R)), torch.is_grad_enabled()
    if not grad:  # nothing kept for backward: blocks of about a tile's pairs bound the memory
        rows = min(rows, max(1, TILE_PAIRS // (x.shape[0] * Tk)))
    keys = keys_needed(future)
    fill = 0.0 if out == "probs" else float("-inf")  # what the keys left out hold after out's mask (and softmax)
    # split, not sliced block by block: a slice's backward writes its gradient into a zero map of the whole
    xs, fs = x.split(rows, dim=-2), future.split(rows)
    ys = y.split(rows, dim=-2) if y is not None else [None] * len(xs)
    blocks, whole = [], None
    for s, xb, yb, fb in zip(range(0, R, rows), xs, ys, fs):
        ne = max(keys[s:s + rows])
        o = mod.residual_f(xb[..., :ne], None if yb is None else yb[..., :ne], res_y, fb[:, :ne], out)
        if grad:
            blocks.append(F.pad(o, (0, Tk - ne), value=fill))
            continue
        if whole is None:  # without autograd each block goes straight into the output: no padded copies to join
            whole = o.new_full(o.shape[:-2] + (R, Tk), fill)
        whole[..., s:s + rows, :ne] = o
    return torch.cat(blocks, dim=-2) if whole is None else whole


def keys_needed(future):
    """For each query row of the mask future [R, Tk], the keys up to its last unmasked one (at least 1): all a
    row needs where the masked keys are -inf, or zero after the softmax."""
    keys = torch.arange(1, future.shape[1] + 1, device=future.device)
    return torch.where(future, 0, keys).amax(dim=1).clamp(min=1).tolist()


def use_tiles(x):
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def residual_f(mod, x, y, res_y, future, out):
    """What dape._DAPE.residual_f defines, for the DAPE module mod (its weights(), kernel, slope and
    zero_future): x + (y if res_y) + f(cat(x, y)), then "logits", "masked" or "probs"."""
    w1, b1, w2, b2 = mod.weights()
    if use_tiles(x):
        spec = Spec(mod.kernel, mod.zero_future, mod.slope, res_y, future, out, SAVE_HIDDEN,
                    grad=torch.is_grad_enabled())
        return _Tiled.apply(x, y, w1, b1, w2, b2, spec)
    f = whole_f(x, y, future, w1, b1, w2, b2, mod.zero_future and future is not None, mod.slope)
    logits = f + x if y is None or not res_y else f + (x + y)
    if out != "logits" and future is not None:
        logits = logits.masked_fill_(future, float("-inf"))
    return F.softmax(logits, dim=-1) if out == "probs" else logits


# -----------------------------------------------------------------------------
# whole maps


def _channel_mix(w, x):
    """w [D, C] applied to the channel axis of flat maps x [B, C, N] (or [C, N]) -> [B, D, N]. As one
    batched product written straight into its output: torch.matmul computes this one transposed and
    then copies it, which holds two maps of the output's size at once."""
    return w @ x if x.dim() == 2 else torch.bmm(w.expand(x.shape[0], -1, -1), x)


def whole_f(x, y, future, w1, b1, w2, b2, zero_future, slope):
    """f(cat(x, y)) on whole maps: [B, H, Tq, Tk]; zero_future: zero `future` before each layer (V2)."""
    if w1.shape[-1] == 1 and not zero_future:  # V1: flat maps [..., C, Tq Tk], a layer one product over C
        C, pairs = x.shape[-3], x.shape[-2:]
        h = _channel_mix(w1[:, :C, 0], x.flatten(-2))  # [B, D, Tq Tk]
        # b1 and y's half (computed once for the batch when y has no batch axis), then the activation, in
        # place: one map of h's size is allocated, and kept for backward
        h += b1[:, None] if y is None else _channel_mix(w1[:, C:, 0], y.flatten(-2)) + b1[:, None]
        F.leaky_relu(h, slope, inplace=True)
        return (_channel_mix(w2[:, :, 0], h) + b2[:, None]).unflatten(-1, pairs)
    pad = (0, w1.shape[-1] // 2)
    zero = (lambda t: t.masked_fill(future, 0.0)) if zero_future else (lambda t: t)
    C = x.shape[-3]
    h = F.conv2d(zero(x), w1[:, :C, None], b1, padding=pad)
    if y is not None:  # in place, as in V1 (a conv's backward does not need its output)
        y = zero(y)
        h += F.conv2d(y if y.dim() == 4 else y[None], w1[:, C:, None], padding=pad)
    if zero_future:  # before the activation (LeakyReLU(0) = 0): both in place
        h.masked_fill_(future, 0.0)
    F.leaky_relu(h, slope, inplace=True)
    return F.conv2d(h, w2[:, :, None], b2, padding=pad)


# -----------------------------------------------------------------------------
# the CPU's tiles: f tile by tile, with a backward pass of its own
#
# A tile is a block of query rows [s, e) of a group of sequences [b0, b1), with the keys [0, ne) that
# those rows need. Its (query, key) pairs are laid out on one flat axis n = (sequence, row, key), each
# row padded with p = k // 2 zeros on both sides (the convolution's zero padding; none for V1), so that
# N = G * Q * (ne + 2p). On that axis both layers of f are one matrix product each:
#
#     X = im2col(cat(x, y)), then a row of ones    [k C + 1, N]    C = Cx + Cy channels; the ones carry b1
#     h = LeakyReLU(X^T @ W1^T)                    [N, D]          V2: zero at padding and future pairs
#     Z = W2 @ h^T                                 [k H, N]        all taps at once (M = k H rows, not H)
#     f[:, n] = sum over taps t of Z[t H : (t + 1) H, n + t - p]
#
# The hidden map is kept pairs-major ([N, D], D contiguous): with K or M as small as the number of heads,
# MKL runs the products of the forward and backward pass faster in that orientation than with [D, N]
# (measured on this project's CPU, caches warm: 44 against 59 ns per pair for the six products).


_tilings = {}  # Spec.tiles' tilings, by shape, mask and kernel


class Spec:
    """What _Tiled computes besides its tensors, and how it cuts the maps into tiles."""

    def __init__(self, kernel, zero_future, slope, res_y, future, out, save_hidden, grad):
        self.kernel, self.zero_future, self.slope, self.res_y = kernel, zero_future, slope, res_y
        self.future = future
        self.out = out if future is not None or out != "masked" else "logits"
        self.skip = future is not None and out != "logits"  # keys masked for a whole block: not computed
        self.grad = grad  # a backward pass will follow: keep what it needs
        self.save_hidden = save_hidden and grad  # keep h for the backward pass rather than recompute it

    def tiles(self, Bn, Tq, Tk):
        """The tiles for maps [Bn, C, Tq, Tk]; made once for each shape, mask and kernel (every layer of a
        model, at every step, asks for the same few: making V2's takes ~0.7 ms at T = 64)."""
        # the mask's bits (packed: in blocked evaluation at 8192 keys a mask is 102 x 8192 bools)
        future = None if self.future is None else np.packbits(self.future.numpy()).tobytes()
        key = (Bn, Tq, Tk, self.kernel, self.zero_future, self.skip, TILE_PAIRS, future)
        tiles = _tilings.get(key)
        if tiles is None:
            if len(_tilings) >= 64:  # an evaluation at many lengths: forget the old ones
                _tilings.clear()
            tiles = _tilings[key] = self.make_tiles(Bn, Tq, Tk)
        return tiles

    def make_tiles(self, Bn, Tq, Tk):
        """Tiles of about TILE_PAIRS pairs, padding included: a block of rows takes all Tk keys, or when
        the mask is applied only the keys up to its last unmasked one (the rest is -inf, zero after the
        softmax; for V2 zero, which is what the conv's zero padding gives). Every sequence of the batch
        goes into one tile where that fits; otherwise a tile is one block of rows of G sequences."""
        p = self.kernel // 2
        need = keys_needed(self.future) if self.skip else [Tk] * Tq
        row_budget = max(1, TILE_PAIRS // Bn)
        out, s = [], 0
        while s < Tq:
            e, ne = s + 1, need[s]
            while e < Tq and (e + 1 - s) * (max(ne, need[e]) + 2 * p) <= row_budget:
                ne = max(ne, need[e])
                e += 1
            G = max(1, min(Bn, TILE_PAIRS // ((e - s) * (ne + 2 * p))))
            for b0 in range(0, Bn, G):
                out.append(_Tile(s, e, ne, b0, min(b0 + G, Bn), p, self.future, self.zero_future))
            s = e
        return out


class _Tile:
    """Rows [s, e), keys [0, ne), sequences [b0, b1) of the [B, C, Tq, Tk] maps; flat buffers hold its
    pairs at [p, p + N) of a width N + 2p (see above)."""

    def __init__(self, s, e, ne, b0, b1, p, future, zero_future):
        self.s, self.e, self.ne, self.b0, self.b1, self.p = s, e, ne, b0, b1, p
        self.G, self.Q, self.L = b1 - b0, e - s, ne + 2 * p
        self.N = self.G * self.Q * self.L
        # V2 zeroes its inputs in the future, and its hidden map there and in each row's padding: few
        # pairs (a triangle per block of rows, 2p per row), so they are zeroed by index, not by a mask
        zero_fut = future[s:e, :ne] if zero_future and future is not None else None  # [Q, ne], True = future
        if zero_fut is not None and not bool(zero_fut.any()):
            zero_fut = None
        self.fut_cols = self.zero_rows = None  # flat positions: of the inputs' buffers, of h's rows
        if p or zero_fut is not None:
            z = torch.zeros(self.Q, self.L, dtype=torch.bool)
            if zero_fut is not None:
                z[:, p:p + ne] = zero_fut
                self.fut_cols = p + self._flat_index(z)
            z[:, :p] = True
            z[:, p + ne:] = True
            self.zero_rows = self._flat_index(z)

    def _flat_index(self, z):
        """The flat positions of every sequence's True entries of z [Q, L]."""
        one = z.flatten().nonzero().squeeze(1)
        return (one + self.Q * self.L * torch.arange(self.G)[:, None]).flatten()

    def of(self, t):
        """The tile of a map, channels first: [B, C, Tq, Tk] -> [C, G, Q, ne]; a map shared by the batch
        [C, Tq, Tk] -> [C, 1, Q, ne] (it broadcasts over the group). A strided view, made in one call
        (tiles are small enough that a chain of slicing calls costs more than some of their arithmetic)."""
        if t.dim() == 3:
            sc, sq, sk = t.stride()
            return t.as_strided((t.shape[0], 1, self.Q, self.ne), (sc, 0, sq, sk),
                                t.storage_offset() + self.s * sq)
        sb, sc, sq, sk = t.stride()
        return t.as_strided((t.shape[1], self.G, self.Q, self.ne), (sc, sb, sq, sk),
                            t.storage_offset() + self.b0 * sb + self.s * sq)

    def slots(self, buf):
        """Where the pairs sit in a flat buffer [R, N + 2p] (contiguous rows): a view [R, G, Q, ne]."""
        R = buf.shape[0]
        return buf.as_strided((R, self.G, self.Q, self.ne), (buf.stride(0), self.Q * self.L, self.L, 1),
                              buf.storage_offset() + 2 * self.p)

    def flat(self, maps, R, reverse=False, zero=None, ones=False):
        """Maps [Ri, G or 1, Q, ne] stacked on the channel axis into a flat zero-padded [R, N + 2p] buffer
        (a plain [R, N] one for V1), zero at the flat positions `zero`, then im2col'ed: [k R, N] with
        block t = buf[:, t : t + N], the inputs of each output's tap t; reverse: block t =
        buf[:, 2p - t : 2p - t + N], what the transposed convolution reads. ones: a last row of ones."""
        p, N = self.p, self.N
        buf = maps[0].new_empty(R + ones, N) if p == 0 else maps[0].new_zeros(R, N + 2 * p)
        slots, r = self.slots(buf[:R]), 0
        for m in maps:
            slots[r:r + m.shape[0]].copy_(m)
            r += m.shape[0]
        if zero is not None:
            buf[:R].index_fill_(1, zero, 0.0)
        if p == 0:
            if ones:
                buf[R].fill_(1.0)
            return buf
        k = 2 * p + 1
        cols = buf.new_empty(k * R + ones, N)
        for t in range(k):
            start = 2 * p - t if reverse else t
            cols[t * R:(t + 1) * R] = buf[:, start:start + N]
        if ones:
            cols[k * R].fill_(1.0)
        return cols


class _Tiled(torch.autograd.Function):
    """x + (y if res_y) + f(cat(x, y)), masked and soft-maxed if spec.out asks, with f tile by tile.
    x [B, Cx, Tq, Tk]; y None, [Cy, Tq, Tk] (shared by the batch) or [B, Cy, Tq, Tk]; the module's own
    weights w1 [D, C, k], b1 [D], w2 [H, D, k], b2 [H]. Saved for the backward pass: the weights, the
    probabilities (which attention keeps anyway), each tile's first-layer input X (k C + 1 floats per
    pair: x and y themselves are not kept) and, with spec.save_hidden, its hidden map (D floats per pair);
    without it, h is recomputed.

    Everything but f is done once on the whole maps: the output starts as x + y + b2 (-inf where
    masked), each tile adds f at its pairs, and the softmax (and in backward its gradient, db2, and the
    residual's share of dx and dy) takes one call for the whole map; a tile only runs f's products."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, y, w1, b1, w2, b2, spec):
        Bn, _, Tq, Tk = x.shape
        W1, W2 = _matrices(w1, b1, w2)
        H = w2.shape[0]
        out = _residual(x, y, b2, spec)
        saved = []
        for tile in spec.tiles(Bn, Tq, Tk):
            X = _inputs(tile, x, y)
            h = _hidden(tile, X, W1, spec.slope, keep=spec.save_hidden)
            if spec.grad:
                saved.append((tile, X, h if spec.save_hidden else None))
            tile.of(out).add_(_second_layer(tile, h, W2, H))
        if spec.out == "probs":
            torch._softmax(out, -1, False, out=out)  # in place: it reads each row before writing it
        # not x and y: the tiles' X hold what backward needs of them, and the logits map A can be freed. Saved as
        # autograd's own, so that they are freed with the graph, and kept where it is retained (backward twice)
        ctx.save_for_backward(w1, b1, w2, out if spec.out == "probs" else None,
                              *(t for _, X, h in saved for t in (X, h)))
        ctx.Cx, ctx.y_shape = x.shape[1], None if y is None else y.shape
        ctx.spec, ctx.tiles = spec, [tile for tile, _, _ in saved]
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        w1, b1, w2, probs, *tensors = ctx.saved_tensors
        Cx, y_shape = ctx.Cx, ctx.y_shape
        spec, saved = ctx.spec, zip(ctx.tiles, tensors[0::2], tensors[1::2])
        W1, W2 = _matrices(w1, b1, w2)
        D, C, k = w1.shape
        H = w2.shape[0]
        kC = k * C
        # the logits' gradient, zero where masked (there the probabilities are 0, or the -inf hides x):
        # it is dx, dy (when y is added) and db2 as far as the residual goes; the tiles add f's share
        if spec.out == "probs":
            dx = torch._softmax_backward_data(g, probs, -1, g.dtype)
        elif spec.out == "masked":
            dx = g.masked_fill(spec.future, 0.0)
        else:
            dx = g.clone()
        dy = db2 = None
        if y_shape is not None and not spec.res_y:
            dy = g.new_zeros(y_shape)
        elif y_shape is not None and len(y_shape) == 3:
            dy = dx.sum(dim=0)
            db2 = dy.sum(dim=(1, 2))  # dy already holds dx's sum over the batch
        elif y_shape is not None:
            dy = dx.clone()
        if db2 is None:
            db2 = dx.sum(dim=(0, 2, 3))
        dW1, dW2 = W1.new_zeros(kC + 1, D), W2.new_zeros(k * H, D)  # transposed: [k C + 1, D], [k H, D]
        for tile, X, h in saved:
            gcols = tile.flat([tile.of(dx)], H, reverse=True)  # [k H, N]: what the second layer's transpose reads
            if h is None:
                h = _hidden(tile, X, W1, spec.slope)
            dW2.addmm_(gcols, h)
            dh = torch.mm(gcols.t(), W2, out=_work("dh", tile.N, D, g))  # the gradient of the activation,
            torch.ops.aten.leaky_relu_backward.grad_input(dh, h, spec.slope, True, grad_input=dh)  # then of h
            if tile.zero_rows is not None:
                dh.index_fill_(0, tile.zero_rows, 0.0)
            dW1.addmm_(X, dh)
            dX = _col2im(tile, torch.mm(W1[:, :kC].t(), dh.t(), out=_work("dX", kC, tile.N, g)), C, k)
            tile.of(dx).add_(dX[:Cx])
            if dy is not None:
                if dy.dim() == 3:
                    tile.of(dy)[:, 0].add_(dX[Cx:].sum(dim=1))
                else:
                    tile.of(dy).add_(dX[Cx:])
        dw1 = dW1[:kC].t().reshape(D, k, C).permute(0, 2, 1)
        dw2 = dW2.view(k, H, D).permute(1, 2, 0)
        return dx, dy, dw1, dW1[kC], dw2, db2, None


_workspace = threading.local()


def _work(name, rows, cols, like):
    """A contiguous [rows, cols] scratch buffer of like's dtype, the same memory for every tile and call
    of this thread: the products write into memory that is mapped and warm in cache rather than into a
    fresh multi-MB buffer per tile."""
    key = f"{name}_{like.dtype}"
    buf = getattr(_workspace, key, None)
    if buf is None or buf.numel() < rows * cols:
        buf = like.new_empty(rows * cols)
        setattr(_workspace, key, buf)
    return buf[:rows * cols].view(rows, cols)


def _matrices(w1, b1, w2):
    """The weights as the flat products use them: W1 [D, k C + 1] (im2col order: tap t, then channel;
    b1 last, against the row of ones) and W2 [k H, D] (tap t's [H, D] at rows t H .. t H + H - 1)."""
    D, C, k = w1.shape
    H = w2.shape[0]
    W1 = torch.cat((w1.permute(0, 2, 1).reshape(D, k * C), b1[:, None]), dim=1)
    return W1, w2.permute(2, 0, 1).reshape(k * H, D)


def _residual(x, y, b2, spec):
    """What the logits add to f, on the whole maps: x + (y if res_y) + b2, -inf where masked when
    spec.out asks for the mask (f is finite, so the -inf stays). A new [B, H, Tq, Tk] map."""
    res = b2[:, None, None]
    if y is not None and spec.res_y:
        res = res + y  # [H, Tq, Tk], or [B, H, Tq, Tk] when y has a batch axis
    if spec.out != "logits" and spec.future is not None:
        res = res.masked_fill(spec.future, float("-inf"))
    return x + res


def _inputs(tile, x, y):
    """The first layer's input X [k C + 1, N]: the tile of cat(x, y) im2col'ed, V2's future zeroed, and
    a last row of ones (for b1)."""
    maps = [tile.of(x)] if y is None else [tile.of(x), tile.of(y).expand(-1, tile.G, -1, -1)]
    return tile.flat(maps, sum(m.shape[0] for m in maps), zero=tile.fut_cols, ones=True)


def _hidden(tile, X, W1, slope, keep=False):
    """h = LeakyReLU(X^T W1^T) [N, D], zero where V2 zeroes it; in the workspace unless kept."""
    N, D = tile.N, W1.shape[0]
    h = torch.mm(X.t(), W1.t(), out=X.new_empty(N, D) if keep else _work("h", N, D, X))
    F.leaky_relu(h, slope, inplace=True)
    if tile.zero_rows is not None:
        h.index_fill_(0, tile.zero_rows, 0.0)
    return h


def _second_layer(tile, h, W2, H):
    """f's second layer at the tile's pairs, without b2: [H, G, Q, ne] (a view of the workspace)."""
    k, p, N = W2.shape[0] // H, tile.p, tile.N
    Z = torch.mm(W2, h.t(), out=_work("Z", W2.shape[0], N, h))  # [k H, N]
    if k == 1:
        return Z.view(H, tile.G, tile.Q, tile.ne)
    o = _work("o", H, N + 2 * p, h)
    inner = o[:, 2 * p:N]  # the outputs at flat positions [p, N - p): all that is ever read
    torch.add(Z[:H, :N - 2 * p], Z[H:2 * H, 1:N - 2 * p + 1], out=inner)
    for t in range(2, k):
        inner.add_(Z[t * H:(t + 1) * H, t:N - 2 * p + t])
    return tile.slots(o)


def _col2im(tile, dcols, C, k):
    """The adjoint of flat(): the gradients [k C, N] of the im2col blocks -> the tile's [C, G, Q, ne]
    (zero where V2 zeroed its inputs)."""
    if k == 1:
        return dcols.view(C, tile.G, tile.Q, tile.ne)
    buf = dcols.new_zeros(C, tile.N + 2 * tile.p)
    for t in range(k):
        buf[:, t:t + tile.N] += dcols[t * C:(t + 1) * C]
    if tile.fut_cols is not None:
        buf.index_fill_(1, tile.fut_cols, 0.0)
    return tile.slots(buf)
