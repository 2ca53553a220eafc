"""
How an attention layer turns its final logits (after the bias and DAPE's f) into weights over the values:
softmax, or stick-breaking (Tan et al., ICLR 2025), either after log-length scaling of the logits (s log n,
n the keys a query sees: SSMax, Nakanishi 2025). model.py's SelfAttention holds one Normalisation and mixes
the values with what it gives; DAPE acts before it (dape.py), so every encoding, with or without DAPE, runs
under every normalisation.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from positional import real

ATTNS = ("softmax", "stickbreaking")
LOGN_SCALES = ("none", "fixed", "learned")


def stick_breaking(logits, future, current=False):
    """Stick-breaking attention's weights (Tan et al., ICLR 2025) from the logits z [B, H, R, Tk] of R queries
    (anything, -inf included, where `future` [R, Tk] is True: keys after the query; the keys are the
    sequence's 0..Tk-1). Query i breaks a stick of length 1 from its nearest visible key back to the first:
    key j takes the share beta_ij = sigmoid(z_ij) of what is left of the stick when it gets there,

        weight_ij = beta_ij * prod over visible l > j of (1 - beta_il),

    the visible keys being j < i, or j <= i with `current` (flash-linear-attention's attend_current).
    Returns (weight [B, H, R, Tk], rem [B, H, R]): rem_i = prod over visible l of (1 - beta_il) is the stick
    left over, 1 - sum_j weight_ij. In log space, float32 (float64 for float64 logits), as
    flash-linear-attention's naive_stickbreaking_attn: log(1 - sigmoid(z)) = logsigmoid(-z), and the product
    over the keys after j a reverse cumulative sum."""
    # without the current key: j >= i exactly where key j + 1 is in the future (and the last key, as i < Tk)
    hidden = future if current else F.pad(future[:, 1:], (0, 1), value=True)
    z = real(logits)
    log_keep = F.logsigmoid(-z).masked_fill(hidden, 0.0)  # log(1 - beta); a hidden key leaves the stick whole
    # log of the stick that reaches key j: the keys after it, as a sum from the last key back, less j's own term
    reaches = log_keep.flip(-1).cumsum(-1).flip(-1) - log_keep
    weights = (F.logsigmoid(z) + reaches).exp().masked_fill(hidden, 0.0)
    return weights, log_keep.sum(-1).exp()


def check(config, fail):
    """GPTConfig's checks of the normalisation options; fail(message) raises."""
    if config.attn not in ATTNS:
        fail(f"unknown attn={config.attn!r}; choose one of {', '.join(ATTNS)}")
    if config.attn == "stickbreaking" and not config.causal:
        fail("attn=stickbreaking is defined for causal attention only (the stick breaks from the query back "
             "to the first key); use causal=True or attn=softmax")
    if config.sb_current and config.attn != "stickbreaking":
        fail(f"sb_current has no effect with attn={config.attn!r}; it is stick-breaking's (attn=stickbreaking)")
    if config.logn_scale not in LOGN_SCALES:
        fail(f"unknown logn_scale={config.logn_scale!r}; choose one of {', '.join(LOGN_SCALES)}")


def describe(config):
    """What takes the place of softmax(logits) in config's attention, in words; None: softmax alone (DAPE's
    fused kernel computes nothing else, dape_paths.py)."""
    parts = (["stick-breaking attention"] if config.attn == "stickbreaking" else []) + \
        (["log-length scaling of the logits"] if config.logn_scale != "none" else [])
    return " with ".join(parts) or None


class Normalisation(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.causal = config.causal
        self.stickbreaking, self.sb_current = config.attn == "stickbreaking", config.sb_current
        self.what = describe(config)
        # log-length scaling's s per head (SSMax's s), learned or fixed; s_h log(n) = 1 at the last query of the
        # training length, so that the logits there are as without scaling
        n = self.keys_seen(torch.tensor([config.block_size - 1]), config.block_size).clamp(min=2)
        s = torch.full((config.n_head,), 1.0 / math.log(n.item()))
        if config.logn_scale == "learned":
            self.logn_s = nn.Parameter(s)
        else:
            self.register_buffer("logn_s", s if config.logn_scale == "fixed" else None, persistent=False)

    def forward(self, logits, qi, future):
        """The attention weights [B, H, R, Tk] of the queries at sequence indices qi from their final logits
        [B, H, R, Tk] (-inf or anything where future [R, Tk] is True): scaled by s log(n) with logn_scale, then
        softmax or stick-breaking; and the stick left over [B, H, R] where it goes to the query's own value
        (stick-breaking without sb_current), else None."""
        if self.logn_s is not None:
            if future is not None:  # -inf times a learned scale would put NaN in the scale's gradient
                logits = logits.masked_fill(future, 0.0)
            logits = logits * self.logn_factor(qi, logits.shape[-1])
        if self.stickbreaking:
            weights, rem = stick_breaking(logits, future, self.sb_current)
            return weights, None if self.sb_current else rem  # with sb_current the rest goes nowhere
        if future is not None:
            logits = logits.masked_fill(future, float("-inf"))
        return F.softmax(logits, dim=-1), None

    def keys_seen(self, qi, Tk):
        """n_i, the keys that the queries at sequence indices qi see among Tk: all of them bidirectionally;
        causally keys 0..i, or 0..i-1 where stick-breaking gives the query's own key no share."""
        if not self.causal:
            return torch.full_like(qi, Tk)
        return qi + (0 if self.stickbreaking and not self.sb_current else 1)

    def logn_factor(self, qi, Tk):
        """c_i = s_h log(n_i), [H, R, 1] float32, for the queries at sequence indices qi (their index in the
        whole sequence, so that a KV cache and query blocks give each query its own n). n is taken as at
        least 2: with one key softmax gives it 1 whatever the scale, and stick-breaking with a zero logit
        would give it half the stick whatever its logit."""
        n = self.keys_seen(qi, Tk).clamp(min=2).float()
        return self.logn_s.float()[:, None, None] * n.log()[:, None]
