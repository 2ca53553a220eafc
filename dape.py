"""
DAPE: data-adaptive positional encoding (Zheng et al., NeurIPS 2024).

Shapes: B batch, H heads, Tq and Tk query and key lengths, C channels of f's input (H or 2H), D f's
hidden width, k V2's kernel along the key axis.

The pre-softmax logits of a layer become A + bias + f(A, bias), where A = q.k/sqrt(hs) are the logits
of all H heads and `bias` the positional bias of all H heads (the paper's B), and f a small network that
mixes the channels of every (query, key) pair into H new ones:

    DAPEV1  f is an MLP applied independently at each (i, j)              (paper eq. 2/3, Appendix J)
    DAPEV2  f is two (1, k) convolutions along the key axis of each row   (DAPE V2, "1xk")

What runs. This file is the definition, and an edit of it (anything but comments and docstrings) runs these
lines exactly: f, residual_f and finish on blocks of query rows, each against only the keys those rows see
(dape_torch.own_code), so an edited f trains at about the unedited speed. An f may mix the keys of a row (V2)
but must not let a key after a query change that query's logits (V2 zeroes the future before each layer), as
causal attention requires. Unedited, faster re-derivations of the same function from weights() run instead:
dape_torch.py's tiles on the CPU, dape_triton.py's fused kernel on CUDA; so there a breakpoint or a print in f
is not hit. `--dape_impl=plain` (GPTConfig.dape_impl) runs these lines whatever the file holds. dape_paths.py
decides by the code as it is in memory, and says once where an edit sends a module to these lines.

Variants (`dape_variant`), for an encoding with a bias:
    concat_residual   A + bias + f(cat(A, bias))   (default; eq. 3, Appendix J)
    concat            A + f(cat(A, bias))          (eq. 2)
    add_residual      A + bias + f(A + bias)       (Fig. 5)
    bias_only         A + bias + f(bias)           (ablation: no semantic input)
For an encoding without a bias (nope, rope, learned, sinusoidal, cope) it is A + f(A).

Initialisation (`dape_init`): "default" leaves f as PyTorch initialises its layers (the released code's), so
that from step 0 f adds to every head a random mix of all heads' logits and biases; "zero" zeroes f's
output layer (init_last_layer), so that f = 0 and DAPE-X computes X at step 0 (with `concat`, A alone) and
learns f from there, as LoRA's B = 0 and ReZero do. docs/dape_init.md measures both.

`future` is the causal mask [Tq, Tk] (True where key j is after query i) or None (bidirectional). f
never sees -inf: the caller masks after f, or asks forward(..., mask_future=True) for the masked logits
directly (what attention uses). V2 zeroes the future before each convolution, so that a row's result is
the same whatever number of future columns the map happens to have (prefix consistency).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

VARIANTS = ("concat_residual", "concat", "add_residual", "bias_only")
INITS = ("default", "zero")
SLOPE = 0.01  # LeakyReLU's negative slope (PyTorch's default, as in Appendix J)


def dape_in_channels(n_head, variant, has_bias):
    return 2 * n_head if has_bias and variant in ("concat_residual", "concat") else n_head


class _DAPE(nn.Module):
    """The variant logic shared by V1 and V2; subclasses define f."""

    kernel = 1  # taps along the key axis (V2's k)
    slope = SLOPE
    zero_future = False  # V2: zero the future before each layer

    def __init__(self, n_head, width, variant, has_bias, init):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"dape_variant must be one of {VARIANTS}, got {variant!r}")
        if init not in INITS:
            raise ValueError(f"dape_init must be one of {INITS}, got {init!r}")
        self.n_head, self.width, self.variant, self.has_bias, self.init = n_head, width, variant, has_bias, init
        self.in_channels = dape_in_channels(n_head, variant, has_bias)

    def forward(self, A, bias, future=None, mask_future=False, residual_f=None):
        """A: [B, H, Tq, Tk]; bias: [H, Tq, Tk], [1 or B, H, Tq, Tk] or None. Returns the logits
        [B, H, Tq, Tk]; with mask_future, the same logits with -inf where future is True. residual_f:
        another implementation of self.residual_f (dape_torch.py's), which the variants then feed."""
        return self._run(A, bias, future, "masked" if mask_future and future is not None else "logits", residual_f)

    def probs(self, A, bias, future=None, residual_f=None):
        """softmax(forward(A, bias, future, mask_future=True), dim=-1): the attention probabilities."""
        return self._run(A, bias, future, "probs", residual_f)

    def _run(self, A, bias, future, out, residual_f=None):
        residual_f = residual_f or self.residual_f
        if bias is not None and bias.dim() == 4 and bias.shape[0] == 1:
            bias = bias[0]  # one map for the whole batch
        if bias is None:
            x, y, res_y = A, None, False  # A + f(A)
        elif self.variant == "concat_residual":
            x, y, res_y = A, bias, True  # A + bias + f(A, bias)
        elif self.variant == "concat":
            x, y, res_y = A, bias, False  # A + f(A, bias)
        elif self.variant == "add_residual":
            x, y, res_y = A + bias, None, False  # S + f(S), S = A + bias
        else:  # bias_only: A + (bias + f(bias)), computed once for the batch when bias has no batch axis
            Bf = residual_f(bias if bias.dim() == 4 else bias[None], None, False, future, "logits")
            return finish(A + Bf, future, out)
        return residual_f(x, y, res_y, future, out)

    def residual_f(self, x, y, res_y, future, out):
        """x + (y if res_y) + f(cat(x, y)), then as `out` asks: "logits", "masked" or "probs".
        x: [B, C, Tq, Tk]; y: None, [C, Tq, Tk] (shared by the batch) or [B, C, Tq, Tk]."""
        X = x if y is None else torch.cat((x, y.expand(x.shape[0], *y.shape[-3:])), dim=1)
        logits = self.f(X, future) + (x + y if res_y else x)
        return finish(logits, future, out)

    def reset_parameters(self):
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        self.init_last_layer()

    def init_last_layer(self):
        """With init "zero", f's output layer (the last layer with parameters that __init__ registers) to zero,
        drawing no random numbers, so that a seed gives both inits the same weights elsewhere. An f that is not
        then zero is an error naming that layer."""
        if self.init != "zero":
            return
        name, last = [(n, m) for n, m in self.named_modules() if m is not self and list(m.parameters(False))][-1]
        with torch.no_grad():
            for p in last.parameters(False):
                p.zero_()
            p = next(self.parameters())
            if p.device.type == "meta":
                return
            X = torch.linspace(-3.0, 3.0, self.in_channels * 14, dtype=p.dtype, device=p.device)
            most = self.f(X.view(1, self.in_channels, 2, 7)).abs().max().item()
        if most != 0.0:
            raise ValueError(f"dape_init='zero' zeroed {name}, the last layer with parameters that "
                             f"{type(self).__name__} registers, but f is not zero at step 0 (max |f| {most:.2g}): "
                             f"register f's output layer last in __init__, or zero it in init_last_layer")


def finish(logits, future, out):
    """logits: a fresh map of the caller's (the residual sum), masked in place."""
    if out != "logits" and future is not None:
        logits = logits.masked_fill_(future, float("-inf"))
    return F.softmax(logits, dim=-1) if out == "probs" else logits


class DAPEV1(_DAPE):
    """f = Linear(C -> D) -> LeakyReLU -> Linear(D -> H) at every (i, j), as Appendix J's `mlp` (a
    Sequential); the released code's parameter names differ (docs/encodings.md)."""

    def __init__(self, n_head, width=32, variant="concat_residual", has_bias=True, init="default"):
        super().__init__(n_head, width, variant, has_bias, init)
        self.mlp = nn.Sequential(nn.Linear(self.in_channels, width), nn.LeakyReLU(SLOPE),
                                 nn.Linear(width, n_head))
        self.init_last_layer()

    def f(self, X, future=None):
        """X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: the MLP over the channels of each pair."""
        return rearrange(self.mlp(rearrange(X, "b c i j -> b i j c")), "b i j h -> b h i j")

    def weights(self):
        """(w1 [D, C, k], b1 [D], w2 [H, D, k], b2 [H]), the form the fast paths take, k = 1."""
        fc1, fc2 = self.mlp[0], self.mlp[2]
        return fc1.weight[:, :, None], fc1.bias, fc2.weight[:, :, None], fc2.bias


class DAPEV2(_DAPE):
    """f = Conv2d(C -> D, (1, k)) -> LeakyReLU -> Conv2d(D -> H, (1, k)): each (i, j) also sees its
    k - 1 neighbouring keys in the same query row, across all heads."""

    zero_future = True

    def __init__(self, n_head, width=32, kernel=3, variant="concat_residual", has_bias=True, init="default"):
        super().__init__(n_head, width, variant, has_bias, init)
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"dape_kernel must be a positive odd number (the conv is centred), got {kernel}")
        self.kernel = kernel
        self.conv1 = nn.Conv2d(self.in_channels, width, (1, kernel), padding=(0, kernel // 2))
        self.act = nn.LeakyReLU(SLOPE)
        self.conv2 = nn.Conv2d(width, n_head, (1, kernel), padding=(0, kernel // 2))
        self.init_last_layer()

    def f(self, X, future=None):
        """X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: two (1, k) convolutions along each row, with the future
        zeroed before each."""
        zero = (lambda t: t.masked_fill(future, 0.0)) if future is not None else (lambda t: t)
        return self.conv2(zero(self.act(self.conv1(zero(X)))))

    def weights(self):
        """(w1 [D, C, k], b1 [D], w2 [H, D, k], b2 [H]), the form the fast paths take."""
        return self.conv1.weight[:, :, 0], self.conv1.bias, self.conv2.weight[:, :, 0], self.conv2.bias
