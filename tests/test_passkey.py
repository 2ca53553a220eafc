"""Passkey retrieval (passkey.py, eval_passkey.py, train.py --passkey_frac): the key's digits where the
depth says, the scorer against an oracle that copies the key and a uniform model, the same prompts for
every model, the one-line errors, and tiny end-to-end runs."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import eval_passkey as EP
import passkey as P
import train
from common import InputError
from configurator import ConfigError
from model import GPT, GPTConfig
from tokenizer import get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin "
        "nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the glass doors. ")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()  # tiny models: a second thread only adds waiting on a busy machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=['byte', 'gpt2'])
def tok(request):
    return get_tokenizer(request.param)


def text_tokens(tok, n):
    return np.resize(np.asarray(tok.encode(TEXT), dtype=np.int64), n)


# -----------------------------------------------------------------------------
# prompts


@pytest.mark.parametrize('depth', [0.0, 0.25, 0.5, 0.75, 1.0])
def test_digits_are_where_the_depth_says(tok, depth):
    L, key = 200, '71432'
    filler = text_tokens(tok, L)
    p = P.make_prompt(tok, key, filler, L, depth)
    ids = p['ids']
    assert len(ids) == L + 1 and p['length'] == L
    assert tok.decode(ids[p['answer']]).strip() == key and tok.decode(ids[p['needle']]).strip() == key
    assert p['answer'].stop == L + 1  # the answer ends the sample
    text = tok.decode(ids)
    assert text.endswith("What is the pass key? The pass key is " + key)
    assert "The pass key is " + key + ". Remember it." in text
    # the filler is one stretch, cut where the depth says: before the needle round(depth * n) of its tokens
    before = tok.encode("\nThe pass key is")
    start = next(i for i in range(len(ids)) if list(ids[i:i + len(before)]) == before)
    question = tok.encode(P.QUESTION)
    q_at = next(i for i in range(start, len(ids)) if list(ids[i:i + len(question)]) == question)
    needle_len = len(tok.encode(P.NEEDLE.replace('{key}', key).split(' ' + key)[0])) + len(tok.encode(' ' + key)) \
        + len(tok.encode(P.NEEDLE.split('{key}')[1]))
    n_fill = q_at - needle_len  # filler tokens in all: before the needle and between needle and question
    assert start == round(depth * n_fill)
    assert list(ids[:start]) == list(filler[:start])
    assert list(ids[start + needle_len:q_at]) == list(filler[start:n_fill])
    assert abs(start / n_fill - depth) <= 0.5 / n_fill + 1e-9


def test_prompt_errors(tok):
    filler = text_tokens(tok, 300)
    with pytest.raises(ValueError, match=r'depth must be in \[0, 1\]'):
        P.make_prompt(tok, '12345', filler, 200, 1.5)
    with pytest.raises(ValueError, match='too short to hold a passkey prompt'):
        P.make_prompt(tok, '12345', filler, 10, 0.5)


def test_prompts_are_seeded_and_shared(tok):
    data = text_tokens(tok, 5000)
    a = P.passkey_prompts(tok, [120, 240], [0.0, 1.0], 3, seed=5, data=data)
    b = P.passkey_prompts(tok, [120, 240], [0.0, 1.0], 3, seed=5, data=data)
    assert len(a) == 2 * 2 * 3 and all(np.array_equal(x['ids'], y['ids']) for x, y in zip(a, b))
    keys = {(p['length'], p['depth'], p['trial']): p['key'] for p in a}
    assert all(keys[(L, d, t)] == keys[(120, 0.0, t)] for L, d, t in keys)  # a trial's key at every cell
    assert len({keys[(120, 0.0, t)] for t in range(3)}) == 3
    c = P.passkey_prompts(tok, [120], [0.0], 3, seed=6, data=data)
    assert [p['key'] for p in c] != [p['key'] for p in a[:3]]
    s = P.passkey_prompts(tok, [300], [1.0], 1, seed=5)  # the fixed sentence
    assert 'The grass is green. The sky is blue.' in tok.decode(s[0]['ids'])


def test_each_depth_reads_its_own_filler(tok):
    """The filler is drawn per (trial, length, depth): were it the same stretch at every depth, the
    cells of one length would share their text and the depths would not be independent samples."""
    data = np.random.default_rng(0).integers(0, 200, size=5000).astype(np.int64)  # no stretch repeats
    L, depths = 150, [0.25, 0.5, 1.0]  # depth > 0: the prompt starts with its filler
    prompts = P.passkey_prompts(tok, [L], depths, 2, seed=3, data=data)
    starts = {}
    for p in prompts:
        head = list(p['ids'][:8])
        at = [i for i in range(len(data) - 8) if list(data[i:i + 8]) == head]
        assert len(at) == 1  # a stretch of the data
        starts[(p['trial'], p['depth'])] = at[0]
    for t in range(2):
        assert len({starts[(t, d)] for d in depths}) == len(depths), starts


# -----------------------------------------------------------------------------
# the scorer


class Oracle(torch.nn.Module):
    """Reads the key from the needle in its input and, after the question, predicts its digits one by one."""

    def __init__(self, tok, vocab):
        super().__init__()
        self.vocab = vocab
        lead, _ = P.key_tokens(tok, '12345')
        self.head = tok.encode("\nThe pass key is") + lead
        self.question = tok.encode(P.QUESTION) + lead

    def forward(self, idx, last):
        B, T = idx.shape
        logits = torch.zeros(B, last, self.vocab)  # the last `last` positions, T - last .. T - 1
        for b in range(B):
            row = idx[b].tolist()
            find = lambda pat: next(i for i in range(T) if row[i:i + len(pat)] == pat) + len(pat)
            key_at, answer_at = find(self.head), find(self.question)
            for t in range(max(answer_at - 1, T - last), T):  # position t predicts answer token t - answer_at + 1
                logits[b, t - (T - last), row[key_at + t - answer_at + 1]] = 30.0
        return logits, None


class Uniform(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx, last):
        return torch.zeros(idx.shape[0], last, self.vocab), None


def test_oracle_scores_100_and_uniform_scores_chance(tok):
    V = 256 if tok.name == 'byte' else 50304
    prompts = P.passkey_prompts(tok, [150, 300], [0.0, 0.5, 1.0], 4, seed=1, data=text_tokens(tok, 4000))
    oracle = P.summarize(P.score_prompts(Oracle(tok, V), [dict(p) for p in prompts], batch=3))
    for L in (150, 300):
        for d in (0.0, 0.5, 1.0):
            assert oracle[L][d]['accuracy'] == 1.0 and oracle[L][d]['logp_mean'] > -1e-6
    uniform = P.score_prompts(Uniform(V), [dict(p) for p in prompts], batch=5)
    # chance of exact match is 1 / V per token (~1e-12 for 5 bytes): none; each token ln(1/V)
    assert not any(p['exact'] for p in uniform)
    for p in uniform:
        n = p['answer'].stop - p['answer'].start
        assert p['logp_mean'] == pytest.approx(-math.log(V)) and p['logp'] == pytest.approx(-n * math.log(V))


class Scripted(torch.nn.Module):
    """Knows each prompt's answer (looked up by its input) and gives answer token j the probability
    probs[j], the rest of the mass spread evenly; at the answer tokens listed in `miss` (negative: from
    the end) a wrong token takes 0.9 and the right one 0.05, so the arg max is wrong there."""

    def __init__(self, prompts, vocab, probs, miss=()):
        super().__init__()
        self.vocab, self.probs, self.miss = vocab, probs, set(miss)
        self.answers = {tuple(p['ids'][:p['length']].tolist()): p['ids'][p['answer']].tolist() for p in prompts}

    def forward(self, idx, last):
        B, T = idx.shape
        logits = torch.zeros(B, last, self.vocab, dtype=torch.float64)
        for b in range(B):
            target = self.answers[tuple(idx[b].tolist())]
            n = len(target)
            for j, t in enumerate(target):  # position T - n + j predicts answer token j
                wrong = j in self.miss or j - n in self.miss
                q = 0.05 if wrong else self.probs[j]
                dist = torch.zeros(self.vocab, dtype=torch.float64)
                dist[t] = q
                if wrong:
                    dist[(t + 1) % self.vocab] = 0.9
                dist[dist == 0] = (1.0 - dist.sum()) / (self.vocab - 1 - wrong)
                logits[b, last - n + j] = dist.log()
        return logits, None


def scored_by(tok, miss=(), probs=(0.5, 0.25, 0.125, 0.0625, 0.03125)):
    V = 256 if tok.name == 'byte' else 50304
    prompts = P.passkey_prompts(tok, [150], [0.0, 1.0], 2, seed=4, data=text_tokens(tok, 3000))
    return P.score_prompts(Scripted(prompts, V, probs, miss), [dict(p) for p in prompts], batch=3)


def test_exact_match_needs_every_answer_token(tok):
    """Exact match is greedy decoding reproducing the whole key: one wrong token, first or last, is a
    miss (a check that skipped a digit would count near misses as retrievals)."""
    for miss, exact in [((), True), ((-1,), False), ((0,), False)]:
        for p in scored_by(tok, miss):
            target = list(p['ids'][p['answer']])
            assert p['exact'] is exact, (miss, p['said'], target)
            assert [s == t for s, t in zip(p['said'], target)] == \
                [not (j in miss or j - len(target) in miss) for j in range(len(target))]


def test_log_likelihood_counts_every_answer_token(tok):
    """logp and logp_mean are the sum and the mean of ln p over all the answer tokens, the first one
    included, checked against probabilities set by hand."""
    probs = (0.5, 0.25, 0.125, 0.0625, 0.03125)
    for p in scored_by(tok, probs=probs):
        n = p['answer'].stop - p['answer'].start
        want = sum(math.log(q) for q in probs[:n])
        assert p['exact'] and p['logp'] == pytest.approx(want, abs=1e-4)  # float32 log_softmax
        assert p['logp_mean'] == pytest.approx(want / n, abs=1e-4)


def test_summary_of_scored_prompts_by_hand():
    """A cell's accuracy, logp_mean (per answer token) and logp (whole answer) are means over its
    trials, each of its own score: none taken for another."""
    ps = [dict(length=100, depth=0.5, exact=True, logp=-1.0, logp_mean=-0.5),  # 2-token answers
          dict(length=100, depth=0.5, exact=False, logp=-6.0, logp_mean=-3.0),
          dict(length=100, depth=0.5, exact=False, logp=-2.0, logp_mean=-1.0),
          dict(length=100, depth=0.0, exact=True, logp=-0.2, logp_mean=-0.1),
          dict(length=300, depth=0.5, exact=False, logp=-8.0, logp_mean=-4.0)]
    s = P.summarize(ps)
    assert list(s) == [100, 300] and list(s[100]) == [0.0, 0.5]
    assert s[100][0.5] == {'accuracy': pytest.approx(1 / 3), 'logp_mean': pytest.approx(-1.5),
                           'logp': pytest.approx(-3.0), 'n': 3}
    assert s[100][0.0] == {'accuracy': 1.0, 'logp_mean': pytest.approx(-0.1), 'logp': pytest.approx(-0.2), 'n': 1}
    assert s[300][0.5] == {'accuracy': 0.0, 'logp_mean': pytest.approx(-4.0), 'logp': pytest.approx(-8.0), 'n': 1}


def test_scores_are_the_models_own_and_batching_changes_nothing():
    tok = get_tokenizer('byte')
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=16, pos='kerple')).eval()
    prompts = P.passkey_prompts(tok, [100], [0.0, 1.0], 3, seed=2, data=text_tokens(tok, 2000))
    one = P.score_prompts(model, [dict(p) for p in prompts], batch=1)
    many = P.score_prompts(model, [dict(p) for p in prompts], batch=4)
    for a, b in zip(one, many):
        assert a['said'] == b['said'] and a['logp'] == pytest.approx(b['logp'], abs=1e-4)
    p = one[0]
    ids = torch.from_numpy(p['ids'])
    with torch.no_grad():
        logits, _ = model(ids[None, :-1], ids[None, 1:])
    lp = torch.log_softmax(logits[0], -1)
    want = sum(float(lp[i - 1, ids[i]]) for i in range(p['answer'].start, p['answer'].stop))
    assert p['logp'] == pytest.approx(want, abs=1e-4)
    # greedy decoding's first token is the first arg max; exact needs all of them to be the key's
    out = model.generate(ids[None, :p['answer'].start], 1, temperature=0)
    assert int(out[0, -1]) == p['said'][0]
    assert p['exact'] == (p['said'] == list(p['ids'][p['answer']]))


# -----------------------------------------------------------------------------
# training


def make_text_data(root, name='text', n_train=20000, n_val=6000):
    """Byte-level text (vocab 256, as the passkey prompt needs) in train.py's format."""
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    ids = np.frombuffer((TEXT * 200).encode(), dtype=np.uint8)
    np.resize(ids, n_train).tofile(os.path.join(d, 'train.bin'))
    np.resize(ids[50:], n_val).tofile(os.path.join(d, 'val.bin'))
    with open(os.path.join(d, 'meta.json'), 'w') as f:
        json.dump({'vocab_size': 256, 'tokenizer': 'byte', 'dtype': 'uint8', 'eot_token': 30,
                   'train_tokens': n_train, 'val_tokens': n_val}, f)
    return d


def test_mix_into_batch():
    tok = get_tokenizer('byte')
    data = np.resize(np.frombuffer(TEXT.encode(), dtype=np.uint8), 3000)
    T = 96
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in range(0, 800, 100)])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in range(0, 800, 100)])
    x0, y0 = x.clone(), y.clone()
    P.mix_into_batch(x, y, data, tok, 0.5, torch.Generator().manual_seed(0))
    mixed = [r for r in range(8) if 'What is the pass key?' in tok.decode(x[r].tolist())]
    assert 0 < len(mixed) < 8
    for r in range(8):
        if r not in mixed:
            assert torch.equal(x[r], x0[r]) and torch.equal(y[r], y0[r])
            continue
        kept = y[r, :-1] >= 0
        assert torch.equal(x[r, 1:][kept], y[r, :-1][kept])  # targets are the next tokens, where kept
        text = tok.decode(torch.cat((x[r], y[r, -1:])).tolist())
        key = text.rsplit('The pass key is ', 1)[1]
        assert len(key) == 5 and key.isdigit() and f"The pass key is {key}. Remember it." in text
        assert (y[r] == -1).sum() == 5  # the needle's digits are not targets, the answer's are
        assert tok.decode(y[r, -5:].tolist()) == key
    # the same generator state gives the same batch (resume draws the same samples)
    x2, y2 = x0.clone(), y0.clone()
    P.mix_into_batch(x2, y2, data, tok, 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(x2, x) and torch.equal(y2, y)


def test_mix_into_batch_masks_exactly_the_needle_digits():
    """The targets left out are those whose token is one of the needle's digits (target i is token
    i + 1): off by one, the model would learn to predict a random digit and not the '.' after it."""
    tok = get_tokenizer('byte')
    data = np.resize(np.frombuffer(TEXT.encode(), dtype=np.uint8), 3000)
    T, B = 96, 16
    x, y = torch.zeros(B, T, dtype=torch.int64), torch.zeros(B, T, dtype=torch.int64)
    P.mix_into_batch(x, y, data, tok, 0.99, torch.Generator().manual_seed(1))
    mixed = [r for r in range(B) if 'What is the pass key?' in tok.decode(x[r].tolist())]
    assert len(mixed) > B // 2
    for r in mixed:
        text = tok.decode(x[r].tolist())  # bytes: character i is token i
        key = tok.decode(y[r, -5:].tolist())
        j = text.index(f"The pass key is {key}. Remember it.") + len("The pass key is ")
        assert [chr(c) for c in x[r, j:j + 5].tolist()] == list(key)  # the needle's digits: tokens j .. j + 4
        assert (y[r] == -1).nonzero()[:, 0].tolist() == list(range(j - 1, j + 4))


def test_train_with_passkey_frac(tmp_path):
    root = str(tmp_path / 'data')
    make_text_data(root)
    cfg = SimpleNamespace(batch_size=8, passkey_frac=0.5)
    get_batch = train.batch_reader(cfg, os.path.join(root, 'text'), np.uint8, 'cpu')
    x, y = get_batch('train', torch.Generator().manual_seed(0), 96)
    tok = get_tokenizer('byte')
    assert any('What is the pass key? The pass key is' in tok.decode(r.tolist()) for r in x)
    xv, _ = get_batch('val', torch.Generator().manual_seed(0), 96)  # validation batches stay text
    assert not any('pass key' in tok.decode(r.tolist()) for r in xv)
    small = dict(n_layer=1, n_head=2, n_embd=16, block_size=96, batch_size=4, gradient_accumulation_steps=1,
                 eval_interval=3, eval_iters=1, log_interval=100, warmup_iters=1, lr_decay_iters=3, max_iters=3,
                 device='cpu', dataset='text', data_root=root)
    res = train.train(small, out_dir=str(tmp_path / 'out'), passkey_frac=0.5)
    assert res['iter_num'] == 3 and all(math.isfinite(v) for v in res['losses'])
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match=r'passkey_frac must be in \[0, 1\)'):
            train.train(small, out_dir=str(tmp_path / 'bad'), passkey_frac=bad)
    with pytest.raises(ConfigError, match='too short to hold a passkey prompt'):  # 32 bytes cannot hold it
        train.train(small, out_dir=str(tmp_path / 'short'), passkey_frac=0.5, block_size=32)


# -----------------------------------------------------------------------------
# eval_passkey.py


def make_ckpt(root, run, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**dict(block_size=48, vocab_size=256, n_layer=1, n_head=2, n_embd=16), **kw}))
    out = os.path.join(root, 'out', run)
    os.makedirs(out, exist_ok=True)
    torch.save({'model': model.state_dict(), 'model_args': dataclasses.asdict(model.config), 'iter_num': 1,
                'dataset': 'text', 'config': {'dataset': 'text', 'data_root': os.path.join(root, 'data')}},
               os.path.join(out, 'ckpt.pt'))
    return out


def ep_cfg(**kw):
    c = {k: getattr(EP, k) for k in EP.config_keys}
    c.update(device='cpu', lengths='96,192', depths='0,0.5,1', trials=2)
    c.update(kw)
    return c


def test_eval_passkey_end_to_end(tmp_path):
    root = str(tmp_path)
    make_text_data(os.path.join(root, 'data'))
    ckpts = [make_ckpt(root, 'kerple', pos='kerple'), make_ckpt(root, 'rope', pos='rope')]
    out = os.path.join(root, 'res')
    res = EP.evaluate(ep_cfg(out_dir=out, rope_scaling='none,yarn'), ckpts)
    labels = [r['label'] for r in res['rows']]
    assert labels == ['kerple', 'rope', 'rope+yarn(s=L/48)']
    for r in res['rows']:
        for L in (96, 192):
            assert set(r['cells'][L]) == {0.0, 0.5, 1.0}
            assert all(0 <= c['accuracy'] <= 1 and c['n'] == 2 and math.isfinite(c['logp_mean'])
                       for c in r['cells'][L].values())
    assert res['rows'][2]['rope_scale'] == {96: 2.0, 192: 4.0}
    # every model read the same prompts
    keys = [[(s['length'], s['depth'], s['key']) for s in r['samples']] for r in res['rows']]
    assert keys[0] == keys[1] == keys[2]
    with open(os.path.join(out, 'passkey.json')) as f:
        saved = json.load(f)
    assert saved['protocol']['lengths'] == [96, 192] and len(saved['rows']) == 3
    md = open(os.path.join(out, 'passkey.md')).read()
    assert '| rope+yarn(s=L/48) |' in md
    assert all(os.path.getsize(os.path.join(out, EP.file_name(lab))) > 1000 for lab in labels)
    # default lengths: the training length x 1 .. 16, and filler=sentence needs no validation split
    res = EP.evaluate(ep_cfg(out_dir=out, lengths='', depths='0.5', trials=1, filler='sentence', plot=False),
                      ckpts[:1])
    assert res['protocol']['lengths'] == [48 * m for m in (2, 4, 8, 16)]  # 48 bytes cannot hold the prompt


def test_eval_passkey_per_length_is_the_mean_over_depths(tmp_path, monkeypatch):
    """The per-length figures (the summary tables) average every depth's cell, not one depth's: scores
    made up per depth (a monkeypatched scorer) give means worked out by hand."""
    root = str(tmp_path)
    make_text_data(os.path.join(root, 'data'))
    ckpt = make_ckpt(root, 'kerple', pos='kerple')

    def fake_score(model, ps, device='cpu', ctx=None, batch=1):
        for p in ps:  # right from depth 0.5 on; log-likelihood -(1 + depth) per token, doubled at 192
            n = p['answer'].stop - p['answer'].start
            lp = -(1 + p['depth']) * p['length'] / 96
            p.update(exact=p['depth'] >= 0.5, logp_mean=lp, logp=n * lp, said=p['ids'][p['answer']].tolist())
        return ps

    monkeypatch.setattr(EP, 'score_prompts', fake_score)
    res = EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False), [ckpt])
    pl = res['rows'][0]['per_length']
    assert pl[96] == {'accuracy': pytest.approx(2 / 3), 'logp_mean': pytest.approx(-1.5), 'logp': pytest.approx(-7.5)}
    assert pl[192] == {'accuracy': pytest.approx(2 / 3), 'logp_mean': pytest.approx(-3.0), 'logp': pytest.approx(-15.0)}
    md = open(os.path.join(root, 'res', 'passkey.md')).read()
    assert '| kerple | 67% | 67% |' in md and '| kerple | -1.500 | -3.000 |' in md


def test_eval_passkey_errors_are_one_line(tmp_path):
    root = str(tmp_path)
    make_text_data(os.path.join(root, 'data'))
    kerple, rope = make_ckpt(root, 'kerple', pos='kerple'), make_ckpt(root, 'rope', pos='rope')
    cases = [([kerple, '--rope_scaling=yarn'], 'applies to RoPE models only'),
             ([rope, '--depths=0,1.5'], 'must be in [0, 1]'),
             ([rope, '--lengths=40'], 'too short to hold a passkey prompt'),
             ([rope, '--rope_scaling=linear'], 'unknown'),
             ([rope, '--rope_scale=4'], 'no effect without --rope_scaling')]
    for args, msg in cases:  # in this process: each message is one line
        with pytest.raises(InputError) as e:
            EP.main([*args, '--device=cpu', f'--out_dir={root}/x'])
        assert msg in str(e.value) and '\n' not in str(e.value), (args, str(e.value))
    # and on the command line: that line alone, exit status 2
    r = subprocess.run([sys.executable, 'eval_passkey.py', kerple, '--rope_scaling=yarn', '--device=cpu'],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith('eval_passkey.py: error: --rope_scaling=yarn applies to RoPE')
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_eval_passkey_groups_seeds_by_hand(tmp_path, monkeypatch):
    """Checkpoints that differ only by their seed form one group: per length the mean and sample std
    (ddof 1) of the seeds' figures (each the mean over depths), and how many seeds learned the task
    (exact match >= learned_exact at the training length); one trained otherwise is a group of its own.
    Scores are made up per checkpoint (a marker in its weights) and the expected figures worked out by hand."""
    root = str(tmp_path)
    make_text_data(os.path.join(root, 'data'))
    ckpts = []
    for marker, (run, conf) in enumerate([('k_s1', {'seed': 1}), ('k_s2', {'seed': 2}), ('k_s3', {'seed': 3}),
                                          ('k_lr', {'seed': 1, 'learning_rate': 1e-3})], 1):
        out = make_ckpt(root, run, pos='kerple', block_size=96)
        ck = torch.load(os.path.join(out, 'ckpt.pt'), weights_only=False)
        ck['config'].update(conf)
        ck['model']['transformer.ln_f.weight'][0] = marker
        torch.save(ck, os.path.join(out, 'ckpt.pt'))
        ckpts.append(out)
    # marker -> {length: (depths right, log-likelihood per token)}; depths 0, 0.5, 1: "right at depths
    # <= 0.5" is an exact match of 2/3 over depths
    plan = {1: {96: (1.0, -0.5), 192: (0.0, -1.0)}, 2: {96: (0.5, -1.0), 192: (-1, -2.0)},
            3: {96: (0.0, -1.5), 192: (-1, -3.0)}, 4: {96: (-1, -2.3), 192: (-1, -2.3)}}

    def fake_score(model, ps, device='cpu', ctx=None, batch=1):
        marker = round(model.transformer.ln_f.weight[0].item())
        for p in ps:
            upto, lp = plan[marker][p['length']]
            n = p['answer'].stop - p['answer'].start
            p.update(exact=p['depth'] <= upto, logp_mean=lp, logp=n * lp, said=p['ids'][p['answer']].tolist())
        return ps

    monkeypatch.setattr(EP, 'score_prompts', fake_score)
    res = EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False), ckpts)
    assert [r['setting'] for r in res['rows']] == ['kerple'] * 3 + ['kerple[learning_rate=0.001]']
    g, lr = res['groups']
    assert (g['label'], g['n'], g['seeds'], lr['n']) == ('kerple', 3, [1, 2, 3], 1)
    # exact match at 96: 1, 2/3, 1/3 -> mean 2/3, std 1/3; at 192: 1/3, 0, 0 -> mean 1/9, std sqrt(1/27)
    assert g['per_length'][96]['accuracy']['mean'] == pytest.approx(2 / 3)
    assert g['per_length'][96]['accuracy']['std'] == pytest.approx(1 / 3)
    assert g['per_length'][192]['accuracy']['mean'] == pytest.approx(1 / 9)
    assert g['per_length'][192]['accuracy']['std'] == pytest.approx(math.sqrt(1 / 27))
    # log-likelihood at 96: -0.5, -1, -1.5 -> -1 ± 0.5; at 192: -1, -2, -3 -> -2 ± 1
    assert (g['per_length'][96]['logp_mean']['mean'], g['per_length'][96]['logp_mean']['std']) == pytest.approx((-1, 0.5))
    assert (g['per_length'][192]['logp_mean']['mean'], g['per_length'][192]['logp_mean']['std']) == pytest.approx((-2, 1))
    # learned at the training length (96): seeds 1 (100%) and 2 (67%), not seed 3 (33%)
    assert (g['learned'], lr['learned'], lr['per_length'][96]['accuracy']['std']) == (2, 0, None)
    md = open(os.path.join(root, 'res', 'passkey.md')).read()
    # over seeds: the mean with its 95% t interval, cut to what a figure can be (0-100%; a log-likelihood at most 0)
    acc = lambda v: _ci_cell(v, '{:.0f}', '%', 100, 0, 1)
    assert f"| kerple | 1,2,3 | 2 of 3 [9, 99]% | {acc([1, 2 / 3, 1 / 3])} | {acc([1 / 3, 0, 0])} |" in md
    assert acc([1, 2 / 3, 1 / 3]) == '67% [0, 100]' and acc([1 / 3, 0, 0]) == '11% [0, 59]'
    lp = lambda v: _ci_cell(v, '{:.3f}', hi=0)
    assert f"| kerple | 1,2,3 | 2 of 3 [9, 99]% | {lp([-0.5, -1, -1.5])} | {lp([-1, -2, -3])} |" in md
    assert lp([-0.5, -1, -1.5]) == '-1.000 [-2.242, 0.000]' 
    assert '| kerple[learning_rate=0.001] | 1 | 0 of 1 [0, 98]% | 0% | 0% |' in md
    saved = json.load(open(os.path.join(root, 'res', 'passkey.json')))
    assert saved['groups'][0]['learned'] == 2 and saved['protocol']['learned_exact'] == 0.5


def _ci_cell(values, fmt, unit='', scale=1, lo=-math.inf, hi=math.inf):
    """A table-over-seeds cell as scipy computes it: the mean and its 95% t interval (scipy.stats.t.interval),
    cut to [lo, hi]."""
    stats = pytest.importorskip("scipy.stats")
    m = float(np.mean(values))
    a, b = stats.t.interval(0.95, len(values) - 1, loc=m, scale=stats.sem(values))
    f = lambda x: fmt.format(scale * x)
    return f"{f(m)}{unit} [{f(max(a, lo))}, {f(min(b, hi))}]"


def _row(label, setting, seed, accs, block=128, lens=(128, 256)):
    return {'label': label, 'setting': setting, 'seed': seed, 'block_size': block,
            'per_length': {L: {'accuracy': a} for L, a in zip(lens, accs)}}


def test_a_seed_exactly_at_the_learned_threshold_counts_as_learned():
    """learned means an exact match of at least learned_exact at the training length: a seed exactly at
    it counts, one just below it does not."""
    rows = [_row('k_s1', 'kerple', 1, [0.5, 0.1]), _row('k_s2', 'kerple', 2, [0.48, 0.0]),
            _row('k_s3', 'kerple', 3, [1.0, 0.3])]
    g, = EP.group_rows(rows, [128, 256], 0.5)
    assert g['learned'] == 2 and g['learned_seeds'] == [True, False, True]


def test_dape_against_its_baseline_over_learned_and_all_seeds():
    """DAPE-X minus X per length: the difference of the mean exact match with its 95% t interval cut to the possible range (exact
    match is bounded: the interval stays within -100..100 points), Welch's p and the exact p (results.compare_means),
    over the seeds that learned retrieval and, apart, over all; the exact p adjusted by Holm's method over every
    comparison of the table, which its caption counts."""
    import results
    rows = [_row('d_s1', 'dape-kerple', 1, [1.0, 0.9]), _row('d_s2', 'dape-kerple', 2, [1.0, 0.7]),
            _row('d_s3', 'dape-kerple', 3, [0.0, 0.0]),
            _row('k_s1', 'kerple', 1, [1.0, 0.2]), _row('k_s2', 'kerple', 2, [0.9, 0.4]),
            _row('k_s3', 'kerple', 3, [0.8, 0.1]), _row('r_s1', 'rope', 1, [1.0, 0.0])]
    groups = EP.group_rows(rows, [128, 256], 0.5)
    c, = EP.compare_groups(groups, [128, 256])
    assert (c['label'], c['baseline'], c['learned']) == ('dape-kerple', 'kerple', [2, 3, 3, 3])
    without_holm = lambda x: {k: v for k, v in x.items() if k != 'p_holm'}
    assert without_holm(c['learned_seeds'][256]) == results.compare_means([0.9, 0.7], [0.2, 0.4, 0.1], bounds=(0, 1))
    assert without_holm(c['all_seeds'][256]) == results.compare_means([0.9, 0.7, 0.0], [0.2, 0.4, 0.1], bounds=(0, 1))
    # Holm over the table: learned and all seeds at both lengths, 128 too (every seed at 100% or near: a test),
    # and the share of seeds that learned
    tests = results.table_tests([c], [128, 256])
    assert len(tests) == 5 and [t['p_holm'] for t in tests] == results.holm([t['p_exact'] for t in tests])
    assert tests[-1] is c['learned_share'] and c['learned_share']['diff'] == pytest.approx(2 / 3 - 1)
    table = EP.comparison_table([c], [128, 256], markdown=True)
    learned = c['learned_seeds'][256]
    pct = dict(learned, diff=100 * learned['diff'], ci=[100 * x for x in learned['ci']])
    assert -100 <= pct['ci'][0] <= pct['ci'][1] <= 100
    line = next(x for x in table.splitlines() if x.startswith('| dape-kerple - kerple | learned | 2 of 3 vs 3 of 3 |'))
    assert line.endswith(f"| {results.difference_text(pct, '{:+.0f}')}, p {results.p_text(learned['p'])}, "
                         f"exact {results.p_text(learned['p_exact'])}, Holm {results.p_text(learned['p_holm'])} |")
    share = c['learned_share']
    assert f"| dape-kerple - kerple | all | 2 of 3 vs 3 of 3, exact {results.p_text(share['p_exact'])}, " \
           f"Holm {results.p_text(share['p_holm'])} |" in table
    caption = EP.comparison_caption([c], [128, 256])
    assert 'for the 5 comparisons of this table' in caption and '0.2 with 2 and 3 seeds, 0.1 with 3 and 3 seeds' in caption
    assert 'the shares of seeds that learned' in caption
    assert 'shares' not in EP.comparison_caption(EP.compare_groups(groups, [128, 256], 'logp_mean'), [128, 256])


@pytest.mark.parametrize('ka,na,kb,nb', [(3, 6, 6, 6), (2, 6, 6, 6), (5, 10, 10, 10), (1, 4, 3, 5), (0, 3, 3, 3),
                                         (4, 6, 2, 6), (6, 6, 6, 6)])
def test_the_share_of_seeds_that_learned_is_compared_by_the_conditional_exact_test(ka, na, kb, nb):
    """Learned k of n against k of n: the permutation test on each seed's 1 or 0 is the hypergeometric test given
    the margins (scipy's hypergeom), two-sided by doubling the smaller tail."""
    stats = pytest.importorskip("scipy.stats")
    rows = ([_row(f'd_s{i}', 'dape-kerple', i, [1.0 if i < ka else 0.0, 0.0]) for i in range(na)]
            + [_row(f'k_s{i}', 'kerple', i, [1.0 if i < kb else 0.0, 0.0]) for i in range(nb)])
    c, = EP.compare_groups(EP.group_rows(rows, [128, 256], 0.5), [128, 256])
    h = stats.hypergeom(na + nb, ka + kb, na)  # a's count of learned seeds, given how many learned in all
    want = min(1.0, 2 * min(h.cdf(ka), h.sf(ka - 1)))
    assert c['learned'] == [ka, na, kb, nb] and c['learned_share']['p_exact'] == pytest.approx(want, rel=1e-9)


def test_a_measure_some_runs_lack_is_over_the_seeds_that_have_it():
    """A results file may lack the log-likelihood of some runs (those evaluated before it was kept): its table
    names the seeds it is over and counts learned among them, and its comparison over the learned seeds takes
    each seed's own value, not the value at that seed's position among every seed."""
    import results
    lens = [128, 256]

    def row(label, setting, seed, accs, lps=None):
        r = _row(label, setting, seed, accs)
        for L, lp in zip(lens, lps or ()):
            r['per_length'][L]['logp_mean'] = lp
        return r
    # dape-kerple's seed 1 learned but has no log-likelihood; seed 2 did not learn, seeds 3 and 4 did
    rows = [row('d_s1', 'dape-kerple', 1, [1.0, 0.9]), row('d_s2', 'dape-kerple', 2, [0.0, 0.0], [-2.2, -2.4]),
            row('d_s3', 'dape-kerple', 3, [1.0, 0.7], [-0.02, -0.5]), row('d_s4', 'dape-kerple', 4, [1.0, 0.8], [-0.01, -0.3]),
            row('k_s1', 'kerple', 1, [1.0, 0.2], [-0.01, -1.9]), row('k_s2', 'kerple', 2, [0.9, 0.4], [-0.05, -1.1]),
            row('k_s3', 'kerple', 3, [0.8, 0.1], [-0.3, -2.0])]
    groups = EP.group_rows(rows, lens, 0.5)
    assert groups[0]['measures']['logp_mean'] == {'seeds': [2, 3, 4], 'n': 3, 'learned': 2}
    assert groups[0]['measures']['accuracy'] == {'seeds': [1, 2, 3, 4], 'n': 4, 'learned': 3}
    c, = EP.compare_groups(groups, lens, 'logp_mean')
    without_holm = lambda x: {k: v for k, v in x.items() if k != 'p_holm'}
    assert without_holm(c['learned_seeds'][256]) == results.compare_means([-0.5, -0.3], [-1.9, -1.1, -2.0])
    assert without_holm(c['all_seeds'][256]) == results.compare_means([-2.4, -0.5, -0.3], [-1.9, -1.1, -2.0])
    assert c['learned'] == [2, 3, 3, 3]
    line = next(x for x in EP.comparison_table([c], lens, markdown=True).splitlines()
                if x.startswith('| dape-kerple - kerple | learned |'))
    assert '| 2 of 3 vs 3 of 3 |' in line
    text = EP.seed_tables({'lengths': lens, 'learned_exact': 0.5}, rows, lens)
    exact, loglik = text.split('Log-likelihood per answer token')[:2]
    assert '| dape-kerple | 1,2,3,4 | 3 of 4 ' in exact and 'the mean over each model' in exact
    assert '| dape-kerple | 2,3,4 | 2 of 3 ' in loglik and '| kerple | 1,2,3 | 3 of 3 ' in loglik
    assert "the mean over each model's seeds with this measure" in loglik


def test_dape_against_its_baseline_in_log_likelihood_too():
    """The continuous measure has its own comparison table: DAPE-X minus X in log-likelihood per answer token, an
    interval that is not cut (a difference of log-likelihoods has no finite bound), Welch's and the exact p, and
    Holm over that table alone; --tables_from prints it after exact match's."""
    import results
    lens = [128, 256]

    def row(label, setting, seed, accs, lps):
        r = _row(label, setting, seed, accs)
        for L, lp in zip(lens, lps):
            r['per_length'][L]['logp_mean'] = lp
        return r
    rows = [row('d_s1', 'dape-kerple', 1, [1.0, 0.9], [-0.01, -0.2]), row('d_s2', 'dape-kerple', 2, [1.0, 0.7], [-0.02, -0.5]),
            row('d_s3', 'dape-kerple', 3, [0.0, 0.0], [-2.2, -2.4]),
            row('k_s1', 'kerple', 1, [1.0, 0.2], [-0.01, -1.9]), row('k_s2', 'kerple', 2, [0.9, 0.4], [-0.05, -1.1]),
            row('k_s3', 'kerple', 3, [0.8, 0.1], [-0.3, -2.0])]
    groups = EP.group_rows(rows, lens, 0.5)
    c, = EP.compare_groups(groups, lens, 'logp_mean')
    assert c['metric'] == 'logp_mean'
    without_holm = lambda x: {k: v for k, v in x.items() if k != 'p_holm'}
    assert without_holm(c['all_seeds'][256]) == results.compare_means([-0.2, -0.5, -2.4], [-1.9, -1.1, -2.0])
    assert without_holm(c['learned_seeds'][256]) == results.compare_means([-0.2, -0.5], [-1.9, -1.1, -2.0])
    assert c['all_seeds'][256]['ci_method'] == 't'
    tests = results.table_tests([c], lens)
    assert [t['p_holm'] for t in tests] == results.holm([t['p_exact'] for t in tests])  # this table's four alone
    learned = c['learned_seeds'][256]
    line = next(x for x in EP.comparison_table([c], lens, markdown=True).splitlines()
                if x.startswith('| dape-kerple - kerple | learned |'))
    assert line.endswith(f"| {results.difference_text(learned, '{:+.2f}')}, p {results.p_text(learned['p'])}, "
                         f"exact {results.p_text(learned['p_exact'])}, Holm {results.p_text(learned['p_holm'])} |")
    assert 'cut to the possible range' not in EP.comparison_caption([c], lens)
    protocol = {'lengths': lens, 'learned_exact': 0.5}
    text = EP.seed_tables(protocol, rows, lens)
    assert text.index('DAPE-X minus X, exact match') < text.index('DAPE-X minus X, log-likelihood per answer token')
    assert line in text


def test_tables_from_a_results_file(tmp_path):
    """--tables_from prints the tables over seeds of a passkey.json without evaluating anything, from the
    runs' figures alone (what a results page keeps)."""
    rows = [_row('k_s1', 'kerple', 1, [1.0, 0.5]), _row('k_s2', 'kerple', 2, [1.0, 0.3])]
    path = tmp_path / 'passkey.json'

    def tables(rows):
        path.write_text(json.dumps({'protocol': {'lengths': [128, 256], 'learned_exact': 0.5},
                                    'rows': [dict(r, per_length={str(L): c for L, c in r['per_length'].items()})
                                             for r in rows]}))
        return EP.main([f'--tables_from={path}'])

    text = tables(rows)
    # every seed at 100%: the single point; 50% and 30%: the t interval with one degree of freedom, cut at 0
    assert f"| kerple | 1,2 | 2 of 2 [16, 100]% | 100% [100, 100] | {_ci_cell([0.5, 0.3], '{:.0f}', '%', 100, 0, 1)} |" in text
    assert '| k_s2 | 100% | 30% |' in text
    assert 'the mean over seeds 1,2 with the 95% t interval of the mean' in text
    # the rule for learned, with the day it was set
    assert 'learned: seeds with an exact match of at least 50% at their training length (the rule since 2026-11-24)' in text
    assert EP.learned_text(0.7).endswith("(this evaluation's rule; the standing one, set on 2026-11-24, is 50%), "
                                             "with the exact (Clopper-Pearson) 95% interval of the share of seeds")
    # models over different seeds: the header must not claim one set for all of them
    text = tables(rows + [_row('r_s3', 'rope', 3, [1.0, 0.0])])
    assert "the mean over each model's seeds with this measure (its seeds column) with" in text and 'seeds 1,2,3' not in text


def test_save_runs_adds_an_evaluation_to_a_results_file(tmp_path, monkeypatch):
    """--save_runs merges the evaluated runs into a results file (source: run, exact match and log-likelihood per
    length), replacing a run of the same label in place and putting a new one after its setting's last; the
    file's tables then include it. A file of another protocol, a file that is not a results file, a folder that
    does not exist and the same run under a second label are refused before anything is evaluated or written."""
    root = str(tmp_path)
    make_text_data(os.path.join(root, 'data'))
    ckpt = make_ckpt(root, 'kerple_s3', pos='kerple')
    scored = []

    def fake_score(model, ps, device='cpu', ctx=None, batch=1):
        scored.append(len(ps))
        for p in ps:
            n = p['answer'].stop - p['answer'].start
            p.update(exact=p['length'] == 96, logp_mean=-0.5, logp=-0.5 * n, said=p['ids'][p['answer']].tolist())
        return ps

    monkeypatch.setattr(EP, 'score_prompts', fake_score)
    path = tmp_path / 'passkey_cpu.json'
    protocol = {'lengths': [96, 192], 'depths': [0, 0.5, 1], 'trials': 2, 'filler': 'val', 'seed': 1337,
                'learned_exact': 0.5}
    old = lambda label, setting, acc: {'label': label, 'setting': setting, 'seed': int(label[-1]), 'block_size': 48,
                                       'per_length': {'96': {'accuracy': acc}, '192': {'accuracy': acc}}}
    path.write_text(json.dumps({'what': 'kept', 'protocol': protocol, 'rows': [
        old('kerple_s1', 'kerple', 1.0), old('kerple_s3', 'kerple', 0.1), old('kerple_s2', 'kerple', 0.2),
        old('alibi_s1', 'alibi', 0.0)]}))
    EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False, save_runs=str(path)), [ckpt])
    saved = json.loads(path.read_text())
    assert saved['what'] == 'kept' and [r['label'] for r in saved['rows']] == ['kerple_s1', 'kerple_s3', 'kerple_s2',
                                                                             'alibi_s1']
    # where the run came from, as its checkpoint records it ('unknown' for this one, saved without the record)
    # and its setting, which a later save of another setting under the same label is checked against
    assert len(saved['rows'][1].pop('setting_key')) == 12
    assert saved['rows'][1] == {'label': 'kerple_s3', 'setting': 'kerple', 'seed': None, 'block_size': 48, 'source': 'run',
                                'per_length': {'96': {'accuracy': 1.0, 'logp_mean': -0.5},
                                               '192': {'accuracy': 0.0, 'logp_mean': -0.5}},
                                **dict.fromkeys(('commit', 'command', 'machine', 'date'), 'unknown')}
    assert '| kerple_s3 | 100% | 0% |' in EP.main([f'--tables_from={path}'])
    EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False, save_runs=str(path)),
                [make_ckpt(root, 'rope_s1', pos='rope')])
    rows = json.loads(path.read_text())['rows']
    assert [r['label'] for r in rows] == ['kerple_s1', 'kerple_s3', 'kerple_s2', 'alibi_s1', 'rope_s1']
    # a new run goes among its setting's runs by seed: before the first of a larger seed, else after the last
    EP.merge_runs(str(path), protocol, [dict(rows[1], label='kerple_s0', seed=0), dict(rows[1], label='kerple_s9', seed=9)])
    assert [r['label'] for r in json.loads(path.read_text())['rows']] == [
        'kerple_s0', 'kerple_s1', 'kerple_s3', 'kerple_s2', 'kerple_s9', 'alibi_s1', 'rope_s1']
    # the same run (setting and seed) under another label would count as a second seed: refused, the file unchanged
    before = path.read_text()
    with pytest.raises(InputError, match="holds kerple_s1, a run of kerple with seed 1, .* again as kerple_s1b"):
        EP.merge_runs(str(path), protocol, [dict(rows[1], label='kerple_s1b', seed=1)])
    assert path.read_text() == before
    n = len(scored)
    with pytest.raises(InputError, match="holds runs evaluated with .*'trials': 2.* uses .*'trials': 3"):
        EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False, save_runs=str(path), trials=3), [ckpt])
    assert path.read_text() == before and len(scored) == n
    # a file that is not a results file, or a folder that does not exist: refused before anything is evaluated
    bad = tmp_path / 'bad.json'
    for text, match in (('{"rows": [', 'not a readable results file'), ('[]', 'not a passkey results file')):
        bad.write_text(text)
        with pytest.raises(InputError, match=match):
            EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False, save_runs=str(bad)), [ckpt])
        assert bad.read_text() == text
    with pytest.raises(InputError, match='--save_runs: no folder'):
        EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False, save_runs=str(tmp_path / 'no' / 'x.json')),
                    [ckpt])
    assert len(scored) == n
    # two checkpoints of one folder name would be one row: refused, with the fix
    twin = make_ckpt(root, os.path.join('elsewhere', 'kerple_s3'), pos='kerple')
    with pytest.raises(InputError, match='both named kerple_s3 .*--labels='):
        EP.evaluate(ep_cfg(out_dir=os.path.join(root, 'res'), plot=False), [ckpt, twin])


def test_zero_init_is_compared_with_its_encoding_and_with_the_default_init():
    """'dape-kerple-zero' (dape_init zero: common.base_label) against 'kerple' and against 'dape-kerple'."""
    import results
    labels = ('kerple', 'dape-kerple', 'dape-kerple-zero', 'dapev2-kerple', 'dape-path-zero')
    pairs = results.dape_pairs(labels, results.label_parts)
    assert pairs == [('dape-kerple', 'kerple'), ('dape-kerple-zero', 'kerple'), ('dape-kerple-zero', 'dape-kerple'),
                     ('dapev2-kerple', 'kerple')]


# -----------------------------------------------------------------------------
# the test-retest of the same runs under two roundings (--rounding_from)

RETEST_PROTOCOL = {'lengths': [128, 256, 512], 'depths': [0, 0.5, 1], 'trials': 10, 'filler': 'val', 'seed': 1337,
                   'digits': 5, 'learned_exact': 0.5}


def _retest_file(path, runs, kernels, suffix='', protocol=RETEST_PROTOCOL):
    """A results file (as --save_runs writes it) of runs {(setting, seed): [exact match at 128, 256, 512]}, trained
    under `kernels`; each run's log-likelihood per token is made from its exact match and seed."""
    rows = [{'label': f"{setting}_s{seed}{suffix}", 'setting': setting, 'seed': seed, 'block_size': 128,
             'per_length': {str(L): {'accuracy': a, 'logp_mean': -2.3 * (1 - a) - 0.01 * seed * (1 + len(suffix))}
                            for L, a in zip(protocol['lengths'], accs)},
             'source': 'run', 'commit': 'abc1234', 'command': 'python train.py', 'date': '2026-11-30',
             'machine': f"AMD EPYC (family 25, model 1), {kernels} kernels, torch 2.13.0+cpu"}
            for (setting, seed), accs in runs.items()]
    path.write_text(json.dumps({'protocol': protocol, 'rows': rows}))
    return str(path)


def _cells(table, start):
    line, = [x for x in table.splitlines() if x.startswith(start)]
    return [c.strip() for c in line.strip('|').split('|')]


def test_merge_runs_of_unknown_seed_and_their_record(tmp_path):
    """Runs without a seed cannot be told to be the same run: a second label of the setting is saved, after the
    first (a seed of None or 0 is not before it). Each saved run names where it was trained as evaluate records
    it (trained_by), not 'unknown'."""
    protocol = {'lengths': [96], 'depths': [0.5], 'trials': 2, 'filler': 'val', 'seed': 1337, 'digits': 5,
                'learned_exact': 0.5}
    trained = {'commit': 'abc', 'command': 'python train.py', 'machine': 'M', 'date': '2026-12-01'}
    row = lambda label, seed: {'label': label, 'setting': 'kerple', 'seed': seed, 'block_size': 48,
                               'per_length': {'96': {'accuracy': 1.0, 'logp_mean': -0.5}}, 'trained_by': trained}
    path = tmp_path / 'runs.json'
    EP.merge_runs(str(path), protocol, [row('a', None)])
    EP.merge_runs(str(path), protocol, [row('b', None)])
    EP.merge_runs(str(path), protocol, [row('c', 0)])
    rows = json.loads(path.read_text())['rows']
    assert [r['label'] for r in rows] == ['a', 'b', 'c']
    assert all({k: r[k] for k in trained} == trained for r in rows)


def test_retest_pairs_the_same_runs_under_two_roundings(tmp_path):
    """--tables_from with --rounding_from: the same runs (setting and seed, whatever their labels and order) under two
    roundings. Per model, Pearson's r and the mean change of each run's exact match (the mean over the lengths), how
    many seeds learned under each and how many changed sides (kerple's seed 2 learns under the first only, its seed
    4 under the second only: the counts agree, two runs changed sides); per run, both side by side; and each
    comparison over every seed once, Holm over each rounding's own table: DAPE-Kerple's exact match is ahead at every
    length under the first and behind at 512 under the second, significant under neither (no conclusion, mixed
    signs); its log-likelihood significantly ahead at 256 under the first only (a conclusion that fails); the share
    of seeds that learned, 5 of 5 against 4 of 5 under both (same sign, not significant). A model in one file only
    (rope) does not count. The expected figures are computed here from the runs, apart."""
    import results
    lens = RETEST_PROTOCOL['lengths']
    a = {**{('kerple', s): v for s, v in zip(range(1, 6), [[1.0, 0.2, 0.1], [0.9, 0.1, 0.0], [1.0, 0.3, 0.1],
                                                           [0.45, 0.2, 0.2], [1.0, 0.1, 0.0]])},
         **{('dape-kerple', s): v for s, v in zip(range(1, 6), [[1.0, 0.6, 0.3], [1.0, 0.7, 0.2], [1.0, 0.8, 0.1],
                                                                [0.9, 0.9, 0.4], [1.0, 0.5, 0.2]])},
         ('rope', 1): [1.0, 0.0, 0.0], ('rope', 2): [1.0, 0.1, 0.0]}
    b = {**{('kerple', s): v for s, v in zip(range(1, 6), [[1.0, 0.2, 0.3], [0.4, 0.2, 0.2], [1.0, 0.3, 0.4],
                                                           [0.8, 0.1, 0.3], [1.0, 0.1, 0.2]])},
         **{('dape-kerple', s): v for s, v in zip(range(1, 6), [[1.0, 0.6, 0.1], [1.0, 0.8, 0.2], [1.0, 0.2, 0.0],
                                                                [0.9, 0.9, 0.1], [1.0, 0.6, 0.1]])}}
    path_a = _retest_file(tmp_path / 'a.json', a, 'AVX512')
    # other labels, and the runs in another order: a run's retest is the same setting and seed, not label or place
    path_b = _retest_file(tmp_path / 'b.json', dict(reversed(list(b.items()))), 'DEFAULT', suffix='_default')
    table = EP.main([f'--tables_from={path_a}', f'--rounding_from={path_b}'])
    moved, per_run, compared, caption = table.split('\n\n')
    assert moved.splitlines()[0] == '| model | runs | r | mean change | learned, AVX512 | learned, DEFAULT | changed sides |'
    learned = {k: {key: v[0] >= 0.5 for key, v in runs.items()} for k, runs in (('a', a), ('b', b))}
    figure = lambda runs, keys: np.array([100 * np.mean(runs[k]) for k in keys])
    for setting, flips in (('kerple', 2), ('dape-kerple', 0)):
        keys = [(setting, s) for s in range(1, 6)]
        xs, ys = figure(a, keys), figure(b, keys)
        assert _cells(moved, f"| {setting} |")[1:] == [
            '5', f"{np.corrcoef(xs, ys)[0, 1]:+.2f}", f"{np.mean(np.abs(xs - ys)):.1f}",
            results.k_of_n_text(sum(learned['a'][k] for k in keys), 5),
            results.k_of_n_text(sum(learned['b'][k] for k in keys), 5), str(flips)]
    assert _cells(moved, '| kerple |')[4] == results.k_of_n_text(4, 5)  # the same count, two runs moved
    every = [k for k in a if k in b]
    assert _cells(moved, '| all |')[1:3] == ['10', f"{np.corrcoef(figure(a, every), figure(b, every))[0, 1]:+.2f}"]
    assert _cells(moved, '| all |')[6] == '2'
    assert 'rope' not in moved + per_run  # in the first file only: not counted
    assert _cells(per_run, '| kerple | 2 |') == ['kerple', '2', f"{100 * np.mean(a[('kerple', 2)]):.1f} / "
                                                                f"{100 * np.mean(b[('kerple', 2)]):.1f}", 'yes / no']
    assert _cells(per_run, '| kerple | 4 |')[3] == 'no / yes'

    def verdicts(runs, flags, bounds=(0, 1)):
        """Each rounding's own table of one measure: DAPE-Kerple minus Kerple over the learned seeds and over all,
        per length, and in exact match's the share of seeds that learned, Holm over those six or seven;
        -> {(which, L): 'ahead', 'behind*', ...}."""
        tests = {}
        for which in ('learned', 'all'):
            for i, L in enumerate(lens):
                vals = lambda m: [runs[(m, s)][i] for s in range(1, 6) if which == 'all' or flags[(m, s)]]
                tests[(which, L)] = results.compare_means(vals('dape-kerple'), vals('kerple'), bounds=bounds)
        if bounds:
            share = lambda m: [float(flags[(m, s)]) for s in range(1, 6)]
            tests[('share', None)] = results.compare_means(share('dape-kerple'), share('kerple'), bounds=(0, 1))
        ok = [k for k, c in tests.items() if c['status'] == 'ok']
        holm = dict(zip(ok, results.holm([tests[k]['p_exact'] for k in ok])))
        return {k: ('ahead' if c['diff'] > 0 else 'behind' if c['diff'] < 0 else 'level')
                + ('*' if holm[k] < results.ALPHA else '') for k, c in tests.items() if k in holm}

    logp = lambda acc, seed, suffix: -2.3 * (1 - acc) - 0.01 * seed * (1 + len(suffix))
    va, vb = verdicts(a, learned['a']), verdicts(b, learned['b'])
    la = verdicts({k: [logp(v, k[1], '') for v in vs] for k, vs in a.items()}, learned['a'], bounds=None)
    lb = verdicts({k: [logp(v, k[1], '_default') for v in vs] for k, vs in b.items()}, learned['b'], bounds=None)
    every_seed = lambda v: [v[('all', L)] for L in lens]
    assert every_seed(va) == ['ahead'] * 3 and every_seed(vb) == ['ahead', 'ahead', 'behind']
    assert every_seed(la)[1] == 'ahead*' and not any('*' in x for x in every_seed(lb))
    assert _cells(compared, '| dape-kerple vs kerple | exact match')[4] == 'opposite or mixed sign, not significant'
    assert _cells(compared, '| dape-kerple vs kerple | exact match')[2].startswith('higher at 3, lower at 0 of 3;')
    assert _cells(compared, '| dape-kerple vs kerple | exact match')[3].startswith('higher at 2, lower at 1 of 3;')
    assert _cells(compared, '| dape-kerple vs kerple | log-likelihood')[4] == 'fails'
    # the share of seeds that learned: 5 of 5 against 4 of 5 under both (kerple's seeds 2 and 4 swapped sides)
    assert (va[('share', None)], vb[('share', None)]) == ('ahead', 'ahead')
    assert _cells(compared, '| dape-kerple vs kerple | share of seeds that learned |')[2:] == [
        '5 of 5 vs 4 of 5, Holm p 1', '5 of 5 vs 4 of 5, Holm p 1', 'same sign, not significant']
    assert len(compared.splitlines()) == 2 + 3  # each comparison once, however many lengths
    assert caption.endswith("Of the 3 comparisons, 1 were conclusions under the first side, of which 0 hold under the "
                            "second and 1 do not; 0 were conclusions under the second only; of the rest, 1 kept their "
                            "sign, 1 had opposite or mixed signs and 0 were exact ties under one side or both.")
    assert "seeds 1,2,3,4,5" in caption and "ATen's AVX512 kernels and its DEFAULT kernels" in caption


def test_retest_of_the_share_of_seeds_that_learned(tmp_path):
    """The share of seeds that learned is a comparison of its own under each rounding: DAPE-Kerple 0 of 6 against
    Kerple's 6 of 6 is behind, significantly (exact p 0.0022, Holm 0.0087 over the table's 4 tests: every seed at
    each length, and the share; none learned, so nothing over the learned seeds), under the first; 2 of 6 against 6 of
    6 under the second is behind but not significantly: a conclusion that fails."""
    import results
    kerple = {('kerple', s): [1.0, 0.5, 0.2] for s in range(6)}
    a = {**kerple, **{('dape-kerple', s): [0.0, 0.0, 0.0] for s in range(6)}}
    b = {**kerple, **{('dape-kerple', s): [1.0 if s < 2 else 0.0, 0.0, 0.0] for s in range(6)}}
    table = EP.main([f"--tables_from={_retest_file(tmp_path / 'a.json', a, 'AVX512')}",
                     f"--rounding_from={_retest_file(tmp_path / 'b.json', b, 'DEFAULT', suffix='_default')}"])
    p = lambda k: results.compare_means([1.0] * k + [0.0] * (6 - k), [1.0] * 6, bounds=(0, 1))['p_exact']
    assert p(0) == pytest.approx(2 / math.comb(12, 6))
    cells = _cells(table, '| dape-kerple vs kerple | share of seeds that learned |')
    assert cells[2] == f"0 of 6 vs 6 of 6, Holm p {results.p_text(4 * p(0))}" and cells[4] == 'fails'
    assert cells[3].startswith("2 of 6 vs 6 of 6, Holm p ")


def test_retest_names_the_machines_its_runs_were_trained_on(tmp_path):
    """The caption says on which machines the runs and their retests were trained: 'of one machine' where every run
    and its retest share one; with runs spread over two machines, both named; a run whose retest ran on another
    machine than the run itself, and a run without a recorded machine, counted apart (their differences are not
    the rounding's alone)."""
    import results
    runs = {(setting, s): [1.0, 0.5, 0.2] for setting in ('kerple', 'dape-kerple') for s in range(3)}
    a, b = _retest_file(tmp_path / 'a.json', runs, 'AVX512'), _retest_file(tmp_path / 'b.json', runs, 'DEFAULT')
    caption = lambda: EP.main([f'--tables_from={a}', f'--rounding_from={b}']).splitlines()[-1]
    assert caption().startswith("The same runs (seeds 0,1,2) trained under two roundings of one machine: ATen's AVX512")
    intel = 'Intel(R) Xeon(R) Processor (family 6, model 207), {} kernels, torch 2.13.0+cpu'

    def move(path, seed, machine):  # the runs of one seed (both settings) to another machine
        saved = json.loads(open(path).read())
        for r in saved['rows']:
            if r['seed'] == seed:
                r['machine'] = machine
        open(path, 'w').write(json.dumps(saved))
    move(a, 2, intel.format('AVX512'))
    move(b, 2, intel.format('DEFAULT'))
    assert caption().startswith("The same runs (seeds 0,1,2) trained under two roundings of one machine per run (2 "
                                "machines: AMD EPYC (family 25, model 1); Intel(R) Xeon(R) Processor (family 6, model "
                                "207)): ATen's AVX512 kernels and its DEFAULT kernels")
    move(b, 1, intel.format('DEFAULT'))  # seed 1's retests on the Intel machine, its runs on the AMD one
    move(b, 0, 'unknown')
    assert ("of one machine per run (2 machines: AMD EPYC (family 25, model 1); Intel(R) Xeon(R) Processor (family 6, "
            "model 207)), except 2 runs retrained on another machine (there the machine differs too) (2 runs without a "
            "recorded machine): ATen's") in caption()
    assert results.cpu_of('NVIDIA H200, torch 2.13.0') == 'NVIDIA H200' and results.cpu_of(None) is None


def test_retest_counts_each_comparison_once_over_every_seed(tmp_path):
    """Each comparison counts once, over every seed, however many lengths: DAPE-Kerple against Kerple in exact match,
    in log-likelihood and in the share of seeds that learned, three rows and three counts; the comparisons over the
    seeds that learned (DAPE-Kerple's seeds 4 and 5 fail under both, at 0% under the first and 30% under the second)
    are left out."""
    kerple = {('kerple', s): [1.0, 0.5, 0.2] for s in range(6)}
    learned = {('dape-kerple', s): [1.0, 0.6 + 0.01 * s, 0.3] for s in range(4)}
    a = {**kerple, **learned, **{('dape-kerple', s): [0.0, 0.0, 0.0] for s in (4, 5)}}
    b = {**kerple, **learned, **{('dape-kerple', s): [0.3, 0.6, 0.3] for s in (4, 5)}}
    table = EP.main([f"--tables_from={_retest_file(tmp_path / 'a.json', a, 'AVX512')}",
                     f"--rounding_from={_retest_file(tmp_path / 'b.json', b, 'DEFAULT', suffix='_default')}"])
    compared, caption = table.split('\n\n')[2:]
    assert [_cells(line, '|')[1] for line in compared.splitlines()[2:]] == [
        'exact match, every seed', 'share of seeds that learned', 'log-likelihood per answer token, every seed']
    assert re.search(r"(Of the 3 comparisons|of the 3 with a test under both)", caption), caption


def test_figure_draws_the_tables_over_seeds_a_column_per_rounding(tmp_path):
    """--figure with --tables_from (and --rounding_from) draws each file's tables over seeds: per model and length the
    mean over seeds with its 95% t interval cut to the possible range, as scipy computes it, the mean alone for one
    seed; a column per file, titled by its file and kernels. --figure alone is refused."""
    stats = pytest.importorskip("scipy.stats")
    a = {('kerple', 1): [1.0, 0.4, 0.1], ('kerple', 2): [1.0, 0.9, 0.3], ('kerple', 3): [0.9, 0.8, 0.0],
         ('rope', 1): [1.0, 0.1, 0.0]}
    b = {('kerple', 1): [1.0, 0.2, 0.3], ('kerple', 2): [0.4, 0.2, 0.0], ('kerple', 3): [1.0, 1.0, 0.9]}
    path_a = _retest_file(tmp_path / 'a.json', a, 'AVX512')
    path_b = _retest_file(tmp_path / 'b.json', b, 'DEFAULT', suffix='_default')
    out = tmp_path / 'fig' / 'retest.png'
    assert EP.main([f'--tables_from={path_a}', f'--rounding_from={path_b}', f'--figure={out}'])
    assert out.stat().st_size > 10_000
    drawn = EP.figure_from_files([path_a, path_b], str(tmp_path / 'again.png'))
    lens = RETEST_PROTOCOL['lengths']
    want = {}
    for title, runs, suffix in (('a.json (AVX512 kernels)', a, ''), ('b.json (DEFAULT kernels)', b, '_default')):
        for setting in dict.fromkeys(s for s, _ in runs):
            seeds = [s for m, s in runs if m == setting]
            for metric, scale, lo, hi in (('accuracy', 100, 0, 100), ('logp_mean', 1, -math.inf, 0)):
                points = []
                for i, L in enumerate(lens):
                    acc = [runs[(setting, s)][i] for s in seeds]
                    v = acc if metric == 'accuracy' else [-2.3 * (1 - x) - 0.01 * s * (1 + len(suffix))
                                                         for x, s in zip(acc, seeds)]
                    m = float(np.mean(v))
                    ci = (stats.t.interval(0.95, len(v) - 1, loc=m, scale=stats.sem(v)) if len(v) > 1 else (m, m))
                    points.append((L, scale * m, scale * max(ci[0], lo / scale), scale * min(ci[1], hi / scale)))
                want[(title, setting, metric)] = points
    assert drawn.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(np.array(drawn[k]), np.array(want[k]), rtol=1e-9, atol=1e-9, err_msg=str(k))
    assert drawn[('a.json (AVX512 kernels)', 'kerple', 'accuracy')][0][3] == 100  # cut to the possible range
    with pytest.raises(InputError, match=r'--figure=.*x\.png draws a results file: name it with --tables_from'):
        EP.main([f'--figure={tmp_path}/x.png'])


def test_retest_errors(tmp_path):
    """--rounding_from needs --tables_from, and a file; two files evaluated differently (SAME_PROTOCOL), or a run
    twice in one file, are refused, the error naming what differs. Each error is one line."""
    runs = {('kerple', s): [1.0, 0.5, 0.2] for s in (1, 2)}
    path_a = _retest_file(tmp_path / 'a.json', runs, 'AVX512')
    cases = [([f'--rounding_from={path_a}'], r'--rounding_from=.*a\.json compares two results files: name the first '
                                              r'with --tables_from'),
             ([f'--tables_from={path_a}', f'--rounding_from={tmp_path}/none.json'], '--rounding_from: no file .*none.json'),
             ([f'--tables_from={tmp_path}/none.json', f'--rounding_from={path_a}'], '--tables_from: no file .*none.json')]
    other = dict(RETEST_PROTOCOL, trials=20, filler='sentence')
    path_b = _retest_file(tmp_path / 'b.json', runs, 'DEFAULT', protocol=other)
    cases.append(([f'--tables_from={path_a}', f'--rounding_from={path_b}'],
                  r"evaluated differently, trials 10 in .*a\.json and 20 in .*b\.json, filler 'val' in .*a\.json and "
                  r"'sentence' in .*b\.json"))
    twice = tmp_path / 'twice.json'
    saved = json.loads(open(_retest_file(twice, runs, 'DEFAULT')).read())
    twice.write_text(json.dumps(dict(saved, rows=saved['rows'] + [dict(saved['rows'][0], label='kerple_s1b')])))
    cases.append(([f'--tables_from={path_a}', f'--rounding_from={twice}'],
                  '--rounding_from: two runs of kerple with seed 1 .kerple_s1 and kerple_s1b.'))
    for args, msg in cases:
        with pytest.raises(InputError, match=msg) as e:
            EP.main(args)
        assert '\n' not in str(e.value)
    # the same protocol: the tables
    assert EP.main([f'--tables_from={path_a}', f'--rounding_from={_retest_file(tmp_path / "c.json", runs, "DEFAULT")}'])


def test_the_test_retest_settings_differ_from_passkey_cpu_in_what_they_state(tmp_path, monkeypatch):
    """config/passkey_cpu_small.py (half the width) and config/passkey_cpu_2layer.py (2 layers) read
    config/passkey_cpu.py: each resolves to its every key but the ones its name and docs/passkey_results.md
    state, from any working directory."""
    from configurator import configure
    monkeypatch.chdir(tmp_path)  # each reads passkey_cpu.py beside itself, not from the working directory
    base = configure(train.DEFAULTS, [os.path.join(ROOT, 'config', 'passkey_cpu.py')])
    for name, changed in [('passkey_cpu_small.py', {'n_head': 8, 'n_embd': 64}),
                          ('passkey_cpu_2layer.py', {'n_layer': 2})]:
        cfg = configure(train.DEFAULTS, [os.path.join(ROOT, 'config', name)])
        assert {k: v for k, v in cfg.items() if base[k] != v} == changed, name


def test_save_runs_keeps_two_settings_of_one_label_apart(tmp_path):
    """A setting's label comes from the runs evaluated together: two trainings that differ in learning rate alone,
    saved one command at a time, are both 'kerple'. Each saved row keeps its setting, so that the second save is
    refused rather than pooled with the first as another seed (and the same setting under another label too)."""
    protocol = {'lengths': [96], 'depths': [0.5], 'trials': 2, 'filler': 'val', 'seed': 1337, 'digits': 5,
                'learned_exact': 0.5}
    row = lambda label, setting, seed, key: {'label': label, 'setting': setting, 'setting_key': key, 'seed': seed,
                                             'block_size': 48, 'per_length': {96: {'accuracy': 1.0, 'logp_mean': -0.1}}}
    path = tmp_path / 'r.json'
    EP.merge_runs(str(path), protocol, [row('k_s1', 'kerple', 1, 'aaa')])
    EP.merge_runs(str(path), protocol, [row('k_s2', 'kerple', 2, 'aaa')])  # another seed of it: kept
    before = path.read_text()
    for new, what in ((row('k3_s1', 'kerple', 1, 'bbb'), 'another setting under the same label'),
                      (row('k_lr_s3', 'kerple[learning_rate=0.001]', 3, 'aaa'), 'the same setting under another label')):
        with pytest.raises(InputError, match=f"holds k_s1 .* is {what}: evaluate the runs of both settings together"):
            EP.merge_runs(str(path), protocol, [new])
        assert path.read_text() == before


def test_options_that_would_change_nothing_or_count_twice_are_refused(tmp_path):
    """--tables_from evaluates nothing: a checkpoint or an evaluation option beside it would be ignored, so it is
    refused; a length or depth given twice would count its prompts as more trials; a key of more digits than a
    64-bit integer holds cannot be drawn. Each a one-line error naming the option."""
    path = tmp_path / 'r.json'
    path.write_text(json.dumps({'protocol': {'lengths': [96], 'learned_exact': 0.5}, 'rows': []}))
    for extra in (['--trials=7'], ['--save_runs=x.json'], [str(tmp_path)]):
        with pytest.raises(InputError, match='evaluates nothing; leave out') as e:
            EP.main([f'--tables_from={path}'] + extra)
        assert '\n' not in str(e.value)
    for key, value in (('lengths', '96,96'), ('depths', '0.5,0.5')):
        with pytest.raises(InputError, match=f'--{key} repeats a value'):
            EP.check_options(ep_cfg(**{key: value}))
    with pytest.raises(InputError, match='--digits is at most 18'):
        EP.check_options(ep_cfg(digits=19))
