"""CHE: the task generators of che_data.py against independent re-implementations of their semantics
(docs/che.md), then the runner of che_tasks.py end to end on CPU. The checkers below decode every sample
with plain Python (lists, ints, a recursive-descent parser) and share no code with che_data.py."""
import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import che_data as D

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 40, 41, 97]


# --- independent checkers: (x: list[int], y: list[int]) -> None (assert) -----------------------

def check_even_pairs(x, y):
    unequal = sum(a != b for a, b in zip(x, x[1:]))
    assert y == [unequal % 2]


def check_modular_arithmetic_simple(x, y, N):
    assert len(x) == (N if N % 2 else N - 1)
    assert all(t in range(5) for t in x[0::2]) and all(t in (5, 6, 7) for t in x[1::2])
    text = ''.join(str(t) if i % 2 == 0 else '+-*'[t - 5] for i, t in enumerate(x))
    assert y == [eval(text) % 5]  # Python's precedence: * before + and -


def check_parity_check(x, y):
    assert y == [x.count(1) % 2]


def check_cycle_navigation(x, y):
    position = 0
    for t in x:
        position = (position + {0: -1, 1: 0, 2: 1}[t]) % 5
    assert y == [position]


def check_stack_manipulation(x, y, N):
    assert len(y) == N + 1
    if N == 1:
        assert x[0] in (0, 1) and y == [x[0], 2]
        return
    k = 0
    while k < N and x[k] in (0, 1):
        k += 1
    # the initial stack is followed by actions only; k counted greedily can overshoot into leading
    # actions only if an action were 0/1, which the vocabulary forbids; 1 <= k <= N-1 by the spec
    assert 1 <= k <= N - 1 and all(t in (2, 3, 4) for t in x[k:])
    stack = list(x[:k])
    for t in x[k:]:
        if t == 2:
            if stack:
                stack.pop()
        else:
            stack.append(t - 3)
    expected = stack[::-1] + [2]
    assert y == expected + [0] * (N + 1 - len(expected))


def check_reverse_string(x, y):
    assert y == x[::-1]


class Parser:
    """Recursive descent for E := d | '-' d | '(' E ')' | '(' E op E ')' over token names."""

    def __init__(self, names):
        self.t, self.i = names, 0

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self, expected=None):
        tok = self.peek()
        assert tok is not None and (expected is None or tok == expected), (self.t, self.i, expected)
        self.i += 1
        return tok

    def expr(self):
        tok = self.take()
        if tok == '-':
            d = self.take()
            assert isinstance(d, int)
            return -d
        if isinstance(tok, int):
            return tok
        assert tok == '('
        left = self.expr()
        if self.peek() == ')':
            self.take(')')
            return left
        op = self.take()
        right = self.expr()
        self.take(')')
        return {'+': left + right, '-': left - right, '*': left * right}[op]

    def parse_all(self):
        v = self.expr()
        assert self.i == len(self.t), 'trailing tokens'
        return v


def check_modular_arithmetic(x, y, N):
    assert len(x) == N
    names = [t if t < 5 else {5: '+', 6: '-', 7: '*', 8: '(', 9: ')'}[t] for t in x]
    value = Parser(names).parse_all() % 5
    assert y == [value]
    # the generator's grammar: exactly the shapes of the spec for small N
    if N <= 4:
        assert [isinstance(n, int) for n in names] == [[True], [False, True],
                                                       [False, True, False],
                                                       [False, False, True, False]][N - 1]


def check_solve_equation(x, y, N):
    assert len(x) == N
    if N < 3:
        assert x == [0] * N and y == [0]
        return
    assert x[-2] == 10 and x[-1] in range(5) and x[:-2].count(9) == 1 and 10 not in x[:-2]
    expr = {5: '+', 6: '-', 7: '(', 8: ')', 9: 'x'}
    names = [t if t < 5 else expr[t] for t in x[:-2]]
    assert '*' not in names
    solutions = [d for d in range(5)
                 if Parser([d if n == 'x' else n for n in names]).parse_all() % 5 == x[-1]]
    assert solutions == y  # exactly one solution, and it is the label


def check_duplicate_string(x, y):
    assert y == x + x


def check_missing_duplicate(x, y, N):
    assert len(x) == N
    if N == 1:
        assert x == [1] and y == [1]
        return
    body = x[:-1] if N % 2 else x
    if N % 2:
        assert x[-1] == 3
    h = N // 2
    assert len(body) == 2 * h and body.count(2) == 1 and 3 not in body
    hole = body.index(2)
    twin = hole + h if hole < h else hole - h
    assert y == [body[twin]]
    assert all(body[i] == body[i + h] for i in range(h) if hole not in (i, i + h))


def check_odds_first(x, y):
    odd = [x[i] for i in range(len(x)) if i % 2 == 1]
    even = [x[i] for i in range(len(x)) if i % 2 == 0]
    assert y == odd + even


def _le_int(bits):
    return sum(b << i for i, b in enumerate(bits))


def _check_terminated(y, value, out_len):
    digits = []
    while value:
        digits.append(value & 1)
        value >>= 1
    digits = digits or [0]
    expected = digits + [2]
    assert len(expected) <= out_len
    assert y == expected + [0] * (out_len - len(expected))


def check_binary(x, y, N, op):
    out_len = N + 1 if op == 'add' else N
    assert len(x) == N and len(y) == out_len
    if N <= 2:
        assert 2 not in x and _le_int(x) < 2 ** N - 1
        if op == 'add':
            _check_terminated(y, _le_int(x), out_len)
        else:
            assert y == [0] * (N - 1) + [2]
        return
    assert x.count(2) == 1
    p = x.index(2)
    n, m = x[:p], x[p + 1:]
    assert 1 <= len(n) <= N - 2 and len(m) == N - 1 - len(n)
    a, b = _le_int(n), _le_int(m)
    assert a >= 1 and b >= 1
    _check_terminated(y, a + b if op == 'add' else a * b, out_len)


def check_compute_sqrt(x, y, N):
    assert len(y) == (N + 1) // 2
    v = int(''.join(map(str, x)), 2)
    r = int(''.join(map(str, y)), 2)
    assert v >= 1 and r * r <= v < (r + 1) * (r + 1)


def check_bucket_sort(x, y):
    assert all(a <= b for a, b in zip(y, y[1:]))
    assert sorted(x) == y and all(t in range(5) for t in x)


CHECKERS = {
    'even_pairs': lambda x, y, N: check_even_pairs(x, y),
    'modular_arithmetic_simple': check_modular_arithmetic_simple,
    'parity_check': lambda x, y, N: check_parity_check(x, y),
    'cycle_navigation': lambda x, y, N: check_cycle_navigation(x, y),
    'stack_manipulation': check_stack_manipulation,
    'reverse_string': lambda x, y, N: check_reverse_string(x, y),
    'modular_arithmetic': check_modular_arithmetic,
    'solve_equation': check_solve_equation,
    'duplicate_string': lambda x, y, N: check_duplicate_string(x, y),
    'missing_duplicate': check_missing_duplicate,
    'odds_first': lambda x, y, N: check_odds_first(x, y),
    'binary_addition': lambda x, y, N: check_binary(x, y, N, 'add'),
    'compute_sqrt': check_compute_sqrt,
    'bucket_sort': lambda x, y, N: check_bucket_sort(x, y),
    'binary_multiplication': lambda x, y, N: check_binary(x, y, N, 'mul'),
}

EXPECTED_VOCAB = {  # (input vocab, output vocab) from the spec
    'even_pairs': (2, 2), 'modular_arithmetic_simple': (9, 5), 'parity_check': (2, 2),
    'cycle_navigation': (3, 5), 'stack_manipulation': (5, 3), 'reverse_string': (2, 2),
    'modular_arithmetic': (11, 5), 'solve_equation': (11, 5), 'duplicate_string': (2, 2),
    'missing_duplicate': (4, 2), 'odds_first': (2, 2), 'binary_addition': (3, 3),
    'compute_sqrt': (2, 2), 'bucket_sort': (5, 5), 'binary_multiplication': (3, 3),
}
EXPECTED_OUT_LEN = {
    'stack_manipulation': lambda N: N + 1, 'reverse_string': lambda N: N,
    'duplicate_string': lambda N: 2 * N, 'odds_first': lambda N: N,
    'binary_addition': lambda N: N + 1, 'compute_sqrt': lambda N: math.ceil(N / 2),
    'bucket_sort': lambda N: N, 'binary_multiplication': lambda N: N,
}
MASKED = {'stack_manipulation', 'binary_addition', 'binary_multiplication'}


def test_registry_matches_spec():
    assert set(D.TASKS) == set(CHECKERS) and len(D.TASKS) == 15
    assert D.TABLE2_TASKS[0] == 'even_pairs' and D.TABLE2_TASKS[-1] == 'bucket_sort'
    for name, task in D.TASKS.items():
        assert (task.input_vocab, task.output_vocab) == EXPECTED_VOCAB[name], name
        assert task.masked == (name in MASKED)
        assert task.random_baseline == (0.2 if task.output_vocab == 5 else 0.5)
    with pytest.raises(ValueError, match='unknown CHE task'):
        D.get_task('nope')


@pytest.mark.parametrize('name', list(D.TASKS))
def test_generator_semantics(name):
    task, check = D.TASKS[name], CHECKERS[name]
    rng = np.random.default_rng(1234)
    for N in LENGTHS:
        B = 64 if N < 50 else 16
        x, y, mask = task.sample(B, N, rng)
        out_len = EXPECTED_OUT_LEN.get(name, lambda N: 1)(N)
        assert x.dtype == np.int64 and y.dtype == np.int64 and mask.dtype == bool
        assert y.shape == (B, out_len) == mask.shape and task.output_length(N) == out_len
        assert x.min() >= 0 and x.max() < task.input_vocab
        assert y.min() >= 0 and y.max() < task.output_vocab
        for xb, yb, mb in zip(x.tolist(), y.tolist(), mask.tolist()):
            check(xb, yb, N)
            if name in MASKED:  # up to and including the first terminator
                end = yb.index(2)
                assert mb == [True] * (end + 1) + [False] * (out_len - end - 1)
            else:
                assert all(mb)


@pytest.mark.parametrize('name', list(D.TASKS))
def test_large_length(name):
    N = 500
    x, y, mask = D.TASKS[name].sample(4, N, np.random.default_rng(0))
    assert y.shape[1] == D.TASKS[name].output_length(N)
    for xb, yb in zip(x.tolist(), y.tolist()):
        CHECKERS[name](xb, yb, N)


def test_small_lengths_exact():
    """Output lengths and masks at N = 1, 2, 3 written out by hand."""
    rng = np.random.default_rng(0)
    ba, bm, st = D.TASKS['binary_addition'], D.TASKS['binary_multiplication'], D.TASKS['stack_manipulation']
    x, y, m = ba.sample(32, 1, rng)  # the only number < 2^1 - 1 is 0
    assert (x == 0).all() and (y == [0, 2]).all() and (m == [True, True]).all()
    x, y, m = bm.sample(32, 1, rng)
    assert (y == [2]).all() and m.all()
    x, y, m = bm.sample(32, 2, rng)
    assert (y == [0, 2]).all() and m.all()
    x, y, m = ba.sample(256, 2, rng)
    assert set(map(tuple, y.tolist())) == {(0, 2, 0), (1, 2, 0), (0, 1, 2)}  # 0, 1, 2
    x, y, m = ba.sample(256, 3, rng)  # 1+1 = 2 -> '01' + end
    assert (x[:, 1] == 2).all() and (x[:, [0, 2]] == 1).all() and (y == [0, 1, 2, 0]).all()
    assert (m == [True, True, True, False]).all()
    x, y, m = bm.sample(256, 3, rng)  # 1*1 = 1 -> '1' + end + 0
    assert (y == [1, 2, 0]).all() and (m == [True, True, False]).all()
    x, y, m = st.sample(64, 1, rng)
    assert (y[:, 1] == 2).all() and (y[:, 0] == x[:, 0]).all() and m.all()
    x, y, m = st.sample(64, 2, rng)  # one bit then one action
    assert y.shape == (64, 3) and set(x[:, 1].tolist()) <= {2, 3, 4}
    for N, shape in [(1, 1), (2, 1), (3, 2)]:
        assert D.TASKS['compute_sqrt'].sample(2, N, rng)[1].shape == (2, shape)
    assert D.TASKS['modular_arithmetic_simple'].sample(2, 2, rng)[0].shape == (2, 1)
    x, y, m = D.TASKS['missing_duplicate'].sample(64, 2, rng)  # s = one bit: 'b2' or '2b'
    assert ((x == 2).sum(axis=1) == 1).all() and (y[:, 0] == x[x != 2]).all()
    with pytest.raises(ValueError):
        ba.sample(2, 0, rng)


def test_distribution_sanity():
    """Labels of the classification tasks are not degenerate; the split point of the binary tasks
    covers its whole range."""
    rng = np.random.default_rng(7)
    for name in ['even_pairs', 'parity_check', 'cycle_navigation', 'modular_arithmetic',
                 'modular_arithmetic_simple', 'solve_equation', 'missing_duplicate']:
        y = D.TASKS[name].sample(2000, 21, rng)[1][:, 0]
        counts = np.bincount(y, minlength=D.TASKS[name].output_vocab)
        assert (counts > 0.5 * 2000 / len(counts) * 0.5).all(), (name, counts)
    x = D.TASKS['binary_addition'].sample(4000, 10, rng)[0]
    assert set((x == 2).argmax(axis=1).tolist()) == set(range(1, 9))


@pytest.mark.parametrize('name', list(D.TASKS))
def test_determinism(name):
    task = D.TASKS[name]
    a = task.sample(8, 23, np.random.default_rng(5))
    b = task.sample(8, 23, np.random.default_rng(5))
    c = task.sample(8, 23, np.random.default_rng(6))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert any(not np.array_equal(u, v) for u, v in zip(a, c))


def test_make_batch_framing():
    task = D.TASKS['duplicate_string']
    idx, targets, y, mask = D.make_batch(task, 4, 5, np.random.default_rng(0))
    assert idx.shape == targets.shape == (4, 15) and y.shape == (4, 10)
    assert (idx[:, 5:] == task.input_vocab).all()           # placeholders
    assert (targets[:, :5] == -1).all() and (targets[:, 5:] == y).all()
    assert (y[:, :5] == idx[:, :5]).all()
    assert D.max_sequence_length(task, 40) == 120
    assert D.max_sequence_length(D.TASKS['modular_arithmetic_simple'], 40) == 40


# --- the runner ------------------------------------------------------------------------------

def test_che_data_needs_no_torch():
    code = "import sys, che_data; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, '-c', code], cwd=ROOT).returncode == 0


torch = pytest.importorskip('torch')
import che_tasks as C  # noqa: E402  (the runner needs torch)
from configurator import configure  # noqa: E402

TINY = ['--n_layer=1', '--n_head=2', '--n_embd=16', '--dape_width=8', '--max_iters=4',
        '--batch_size=8', '--eval_samples=8', '--eval_batch_size=8', '--log_interval=2',
        '--eval_min_len=41', '--eval_max_len=45', '--eval_stride=2', '--id_stride=13', '--device=cpu']


def _cfg(**kw):
    cfg = {k: getattr(C, k) for k in C.config_keys}
    cfg.update(n_layer=1, n_head=2, n_embd=16, dape_width=8, device='cpu')
    cfg.update(kw)
    return cfg


class _Oracle(torch.nn.Module):
    """A stand-in for GPT: logits that put all mass on the target (or on class `const`)."""

    def __init__(self, V, const=None):
        super().__init__()
        self.V, self.const = V, const

    def forward(self, idx, targets):
        t = targets.clamp(min=0) if self.const is None else torch.full_like(targets, self.const)
        return torch.nn.functional.one_hot(t, self.V).float() * 10, None


class _LearnsAt(torch.nn.Module):
    """Wrong on every output token for its first `wrong_steps` forwards, right after: a training curve
    whose start and end are told apart. A parameter of its own gives the optimizer something to step."""

    def __init__(self, V, wrong_steps):
        super().__init__()
        self.V, self.wrong_steps, self.calls = V, wrong_steps, 0
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, idx, targets):
        self.calls += 1
        t = targets.clamp(min=0)
        if self.calls <= self.wrong_steps:
            t = 1 - t
        return torch.nn.functional.one_hot(t, self.V).float() * 10 + self.w, None


def test_final_train_stats_are_the_last_logged_steps():
    """final_train_acc and final_loss report the end of training (the last log_interval steps), not
    its start: a model wrong for 4 steps and right for the last 2 ends at 100%."""
    import contextlib
    task = C.TASKS['even_pairs']  # output classes 0 and 1: logit 10 on one, 0 on the other
    cfg = _cfg(max_iters=6, log_interval=2, batch_size=4)
    res = C.train(_LearnsAt(3, wrong_steps=4), task, cfg, 'cpu', contextlib.nullcontext(), log=lambda *a: None)
    assert res['steps'] == 6 and res['final_train_acc'] == 1.0
    assert res['final_loss'] == pytest.approx(math.log1p(math.exp(-10)), rel=1e-3)


def test_accuracy_is_token_weighted_and_masked():
    import contextlib
    task = C.TASKS['binary_addition']
    cfg = _cfg(eval_samples=64, eval_batch_size=16)
    accs, err = C.evaluate(_Oracle(4), task, [41, 60], cfg, 'cpu', contextlib.nullcontext(), log=lambda *a: None)
    assert err is None and accs == {41: 1.0, 60: 1.0}
    # always answering 0: accuracy = share of zeros among the unmasked target tokens of all samples
    accs, _ = C.evaluate(_Oracle(4, const=0), task, [41], cfg, 'cpu', contextlib.nullcontext(), log=lambda *a: None)
    rng = np.random.default_rng(cfg['seed'] + 1_000_003)  # the samples evaluate() drew
    zeros = total = 0
    for _ in range(4):
        _, _, y, mask = C.make_batch(task, 16, 41, rng)
        zeros += int(((y == 0) & mask).sum())
        total += int(mask.sum())
    assert accs[41] == pytest.approx(zeros / total)


def test_runner_cli_end_to_end(tmp_path):
    out = tmp_path / 'che'
    cmd = [sys.executable, 'che_tasks.py', '--task=missing_duplicate', '--pos=kerple', '--dape=v1',
           f'--out_dir={out}'] + TINY
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert 'OOD score' in p.stdout and 'ID ' in p.stdout and '8 samples per length, 4 position draws per length' in p.stdout
    cell = json.loads((out / 'missing_duplicate_kerple_v1.json').read_text())
    assert cell['n_runs'] == 1 and cell['random_baseline'] == 50
    r = cell['runs'][0]
    assert (out / 'runs' / 'missing_duplicate_kerple_v1_s0_lr0.0003.json').exists()
    assert sorted(map(int, r['per_length'])) == [41, 43, 45]
    assert sorted(map(int, r['id_per_length'])) == [1, 14, 27, 40]
    assert r['servable'] and 0 <= r['score'] <= 100 and r['random_baseline'] == 50
    assert r['score'] == pytest.approx(np.mean(list(r['per_length'].values())))
    assert r['id_score'] == pytest.approx(np.mean(list(r['id_per_length'].values())))
    assert cell['score'] == r['score'] and cell['id_score'] == r['id_score']
    assert r['eval']['position_draws_per_length'] == 4 and 0 <= r['final_train_acc'] <= 100
    assert r['train']['steps'] == 4 and r['rand_pos'] and r['block_size'] == 41
    assert (out / 'missing_duplicate_kerple_v1.png').stat().st_size > 1000
    # a bad option fails fast with one line, before any training
    p = subprocess.run([sys.executable, 'che_tasks.py', '--task=nope'], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "unknown task 'nope'" in p.stderr


def test_grid_columns_run_dape_on_the_encodings_asked_for():
    cfg = _cfg(grid_pos='nope,alibi,kerple', grid_dape='none,v1,v2', grid_dape_pos='kerple')
    assert C.grid_columns(cfg) == [('nope', 'none'), ('alibi', 'none'), ('kerple', 'none'), ('kerple', 'v1'),
                                   ('kerple', 'v2')]
    assert len(C.grid_columns(dict(cfg, grid_dape_pos=''))) == 9  # '' is every grid_pos


@pytest.mark.parametrize('option, message', [
    (dict(dtype='float64'), "dtype must be auto, float32, bfloat16 or float16, got 'float64'"),
    (dict(device='tpu'), "--device=tpu is not a device: use auto, cpu, cuda or cuda:N"),
    (dict(learning_rate=-1.0), "learning_rate must be > 0"),
    (dict(eval_min_len=90, eval_max_len=50), "no evaluation lengths"),
    (dict(eval_min_len=40), "eval_min_len=40 must be above train_max_len=40"),
    (dict(seeds='0,x'), "seeds must be comma-separated integers"),
    (dict(learning_rates='1e-3,0'), "learning_rate must be > 0, got 0.0"),
    (dict(seeds='1,1'), "must not repeat"),
    (dict(eval_draws=0), "eval_draws must be >= 1"),
    (dict(bidir_bias='left'), "unknown bidir_bias='left'"),
    (dict(grid=True, grid_tasks='even_pairs', grid_pos='alibi,kerple', grid_dape_pos='kerple,fire'),
     "grid_dape_pos names fire, which grid_pos='alibi,kerple' does not run"),
])
def test_bad_options_fail_before_training(option, message):
    with pytest.raises(ValueError, match=message.replace('(', r'\(')):
        C.check_config(_cfg(**option))


def test_grid_table_and_not_servable(tmp_path):
    """learned without randomized positions has no row for the test lengths: 'n/s', no crash."""
    out = tmp_path / 'grid'
    results, table = C.main(TINY + ['--grid=True', '--grid_tasks=even_pairs,bucket_sort',
                                    '--grid_pos=alibi,learned', '--grid_dape=none', '--max_iters=2',
                                    '--rand_pos=False', '--rand_pos_max=0', f'--out_dir={out}'])
    lines = table.splitlines()
    assert lines[0] == '| Level | Task | Random | ALiBi | Learned |'
    assert lines[2].startswith('| R | even_pairs | 50 | ') and lines[3].startswith('| CS | bucket_sort | 20 | ')
    for line in lines[2:4]:
        cells = [c.strip() for c in line.strip('|').split('|')][3:]
        assert cells[1] == 'n/s' and 0 <= float(cells[0]) <= 100
    r = results[('even_pairs', 'learned', 'none')]
    assert r['score'] is None and not r['runs'][0]['servable'] and 'N=41' in r['runs'][0]['error']
    assert 0 <= r['id_score'] <= 100  # what it learned in distribution is still measured
    assert (out / 'table.md').exists() and (out / 'even_pairs.png').exists()
    assert len(json.loads((out / 'grid.json').read_text())) == 4
    from results import PAPER_TABLE2_COLUMNS
    assert [C.encoding_label(p, d) for p, d in PAPER_TABLE2_COLUMNS] == [
        'ALiBi', 'Kerple', 'FIRE', 'DAPE-ALiBi', 'DAPE-Kerple', 'DAPE-FIRE']
    assert C.encoding_label('rope', 'v2') == 'DAPEv2-RoPE'


def test_evaluation_draws_positions_like_training():
    """Ruoss et al.'s protocol (the default): evaluation draws randomized positions as training does;
    rand_pos_eval=False evaluates at 0..T-1. The output head is a layer of its own."""
    import contextlib
    task = C.TASKS['reverse_string']
    for rand_pos_eval in (True, False):
        cfg = _cfg(rand_pos_max=512, rand_pos_eval=rand_pos_eval, eval_samples=2, eval_batch_size=2)
        model = C.build_model(task, cfg)
        assert model.lm_head.weight is not model.transformer.wte.weight
        seen, positions = [], model.positions
        model.positions = lambda *a, **k: seen.append(positions(*a, **k)) or seen[-1]
        C.evaluate(model, task, [41], cfg, 'cpu', contextlib.nullcontext(), log=lambda *a: None)
        assert not model.training and seen and all(len(p) == 82 for p in seen)
        assert all(torch.equal(p, torch.arange(82)) != rand_pos_eval for p in seen)
        assert all((p.diff() > 0).all() and p.max() < 512 for p in seen)


def test_randomized_positions_serve_longer_lengths():
    """Trained with randomized positions, the model sees positions far past its training range,
    and evaluates at test lengths longer than it (positions 0..T-1 here): even `learned`, whose table
    then has rand_pos_max rows."""
    import contextlib
    task = C.TASKS['reverse_string']
    for pos in ['kerple', 'learned']:
        cfg = _cfg(pos=pos, dape='v1', rand_pos=True, rand_pos_max=512, rand_pos_eval=False, max_iters=3,
                   batch_size=4, log_interval=3, eval_samples=4, eval_batch_size=4)
        torch.manual_seed(0)
        model = C.build_model(task, cfg)
        assert model.config.block_size == 80 and model.config.rand_pos_max == 512
        model.train()
        drawn = torch.cat([model.positions(80) for _ in range(20)])
        assert drawn.max() >= 80  # positions beyond the training length are trained
        C.train(model, task, cfg, 'cpu', contextlib.nullcontext(), log=lambda *a: None)
        accs, err = C.evaluate(model, task, [41, 150], cfg, 'cpu', contextlib.nullcontext(),
                               log=lambda *a: None)
        assert err is None and set(accs) == {41, 150}  # N=150: 300 tokens > block_size 80
        assert all(0 <= a <= 1 for a in accs.values())
    # without randomized positions, learned stops at its training length
    cfg = _cfg(pos='learned', dape='none', rand_pos=False, rand_pos_max=0, eval_samples=4, eval_batch_size=4)
    accs, err = C.evaluate(C.build_model(task, cfg), task, [41], cfg, 'cpu', contextlib.nullcontext(),
                           log=lambda *a: None)
    assert accs == {} and 'N=41' in err


def test_block_size_and_vocab():
    cfg = _cfg()
    for name, bs in [('duplicate_string', 120), ('binary_addition', 81), ('even_pairs', 41),
                     ('compute_sqrt', 60)]:
        g = C.build_model(C.TASKS[name], cfg, config_only=True)
        assert g.block_size == bs and not g.causal
    assert C.build_model(C.TASKS['modular_arithmetic'], cfg, config_only=True).vocab_size == 12
    assert C.build_model(C.TASKS['cycle_navigation'], cfg, config_only=True).vocab_size == 5
    g = C.build_model(C.TASKS['parity_check'], _cfg(pos='nope'), config_only=True)
    assert not g.rand_pos  # nope ignores positions: randomizing them is switched off, not an error


# --- in-distribution accuracy, seeds and learning rates, position draws ------------------------

class _ShortOnly(torch.nn.Module):
    """Right on sequences up to `longest` tokens, wrong beyond: what a model that learned the task and
    failed to extrapolate looks like."""

    def __init__(self, V, longest):
        super().__init__()
        self.V, self.longest = V, longest

    def forward(self, idx, targets):
        t = targets.clamp(min=0)
        if idx.shape[1] > self.longest:
            t = 1 - t
        return torch.nn.functional.one_hot(t, self.V).float() * 10, None


def test_id_accuracy_stays_in_the_training_range():
    import contextlib
    task = C.TASKS['even_pairs']
    quiet = lambda *a: None
    cfg = _cfg(eval_samples=8, eval_batch_size=8, eval_min_len=41, eval_max_len=61, eval_stride=10)
    ev = C.evaluate_id_ood(_ShortOnly(3, longest=41), task, cfg, 'cpu', contextlib.nullcontext(), quiet)
    assert sorted(map(int, ev['id']['per_length'])) == list(range(1, 41))
    assert sorted(map(int, ev['ood']['per_length'])) == [41, 51, 61]
    assert ev['id']['score'] == 100 and ev['ood']['score'] == 0
    # the ID evaluation draws its own samples: how many ID lengths there are changes no OOD sample
    zero = _Oracle(3, const=0)
    a = C.evaluate_id_ood(zero, task, _cfg(**dict(cfg, id_stride=1)), 'cpu', contextlib.nullcontext(), quiet)
    b = C.evaluate_id_ood(zero, task, _cfg(**dict(cfg, id_stride=7)), 'cpu', contextlib.nullcontext(), quiet)
    assert a['ood'] == b['ood'] and sorted(map(int, b['id']['per_length'])) == [1, 8, 15, 22, 29, 36]
    assert 0 < a['ood']['score'] < 100  # answering 0 everywhere: the score depends on the samples


@pytest.mark.parametrize('samples, batch, draws, sizes', [
    (64, 64, 4, [16, 16, 16, 16]), (64, 16, 1, [16, 16, 16, 16]), (10, 64, 3, [4, 3, 3]),
    (2, 64, 4, [1, 1]), (512, 64, 1, [64] * 8)])
def test_eval_batches_are_position_draws(samples, batch, draws, sizes):
    cfg = _cfg(eval_samples=samples, eval_batch_size=batch, eval_draws=draws)
    assert C.eval_batches(cfg) == sizes and C.position_draws(cfg) == len(sizes)
    assert C.position_draws(dict(cfg, rand_pos_eval=False)) == 0  # positions 0..T-1: nothing drawn
    assert C.position_draws(dict(cfg, pos='nope')) == 0


def _fake_run(cfg, log=print, command='unknown'):
    """A run's result without training: scores made up from the seed and the learning rate."""
    s, lr = cfg['seed'], cfg['learning_rate']
    return {'seed': s, 'learning_rate': lr, 'score': 50 + s + 1000 * lr, 'id_score': 90 - s - 1000 * lr,
            'final_train_acc': 80.0 + s}


def test_seeds_and_rates_statistics(monkeypatch):
    monkeypatch.setattr(C, 'run_one', _fake_run)
    cfg = _cfg(task='even_pairs', pos='alibi', seeds='0,1,2', learning_rates='1e-4,3e-4', out_dir='')
    cell = C.run_cell(cfg, log=lambda *a: None)
    assert cell['n_runs'] == 6 and cell['seeds'] == [0, 1, 2] and cell['learning_rates'] == [1e-4, 3e-4]
    assert sorted((r['seed'], r['learning_rate']) for r in cell['runs']) == \
        sorted((s, lr) for s in (0, 1, 2) for lr in (1e-4, 3e-4))
    ood = [50 + s + 1000 * lr for s in (0, 1, 2) for lr in (1e-4, 3e-4)]
    ind = [90 - s - 1000 * lr for s in (0, 1, 2) for lr in (1e-4, 3e-4)]
    assert cell['score'] == pytest.approx(max(ood)) and cell['score_mean'] == pytest.approx(np.mean(ood))
    assert cell['id_score'] == pytest.approx(max(ind)) and cell['id_score_mean'] == pytest.approx(np.mean(ind))
    assert cell['final_train_acc_mean'] == pytest.approx(81.0)
    assert cell['best_run'] == {'seed': 2, 'learning_rate': 3e-4, 'id_score': pytest.approx(87.7)}
    # one run not servable: no statistic ("n/s"), not a max over the others
    assert C.summarize([_fake_run(cfg), dict(_fake_run(cfg), score=None)])['score'] is None
    # single seed and rate by default
    assert C.run_cell(_cfg(task='even_pairs', pos='alibi', seed=5, out_dir=''), log=lambda *a: None)['n_runs'] == 1
    table = C.grid_table({('even_pairs', 'alibi', 'none'): cell}, ['even_pairs'], [('alibi', 'none')], cfg)
    lines = table.splitlines()
    assert lines[2] == f"| R | even_pairs | 50 | {max(ood):.2f} ({np.mean(ood):.2f}) |"
    assert f"| R | even_pairs | 50 | {max(ind):.2f} ({np.mean(ind):.2f}) |" in lines
    assert "max over seeds 0,1,2 x learning rates 0.0001,0.0003 (the paper's statistic)" in table
    summary = C.summary_table({('even_pairs', 'alibi', 'none'): dict(cell, random_baseline=50.0, encoding='ALiBi')},
                              ['even_pairs'], [('alibi', 'none')])
    assert summary.splitlines()[2].startswith(f"| even_pairs | ALiBi | 50 | {max(ind):.2f} | {np.mean(ind):.2f} | "
                                              f"{max(ood):.2f} | {np.mean(ood):.2f} | 81.00 | 6 | 73.52 |")


def test_tiny_grid_two_seeds_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / 'grid'
    args = TINY + ['--grid=True', '--grid_tasks=missing_duplicate', '--grid_pos=alibi', '--grid_dape=v1',
                   '--max_iters=2', '--seeds=0,1', '--eval_draws=2', f'--out_dir={out}']
    cells, table = C.main(args)
    cell = cells[('missing_duplicate', 'alibi', 'v1')]
    assert cell['n_runs'] == 2 and [r['seed'] for r in cell['runs']] == [0, 1]
    assert all(sorted(map(int, r['id_per_length'])) == [1, 14, 27, 40] for r in cell['runs'])
    assert cell['score'] == max(r['score'] for r in cell['runs'])
    assert cell['position_draws_per_length'] == 2
    saved = json.loads((out / 'grid.json').read_text())
    assert len(saved) == 1 and len(saved[0]['runs']) == 2
    assert len(list((out / 'runs').glob('*.json'))) == 2 and (out / 'missing_duplicate.png').exists()
    assert 'In distribution (ID)' in table and '2 position draws per length' in table
    capsys.readouterr()
    again, _ = C.main(args + ['--resume=True'])  # nothing left to train: both runs are reused
    assert capsys.readouterr().out.count('reused') == 2
    assert again[('missing_duplicate', 'alibi', 'v1')]['runs'] == cell['runs']


def che_task_configs():
    """The configs che_tasks.py reads: config/che_*.py for CHE, config/<retrieval task>_*.py for the
    retrieval tasks -> {family: [paths]}."""
    import retrieval_data
    return {'che': sorted(glob.glob(os.path.join(ROOT, 'config', 'che_*.py'))),
            'retrieval': sorted(f for t in retrieval_data.TASKS for f in glob.glob(os.path.join(ROOT, 'config', f'{t}_*.py')))}


def test_che_config_files_are_valid():
    """Every CHE and retrieval config is read by che_tasks.py: its keys are che_tasks' keys and its grid
    builds; and each family's configs set one rule for 'learned' (learned_frac), the same in all."""
    configs = che_task_configs()
    assert len(configs['che']) >= 5 and len(configs['retrieval']) >= 2
    for family, files in configs.items():
        rules = set()
        for path in files:
            cfg = configure({k: getattr(C, k) for k in C.config_keys}, [path])
            C.check_config(cfg)
            found = {}
            exec(open(path).read(), {}, found)
            assert 'learned_frac' in found, f"{path} does not set the family's learned rule"
            rules.add(found['learned_frac'])
        assert len(rules) == 1, (family, rules)


def _cell(task, pos, dape, scores, lr=1e-3):
    """A finished cell from (seed, ID, OOD) triples, in the order given."""
    runs = [{'seed': s, 'learning_rate': lr, 'id_score': i, 'score': o, 'final_train_acc': i}
            for s, i, o in scores]
    return {'task': task, 'pos': pos, 'dape': dape, 'runs': runs}


def _row(table, start):
    rows = [line for line in table.splitlines() if line.startswith(start)]
    assert len(rows) == 1, (start, table)
    return [c.strip() for c in rows[0].strip('|').split('|')]


def _cells(c):
    """A comparison's four cells: the difference [95% interval], Welch's p, the exact p, its Holm adjustment."""
    import results
    return [results.difference_text(c), results.p_text(c['p']), results.p_text(c['p_exact']), results.p_text(c['p_holm'])]


def test_seeds_table_counts_learned_seeds_and_pairs_dape_with_its_baseline():
    """Per (task, encoding): seeds that reached the learned threshold on ID (not OOD), ID's mean with its 95% t interval
    over every seed (cut to 0-100; the figures are scipy's), OOD over the seeds that learned (the others' figures in
    brackets), the per-seed figures in seed order; then DAPE-X against X: the difference of the means with its 95% t
    interval cut to the possible range (accuracy is bounded), Welch's p, the exact p and its Holm adjustment over
    the table's comparisons, over the learned seeds and, apart, over every seed; the caption states the rule for
    learned with its date."""
    import results
    cells = {('reverse_string', 'alibi', 'none'): _cell('reverse_string', 'alibi', 'none',
                                                         [(2, 90.0, 65.0), (0, 80.0, 60.0), (1, 70.0, 55.0)]),
             ('reverse_string', 'alibi', 'v1'): _cell('reverse_string', 'alibi', 'v1',
                                                      [(0, 75.0, 70.0), (1, 74.9, 72.0), (2, 100.0, 80.0)]),
             ('reverse_string', 'kerple', 'none'): _cell('reverse_string', 'kerple', 'none',
                                                          [(0, 99.0, 10.0), (1, 99.0, 11.0), (2, 99.0, 30.0)])}
    columns = [('alibi', 'none'), ('kerple', 'none'), ('alibi', 'v1')]
    cfg = _cfg(seeds='0,1,2', learning_rate=1e-3)
    table = C.seeds_table(cells, ['reverse_string'], columns, cfg)
    header = [c.strip() for c in table.splitlines()[0].strip('|').split('|')]
    assert header == ['Task', 'Encoding', 'Random', 'learned [95% interval]', 'ID', 'ID per seed',
                      'OOD (learned seeds)', 'OOD per seed']
    # chance 50, learned_frac 0.5: learned from 75% ID on; OOD plays no part
    assert results.learned_threshold(C.TASKS['reverse_string'], cfg) == 75.0
    assert results.learned_threshold(C.TASKS['bucket_sort'], cfg) == 60.0
    alibi = _row(table, '| reverse_string | ALiBi |')
    # the share of seeds with its exact (Clopper-Pearson) interval: 2 of 3 -> [9.4%, 99.2%]
    assert alibi == ['reverse_string', 'ALiBi', '50', '2 of 3 [9, 99]%', '80.0 [55.2, 100.0]', '80.0, 70.0, 90.0',
                     '62.5 [30.7, 94.3]', '60.0, (55.0), 65.0']
    dape = _row(table, '| reverse_string | DAPE-ALiBi |')
    assert dape[3] == '2 of 3 [9, 99]%' and dape[5] == '75.0, 74.9, 100.0'  # 74.9 is below the threshold
    assert dape[4] == '83.3 [47.4, 100.0]' and dape[6:] == ['75.0 [11.5, 100.0]', '70.0, (72.0), 80.0']
    pair = _row(table, '| reverse_string | DAPE-ALiBi vs ALiBi |')
    learned, every, ids = (results.compare_means(a, b, bounds=(0.0, 100.0)) for a, b in [
        ([70.0, 80.0], [60.0, 65.0]), ([70.0, 72.0, 80.0], [60.0, 55.0, 65.0]), ([75.0, 74.9, 100.0], [80.0, 70.0, 90.0])])
    share = results.compare_means([1.0, 0.0, 1.0], [1.0, 1.0, 0.0], bounds=(0.0, 1.0))  # learned: seeds 0, 2 against 0, 1
    assert results.holm_over([learned, every, ids, share]) == 4  # the table's four comparisons
    assert pair[2] == f"2 of 3 vs 2 of 3, exact {results.p_text(share['p_exact'])}, Holm {results.p_text(share['p_holm'])}"
    assert pair[3:] == _cells(learned) + _cells(every) + _cells(ids)
    assert pair[4] != pair[8]  # the seeds that did not learn change the test: they are not in the first
    assert -100 <= learned['ci'][0] <= learned['ci'][1] <= 100 and learned['ci_method'] == 't, clipped'
    caption = table.splitlines()[-1]
    assert "CHE's rule since 2026-11-24" in caption and 'for the 4 comparisons of this table' in caption
    assert "In the learned column of a comparison, the exact p of the difference between the shares" in caption
    assert 'Smallest possible exact p: 0.33 with 2 and 2 seeds, 0.1 with 3 and 3 seeds.' in caption
    assert _row(table, '| reverse_string | Kerple |')[3] == '3 of 3 [29, 100]%'
    assert '75% for reverse_string' in table.splitlines()[-1]
    assert not any(line.startswith('| reverse_string | DAPE-Kerple') for line in table.splitlines())
    other = C.seeds_table(cells, ['reverse_string'], columns, dict(cfg, learned_frac=0.1))
    assert _row(other, '| reverse_string | ALiBi |')[3] == '3 of 3 [29, 100]%'  # 55% is enough
    assert "this run's rule; CHE's, set on 2026-11-24, is 0.5" in other.splitlines()[-1]


def test_holm_counts_every_comparison_of_the_table():
    """Holm's adjustment is over every comparison of the table, not row by row: two pairs of 4 seeds fully apart
    (exact p 2/70 each time) give six comparisons of means and two of the shares of seeds that learned (4 of 4
    against 4 of 4: exact p 1), each adjusted to at least 8 x 2/70."""
    import results
    figures = {'none': [(s, 60.0 + s, 50.0 + s) for s in range(4)], 'v1': [(s, 90.0 + s, 80.0 + s) for s in range(4)]}
    cells = {('bucket_sort', pos, d): _cell('bucket_sort', pos, d, runs) for pos in ('alibi', 'kerple')
             for d, runs in figures.items()}
    table = C.seeds_table(cells, ['bucket_sort'], [(p, d) for d in ('none', 'v1') for p in ('alibi', 'kerple')],
                          _cfg(seeds='0,1,2,3', learning_rate=1e-3))
    for pair in ('| bucket_sort | DAPE-ALiBi vs ALiBi |', '| bucket_sort | DAPE-Kerple vs Kerple |'):
        row = _row(table, pair)
        assert row[5::4] == [results.p_text(2 / 70)] * 3 and row[6::4] == [results.p_text(8 * 2 / 70)] * 3
        assert row[2] == '4 of 4 vs 4 of 4, exact 1, Holm 1'
    assert 'for the 8 comparisons of this table. Smallest possible exact p: 0.029 with 4 and 4 seeds.' in table


@pytest.mark.parametrize('ka,na,kb,nb', [(3, 6, 6, 6), (0, 3, 3, 3), (1, 4, 3, 5), (5, 10, 10, 10), (2, 2, 2, 2)])
def test_the_shares_of_seeds_that_learned_are_compared_by_the_conditional_exact_test(ka, na, kb, nb):
    """DAPE-X's k of n seeds that learned against X's: the permutation test on each seed's 1 or 0 is the
    hypergeometric test given the margins (scipy's hypergeom), two-sided by doubling the smaller tail; its Holm
    adjustment counts it among the table's comparisons."""
    stats = pytest.importorskip("scipy.stats")
    import results
    ids = lambda k, n: [(s, 90.0 if s < k else 10.0, 50.0) for s in range(n)]  # bucket_sort: learned from 60%
    cells = {('bucket_sort', 'alibi', 'v1'): _cell('bucket_sort', 'alibi', 'v1', ids(ka, na)),
             ('bucket_sort', 'alibi', 'none'): _cell('bucket_sort', 'alibi', 'none', ids(kb, nb))}
    rows = results.seed_rows(cells, ['bucket_sort'], [('alibi', 'none'), ('alibi', 'v1')],
                       _cfg(seeds=','.join(map(str, range(max(na, nb)))), learning_rate=1e-3))
    (_, _, cs), = results.seed_comparisons(rows)
    h = stats.hypergeom(na + nb, ka + kb, na)  # DAPE's count of learned seeds, given how many learned in all
    want = min(1.0, 2 * min(h.cdf(ka), h.sf(ka - 1)))
    assert cs[3]['p_exact'] == pytest.approx(want, rel=1e-9) and cs[3]['diff'] == pytest.approx(ka / na - kb / nb)
    assert [c['p_holm'] for c in cs if c['status'] == 'ok'] == results.holm([c['p_exact'] for c in cs if c['status'] == 'ok'])


def test_seeds_table_rows_per_learning_rate_and_unservable_runs():
    cells = {('even_pairs', 'alibi', 'none'): _cell('even_pairs', 'alibi', 'none', [(0, 90.0, 60.0), (1, 92.0, 62.0)]),
             ('even_pairs', 'alibi', 'v1'): _cell('even_pairs', 'alibi', 'v1', [(0, 90.0, 70.0), (1, 92.0, 71.0)])}
    for key, (lr_runs) in [(('even_pairs', 'alibi', 'none'), [(0, 50.0, 50.0), (1, 52.0, 51.0)]),
                           (('even_pairs', 'alibi', 'v1'), [(0, 80.0, None), (1, 81.0, 52.0)])]:
        cells[key]['runs'] += _cell(*key, lr_runs, lr=1e-4)['runs']
    cfg = _cfg(seeds='0,1', learning_rates='1e-4,1e-3')
    table = C.seeds_table(cells, ['even_pairs'], [('alibi', 'none'), ('alibi', 'v1')], cfg)
    assert _row(table, '| even_pairs | ALiBi | 0.001 |')[4:7] == ['2 of 2 [16, 100]%', '91.0 [78.3, 100.0]', '90.0, 92.0']
    assert _row(table, '| even_pairs | ALiBi | 0.0001 |')[4:9] == ['0 of 2 [0, 84]%', '51.0 [38.3, 63.7]', '50.0, 52.0', '-',
                                                                  '(50.0), (51.0)']
    import results
    c = results.compare_means([70.0, 71.0], [60.0, 62.0], bounds=(0.0, 100.0))
    # six comparisons in the table (ID and the shares of seeds that learned at each rate, OOD at 0.001 twice), each
    # p_exact 1/3 or 1: Holm 1
    assert _row(table, '| even_pairs | DAPE-ALiBi vs ALiBi | 0.001 |')[4:8] == [
        results.difference_text(c), results.p_text(c['p']), '0.33', '1']
    assert 'for the 6 comparisons of this table' in table.splitlines()[-1]
    low = _row(table, '| even_pairs | DAPE-ALiBi | 0.0001 |')
    assert low[7:9] == ['n/s', 'n/s, 52.0']  # a run not servable at the test lengths: no mean, no test
    assert _row(table, '| even_pairs | DAPE-ALiBi vs ALiBi | 0.0001 |')[4:12] == ['n/s'] * 8
    cells[('even_pairs', 'alibi', 'v1')]['runs'][2]['score'] = 53.0  # servable now; ALiBi learned in no seed
    table = C.seeds_table(cells, ['even_pairs'], [('alibi', 'none'), ('alibi', 'v1')], cfg)
    assert _row(table, '| even_pairs | DAPE-ALiBi vs ALiBi | 0.0001 |')[3:8] == ['2 of 2 vs 0 of 2, exact 0.33, Holm 1', 'n/a: 0 seeds', '-',
                                                                              '-', '-']
    with pytest.raises(ValueError, match='learned_frac must be in'):
        C.check_config(_cfg(learned_frac=1.5))


def test_saved_runs_give_the_same_tables(tmp_path):
    """save_runs writes the figures the tables over seeds are made of; tables_from makes the same tables
    from that file alone, as the published pages are made."""
    out, saved = tmp_path / 'grid', tmp_path / 'runs.json'
    args = ['--grid=True', '--grid_tasks=bucket_sort', '--grid_pos=alibi', '--grid_dape=none,v1', '--n_layer=1',
            '--n_head=2', '--n_embd=16', '--dape_width=8', '--batch_size=4', '--eval_samples=2',
            '--eval_batch_size=2', '--eval_min_len=41', '--eval_max_len=41', '--id_stride=20', '--device=cpu',
            '--max_iters=2', '--seeds=0,1', '--eval_draws=1', '--plot=False', f'--out_dir={out}',
            f'--save_runs={saved}']
    cells, _ = C.main(args)
    runs = json.loads(saved.read_text())['runs']
    assert len(runs) == 4 and set(runs[0]) >= {'task', 'pos', 'dape', 'seed', 'learning_rate', 'id_score', 'score'}
    # each with where it came from: the command line, the commit, the machine and the date
    import common
    assert runs[0]['command'] == 'python che_tasks.py ' + ' '.join(args)
    assert runs[0]['commit'] == common.code_version() and runs[0]['machine'] == common.machine_text('cpu')
    assert runs[0]['date'] == __import__('datetime').date.today().isoformat()
    cfg = configure({k: getattr(C, k) for k in C.config_keys}, args)
    # with each run's accuracy per test length, so that the tables per length come from the file too
    assert runs[0]['per_length'] == cells[('bucket_sort', 'alibi', 'none')]['runs'][0]['per_length']
    # the same options without save_runs, which tables_from refuses (it trains nothing to save)
    assert C.main([a for a in args if not a.startswith('--save_runs=')] + [f'--tables_from={saved}']) == (
        C.seeds_table(cells, ['bucket_sort'], C.grid_columns(cfg), cfg) + '\n\nPer test length:\n\n'
        + C.length_tables(cells, ['bucket_sort'], C.grid_columns(cfg), cfg))


def test_save_runs_merges_reruns_into_a_results_file(tmp_path):
    """A grid saved into an existing results file replaces the runs it reran (same task, encoding, learning
    rate, seed), marked source: run, and keeps the others and the file's other fields."""
    path = tmp_path / 'che.json'
    run = lambda seed, dape, score, **kw: dict(task='bucket_sort', pos='alibi', dape=dape, seed=seed,
                                               learning_rate=1e-3, id_score=score, score=score, variants={}, **kw)
    path.write_text(json.dumps({'what': 'kept', 'runs': [run(0, 'none', 1.0, source='published'),
                                                          run(1, 'none', 2.0, source='run'),
                                                          run(0, 'v1', 3.0, source='published')]}))
    C.merge_runs(str(path), [run(0, 'none', 9.0), run(2, 'none', 8.0)])
    saved = json.loads(path.read_text())
    assert saved['what'] == 'kept'
    assert [(r['dape'], r['seed'], r['score'], r['source']) for r in saved['runs']] == [
        ('none', 0, 9.0, 'run'), ('none', 1, 2.0, 'run'), ('none', 2, 8.0, 'run'), ('v1', 0, 3.0, 'published')]
    # a run at another learning rate is another run: kept beside the one it does not replace
    C.merge_runs(str(path), [dict(run(0, 'none', 5.0), learning_rate=3e-3)])
    saved = json.loads(path.read_text())
    assert [(r['learning_rate'], r['score']) for r in saved['runs'] if r['dape'] == 'none' and r['seed'] == 0] == [
        (1e-3, 9.0), (3e-3, 5.0)]


@pytest.mark.parametrize('task', ['bucket_sort', 'flip_flop', 'mqar'])
def test_training_draws_every_length_up_to_the_longest(task, monkeypatch):
    """N ~ U{min_len..train_max_len}, both ends included: the longest training length is in distribution
    only if training draws it."""
    import contextlib
    drawn, frame = [], C.frame
    monkeypatch.setattr(C, 'frame', lambda t, B, N, rng, variant=None: drawn.append(N) or frame(t, B, N, rng, variant))
    t = C.TASKS[task]
    cfg = _cfg(task=task, max_iters=60, batch_size=1, train_max_len=t.min_len + 2, log_interval=60)
    C.train(C.build_model(t, cfg), t, cfg, 'cpu', contextlib.nullcontext(), log=lambda *a: None)
    assert set(drawn) == {t.min_len, t.min_len + 1, t.min_len + 2}


def test_seeds_are_ordered_as_numbers():
    """Seed 10 comes after seed 9, in the per-seed columns and in the committed runs."""
    cells = {('reverse_string', 'alibi', 'none'): _cell('reverse_string', 'alibi', 'none',
                                                         [(10, 90.0, 65.0), (9, 80.0, 60.0), (2, 70.0, 55.0)])}
    cfg = _cfg(seeds='2,9,10', learning_rate=1e-3)
    table = C.seeds_table(cells, ['reverse_string'], [('alibi', 'none')], cfg)
    assert _row(table, '| reverse_string | ALiBi |')[5] == '70.0, 80.0, 90.0'
    assert 'over seeds 2,9,10:' in table
    for r in cells[('reverse_string', 'alibi', 'none')]['runs']:
        r.update(task='reverse_string', pos='alibi', dape='none')
    assert [r['seed'] for r in C.compact_runs(cells)] == [2, 9, 10]


def test_the_confidence_interval_is_welchs():
    """compare_means against figures from an independent implementation (scipy.stats.ttest_ind with
    equal_var=False and its confidence_interval(0.95), scipy 1.17): the difference, its interval, df, p."""
    import results
    c = results.compare_means([71.2, 64.5, 80.1, 77.7], [60.3, 58.8, 70.2, 49.9, 66.0, 61.5])
    assert c['diff'] == pytest.approx(12.258333333333326, abs=1e-9)
    assert c['ci'] == pytest.approx([1.4556065262039066, 23.061060140462743], abs=1e-6)
    assert c['df'] == pytest.approx(6.502985462601774, abs=1e-9)
    assert c['p'] == pytest.approx(0.03173907831341556, abs=1e-9)


def test_dape_with_f_zero_at_init_is_a_column_of_its_own(tmp_path):
    """dape='v1:zero': DAPE V1 with f's last layer zero at init (GPTConfig.dape_init), labelled, filed and
    compared with its encoding apart from the default init's runs."""
    g = C.build_model(C.TASKS['bucket_sort'], _cfg(pos='alibi', dape='v1:zero'), config_only=True)
    assert (g.dape, g.dape_init) == ('v1', 'zero')
    assert C.build_model(C.TASKS['bucket_sort'], _cfg(pos='alibi', dape='v1'), config_only=True).dape_init == 'default'
    assert C.encoding_label('alibi', 'v1:zero') == 'DAPE-ALiBi (zero init)'
    assert C._run_path(_cfg(task='bucket_sort', pos='alibi', dape='v1:zero', out_dir=str(tmp_path))).endswith(
        'bucket_sort_alibi_v1-zero_s0_lr0.0003.json')
    import results
    figures = {'none': [(0, 90.0, 80.0), (1, 92.0, 85.0)], 'v1': [(0, 70.0, 60.0), (1, 95.0, 75.0)],
               'v1:zero': [(0, 91.0, 82.0), (1, 93.0, 88.0)]}
    cells = {('bucket_sort', 'alibi', d): _cell('bucket_sort', 'alibi', d, runs) for d, runs in figures.items()}
    table = C.seeds_table(cells, ['bucket_sort'], [('alibi', 'none'), ('alibi', 'v1'), ('alibi', 'v1:zero')],
                          _cfg(seeds='0,1', learning_rate=1e-3))
    assert _row(table, '| bucket_sort | DAPE-ALiBi (zero init) vs ALiBi |')[2] == '2 of 2 vs 2 of 2, exact 1, Holm 1'
    # and against DAPE-ALiBi with the default init, over every seed
    against_default = _row(table, '| bucket_sort | DAPE-ALiBi (zero init) vs DAPE-ALiBi |')
    every = results.compare_means([82.0, 88.0], [60.0, 75.0], bounds=(0.0, 100.0))
    assert against_default[7:10] == [results.difference_text(every), results.p_text(every['p']),
                                     results.p_text(every['p_exact'])]
    assert [line.split('|')[2].strip() for line in table.splitlines()
                                                  if line.startswith('| bucket_sort |') and ' vs ' in line] == [
        'DAPE-ALiBi vs ALiBi', 'DAPE-ALiBi (zero init) vs ALiBi', 'DAPE-ALiBi (zero init) vs DAPE-ALiBi']
    with pytest.raises(ValueError, match="unknown dape_init='small'"):
        C.check_config(_cfg(pos='alibi', dape='v1:small'))


def _runs_with_lengths(task, pos, dape, figures, machine='cpu, AVX512 kernels, torch'):
    """A cell whose runs keep their accuracy per test length: figures [(seed, ID, {N: accuracy})], OOD their mean."""
    runs = [{'seed': s, 'learning_rate': 1e-3, 'id_score': i, 'score': float(np.mean(list(acc.values()))),
             'per_length': {str(N): a for N, a in acc.items()}, 'machine': machine} for s, i, acc in figures]
    return {'task': task, 'pos': pos, 'dape': dape, 'runs': runs}


def test_retest_tables_pair_runs_by_seed_and_rate():
    """A run is its seed and its learning rate: the first file's run at a second rate, whose seed the other file
    holds at the first rate only, is in one file and not counted (the second rate listed first, so that a row of
    one file alone would pair with another's row)."""
    figures = lambda shift: [(s, 80.0 + s + shift, {41: 60.0 + s, 51: 50.0 + s}) for s in range(3)]
    cells = lambda: {('bucket_sort', 'alibi', d): _runs_with_lengths('bucket_sort', 'alibi', d, figures(i))
                     for i, d in enumerate(('none', 'v1'))}
    cells_a, cells_b = cells(), cells()
    cells_a[('bucket_sort', 'alibi', 'none')]['runs'].append(dict(cells_a[('bucket_sort', 'alibi', 'none')]['runs'][0],
                                                                  learning_rate=3e-3, id_score=10.0))
    table = C.retest_tables(cells_a, cells_b, ['bucket_sort'], [('alibi', 'none'), ('alibi', 'v1')],
                            _cfg(seeds='0,1,2', learning_rates='3e-3,1e-3'))
    assert _row(table, '| ALiBi lr 0.001 | 3 |')[6] == '0' and _row(table, '| all | 6 |')[6] == '0', table
    assert not any(line.startswith('| ALiBi lr 0.003') for line in table.splitlines())


def test_length_tables_give_every_seed_at_every_length_and_each_dape_difference():
    """Per test length: each encoding's mean with its 95% t interval over every seed (cut to 0-100; the figures are
    scipy's), the seed that did not learn the task included (no threshold decides these); then DAPE-X minus X at
    each length with Welch's, the exact and Holm's p, Holm over every length of every pair (one table). No table
    where the runs keep no per-length figures."""
    import results
    base = [(0, 90.0, {41: 60.0, 51: 50.0}), (1, 30.0, {41: 20.0, 51: 22.0}), (2, 80.0, {41: 64.0, 51: 40.0})]
    dape = [(0, 95.0, {41: 70.0, 51: 61.0}), (1, 91.0, {41: 75.0, 51: 58.0}), (2, 99.0, {41: 80.0, 51: 65.0})]
    cells = {('bucket_sort', pos, d): _runs_with_lengths('bucket_sort', pos, d, runs)
             for pos in ('alibi', 'kerple') for d, runs in (('none', base), ('v1', dape))}
    columns = [('alibi', 'none'), ('alibi', 'v1'), ('kerple', 'none'), ('kerple', 'v1')]
    cfg = _cfg(seeds='0,1,2', learning_rate=1e-3)
    table = C.length_tables(cells, ['bucket_sort'], columns, cfg)
    assert _row(table, '| 41 |')[:3] == ['41', '48.0 [0.0, 100.0]', '75.0 [62.6, 87.4]']
    assert _row(table, '| 51 |')[1] == '37.3 [2.1, 72.6]'  # seed 1 (ID 30%) counts here
    at = {N: results.compare_means([r[2][N] for r in dape], [r[2][N] for r in base], bounds=(0.0, 100.0)) for N in (41, 51)}
    same = {N: dict(c) for N, c in at.items()}  # Kerple's pair has the same figures
    assert results.holm_over(list(at.values()) + list(same.values())) == 4  # every length of every pair: one table
    for N in (41, 51):
        assert _row(table, f'| DAPE-ALiBi minus ALiBi | {N} |')[2:] == _cells(at[N])
        assert _row(table, f'| DAPE-Kerple minus Kerple | {N} |')[2:] == _cells(same[N])
    assert 'for the 4 comparisons of this table' in table
    assert ('over every seed (0,1,2), whether or not it learned the task: the mean with the 95% t interval of the '
            'mean (n - 1 degrees of freedom), cut to 0-100' in table)
    plain = {k: _cell(*k, [(r['seed'], r['id_score'], r['score']) for r in c['runs']]) for k, c in cells.items()}
    assert C.length_tables(plain, ['bucket_sort'], columns, cfg) == ''


def test_retest_tables_pair_the_same_runs_under_two_roundings():
    """The test-retest: only runs in both files count; per encoding, Pearson's r and the mean change of the runs'
    OOD scores, how many seeds learned under each rounding and how many changed sides; per run, both roundings
    side by side; and each comparison of the tables over seeds once, computed under each rounding as its table
    computes it, classed: here none is significant, so none is a conclusion, and a tie is said as one."""
    import results
    # ALiBi's seed 0 learns (60% for bucket_sort) only under the second rounding, its seed 1 only under the first
    a_base = [(s, [50.0, 75.0, 80.0, 85.0][s], {41: 50.0 + s, 51: 40.0 + 2 * s}) for s in range(4)]
    a_dape = [(s, 80.0 + 4 * s, {41: 60.0 + s, 51: 45.0 + s}) for s in range(4)]
    b_base = [(s, [71.0, 50.0, 81.0, 86.0][s], {41: 50.5 + s, 51: 48.0 + s}) for s in range(4)]
    b_dape = [(0, 20.0, {41: 61.0, 51: 44.0})] + [(s, 80.5 + 4 * s, {41: 61.0 + s, 51: 43.0 + s}) for s in range(1, 4)]
    other = 'cpu, DEFAULT kernels, torch'
    cells_a = {('bucket_sort', 'alibi', d): _runs_with_lengths('bucket_sort', 'alibi', d, runs + [(9, 99.0, {41: 1.0, 51: 1.0})])
               for d, runs in (('none', a_base), ('v1', a_dape))}  # seed 9: in the first file only
    cells_b = {('bucket_sort', 'alibi', d): _runs_with_lengths('bucket_sort', 'alibi', d, runs, other)
               for d, runs in (('none', b_base), ('v1', b_dape))}
    cfg = _cfg(seeds='0,1,2,3', learning_rate=1e-3)
    table = C.retest_tables(cells_a, cells_b, ['bucket_sort'], [('alibi', 'none'), ('alibi', 'v1')], cfg)
    lines = table.splitlines()
    assert lines[0] == '| model | runs | r | mean change | learned, AVX512 | learned, DEFAULT | changed sides |'
    dape = _row(table, '| DAPE-ALiBi | 4 |')
    oods = [[np.mean(list(r[2].values())) for r in runs] for runs in (a_dape, b_dape)]
    assert dape[2:4] == [f"{np.corrcoef(*oods)[0, 1]:+.2f}", f"{np.mean(np.abs(np.subtract(*oods))):.1f}"]
    assert dape[4:] == [results.k_of_n_text(4, 4), results.k_of_n_text(3, 4), '1']  # seed 0: 80% then 20% (< 60%)
    assert _row(table, '| ALiBi | 4 |')[4:] == [results.k_of_n_text(3, 4)] * 2 + ['2']
    assert _row(table, '| all | 8 |')[6] == '3'
    assert _row(table, '| DAPE-ALiBi | 0 |')[2:] == ['52.5 / 52.5', 'yes / no']
    assert not any(line.startswith('| ALiBi | 9 |') for line in lines)  # not in both: not counted
    # ID over every seed: DAPE ahead under the first rounding, behind under the second; OOD ahead under both
    assert _row(table, '| DAPE-ALiBi vs ALiBi | ID, every seed |')[-1] == 'opposite or mixed sign, not significant'
    assert _row(table, '| DAPE-ALiBi vs ALiBi | OOD, every seed |')[-1] == 'same sign, not significant'
    # the shares of seeds that learned: DAPE ahead under the first (4 of 4 against 3 of 4), tied under the second
    assert _row(table, '| DAPE-ALiBi vs ALiBi | share of seeds that learned |')[2:] == [
        '4 of 4 vs 3 of 4, Holm p 1', '3 of 4 vs 3 of 4, Holm p 1', 'tie']
    assert lines[-1].startswith('The same runs (seeds 0,1,2,3) trained under two roundings of one machine: ')
    assert lines[-1].endswith('No comparison was a conclusion under either side: of the 3 with a test under both, 1 '
                              'kept their sign, 1 had opposite or mixed signs and 1 were exact ties under one side or '
                              'both.')
    # DAPE-ALiBi's seed 3 trained, and retrained, on another machine; then its seed 2's retest too: the caption
    # names both machines, and counts the run whose retest ran elsewhere, pairing each run with its own retest
    caption = lambda: C.retest_tables(cells_a, cells_b, ['bucket_sort'], [('alibi', 'none'), ('alibi', 'v1')],
                                      cfg).splitlines()[-1]
    for cells in (cells_a, cells_b):
        cells[('bucket_sort', 'alibi', 'v1')]['runs'][3]['machine'] = 'other cpu, AVX512 kernels, torch'
    assert caption().startswith('The same runs (seeds 0,1,2,3) trained under two roundings of one machine per run (2 '
                                'machines: cpu; other cpu): ')
    cells_b[('bucket_sort', 'alibi', 'v1')]['runs'][2]['machine'] = 'other cpu, DEFAULT kernels, torch'
    assert caption().startswith('The same runs (seeds 0,1,2,3) trained under two roundings of one machine per run (2 '
                                'machines: cpu; other cpu), except 1 run retrained on another machine (there the machine '
                                'differs too): ')
    # every run retrained with the same kernels on another machine: the sides are the two machines, not a rounding
    for cells, machine in ((cells_a, 'cpu, AVX512 kernels, torch'), (cells_b, 'other cpu, AVX512 kernels, torch')):
        for cell in cells.values():
            for r in cell['runs']:
                r['machine'] = machine
    table = C.retest_tables(cells_a, cells_b, ['bucket_sort'], [('alibi', 'none'), ('alibi', 'v1')], cfg)
    assert table.splitlines()[0].startswith('| model | runs | r | mean change | learned, cpu | learned, other cpu |')
    assert table.splitlines()[-1].startswith("The same runs (seeds 0,1,2,3) trained twice with ATen's AVX512 kernels, "
                                             "on two machines: cpu (tables_from), then other cpu (rounding_from), "
                                             "otherwise identical. A run's figure: ")
    with pytest.raises(ValueError, match='rounding_from=.*name the first with tables_from'):
        C.check_config(_cfg(rounding_from='x.json'))


def test_a_saved_run_keeps_where_it_was_trained(tmp_path):
    """A run records where it was trained; a later save (resume=True reuses it, perhaps under another rounding or
    commit) writes that record, and the save's own provenance only for runs without one."""
    cells = {('bucket_sort', 'alibi', 'none'): _cell('bucket_sort', 'alibi', 'none', [(0, 80.0, 70.0), (1, 81.0, 71.0)])}
    trained = {'commit': 'abc1234', 'command': 'python che_tasks.py --seeds=0', 'machine': 'cpu, DEFAULT kernels, torch',
               'date': '2026-11-28'}
    for r in cells[('bucket_sort', 'alibi', 'none')]['runs']:
        r.update(task='bucket_sort', pos='alibi', dape='none')
    cells[('bucket_sort', 'alibi', 'none')]['runs'][0]['trained'] = trained
    saved = {'commit': 'def5678', 'command': 'python che_tasks.py --save_runs=x', 'machine': 'cpu, AVX512 kernels, torch',
             'date': '2026-11-29'}
    path = tmp_path / 'runs.json'
    C.merge_runs(str(path), C.compact_runs(cells), saved)
    runs = {r['seed']: r for r in json.loads(path.read_text())['runs']}
    assert {k: runs[0][k] for k in trained} == trained
    assert {k: runs[1][k] for k in saved} == saved
    # and a run trained here records it
    cfg = _cfg(task='bucket_sort', pos='alibi', seed=0, max_iters=1, batch_size=2, eval_samples=1, eval_batch_size=1,
               eval_draws=1, eval_min_len=41, eval_max_len=41, id_stride=40, out_dir='', plot=False)
    run = C.run_one(cfg, log=lambda *a: None, command='python che_tasks.py --x')
    import common
    assert run['trained'] == common.provenance('python che_tasks.py --x', 'cpu')


def test_retest_counts_only_the_comparisons_that_have_a_test():
    """With one seed a side there is no test under either rounding: the comparison is n/a, not a conclusion that
    fails, and the caption counts it apart."""
    one = {('bucket_sort', 'alibi', d): _runs_with_lengths('bucket_sort', 'alibi', d, [(0, x, {41: x, 51: x, 61: x})])
           for d, x in (('none', 70.0), ('v1', 80.0))}
    table = C.retest_tables(one, one, ['bucket_sort'], [('alibi', 'none'), ('alibi', 'v1')],
                            _cfg(seeds='0', learning_rate=1e-3))
    assert _row(table, '| DAPE-ALiBi vs ALiBi | ID, every seed |')[-1] == 'n/a: no test under one side'
    assert table.endswith('of the 0 with a test under both, 0 kept their sign, 0 had opposite or mixed signs and 0 '
                          'were exact ties under one side or both; 3 had no test under one side.')


def test_retest_and_length_tables_where_some_runs_keep_no_per_length_figures():
    """Results files written before runs kept their per-length accuracies: the test-retest of such a file against
    one that keeps them reads neither's per-length figures (it must not fail), in either order, and a lengths table
    over a file that mixes both kinds names the seeds its figures are over, not every seed."""
    with_lengths = {('bucket_sort', 'alibi', d): _runs_with_lengths('bucket_sort', 'alibi', d,
                                                                   [(s, 80.0 + s + k, {41: 60.0 + s + k, 51: 50.0 + s})
                                                                    for s in range(3)])
                    for k, d in enumerate(('none', 'v1'))}
    without = {key: _cell(*key, [(r['seed'], r['id_score'], r['score']) for r in c['runs']])
               for key, c in with_lengths.items()}
    columns, cfg = [('alibi', 'none'), ('alibi', 'v1')], _cfg(seeds='0,1,2', learning_rate=1e-3)
    for a, b in ((with_lengths, without), (without, with_lengths)):
        table = C.retest_tables(a, b, ['bucket_sort'], columns, cfg)
        assert table.endswith('of the 3 with a test under both, 2 kept their sign, 0 had opposite or mixed signs and '
                              '1 were exact ties under one side or both.'), table[-300:]
    # seeds 3 and 4: older records, no per-length figures
    mixed = {}
    for key, c in with_lengths.items():
        old = [dict({k: v for k, v in r.items() if k != 'per_length'}, seed=s) for s, r in zip((3, 4), c['runs'])]
        mixed[key] = dict(c, runs=c['runs'] + old)
    table = C.length_tables(mixed, ['bucket_sort'], columns, _cfg(seeds='0,1,2,3,4', learning_rate=1e-3))
    assert 'over every seed (0,1,2), whether or not it learned' in table


def test_pearson_and_the_side_ahead_ignore_rounding():
    """A constant list has no correlation even where its float std rounds to 1e-17 (scipy says nan); the same
    values in another order are level, not ahead by the 1e-15 that summing them in that order leaves."""
    import results
    assert results.pearson([0.05] * 3, [1, 2, 3.5]) is None
    assert results.pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(0.9933992677987827)
    a = [49.73, 11.0, 52.79, 51.56, 0.79]
    c = results.compare_means(a, [51.56, 0.79, 49.73, 52.79, 11.0], bounds=(0, 100))
    assert c['diff'] == 0.0 and results.direction([c]) == (None, '0')
    assert results.direction([results.compare_means(a, [v - 0.01 for v in a], bounds=(0, 100))])[1] == '+'


def _fake_cell_run(cfg, log=print, command='unknown'):
    """_fake_run with the task and encoding a results file files it under."""
    return dict(_fake_run(cfg), task=cfg['task'], pos=cfg['pos'], dape=cfg['dape'])


def test_save_runs_keeps_a_single_cells_runs(tmp_path, monkeypatch):
    """--save_runs without --grid merges the cell's runs into the file, as a grid's are."""
    monkeypatch.setattr(C, 'run_one', _fake_cell_run)
    path = tmp_path / 'runs.json'
    C.main(['--task=bucket_sort', '--pos=alibi', '--seeds=0,1', '--out_dir=', '--device=cpu', f'--save_runs={path}'])
    runs = json.loads(path.read_text())['runs']
    assert [(r['task'], r['pos'], r['dape'], r['seed'], r['source']) for r in runs] == [
        ('bucket_sort', 'alibi', 'none', 0, 'run'), ('bucket_sort', 'alibi', 'none', 1, 'run')]
    assert runs[0]['command'].startswith('python che_tasks.py --task=bucket_sort')


def test_save_runs_with_tables_from_is_refused():
    """tables_from trains nothing: a save_runs beside it would be silently ignored."""
    with pytest.raises(ValueError, match=r'save_runs=x\.json with tables_from=y\.json: .*drop one of them'):
        C.check_config(_cfg(save_runs='x.json', tables_from='y.json'))


def _trains_nothing(cfg, log=print, command='unknown'):
    raise AssertionError('trained before the save_runs file was checked')


def test_a_bad_save_runs_file_fails_before_training_and_is_left_as_it_was(tmp_path, monkeypatch):
    """A missing folder, a file that is not JSON and a JSON file that is not a results file (a passkey file holds
    'rows') are refused before any run trains, each in one line naming the file; the file is not touched."""
    monkeypatch.setattr(C, 'run_one', _trains_nothing)
    grid = ['--grid=True', '--grid_tasks=bucket_sort', '--grid_pos=alibi', '--grid_dape=none', '--out_dir=',
            '--device=cpu']
    missing = tmp_path / 'no_such_folder' / 'x.json'
    with pytest.raises(ValueError, match=f"save_runs={missing}: there is no folder .*no_such_folder to write it in"):
        C.main(grid + [f'--save_runs={missing}'])
    assert not missing.parent.exists()
    for text, message in (('{"runs": [{"task": "bucket', 'cannot be read as JSON'),
                          ('{"rows": []}', 'is not a che_tasks results file'),
                          ('{"runs": [{"seed": 0}]}', 'is not a che_tasks results file')):
        path = tmp_path / 'runs.json'
        path.write_text(text)
        with pytest.raises(ValueError, match=f"save_runs={path} {message}.*repair it or name a new file"):
            C.main(grid + [f'--save_runs={path}'])
        assert path.read_text() == text
    # a results file, or none yet, passes
    path.write_text('{"runs": []}')
    C.check_config(_cfg(save_runs=str(path)))
    C.check_config(_cfg(save_runs=str(tmp_path / 'new.json')))


def test_tables_from_names_a_missing_or_bad_file_and_what_a_file_holds(tmp_path):
    """tables_from (and rounding_from) on a file that is not there or not JSON: one line naming it; options that
    select no run of the file: one line saying what was asked and what the file holds, not a table's header."""
    missing = tmp_path / 'none.json'
    with pytest.raises(ValueError, match=f"tables_from={missing}: no such file"):
        C.check_config(_cfg(tables_from=str(missing)))
    bad = tmp_path / 'bad.json'
    bad.write_text('{"runs": [')
    with pytest.raises(ValueError, match=f"tables_from={bad} cannot be read as JSON"):
        C.check_config(_cfg(tables_from=str(bad)))
    path = tmp_path / 'runs.json'
    cells = {('bucket_sort', 'alibi', d): _cell('bucket_sort', 'alibi', d, [(0, 80.0, 70.0)]) for d in ('none', 'v1')}
    for (t, p, d), c in cells.items():
        for r in c['runs']:
            r.update(task=t, pos=p, dape=d)
    C.merge_runs(str(path), C.compact_runs(cells))
    with pytest.raises(ValueError, match=f"rounding_from={missing}: no such file"):
        C.check_config(_cfg(task='bucket_sort', pos='alibi', learning_rate=1e-3, tables_from=str(path),
                            rounding_from=str(missing)))
    with pytest.raises(ValueError, match=r"holds no run of task bucket_sort, encoding alibi/none at learning rate "
                                         r"0\.0003: it holds tasks bucket_sort; encodings \(pos/dape\) alibi/none, "
                                         r"alibi/v1; learning rates 0\.001; select those"):
        C.check_config(_cfg(task='bucket_sort', pos='alibi', tables_from=str(path)))
    C.check_config(_cfg(task='bucket_sort', pos='alibi', learning_rate=1e-3, tables_from=str(path)))


def test_resume_names_a_run_record_cut_short(tmp_path):
    """A truncated run record in out_dir/runs/: one line naming it and the two ways on, before anything trains
    (check_config) and where run_one reads it; the record is left for the user to delete."""
    cfg = _cfg(task='bucket_sort', pos='alibi', seeds='0,1', out_dir=str(tmp_path), resume=True)
    path = C._run_path(dict(cfg, seed=1))
    os.makedirs(os.path.dirname(path))
    with open(path, 'w') as f:
        f.write('{"task": "bucket_sort", "score"')
    message = f"resume=True reuses {path}, which is not whole JSON .*delete it .*or pass --resume=False"
    with pytest.raises(ValueError, match=message):
        C.check_config(cfg)
    with pytest.raises(ValueError, match=message):
        C.run_one(dict(cfg, seed=1), log=lambda *a: None)
    assert open(path).read() == '{"task": "bucket_sort", "score"'
    C.check_config(dict(cfg, resume=False))  # which trains the run again over it


def test_mqar_beyond_its_keys_names_eval_max_len():
    with pytest.raises(ValueError, match=r"eval_max_len=257: mqar needs 1 <= N <= 256 .*lower --eval_max_len"):
        C.check_config(_cfg(task='mqar', eval_max_len=257))


def test_retrieval_tasks_are_at_positions_0_to_T_minus_1_by_their_configs():
    """The retrieval configs set rand_pos=False (docs/retrieval.md); the runner's default, rand_pos=True, draws
    randomized positions for a retrieval task as for CHE, and the module's docstring says so."""
    for name in ('flip_flop', 'mqar'):
        cfg = configure({k: getattr(C, k) for k in C.config_keys}, [os.path.join(ROOT, 'config', f'{name}_cpu.py')])
        assert not C.build_model(C.TASKS[name], dict(cfg, pos='rope'), config_only=True).rand_pos
        assert C.build_model(C.TASKS[name], _cfg(task=name, pos='rope'), config_only=True).rand_pos
    doc = ' '.join(C.__doc__.split())
    assert 'at positions 0..T-1 as its configs set it (rand_pos=False; the runner\'s default, rand_pos=True, ' \
           'draws randomized positions for any task)' in doc


def test_an_edited_dape_py_is_recorded_labelled_and_kept_apart(tmp_path, monkeypatch):
    """A run trained with an edited dape.py (an ablation of f) records it, is labelled with its tag, is not reused
    by resume=True where the out_dir's run was trained with another dape.py, and does not replace its
    baseline's run in a save_runs file (nor the reverse)."""
    import common
    cfg = _cfg(task='bucket_sort', pos='alibi', dape='v1', seed=0, max_iters=1, batch_size=2, eval_samples=1,
               eval_batch_size=1, eval_draws=1, eval_min_len=41, eval_max_len=41, id_stride=40, out_dir=str(tmp_path),
               resume=True, plot=False)
    base = C.run_one(cfg, log=lambda *a: None)
    assert base['dape_py']['tag'] is None and base['encoding'] == 'DAPE-ALiBi'
    edited = dict(common.dape_record(), sha256='ab12cd3' + '0' * 57, edited=True)
    monkeypatch.setattr(C, 'dape_record', lambda: edited)
    said = []
    ablation = C.run_one(cfg, log=said.append)
    assert any('trained with another dape.py' in line for line in said)  # trained again, not reused
    assert ablation['dape_py'] == {'sha256': edited['sha256'], 'edited': True, 'tag': 'ab12cd3'}
    assert ablation['encoding'] == 'DAPE-ALiBi[dape.py=ab12cd3]'
    path = str(tmp_path / 'runs.json')
    cell = lambda run: {('bucket_sort', 'alibi', 'v1'): {'runs': [run]}}
    C.merge_runs(path, C.compact_runs(cell(base)))
    with pytest.raises(common.InputError, match="trained with dape.py as committed, and this run with dape.py "
                                                "ab12cd3: save an ablation's runs in a file of their own"):
        C.merge_runs(path, C.compact_runs(cell(ablation)))
    C.merge_runs(str(tmp_path / 'ablation.json'), C.compact_runs(cell(ablation)))
    assert json.loads((tmp_path / 'ablation.json').read_text())['runs'][0]['dape_tag'] == 'ab12cd3'
