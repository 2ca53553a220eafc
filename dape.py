"""
DAPE: data-adaptive positional encoding (Zheng et al., NeurIPS 2024).

The pre-softmax logits of a layer become A + B + f(A, B), where A = q.k/sqrt(hs) are the logits of all
H heads, B the positional bias of all H heads, and f a small network that mixes the 2H channels at
every (query, key) pair into H new ones:

    DAPEV1  f is an MLP applied independently at each (i, j)              (paper eq. 2/3, Appendix J)
    DAPEV2  f is two (1, k) convolutions along the key axis of each row   (DAPE V2, "1xk")

Both work in the [batch, channel, query, key] layout the attention already has: the first layer
contracts over the channel axis (a matmul with the heads as the inner dimension, or a conv), so nothing
is permuted to channels-last and back. Because f is linear in its input before the activation, its
first layer is split into a logits half and a bias half: W1 . cat(A, B) = W1_A . A + W1_B . B. B has no
batch axis for static encodings, so W1_B . B is computed once per layer instead of once per sequence.

Variants (`dape_variant`), for an encoding with a bias B:
    concat_residual   A + B + f(cat(A, B))   (default; eq. 3, Appendix J)
    concat            A + f(cat(A, B))       (eq. 2)
    add_residual      A + B + f(A + B)       (Fig. 5)
    bias_only         A + B + f(B)           (ablation: no semantic input)
For an encoding without a bias (nope, rope, learned, sinusoidal, cope) it is A + f(A).

`future` is the causal mask [Tq, Tk] (True where key j is after query i) or None (bidirectional). f
never sees -inf: the caller masks after f. V2 zeroes the future before each convolution, so a row's
result is the same whatever number of future columns the map happens to have (prefix consistency).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = ("concat_residual", "concat", "add_residual", "bias_only")


def dape_in_channels(n_head, variant, has_bias):
    return 2 * n_head if has_bias and variant in ("concat_residual", "concat") else n_head


class _DAPE(nn.Module):
    """The variant logic shared by V1 and V2; subclasses define f(x, y, future), where the channels
    of x go to the first in_channels columns of the first layer and those of y (optional) to the rest."""

    def __init__(self, n_head, width, variant, has_bias):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"dape_variant must be one of {VARIANTS}, got {variant!r}")
        self.n_head, self.width, self.variant, self.has_bias = n_head, width, variant, has_bias
        self.in_channels = dape_in_channels(n_head, variant, has_bias)

    def forward(self, A, B, future=None):
        # A: [B, H, Tq, Tk]; B: [H, Tq, Tk], [B, H, Tq, Tk] or None
        if B is None:
            return A + self.f(A, None, future)
        if self.variant == "concat_residual":
            return A + B + self.f(A, B, future)
        if self.variant == "concat":
            return A + self.f(A, B, future)
        if self.variant == "add_residual":
            S = A + B
            return S + self.f(S, None, future)
        return A + B + self.f(B, None, future)  # bias_only

    def reset_parameters(self):
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _mix(w, x):
    """Apply w [D, C] to the channel axis of x [..., C, Tq, Tk] -> [..., D, Tq, Tk], as one matmul
    with C as the contraction axis."""
    return torch.matmul(w, x.flatten(-2)).unflatten(-1, x.shape[-2:])


class DAPEV1(_DAPE):
    """f = Linear(C_in -> D) -> LeakyReLU -> Linear(D -> H) at every (i, j). The parameters are named
    like Appendix J's `mlp` (Sequential), so state dicts interchange with the paper's module."""

    def __init__(self, n_head, width=32, variant="concat_residual", has_bias=True):
        super().__init__(n_head, width, variant, has_bias)
        self.mlp = nn.Sequential(nn.Linear(self.in_channels, width), nn.LeakyReLU(0.01),
                                 nn.Linear(width, n_head))

    def f(self, x, y, future):
        fc1, fc2 = self.mlp[0], self.mlp[2]
        C = x.shape[-3]
        h = _mix(fc1.weight[:, :C], x)
        if y is not None:
            h = h + _mix(fc1.weight[:, C:], y)  # y without a batch axis broadcasts over it
        h = F.leaky_relu(h + fc1.bias[:, None, None], 0.01, inplace=True)  # in place: autograd keeps one copy
        return _mix(fc2.weight, h) + fc2.bias[:, None, None]


class DAPEV2(_DAPE):
    """f = Conv2d(C_in -> D, (1, k)) -> LeakyReLU -> Conv2d(D -> H, (1, k)): each (i, j) also sees its
    k - 1 neighbouring keys in the same query row, across all heads."""

    def __init__(self, n_head, width=32, kernel=3, variant="concat_residual", has_bias=True):
        super().__init__(n_head, width, variant, has_bias)
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"dape_kernel must be a positive odd number (the conv is centred), got {kernel}")
        self.kernel = kernel
        self.conv1 = nn.Conv2d(self.in_channels, width, (1, kernel), padding=(0, kernel // 2))
        self.act = nn.LeakyReLU(0.01)
        self.conv2 = nn.Conv2d(width, n_head, (1, kernel), padding=(0, kernel // 2))

    def f(self, x, y, future):
        pad = (0, self.kernel // 2)
        zero_future = (lambda t: t.masked_fill(future, 0.0)) if future is not None else (lambda t: t)
        w1, C = self.conv1.weight, x.shape[-3]
        h = F.conv2d(zero_future(x), w1[:, :C], self.conv1.bias, padding=pad)
        if y is not None:
            y = zero_future(y)
            h = h + F.conv2d(y if y.dim() == 4 else y[None], w1[:, C:], padding=pad)
        h = zero_future(F.leaky_relu(h, 0.01))
        return F.conv2d(h, self.conv2.weight, self.conv2.bias, padding=pad)
