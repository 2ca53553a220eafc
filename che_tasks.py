"""
The Chomsky Hierarchy Evaluation (CHE) benchmark: the DAPE paper's Table 2 / Appendix D.

Two halves, readable top to bottom:
1) Task generators. 15 tasks (Deletang et al., ICLR 2023), token ids as in the reference suite so
   samples can be compared with it. Each task is a `CHETask` with its input vocabulary, output
   vocabulary, output length as a function of N and `sample(batch_size, length, rng)` returning
   numpy int64 inputs [B, n_in], targets [B, |y|] and a bool accuracy mask [B, |y|].
   Semantics: ../shared/specs/che.md (see also the docstrings below).
2) A runner (protocol of Ruoss et al., ACL 2023): train the bidirectional encoder of model.py
   (causal=False) on N ~ U{1..40}, evaluate at lengths above 40 (the paper: every N in 41..500;
   the CPU default: 41..100, every 5th), report the mean per-length accuracy next to the
   random-guess baseline. Single runs, a tasks x encodings grid printed as
   the paper's Table 2, JSON results and a per-length accuracy plot.

$ python che_tasks.py --task=reverse_string --pos=kerple --dape=v1         # CPU smoke run
$ python che_tasks.py config/che_paper.py --task=reverse_string --pos=fire --dape=v1   # paper scale
$ python che_tasks.py --grid=True                                           # Table 2 (smoke scale)
"""
import math
import os
import sys
import json
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

# -----------------------------------------------------------------------------
# generators. Every one is vectorised over the batch with numpy; where an answer needs
# arbitrary precision (binary addition/multiplication, square roots of 500-bit numbers) the bits are
# sampled and laid out with numpy and only the per-row big-integer arithmetic is Python ints.

MOD = 5  # modulus of the arithmetic tasks and length of the navigation cycle
TERMINATOR = 2  # ends the result in the targets of the masked tasks (stack, binary add/multiply)


def _bits(rng, B, N):
    return rng.integers(0, 2, size=(B, N), dtype=np.int64)


def _nonzero_bits(rng, widths, N):
    """[B, N] little-endian bit rows, row b uniform over the nonzero numbers of widths[b] bits
    (zeros beyond the width). Rejection sampling: redraw the all-zero rows."""
    B = len(widths)
    inside = np.arange(N)[None, :] < widths[:, None]
    bits = _bits(rng, B, N) * inside
    bad = ~bits.any(axis=1)
    while bad.any():
        bits[bad] = _bits(rng, int(bad.sum()), N) * inside[bad]
        bad = ~bits.any(axis=1)
    return bits


def _bits_to_ints(bits):
    """Little-endian bit rows [B, N] -> list of Python ints (any width)."""
    packed = np.packbits(bits.astype(np.uint8), axis=1, bitorder='little')
    return [int.from_bytes(row.tobytes(), 'little') for row in packed]


def _ints_to_bits(values, width):
    """Python ints -> ([B, width] little-endian bits, [B] minimal lengths). The minimal binary of 0
    is the single digit '0', as in the reference suite (f'{0:b}' == '0')."""
    nbytes = max(1, (max(max(v.bit_length() for v in values), width) + 7) // 8)
    raw = np.frombuffer(b''.join(v.to_bytes(nbytes, 'little') for v in values), dtype=np.uint8)
    bits = np.unpackbits(raw.reshape(len(values), nbytes), axis=1, bitorder='little')
    lengths = np.array([max(1, v.bit_length()) for v in values], dtype=np.int64)
    return bits[:, :width].astype(np.int64), lengths


def _terminated(bits, lengths, out_len, terminator=TERMINATOR):
    """Result bits, then the terminator, then zeros, to out_len tokens."""
    j = np.arange(out_len)[None, :]
    L = lengths[:, None]
    padded = np.zeros((bits.shape[0], out_len), dtype=np.int64)
    w = min(out_len, bits.shape[1])
    padded[:, :w] = bits[:, :w]
    return np.where(j < L, padded, np.where(j == L, terminator, 0))


# --- regular -----------------------------------------------------------------

def even_pairs(B, N, rng):
    """Random bits; label 1 iff the number of unequal neighbours is odd, i.e. s_0 != s_{N-1}."""
    x = _bits(rng, B, N)
    return x, (x[:, :1] != x[:, -1:]).astype(np.int64)


MAS_PLUS, MAS_MINUS, MAS_TIMES = 5, 6, 7  # id 8 ('_' in the reference) exists, never sampled


def modular_arithmetic_simple(B, N, rng):
    """Digits 0-4 and operators + - * alternating, no brackets, usual precedence, result mod 5.
    The reference needs an odd length: an even N produces N-1 input tokens."""
    n = N if N % 2 == 1 else N - 1
    k = n // 2 + 1  # number of digits
    digits = rng.integers(0, MOD, size=(B, k), dtype=np.int64)
    ops = rng.integers(0, 3, size=(B, k - 1), dtype=np.int64) + MAS_PLUS
    x = np.empty((B, n), dtype=np.int64)
    x[:, 0::2] = digits
    x[:, 1::2] = ops
    # left to right: `term` is the running product, flushed into `total` (with the sign of the
    # +/- before it) when the next + or - arrives; * binds tighter so it only grows the term
    total = np.zeros(B, dtype=np.int64)
    sign = np.ones(B, dtype=np.int64)
    term = digits[:, 0].copy()
    for i in range(k - 1):
        op, d = ops[:, i], digits[:, i + 1]
        times = op == MAS_TIMES
        total = np.where(times, total, (total + sign * term) % MOD)
        sign = np.where(times, sign, np.where(op == MAS_PLUS, 1, -1))
        term = np.where(times, term * d, d) % MOD
    y = (total + sign * term) % MOD
    return x, y[:, None]


def parity_check(B, N, rng):
    """Random bits; label = number of ones mod 2."""
    x = _bits(rng, B, N)
    return x, (x.sum(axis=1, keepdims=True) % 2)


def cycle_navigation(B, N, rng):
    """Token t in {0,1,2} moves t-1 (left, stay, right) on a cycle of 5 from 0; label = final
    position."""
    x = rng.integers(0, 3, size=(B, N), dtype=np.int64)
    return x, ((x - 1).sum(axis=1, keepdims=True) % MOD)


# --- deterministic context-free ------------------------------------------------

STACK_POP, STACK_PUSH0, STACK_PUSH1, STACK_END = 2, 3, 4, TERMINATOR


def stack_manipulation(B, N, rng):
    """An initial stack of k ~ U[1, N-1] bits (bottom to top), then N-k actions POP / PUSH 0 /
    PUSH 1 (POP on an empty stack is a no-op). Target: the final stack top to bottom, a terminator,
    zeros to N+1. N = 1: one bit b, target [b, terminator]."""
    if N == 1:
        b = _bits(rng, B, 1)
        return b, np.concatenate([b, np.full((B, 1), STACK_END)], axis=1)
    k = rng.integers(1, N, size=B)
    pos = np.arange(N)[None, :]
    x = np.where(pos < k[:, None], _bits(rng, B, N),
                 rng.integers(STACK_POP, STACK_PUSH1 + 1, size=(B, N), dtype=np.int64))
    # simulate all B stacks at once: stack[b, :height[b]] is stack b, bottom first
    stack = np.zeros((B, N + 1), dtype=np.int64)
    height = np.zeros(B, dtype=np.int64)
    rows = np.arange(B)
    for t in range(N):
        tok, initial = x[:, t], t < k
        push = initial | (tok >= STACK_PUSH0)
        value = np.where(initial, tok, tok - STACK_PUSH0)
        stack[rows[push], height[push]] = value[push]
        pop = ~initial & (tok == STACK_POP) & (height > 0)
        height = height + push - pop
    j = np.arange(N + 1)[None, :]
    top_down = stack[rows[:, None], np.clip(height[:, None] - 1 - j, 0, None)]
    y = np.where(j < height[:, None], top_down, np.where(j == height[:, None], STACK_END, 0))
    return x, y


def reverse_string(B, N, rng):
    """Random bits; target = the string reversed."""
    x = _bits(rng, B, N)
    return x, x[:, ::-1].copy()


def _bracket_expressions(B, L, rng, ops, plus, minus, times, lpar, rpar):
    """B random bracketed expressions of exactly L >= 1 tokens and their values mod 5:
    L=1 `d`, L=2 `-d`, L=3 `(d)`, L=4 `(-d)`, L>=5 `(A op B)` with |A| ~ U[1, L-4],
    |B| = L-3-|A|, op uniform over `ops`. Vectorised over the batch: the recursion is unrolled
    level by level (a frontier of segments of all B samples at once) while writing the tokens, and
    the values are then combined bottom up over the recorded levels."""
    x = np.zeros((B, L), dtype=np.int64)
    value = np.zeros(2 * B * L, dtype=np.int64)  # one slot per tree node; B*(2*leaves-1) < 2BL
    seg_b, seg_s = np.arange(B), np.zeros(B, dtype=np.int64)
    seg_len, seg_id = np.full(B, L, dtype=np.int64), np.arange(B)
    next_id, levels = B, []
    while len(seg_b):
        leaf = seg_len <= 4
        # leaves: d, -d, (d), (-d)
        b, s, n, i = seg_b[leaf], seg_s[leaf], seg_len[leaf], seg_id[leaf]
        d = rng.integers(0, MOD, size=len(b), dtype=np.int64)
        neg, par = (n == 2) | (n == 4), n >= 3
        value[i] = np.where(neg, -d, d) % MOD
        x[b, s + par + neg] = d
        x[b[neg], (s + par)[neg]] = minus
        x[b[par], s[par]] = lpar
        x[b[par], (s + n - 1)[par]] = rpar
        # internal nodes: ( A op B )
        b, s, n, i = seg_b[~leaf], seg_s[~leaf], seg_len[~leaf], seg_id[~leaf]
        m = len(b)
        left = rng.integers(1, n - 3) if m else np.zeros(0, dtype=np.int64)  # U[1, n-4]
        right = n - 3 - left
        op = np.asarray(ops)[rng.integers(0, len(ops), size=m)]
        x[b, s] = lpar
        x[b, s + 1 + left] = op
        x[b, s + n - 1] = rpar
        left_id, right_id = next_id + np.arange(m), next_id + m + np.arange(m)
        next_id += 2 * m
        levels.append((i, left_id, right_id, op))
        seg_b = np.concatenate([b, b])
        seg_s = np.concatenate([s + 1, s + 2 + left])
        seg_len = np.concatenate([left, right])
        seg_id = np.concatenate([left_id, right_id])
    for i, left_id, right_id, op in reversed(levels):
        a, c = value[left_id], value[right_id]
        value[i] = np.where(op == plus, a + c, np.where(op == minus, a - c, a * c)) % MOD
    return x, value[:B]


MA_PLUS, MA_MINUS, MA_TIMES, MA_LPAR, MA_RPAR = 5, 6, 7, 8, 9  # input width 11 (10 = x, unused)


def modular_arithmetic(B, N, rng):
    """A random bracketed expression over digits 0-4 and + - * of exactly N tokens; value mod 5."""
    x, v = _bracket_expressions(B, N, rng, (MA_PLUS, MA_MINUS, MA_TIMES),
                                MA_PLUS, MA_MINUS, MA_TIMES, MA_LPAR, MA_RPAR)
    return x, v[:, None]


SE_PLUS, SE_MINUS, SE_LPAR, SE_RPAR, SE_X, SE_EQ = 5, 6, 7, 8, 9, 10


def solve_equation(B, N, rng):
    """A bracketed +/- expression of N-2 tokens with one digit replaced by x, then `=` and its
    value mod 5; label = the replaced digit (unique: x enters with coefficient +-1). The digit is
    the first one at or after a uniform index, cyclically. N < 3: all-zero input, label 0."""
    if N < 3:
        return np.zeros((B, N), dtype=np.int64), np.zeros((B, 1), dtype=np.int64)
    L = N - 2
    expr, v = _bracket_expressions(B, L, rng, (SE_PLUS, SE_MINUS),
                                   SE_PLUS, SE_MINUS, -1, SE_LPAR, SE_RPAR)
    start = rng.integers(0, L, size=B)
    digit = expr < MOD
    at_or_after = digit & (np.arange(L)[None, :] >= start[:, None])
    pos = np.where(at_or_after.any(axis=1), at_or_after.argmax(axis=1), digit.argmax(axis=1))
    rows = np.arange(B)
    label = expr[rows, pos].copy()
    expr[rows, pos] = SE_X
    x = np.concatenate([expr, np.full((B, 1), SE_EQ), v[:, None]], axis=1)
    return x, label[:, None]


# --- context-sensitive ------------------------------------------------------------

def duplicate_string(B, N, rng):
    """Random bits s; target = s s."""
    x = _bits(rng, B, N)
    return x, np.concatenate([x, x], axis=1)


MD_HOLE, MD_PAD = 2, 3


def missing_duplicate(B, N, rng):
    """s of N//2 bits, d = s s with one uniform position replaced by the hole token, a pad token
    appended if N is odd; label = the missing bit. N = 1: input [1], label 1."""
    if N == 1:
        return np.ones((B, 1), dtype=np.int64), np.ones((B, 1), dtype=np.int64)
    s = _bits(rng, B, N // 2)
    d = np.concatenate([s, s], axis=1)
    pos = rng.integers(0, d.shape[1], size=B)
    rows = np.arange(B)
    label = d[rows, pos].copy()
    d[rows, pos] = MD_HOLE
    if N % 2:
        d = np.concatenate([d, np.full((B, 1), MD_PAD)], axis=1)
    return d, label[:, None]


def odds_first(B, N, rng):
    """Random bits s; target = s[1::2] + s[0::2] (odd positions first, 0-indexed)."""
    x = _bits(rng, B, N)
    return x, np.concatenate([x[:, 1::2], x[:, 0::2]], axis=1)


BIN_OP, BIN_END = 2, TERMINATOR  # the operator token in the input, the end of the target


def _binary_operation(B, N, rng, multiply):
    """Little-endian `n op m` with |n| ~ U[1, N-2], |m| = N-1-|n|, n and m uniform nonzero within
    their widths; target = the result in minimal little-endian bits, the terminator, zeros.
    Output length: N+1 for addition; N for multiplication (n*m has at most |n|+|m| = N-1 bits,
    plus the terminator). N <= 2 (no room for two numbers and the operator): the N bits of a
    random number < 2^N - 1; addition answers its minimal binary, multiplication N-1 zeros."""
    out_len = N if multiply else N + 1
    if N <= 2:
        v = rng.integers(0, 2 ** N - 1, size=B)
        x = ((v[:, None] >> np.arange(N)[None, :]) & 1).astype(np.int64)
        if multiply:
            res_bits, res_len = np.zeros((B, N), dtype=np.int64), np.full(B, N - 1)
        else:
            res_bits, res_len = _ints_to_bits([int(a) for a in v], out_len)
        return x, _terminated(res_bits, res_len, out_len, BIN_END)
    ln = rng.integers(1, N - 1, size=B)
    lm = N - 1 - ln
    nb, mb = _nonzero_bits(rng, ln, N), _nonzero_bits(rng, lm, N)
    rows, j = np.arange(B)[:, None], np.arange(N)[None, :]
    x = np.where(j < ln[:, None], nb,
                 np.where(j == ln[:, None], BIN_OP, mb[rows, np.clip(j - ln[:, None] - 1, 0, None)]))
    n, m = _bits_to_ints(nb), _bits_to_ints(mb)
    res = [a * c for a, c in zip(n, m)] if multiply else [a + c for a, c in zip(n, m)]
    res_bits, res_len = _ints_to_bits(res, out_len)
    return x, _terminated(res_bits, res_len, out_len, BIN_END)


def binary_addition(B, N, rng):
    return _binary_operation(B, N, rng, multiply=False)


def binary_multiplication(B, N, rng):
    return _binary_operation(B, N, rng, multiply=True)


def compute_sqrt(B, N, rng):
    """x ~ U[1, 2^N - 1] as N big-endian bits; target = floor(sqrt(x)) in big-endian bits,
    zero-padded (on the left) to ceil(N/2)."""
    out_len = (N + 1) // 2
    little = _nonzero_bits(rng, np.full(B, N), N)
    roots = [math.isqrt(v) for v in _bits_to_ints(little)]
    root_bits, _ = _ints_to_bits(roots, out_len)
    return little[:, ::-1].copy(), root_bits[:, ::-1].copy()


def bucket_sort(B, N, rng):
    """Tokens uniform over 0-4; target = sorted ascending."""
    x = rng.integers(0, 5, size=(B, N), dtype=np.int64)
    return x, np.sort(x, axis=1)


# -----------------------------------------------------------------------------
# the task registry

@dataclass(frozen=True)
class CHETask:
    name: str
    level: str                # R (regular), DCF (deterministic context-free), CS (context-sensitive)
    input_vocab: int          # input ids are 0..input_vocab-1; the placeholder id is input_vocab
    output_vocab: int
    out_len: Callable[[int], int]  # |y| as a function of N
    generate: Callable        # (B, N, rng) -> (x [B, n_in], y [B, |y|])
    masked: bool = False      # accuracy counts only up to and including the first TERMINATOR
    random_baseline: float = 0.5  # random-guess accuracy as reported in the literature

    def output_length(self, length):
        return self.out_len(length)

    def sample(self, batch_size, length, rng):
        """-> inputs int64 [B, n_in], targets int64 [B, |y|], accuracy mask bool [B, |y|].
        n_in = length except modular_arithmetic_simple at even length (length - 1)."""
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        x, y = self.generate(batch_size, length, rng)
        if self.masked:  # every masked target holds a terminator: argmax finds the first one
            end = (y == TERMINATOR).argmax(axis=1)
            mask = np.arange(y.shape[1])[None, :] <= end[:, None]
        else:
            mask = np.ones(y.shape, dtype=bool)
        return x.astype(np.int64), y.astype(np.int64), mask


_one = lambda N: 1
TASKS = {t.name: t for t in [
    # the 14 tasks of the DAPE paper's Table 2, in its order, then binary_multiplication
    CHETask('even_pairs', 'R', 2, 2, _one, even_pairs),
    CHETask('modular_arithmetic_simple', 'R', 9, 5, _one, modular_arithmetic_simple,
            random_baseline=0.2),
    CHETask('parity_check', 'R', 2, 2, _one, parity_check),
    CHETask('cycle_navigation', 'R', 3, 5, _one, cycle_navigation, random_baseline=0.2),
    CHETask('stack_manipulation', 'DCF', 5, 3, lambda N: N + 1, stack_manipulation, masked=True),
    CHETask('reverse_string', 'DCF', 2, 2, lambda N: N, reverse_string),
    CHETask('modular_arithmetic', 'DCF', 11, 5, _one, modular_arithmetic, random_baseline=0.2),
    CHETask('solve_equation', 'DCF', 11, 5, _one, solve_equation, random_baseline=0.2),
    CHETask('duplicate_string', 'CS', 2, 2, lambda N: 2 * N, duplicate_string),
    CHETask('missing_duplicate', 'CS', 4, 2, _one, missing_duplicate),
    CHETask('odds_first', 'CS', 2, 2, lambda N: N, odds_first),
    CHETask('binary_addition', 'CS', 3, 3, lambda N: N + 1, binary_addition, masked=True),
    CHETask('compute_sqrt', 'CS', 2, 2, lambda N: (N + 1) // 2, compute_sqrt),
    CHETask('bucket_sort', 'CS', 5, 5, lambda N: N, bucket_sort, random_baseline=0.2),
    CHETask('binary_multiplication', 'CS', 3, 3, lambda N: N, binary_multiplication, masked=True),
]}
TABLE2_TASKS = list(TASKS)[:14]


def get_task(name):
    if name not in TASKS:
        raise ValueError(f"unknown CHE task {name!r}; choose from: {', '.join(TASKS)}")
    return TASKS[name]


def make_batch(task, batch_size, length, rng):
    """The encoder framing: |y| placeholder tokens (id = input vocab size) appended to the input;
    training targets are -1 (ignored) except at the last |y| positions.
    -> idx [B, n_in+|y|], targets [B, n_in+|y|], y [B, |y|], mask [B, |y|] (numpy int64/bool)."""
    x, y, mask = task.sample(batch_size, length, rng)
    B, n_out = y.shape
    idx = np.concatenate([x, np.full((B, n_out), task.input_vocab, dtype=np.int64)], axis=1)
    targets = np.concatenate([np.full(x.shape, -1, dtype=np.int64), y], axis=1)
    return idx, targets, y, mask


def max_sequence_length(task, max_len):
    """Longest framed sequence (inputs + placeholders) for N in 1..max_len."""
    return max(task.sample(1, N, np.random.default_rng(0))[0].shape[1] + task.output_length(N)
               for N in range(1, max_len + 1))


# -----------------------------------------------------------------------------
# the DAPE paper's Table 2 (accuracy %, test lengths 41-500, max over seeds and learning rates),
# printed beside our own table for comparison. Columns: (pos, dape).
PAPER_TABLE2_COLUMNS = [('alibi', 'none'), ('kerple', 'none'), ('fire', 'none'),
                        ('alibi', 'v1'), ('kerple', 'v1'), ('fire', 'v1')]
PAPER_TABLE2 = {
    'even_pairs': [73.52, 57.50, 73.86, 99.99, 99.58, 100],
    'modular_arithmetic_simple': [20.02, 21.79, 21.09, 23.58, 24.47, 24.46],
    'parity_check': [50.09, 50.07, 50.97, 50.30, 50.07, 50.04],
    'cycle_navigation': [24.64, 29.47, 28.41, 22.99, 34.53, 27.54],
    'stack_manipulation': [66.42, 66.93, 69.33, 68.18, 72.04, 70.90],
    'reverse_string': [71.09, 71.54, 65.89, 73.37, 70.74, 76.40],
    'modular_arithmetic': [30.56, 24.79, 30.92, 31.34, 32.37, 31.50],
    'solve_equation': [19.92, 21.15, 22.06, 20.03, 22.49, 22.42],
    'duplicate_string': [65.13, 66.72, 69.03, 70.84, 72.95, 72.71],
    'missing_duplicate': [74.21, 79.06, 79.27, 83.41, 87.57, 89.17],
    'odds_first': [59.88, 62.59, 63.28, 63.78, 67.08, 66.34],
    'binary_addition': [54.72, 56.35, 55.70, 59.71, 60.88, 56.62],
    'compute_sqrt': [50.63, 51.11, 50.80, 51.64, 51.33, 52.46],
    'bucket_sort': [98.45, 99.38, 99.57, 99.38, 98.81, 99.37],
}
POS_NAMES = {'nope': 'NoPE', 'learned': 'Learned', 'sinusoidal': 'Sinusoidal', 'rope': 'RoPE',
             't5': 'T5', 'alibi': 'ALiBi', 'kerple': 'Kerple', 'kerple_power': 'Kerple-power',
             'fire': 'FIRE', 'cope': 'CoPE', 'xl': 'XL'}


def encoding_label(pos, dape):
    name = POS_NAMES.get(pos, pos)
    return name if dape == 'none' else f"{'DAPE' if dape == 'v1' else 'DAPEv2'}-{name}"


# -----------------------------------------------------------------------------
# runner: model, training, evaluation

def model_block_size(task, train_max_len):
    """block_size = the longest framed training sequence (N = train_max_len plus its |y|
    placeholders): the training range. It sizes `learned` (which cannot run past it unless trained
    with randomized positions, whose table then has rand_pos_max rows) and FIRE's L0; the relative
    encodings run at any length."""
    return max_sequence_length(task, train_max_len)


def build_model(task, cfg, config_only=False):
    from model import GPT, GPTConfig
    from positional import ENCODINGS
    # randomized positions change nothing for an encoding that ignores positions (nope), and
    # GPTConfig refuses the combination: switch them off there rather than fail a grid cell
    uses_positions = cfg['pos'] not in ENCODINGS or ENCODINGS[cfg['pos']].uses_positions
    rand_pos = cfg['rand_pos'] and uses_positions  # (an unknown pos is left to GPTConfig to reject)
    # the head is a Linear of its own, as in the reference suite: tied to the embedding, output class c
    # would share its weights with input token c
    gcfg = GPTConfig(block_size=model_block_size(task, cfg['train_max_len']),
                     vocab_size=max(task.input_vocab + 1, task.output_vocab),
                     n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'],
                     dropout=cfg['dropout'], bias=cfg['bias'], pos=cfg['pos'], dape=cfg['dape'],
                     dape_variant=cfg['dape_variant'], dape_width=cfg['dape_width'],
                     dape_kernel=cfg['dape_kernel'], causal=False, tie_weights=False, rand_pos=rand_pos,
                     rand_pos_max=cfg['rand_pos_max'] if rand_pos else 0,
                     rand_pos_eval=rand_pos and cfg['rand_pos_eval'])
    return gcfg if config_only else GPT(gcfg)


def output_loss_and_correct(model, task, idx, targets, y, mask, autocast):
    """Cross-entropy over the output vocabulary at the last |y| positions (mean over batch and
    positions), and the per-token correctness [B, |y|] of the argmax prediction."""
    import torch
    import torch.nn.functional as F
    with autocast:
        logits, _ = model(idx, targets)
    out = logits[:, -y.shape[1]:, :task.output_vocab].float()
    loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    return loss, (out.argmax(-1) == y)


def _to_device(arrays, device):
    import torch
    return [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]


def train(model, task, cfg, device, autocast, log=print):
    """Adam at a constant learning rate, gradient clipping; each step one N ~ U{1..train_max_len}
    for the whole batch. model.train() makes the model draw randomized positions (cfg rand_pos)."""
    import torch
    rng = np.random.default_rng(cfg['seed'])
    opt = torch.optim.Adam(model.parameters(), lr=cfg['learning_rate'])
    model.train()
    t0, hist = time.time(), []
    for step in range(1, cfg['max_iters'] + 1):
        N = int(rng.integers(1, cfg['train_max_len'] + 1))
        idx, targets, y, mask = _to_device(make_batch(task, cfg['batch_size'], N, rng), device)
        loss, correct = output_loss_and_correct(model, task, idx, targets, y, mask, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg['grad_clip'] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        opt.step()
        hist.append((loss.item(), (correct & mask).sum().item() / mask.sum().item()))
        if step % cfg['log_interval'] == 0 or step == cfg['max_iters']:
            recent = hist[-cfg['log_interval']:]
            log(f"  step {step}/{cfg['max_iters']}: loss {np.mean([h[0] for h in recent]):.4f}, "
                f"train acc {100 * np.mean([h[1] for h in recent]):.2f}%, {time.time() - t0:.1f}s")
    recent = hist[-cfg['log_interval']:]
    return {'steps': cfg['max_iters'], 'time_s': time.time() - t0,
            'final_loss': float(np.mean([h[0] for h in recent])),
            'final_train_acc': float(np.mean([h[1] for h in recent]))}


def evaluate(model, task, lengths, cfg, device, autocast, log=print):
    """Token-weighted masked accuracy at every N in lengths on fresh samples; positions drawn at
    random as in training (cfg rand_pos_eval, the reference suite's protocol) or 0..T-1.
    Stops at the first length the model cannot serve (`learned` past its table: ValueError) and
    returns (per-length accuracies, error message or None)."""
    import torch
    rng = np.random.default_rng(cfg['seed'] + 1_000_003)  # eval samples never seen in training
    model.eval()
    accs, t0 = {}, time.time()
    with torch.no_grad():
        for i, N in enumerate(lengths):
            right = total = 0
            for start in range(0, cfg['eval_samples'], cfg['eval_batch_size']):
                B = min(cfg['eval_batch_size'], cfg['eval_samples'] - start)
                idx, targets, y, mask = _to_device(make_batch(task, B, N, rng), device)
                try:
                    _, correct = output_loss_and_correct(model, task, idx, targets, y, mask, autocast)
                except ValueError as e:
                    log(f"  N={N} (sequence length {idx.shape[1]}): not servable: {e}")
                    return accs, f"N={N} (sequence length {idx.shape[1]}): {e}"
                right += (correct & mask).sum().item()
                total += mask.sum().item()
            accs[N] = right / total
            if (i + 1) % max(1, len(lengths) // 10) == 0 or i + 1 == len(lengths):
                log(f"  eval N={N}: acc {100 * accs[N]:.2f}% ({i + 1}/{len(lengths)} lengths, "
                    f"{time.time() - t0:.1f}s)")
    return accs, None


def eval_lengths(cfg):
    return list(range(cfg['eval_min_len'], cfg['eval_max_len'] + 1, cfg['eval_stride']))


def _device_and_autocast(cfg):
    import contextlib
    import torch
    device = cfg['device']
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    dtype = cfg['dtype']
    if dtype == 'auto':
        dtype = 'bfloat16' if device.startswith('cuda') and torch.cuda.is_bf16_supported() else 'float32'
    if dtype == 'float32':
        return device, dtype, contextlib.nullcontext()
    dt = {'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    return device, dtype, torch.autocast(device_type=device.split(':')[0], dtype=dt)


def run_one(cfg, log=print):
    """Train and evaluate one (task, pos, dape) cell. -> result dict (also written as JSON)."""
    import torch
    task = get_task(cfg['task'])
    device, dtype, autocast = _device_and_autocast(cfg)
    torch.manual_seed(cfg['seed'])
    label = encoding_label(cfg['pos'], cfg['dape'])
    result = {'task': task.name, 'level': task.level, 'pos': cfg['pos'], 'dape': cfg['dape'],
              'encoding': label, 'random_baseline': 100 * task.random_baseline,
              'device': device, 'dtype': dtype, 'config': dict(cfg)}
    log(f"== {task.name} | {label} (pos={cfg['pos']}, dape={cfg['dape']}) on {device} ({dtype})")
    model = build_model(task, cfg).to(device)
    result['n_params'] = sum(p.numel() for p in model.parameters())
    result['block_size'] = model.config.block_size
    result['rand_pos'], result['rand_pos_eval'] = model.config.rand_pos, model.config.rand_pos_eval
    if cfg['compile']:
        model = torch.compile(model, dynamic=True)
    result['train'] = train(model, task, cfg, device, autocast, log)
    lengths = eval_lengths(cfg)
    t0 = time.time()
    accs, error = evaluate(model, task, lengths, cfg, device, autocast, log)
    result['eval_time_s'] = time.time() - t0
    result['per_length'] = {str(N): 100 * a for N, a in accs.items()}
    result['servable'] = error is None
    result['error'] = error
    # the score is the mean over every evaluated length; a model that cannot run at some of them
    # has no score (the table says "n/s") rather than a mean over the lengths it happened to reach
    result['score'] = float(np.mean(list(accs.values()))) * 100 if error is None else None
    score = 'n/s (not servable)' if result['score'] is None else f"{result['score']:.2f}%"
    log(f"== {task.name} | {label}: score {score} over N={lengths[0]}..{lengths[-1]}"
        f" (random {result['random_baseline']:.0f}%)")
    if cfg['out_dir']:
        os.makedirs(cfg['out_dir'], exist_ok=True)
        stem = os.path.join(cfg['out_dir'], f"{task.name}_{cfg['pos']}_{cfg['dape']}")
        _write_json(stem + '.json', result)
        if cfg['plot']:
            plot_per_length({label: result}, task, stem + '.png', cfg)
    return result


def _fmt(score):
    return 'n/s' if score is None else f"{score:.2f}"


def _write_json(path, obj):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plot_per_length(results, task, path, cfg):
    """Accuracy against test length, one line per encoding, the random-guess level dashed."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        if r.get('per_length'):
            Ns = sorted(int(n) for n in r['per_length'])
            ax.plot(Ns, [r['per_length'][str(n)] for n in Ns],
                    label=f"{label} ({_fmt(r.get('score'))})", lw=1.2)
    ax.axhline(100 * task.random_baseline, color='gray', ls='--', lw=1, label='random')
    ax.set_xlabel(f"test length N (trained on 1..{cfg['train_max_len']})")
    ax.set_ylabel('accuracy (%)')
    ax.set_ylim(0, 101)
    ax.set_title(f"CHE {task.name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _split(s):
    return [v.strip() for v in s.split(',') if v.strip()]


def resolve_tasks(spec):
    if spec == 'table2':
        return list(TABLE2_TASKS)
    if spec == 'all':
        return list(TASKS)
    names = _split(spec)
    for n in names:
        get_task(n)
    return names


def grid_table(results, tasks, columns, cfg):
    """Markdown table shaped like the paper's Table 2: a row per task, a column per encoding."""
    labels = [encoding_label(p, d) for p, d in columns]
    lines = ['| Level | Task | Random | ' + ' | '.join(labels) + ' |',
             '| --- | --- | --- |' + ' --- |' * len(labels)]
    for t in tasks:
        task = TASKS[t]
        cells = []
        for p, d in columns:
            r = results.get((t, p, d))
            cells.append('err' if r is None or 'score' not in r else _fmt(r['score']))
        lines.append(f"| {task.level} | {t} | {100 * task.random_baseline:.0f} | " + ' | '.join(cells) + ' |')
    lines.append('')
    Ns = eval_lengths(cfg)
    lines.append(f"Accuracy (%), mean over test lengths {Ns[0]}..{Ns[-1]}"
                 f" (stride {cfg['eval_stride']}, {cfg['eval_samples']} samples each); one seed "
                 f"({cfg['seed']}), lr {cfg['learning_rate']}, {cfg['max_iters']} steps of batch "
                 f"{cfg['batch_size']}, {cfg['n_layer']}L/{cfg['n_head']}H/d{cfg['n_embd']}, "
                 f"randomized positions {'up to ' + str(cfg['rand_pos_max']) if cfg['rand_pos'] else 'off'}"
                 f"{' (in evaluation too)' if cfg['rand_pos'] and cfg['rand_pos_eval'] else ''}. "
                 "n/s: not servable at the test lengths. The paper reports the max over seeds and "
                 "learning rates after 200k steps.")
    return '\n'.join(lines)


def paper_table(tasks):
    labels = [encoding_label(p, d) for p, d in PAPER_TABLE2_COLUMNS]
    lines = ['| Task | ' + ' | '.join(labels) + ' |', '| --- |' + ' --- |' * len(labels)]
    for t in tasks:
        if t in PAPER_TABLE2:
            lines.append(f'| {t} | ' + ' | '.join(f'{v:.2f}' for v in PAPER_TABLE2[t]) + ' |')
    return '\n'.join(lines)


def run_grid(cfg, log=print):
    """Every task x every (pos, dape): train, evaluate, print and write the Table 2-shaped table."""
    tasks = resolve_tasks(cfg['grid_tasks'])
    columns = [(p, d) for d in _split(cfg['grid_dape']) for p in _split(cfg['grid_pos'])]
    results, t0 = {}, time.time()
    out = cfg['out_dir']
    for t in tasks:
        for p, d in columns:
            one = dict(cfg, task=t, pos=p, dape=d, plot=False)
            try:
                results[(t, p, d)] = run_one(one, log)
            except ValueError as e:  # a configuration the model rejects: record, go on
                log(f"== {t} | {encoding_label(p, d)}: error: {e}")
                results[(t, p, d)] = {'task': t, 'pos': p, 'dape': d, 'error': str(e)}
        if out and cfg['plot']:
            plot_per_length({encoding_label(p, d): results[(t, p, d)] for p, d in columns},
                            TASKS[t], os.path.join(out, f"{t}.png"), cfg)
        table = grid_table(results, tasks[:tasks.index(t) + 1], columns, cfg)
        if out:  # rewritten after every task, so a long grid can be read while it runs
            with open(os.path.join(out, 'table.md'), 'w') as f:
                f.write(table + '\n\nDAPE paper, Table 2:\n\n' + paper_table(tasks) + '\n')
            _write_json(os.path.join(out, 'grid.json'),
                        [results[k] for k in results])
    log(f"\nCHE grid finished in {time.time() - t0:.0f}s\n")
    log(table)
    log('\nDAPE paper, Table 2 (for reference):\n')
    log(paper_table(tasks))
    return results, table


# -----------------------------------------------------------------------------
# configuration (configurator conventions as in train.py). Defaults: a CPU smoke run of a few
# minutes per task; config/che_paper.py is the paper's setting (GPU).
_names_before_config = set(globals())
task = 'reverse_string'
pos = 'kerple'
dape = 'none'                # none | v1 | v2
dape_variant = 'concat_residual'
dape_width = 32              # D_DAPE (paper: 64)
dape_kernel = 3              # DAPE v2 kernel width
n_layer = 2                  # paper: 5
n_head = 4                   # paper: 8
n_embd = 64                  # paper: 256
dropout = 0.0
bias = False
rand_pos = True              # randomized positions (Ruoss et al.) in training
rand_pos_max = 2048          # the maximum randomized position L
rand_pos_eval = True         # and at evaluation, as Ruoss et al.'s code does; False: positions 0..T-1
train_max_len = 40           # training lengths N ~ U{1..train_max_len}
max_iters = 300              # paper: 200k
batch_size = 32              # paper: 128
learning_rate = 3e-4         # spec: one of 1e-4, 3e-4, 5e-4; constant
grad_clip = 1.0
eval_min_len = 41
eval_max_len = 100           # paper: 500
eval_stride = 5              # paper: 1 (every length)
eval_samples = 64            # per length; paper: 512
eval_batch_size = 64
log_interval = 50
seed = 0
device = 'auto'              # auto: cuda if available
dtype = 'auto'               # auto: bfloat16 autocast on a GPU that has it, else float32
compile = False
out_dir = 'out-che'          # '' writes nothing
plot = True
grid = False                 # True: every grid_tasks x grid_pos x grid_dape, Table 2 shaped
grid_tasks = 'table2'        # table2 (the paper's 14) | all (15) | comma-separated names
grid_pos = 'alibi,kerple,fire'
grid_dape = 'none,v1'
config_keys = [k for k in globals() if k not in _names_before_config and not k.startswith('_')]



def check_config(cfg):
    """Fail before any training on a bad task name or a (pos, dape) the model rejects: builds every
    cell's GPTConfig, which validates itself (ValueError naming the field)."""
    from configurator import check_device
    from model import GPTConfig
    if cfg['grid']:
        tasks = resolve_tasks(cfg['grid_tasks'])
        cells = [(t, p, d) for t in tasks for d in _split(cfg['grid_dape']) for p in _split(cfg['grid_pos'])]
    else:
        cells = [(get_task(cfg['task']).name, cfg['pos'], cfg['dape'])]
    if not cells:
        raise ValueError("the grid is empty: set grid_tasks, grid_pos and grid_dape")
    for t, p, d in cells:
        cell = dict(cfg, task=t, pos=p, dape=d)
        build_model(get_task(t), cell, config_only=True)
    for k in ('max_iters', 'batch_size', 'train_max_len', 'eval_samples', 'eval_batch_size',
              'eval_stride', 'log_interval', 'eval_min_len'):
        if cfg[k] < 1:
            raise ValueError(f"{k} must be >= 1, got {cfg[k]}")
    if not eval_lengths(cfg):
        raise ValueError(f"no evaluation lengths in eval_min_len..eval_max_len = "
                         f"{cfg['eval_min_len']}..{cfg['eval_max_len']}")
    if not cfg['learning_rate'] > 0:
        raise ValueError(f"learning_rate must be > 0, got {cfg['learning_rate']}")
    if cfg['dtype'] not in ('auto', 'float32', 'bfloat16', 'float16'):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {cfg['dtype']!r}")
    check_device(cfg['device'])


def main(argv=None):
    """argv: command-line arguments (None: sys.argv[1:]). -> the run's result(s)."""
    from configurator import configure
    config = configure({k: globals()[k] for k in config_keys}, argv)
    try:
        check_config(config)
    except ValueError as e:
        if argv is not None:
            raise
        print(f"che_tasks: {e}", file=sys.stderr)
        sys.exit(2)
    return run_grid(config) if config['grid'] else run_one(config)


if __name__ == '__main__':
    main()
