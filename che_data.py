"""
The tasks of the Chomsky Hierarchy Evaluation (CHE; Deletang et al., ICLR 2023), as the DAPE paper's
Table 2 uses them: data generation only (numpy, no torch). The runner that trains and scores models on
them is che_tasks.py; the semantics are written out in docs/che.md.

15 tasks, token ids as in the reference suite so that samples can be compared with it. Each task is a
`CHETask` with its input vocabulary, output vocabulary, output length as a function of N and
`sample(batch_size, length, rng)` returning numpy int64 inputs [B, n_in], targets [B, |y|] and a bool
accuracy mask [B, |y|]. `make_batch` frames a sample for the bidirectional encoder (placeholders
appended, training targets at the last |y| positions).
"""
import functools
import math
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
    top_down = stack[rows[:, None], np.clip(height[:, None] - 1 - np.arange(N + 1)[None, :], 0, None)]
    return x, _terminated(top_down, height, N + 1, STACK_END)


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


binary_addition = functools.partial(_binary_operation, multiply=False)
binary_multiplication = functools.partial(_binary_operation, multiply=True)


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
    output_length: Callable[[int], int]  # |y| as a function of N
    generate: Callable        # (B, N, rng) -> (x [B, n_in], y [B, |y|])
    masked: bool = False      # accuracy counts only up to and including the first TERMINATOR
    random_baseline: float = 0.5  # random-guess accuracy as reported in the literature
    causal = False            # CHE trains a bidirectional encoder (retrieval_data.py's tasks are causal)
    min_len = 1
    variants = {}             # no test distribution but the training one

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
