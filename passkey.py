"""
Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"; the test YaRN and LongLoRA report):
a random number is hidden at a chosen depth in a long stretch of filler text, and the prompt ends with
the question; the model must produce the number's digits.

    one sample of length L: L + 1 tokens, of which the model reads the first L
    [ filler[:a] ][ NEEDLE with the key ][ filler[a:] ][ QUESTION ][ key digits ]
                                                                     ^ scored: the answer
    a = round(depth * len(filler)): depth 0 puts the key at the start, depth 1 just before the question.

The filler is a contiguous stretch of a token array (the validation split for evaluation, the
training split for the samples train.py mixes in) or a fixed sentence repeated, as in the original.
Everything is built from token ids, so it works alike for bytes and GPT-2 BPE (tokenizer.py). The
key's digits are kept apart from the words around them: for bytes the space before the number is the
last token of the question (the answer is the digits alone); for BPE it is part of the number's first
token (' 714'), as GPT-2 writes numbers.

Scoring: exact match (every answer token is the model's most likely next token given the right ones
before it, which is the same as greedy decoding reproducing the key) and the log-likelihood of the
answer tokens, a graded score that small models need. A model that knows that digits come but not
which scores ln(1/10) per digit; a uniform one ln(1/V) per token.
"""

import math
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

# the wording of the original (Mohtashami & Jaggi), with the key's place marked; the newlines set the
# needle and the question apart from the filler, which is cut anywhere
NEEDLE = "\nThe pass key is {key}. Remember it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
SENTENCE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DIGITS = 5  # the key is a random number of this many digits (no leading zero)


def new_key(rng, digits=DIGITS):
    """A random key of `digits` digits from a numpy Generator."""
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def key_tokens(tok, key):
    """(lead, digits): the tokens of ' ' + key, split before the first token that holds a digit. For
    bytes lead is the space; for GPT-2 BPE it is empty (the space is part of ' 714')."""
    ids = tok.encode(' ' + key)
    first = next(i for i, t in enumerate(ids) if any(c.isdigit() for c in tok.decode([t])))
    return ids[:first], ids[first:]


def make_prompt(tok, key, filler, length, depth):
    """One sample of `length` (see the top): a dict with ids (int64 [length + 1]), answer (slice of
    ids: the key's digits the model must produce), needle (slice of ids: the same digits in the
    needle), key, length, depth. `filler` holds at least the filler's tokens; its first ones are used."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (0: the key at the start, 1: at the end), got {depth}")
    before, after = NEEDLE.split(' {key}')  # the space goes with the key (key_tokens)
    lead, digits = key_tokens(tok, key)
    needle_head = tok.encode(before) + lead
    needle = needle_head + digits + tok.encode(after)
    question = tok.encode(QUESTION) + lead
    n_fill = length + 1 - len(needle) - len(question) - len(digits)
    if n_fill < 0:
        raise ValueError(f"length {length} is too short to hold a passkey prompt: its needle, question and "
                         f"answer take {length + 1 - n_fill} tokens, so the length must be >= {length - n_fill}")
    if len(filler) < n_fill:
        raise ValueError(f"{len(filler)} filler tokens given, {n_fill} needed")
    fill = np.asarray(filler[:n_fill], dtype=np.int64)
    a = round(depth * n_fill)
    ids = np.concatenate([fill[:a], needle, fill[a:], question, digits]).astype(np.int64)
    k = a + len(needle_head)
    return {'ids': ids, 'answer': slice(len(ids) - len(digits), len(ids)), 'needle': slice(k, k + len(digits)),
            'key': key, 'length': length, 'depth': depth}


def passkey_prompts(tok, lengths, depths, trials, seed, data=None, digits=DIGITS):
    """The evaluation's samples: `trials` per length and depth, filler from the token array `data` (a
    random stretch each) or, with data=None, the fixed sentence. Seeded by (seed, trial) for the key,
    so that a trial hides the same key at every length and depth, and (seed, trial, length, depth)
    for where the filler comes from: the same prompts for every model that shares the tokenizer."""
    prompts = []
    for L in lengths:
        for depth in depths:
            for t in range(trials):
                key = new_key(np.random.default_rng([seed, t]), digits)
                if data is None:  # the original's sentence, repeated
                    filler = np.resize(np.asarray(tok.encode(SENTENCE), dtype=np.int64), L)
                else:
                    rng = np.random.default_rng([seed, t, L, round(depth * 10 ** 6)])
                    if len(data) < L:
                        raise ValueError(f"the filler data holds {len(data)} tokens, fewer than length {L} needs")
                    start = int(rng.integers(0, len(data) - L + 1))
                    filler = data[start:start + L]
                prompts.append(dict(make_prompt(tok, key, filler, L, depth), trial=t))
    return prompts


@torch.no_grad()
def score_prompts(model, prompts, device='cpu', ctx=None, batch=1):
    """Score each prompt: the model reads ids[:L] and its logits at the answer's positions are compared
    with the key's digits. Adds to each prompt (and returns them): exact (every answer token is the
    arg max: greedy decoding reproduces the key), logp (sum of the answer tokens' log-probabilities,
    nats), logp_mean (per token), said (the arg max tokens). Prompts of one length go in batches;
    `model` is anything called as model(idx, last=k) -> (logits [B, k, V], _), like model.GPT."""
    ctx = ctx if ctx is not None else nullcontext()
    by_length = {}
    for p in prompts:
        by_length.setdefault(p['length'], []).append(p)
    for L, group in by_length.items():
        for s in range(0, len(group), batch):
            chunk = group[s:s + batch]
            x = torch.from_numpy(np.stack([p['ids'][:L] for p in chunk])).to(device)
            k = max(p['answer'].stop - p['answer'].start for p in chunk)
            with ctx:
                logits, _ = model(x, last=k)
            logp = F.log_softmax(logits.float(), dim=-1).cpu()
            for row, p in enumerate(chunk):
                target = torch.from_numpy(p['ids'][p['answer']])
                lp = logp[row, k - len(target):]  # the last positions predict the answer tokens
                tok_lp = lp.gather(-1, target[:, None])[:, 0].double()
                said = lp.argmax(dim=-1)
                p.update(exact=bool(torch.equal(said, target)), logp=float(tok_lp.sum()),
                         logp_mean=float(tok_lp.mean()), said=said.tolist())
    return prompts


def summarize(prompts):
    """{length: {depth: {accuracy, logp_mean, logp, n}}} over the trials of scored prompts: accuracy
    is the fraction of exact matches, logp_mean the mean log-likelihood per answer token, logp the
    mean log-likelihood of the whole answer."""
    cells = {}
    for p in prompts:
        cells.setdefault(p['length'], {}).setdefault(p['depth'], []).append(p)
    return {L: {d: {'accuracy': sum(p['exact'] for p in ps) / len(ps),
                    'logp_mean': sum(p['logp_mean'] for p in ps) / len(ps),
                    'logp': sum(p['logp'] for p in ps) / len(ps), 'n': len(ps)}
                for d, ps in sorted(by_depth.items())}
            for L, by_depth in sorted(cells.items())}


def mix_into_batch(x, y, data, tok, frac, gen, digits=DIGITS):
    """train.py's --passkey_frac: replace each row of the batch x, y [B, T] (int64, CPU) with a passkey
    sample of length T with probability frac, in place; returns x, y. The filler is a random stretch
    of `data` (the training split), the key and its depth are random, all drawn from the torch
    Generator `gen` (the batch generator, so that a resumed run draws the same batches). Every target
    is kept, a language model's, except the needle's digits: they are random, and predicting them
    would only teach the model to say random digits; the answer's digits after the question are what
    the model learns to copy."""
    B, T = x.shape
    rows = (torch.rand(B, generator=gen) < frac).nonzero()[:, 0].tolist()
    for r in rows:
        key = str(int(torch.randint(10 ** (digits - 1), 10 ** digits, (1,), generator=gen)))
        depth = float(torch.rand(1, generator=gen))
        start = int(torch.randint(len(data) - T, (1,), generator=gen))
        p = make_prompt(tok, key, data[start:start + T], T, depth)
        ids = torch.from_numpy(p['ids'])
        x[r], y[r] = ids[:-1], ids[1:]
        y[r, p['needle'].start - 1:p['needle'].stop - 1] = -1  # target i is token i + 1
    return x, y


def chance_logp_per_digit():
    """The log-likelihood per digit of a model that knows that a digit comes but not which: ln(1/10)."""
    return -math.log(10)
