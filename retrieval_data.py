"""
Retrieval tasks for causal models, which small models learn in minutes on a CPU: beside CHE's formal
languages (che_data.py), the tasks that current length-generalisation papers use for retrieval. The
runner is che_tasks.py (train short, test long; ID beside OOD; seeds; tables and plots).

flip_flop   Flip-flop language modelling (Liu et al. 2023, arXiv 2306.00946). A sequence of instruction-bit
            pairs: "w b" writes bit b, "r b" reads (b must be the bit of the latest write), "i b" is a
            distractor with a random bit. The model must predict the bit after each read: remember the last
            written bit across any number of distractors. Each instruction is "i" with probability
            p_ignore, else "w" or "r" alike; a sequence starts with a write and ends with a read. Trained
            on the paper's FFL(0.8) (p_ignore = 0.8); tested also on its two other distributions, sparse
            (p_ignore = 0.98: long gaps between write and read) and dense (p_ignore = 0.1).
mqar        Multi-query associative recall (Arora et al. 2023, Zoology): N key-value pairs (distinct keys,
            random values), then the N keys again in a random order, each followed by its value. The model
            must predict a key's value when the key comes back.

Length N: instruction-bit pairs (flip_flop: 2N tokens) or key-value pairs (mqar: 4N tokens). Token ids
put the answers first, so that the runner's output head can be cut to them: bits 0, 1, then w, r, i
(flip_flop); values 0..V-1, then keys V..V+K-1 (mqar).

A generator returns (idx [B, T], targets [B, T]) int64: the targets are -1 except where the next token is
determined by the task (after a read, after a recalled key), which is what the model is trained on and
scored at; the other next tokens are random draws a model cannot predict.
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# flip_flop's tokens: the two bits first (the answers), then the instructions
BIT0, BIT1, WRITE, READ, IGNORE = 0, 1, 2, 3, 4
FLIP_FLOP_P_IGNORE = {'train': 0.8, 'sparse': 0.98, 'dense': 0.1}  # the paper's FFL(0.8), FFL(0.98), FFL(0.1)
MQAR_VALUES, MQAR_KEYS = 64, 256  # N <= MQAR_KEYS key-value pairs per sequence


def flip_flop(B, N, rng, p_ignore=FLIP_FLOP_P_IGNORE['train']):
    """B sequences of N instruction-bit pairs (N >= 2: a write first, a read last)."""
    if N < 2:
        raise ValueError(f"flip_flop needs N >= 2 pairs (a write and a read), got {N}")
    p_other = (1 - p_ignore) / 2
    ops = rng.choice([WRITE, READ, IGNORE], size=(B, N), p=[p_other, p_other, p_ignore])
    ops[:, 0], ops[:, -1] = WRITE, READ
    bits = rng.integers(0, 2, size=(B, N))
    # a read returns the bit of the latest write: carry each write's bit forward over the other pairs
    last_write = np.maximum.accumulate(np.where(ops == WRITE, np.arange(N)[None, :], 0), axis=1)
    bits = np.where(ops == READ, np.take_along_axis(bits, last_write, axis=1), bits)
    idx = np.stack((ops, bits), axis=2).reshape(B, 2 * N)
    targets = np.full((B, 2 * N), -1)
    targets[:, 0::2] = np.where(ops == READ, bits, -1)  # at the instruction, the bit that follows it
    return idx.astype(np.int64), targets.astype(np.int64)


def mqar(B, N, rng, n_keys=MQAR_KEYS, n_values=MQAR_VALUES):
    """B sequences of N key-value pairs then the N keys again, shuffled, each followed by its value."""
    if not 1 <= N <= n_keys:
        raise ValueError(f"mqar needs 1 <= N <= {n_keys} key-value pairs, got {N}")
    keys = np.argsort(rng.random((B, n_keys)), axis=1)[:, :N] + n_values  # distinct keys per sequence
    values = rng.integers(0, n_values, size=(B, N))
    order = np.argsort(rng.random((B, N)), axis=1)
    pairs = np.stack((keys, values), axis=2).reshape(B, 2 * N)
    queries = np.stack((np.take_along_axis(keys, order, 1), np.take_along_axis(values, order, 1)), 2).reshape(B, 2 * N)
    idx = np.concatenate((pairs, queries), axis=1)
    targets = np.full((B, 4 * N), -1)
    targets[:, 2 * N::2] = queries[:, 1::2]  # at each recalled key, its value
    return idx.astype(np.int64), targets.astype(np.int64)


@dataclass(frozen=True)
class RetrievalTask:
    name: str
    input_vocab: int  # ids 0..input_vocab-1
    output_vocab: int  # the answers are ids 0..output_vocab-1
    seq_len: Callable[[int], int]  # tokens per sequence as a function of N
    generate: Callable  # (B, N, rng) -> (idx [B, T], targets [B, T])
    random_baseline: float
    min_len: int = 1
    # test distributions other than the training one, evaluated at the test lengths beside it
    variants: dict = field(default_factory=dict)
    level: str = 'retrieval'
    causal: bool = True


TASKS = {t.name: t for t in [
    RetrievalTask('flip_flop', 5, 2, lambda N: 2 * N, flip_flop, 0.5, min_len=2,
                  variants={name: (lambda B, N, rng, p=p: flip_flop(B, N, rng, p))
                            for name, p in FLIP_FLOP_P_IGNORE.items() if name != 'train'}),
    RetrievalTask('mqar', MQAR_VALUES + MQAR_KEYS, MQAR_VALUES, lambda N: 4 * N, mqar, 1 / MQAR_VALUES),
]}
