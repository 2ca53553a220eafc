"""retrieval_data.py's generators (flip-flop, MQAR) against their definitions, checked by independent
loops over every sequence; and che_tasks.py's causal mode: framing, scoring at exactly the determined
positions, the other test distributions summarized and tabled."""

import numpy as np
import pytest
import torch

import che_tasks
import retrieval_data as rd
from che_data import TASKS as CHE_TASKS, make_batch


def test_flip_flop_reads_return_the_latest_write():
    rng = np.random.default_rng(0)
    for p_ignore in (0.8, 0.98, 0.1):
        idx, targets = rd.flip_flop(200, 13, rng, p_ignore)
        assert idx.shape == targets.shape == (200, 26)
        for seq, tgt in zip(idx, targets):
            ops, bits = seq[0::2], seq[1::2]
            assert ops[0] == rd.WRITE and ops[-1] == rd.READ and set(bits) <= {rd.BIT0, rd.BIT1}
            memory = None
            for t, (op, bit) in enumerate(zip(ops, bits)):
                if op == rd.WRITE:
                    memory = bit
                if op == rd.READ:
                    assert bit == memory and tgt[2 * t] == bit  # the bit read is the last one written
                else:
                    assert tgt[2 * t] == -1
                assert tgt[2 * t + 1] == -1  # the next instruction is never determined


def test_flip_flop_distributions():
    """Instructions are 'ignore' with probability p_ignore, else write or read alike (first and last fixed)."""
    rng = np.random.default_rng(1)
    for p_ignore in (0.8, 0.98, 0.1):
        ops = rd.flip_flop(4000, 50, rng, p_ignore)[0][:, 2:-2:2]
        assert abs((ops == rd.IGNORE).mean() - p_ignore) < 0.01
        assert abs((ops == rd.WRITE).mean() - (ops == rd.READ).mean()) < 0.01
    with pytest.raises(ValueError, match="N >= 2"):
        rd.flip_flop(1, 1, rng)


def test_flip_flop_by_hand():
    """One small case written out: w1 i0 r? w0 i1 r? -> the reads return 1 and 0."""
    class Fixed:  # an rng that returns these instructions and bits
        def choice(self, options, size, p):
            return np.array([[rd.WRITE, rd.IGNORE, rd.READ, rd.WRITE, rd.IGNORE, rd.READ]])

        def integers(self, lo, hi, size):
            return np.array([[1, 0, 0, 0, 1, 1]])
    idx, targets = rd.flip_flop(1, 6, Fixed())
    W, R, I = rd.WRITE, rd.READ, rd.IGNORE
    assert idx[0].tolist() == [W, 1, I, 0, R, 1, W, 0, I, 1, R, 0]
    assert targets[0].tolist() == [-1, -1, -1, -1, 1, -1, -1, -1, -1, -1, 0, -1]


def test_mqar_recalls_every_key_with_its_value():
    rng = np.random.default_rng(2)
    N, V = 9, rd.MQAR_VALUES
    idx, targets = rd.mqar(300, N, rng)
    assert idx.shape == targets.shape == (300, 4 * N)
    for seq, tgt in zip(idx, targets):
        keys, values = seq[0:2 * N:2], seq[1:2 * N:2]
        assert len(set(keys)) == N and all(V <= k < V + rd.MQAR_KEYS for k in keys)
        assert all(0 <= v < V for v in values)
        memory = dict(zip(keys, values))
        queries = seq[2 * N::2]
        assert sorted(queries) == sorted(keys)  # every key comes back once
        for m, key in enumerate(queries):
            assert seq[2 * N + 2 * m + 1] == memory[key] == tgt[2 * N + 2 * m]
        assert (tgt[:2 * N] == -1).all() and (tgt[2 * N + 1::2] == -1).all()
    with pytest.raises(ValueError, match="1 <= N <= 256"):
        rd.mqar(1, 257, rng)


def test_che_framing_is_unchanged():
    """The runner's framing of a CHE task: make_batch's inputs and targets, scored exactly at the positions
    of the masked accuracy (a masked task counts up to its terminator)."""
    task = CHE_TASKS['binary_addition']
    idx, targets, scored = che_tasks.frame(task, 8, 5, np.random.default_rng(3))
    ref_idx, ref_targets, y, mask = make_batch(task, 8, 5, np.random.default_rng(3))
    assert (idx == ref_idx).all() and (targets == ref_targets).all()
    assert (scored[:, -y.shape[1]:] == mask).all() and not scored[:, :-y.shape[1]].any()


class Oracle(torch.nn.Module):
    """A 'model' whose logits put all the mass on the true next token (or, wrong=True, on another)."""

    def __init__(self, vocab, wrong=False):
        super().__init__()
        self.vocab, self.wrong = vocab, wrong

    def forward(self, idx, targets):
        ans = torch.where(targets >= 0, targets, torch.zeros_like(targets))
        if self.wrong:
            ans = (ans + 1) % 2
        return 10 * torch.nn.functional.one_hot(ans, self.vocab).float(), None


def test_scoring_counts_exactly_the_determined_positions():
    task = che_tasks.TASKS['flip_flop']
    idx, targets, scored = (torch.from_numpy(a) for a in che_tasks.frame(task, 16, 20, np.random.default_rng(4)))
    for wrong, acc in ((False, 1.0), (True, 0.0)):
        loss, correct = che_tasks.output_loss_and_correct(Oracle(task.input_vocab, wrong), task, idx, targets,
                                                          scored, torch.autocast("cpu", enabled=False))
        assert correct.sum().item() / scored.sum().item() == acc
        assert (loss.item() < 1e-3) == (not wrong)
    assert scored.sum().item() == (idx[:, 0::2] == rd.READ).sum().item()


def test_other_test_distributions_are_summarized_and_tabled():
    """A flip-flop cell reports its sparse and dense scores (max and mean over runs) beside its OOD score,
    in the grid table as rows of their own and in the summary as columns."""
    runs = [dict(score=60.0, id_score=90.0, final_train_acc=95.0, seed=s, learning_rate=1e-3,
                 variants={'sparse': dict(score=sp, per_length={}), 'dense': dict(score=de, per_length={})})
            for s, (sp, de) in enumerate([(50.0, 99.0), (70.0, 97.0)])]
    cell = dict(che_tasks.summarize(runs), runs=runs, encoding='FoX', random_baseline=50.0, n_runs=2)
    assert cell['variants'] == {'sparse': {'score': 70.0, 'score_mean': 60.0},
                                'dense': {'score': 99.0, 'score_mean': 98.0}}
    cfg = dict({k: getattr(che_tasks, k) for k in che_tasks.config_keys}, task="flip_flop", seeds="0,1",
               train_max_len=8, eval_min_len=9, eval_max_len=20)
    table = che_tasks.grid_table({('flip_flop', 'fox', 'none'): cell}, ['flip_flop'], [('fox', 'none')], cfg)
    assert "| retrieval | flip_flop, sparse | 50 | 70.00 (60.00) |" in table
    assert "| retrieval | flip_flop, dense | 50 | 99.00 (98.00) |" in table
    assert "bidir_bias" not in table  # a causal task has no left and right to tell apart
    summary = che_tasks.summary_table({('flip_flop', 'fox', 'none'): cell}, ['flip_flop'], [('fox', 'none')])
    assert "OOD dense max | OOD dense mean | OOD sparse max | OOD sparse mean |" in summary
    assert summary.splitlines()[-1].endswith("| 99.00 | 98.00 | 70.00 | 60.00 | - |")


def test_a_grid_column_takes_the_attention_options():
    """'nope+sb' and 'kerple+logn' in a grid's encodings build stick-breaking and log-length-scaled models
    (common.pos_options), with DAPE too, label their columns apart from the plain encoding, and an unknown
    option is an error naming the ones there are."""
    task = che_tasks.TASKS['flip_flop']
    cfg = dict({k: getattr(che_tasks, k) for k in che_tasks.config_keys}, task="flip_flop", train_max_len=8)
    sb = che_tasks.build_model(task, dict(cfg, pos='nope+sb', dape='v1'), config_only=True)
    assert (sb.pos, sb.attn, sb.sb_current, sb.logn_scale, sb.dape) == ('nope', 'stickbreaking', False, 'none', 'v1')
    logn = che_tasks.build_model(task, dict(cfg, pos='kerple+sbc+logn-fixed'), config_only=True)
    assert (logn.pos, logn.attn, logn.sb_current, logn.logn_scale) == ('kerple', 'stickbreaking', True, 'fixed')
    plain = che_tasks.build_model(task, dict(cfg, pos='kerple'), config_only=True)
    assert (plain.attn, plain.logn_scale) == ('softmax', 'none')
    assert che_tasks.encoding_label('nope+sb', 'v1') == 'DAPE-NoPE+sb'
    assert che_tasks.encoding_label('kerple+logn', 'none') == 'Kerple+logn'
    with pytest.raises(ValueError, match=r"unknown option '\+softmax'.*\+sb, \+sbc, \+logn, \+logn-fixed"):
        che_tasks.build_model(task, dict(cfg, pos='kerple+softmax'), config_only=True)
