"""results.py's statistics for a few seeds a side: the exact permutation test, Holm's adjustment, Welch's t
interval of a bounded difference cut to the possible range, compare_means, which carries them into the tables, and
the exact binomial interval of a count of seeds. Each is checked
against a computation by hand or by its definition, and, where scipy is installed (bash test.sh installs it),
against scipy.stats."""

import itertools
import math

import numpy as np
import pytest

import results


# -----------------------------------------------------------------------------
# the exact permutation test


def permutation_p_by_definition(a, b):
    """The two-sided p over every ordering of the pooled values (each split of the runs then counted
    len(a)! len(b)! times, so the shares are those over splits): twice the smaller share of orderings whose
    difference of means is at most / at least the observed one, capped at 1."""
    x, na = list(a) + list(b), len(a)
    observed = np.mean(a) - np.mean(b)
    diffs = np.array([np.mean(p[:na]) - np.mean(p[na:]) for p in itertools.permutations(x)])
    less, greater = np.mean(diffs <= observed + 1e-9), np.mean(diffs >= observed - 1e-9)
    return min(1.0, 2 * min(less, greater))


def test_permutation_test_by_hand():
    # fully apart, 3 and 3: only the observed split of the 20 is as extreme on its side, p = 2 / 20
    assert results.permutation_test([4.0, 5.0, 6.0], [1.0, 2.0, 3.0]) == {'p': 0.1, 'p_min': 0.1, 'splits': 20,
                                                                       'exact': True}
    # every seed at 0% against every seed at 100%: ties within each side, still the smallest p
    assert results.permutation_test([0.0] * 3, [100.0] * 3)['p'] == pytest.approx(0.1)
    # identical groups, also where the values' sums round differently in different orders
    assert results.permutation_test([1.0, 2.0, 3.0], [3.0, 1.0, 2.0])['p'] == 1.0
    assert results.permutation_test([0.1, 0.2, 0.3], [0.3, 0.1, 0.2])['p'] == 1.0
    # (scipy 1.17 gives 0.886 here: its tolerance is relative to the observed difference, which is 0; ours is
    # floored at the data's scale)
    assert results.permutation_test([0.2, 0.9, 0.5, 0.3], [0.5, 0.3, 0.2, 0.9])['p'] == 1.0
    assert results.permutation_test([5.0, 5.0], [5.0, 5.0, 5.0])['p'] == 1.0  # no spread at all
    # one run against three, the largest: 1 of the 4 splits is as extreme on its side, p = 2 x 1/4 (twice the
    # smaller tail, as scipy computes it; counting |difference| would give 1/4 here)
    assert results.permutation_test([7.0], [1.0, 2.0, 3.0]) == {'p': 0.5, 'p_min': 0.5, 'splits': 4, 'exact': True}
    assert results.permutation_test([1.0], [2.0])['p'] == 1.0
    with pytest.raises(ValueError):
        results.permutation_test([], [1.0, 2.0])


@pytest.mark.parametrize('na, nb', [(1, 1), (1, 3), (2, 2), (3, 3), (2, 5), (5, 5), (4, 6), (10, 10)])
def test_the_smallest_p_is_two_over_the_number_of_splits(na, nb):
    """Runs fully apart give the smallest p the sample sizes allow, 2 / C(na + nb, na) (capped at 1), and
    every p of those sizes is at least that."""
    low, high = np.arange(nb, dtype=float), 100.0 + np.arange(na)
    r = results.permutation_test(high, low)
    assert r['p'] == r['p_min'] == pytest.approx(min(1.0, 2 / math.comb(na + nb, na)), rel=1e-12)
    assert r['exact'] and r['splits'] == math.comb(na + nb, na)
    rng = np.random.default_rng(na * 100 + nb)
    for _ in range(5):
        assert results.permutation_test(rng.normal(size=na), rng.normal(size=nb))['p'] >= r['p_min'] - 1e-12


def test_permutation_test_against_its_definition_with_one_run_a_side_and_ties():
    """Where scipy cannot go (it needs two runs a side), and with ties: every ordering of the pooled runs."""
    rng = np.random.default_rng(0)
    cases = [([7.0], [1.0, 2.0, 3.0]), ([0.0], [0.0, 100.0, 100.0, 100.0]), ([2.0, 2.0], [1.0, 2.0, 3.0, 3.0]),
             ([0.0, 10.0], [1.0, 2.0, 3.0, 4.0]), ([5.0, 6.0], [1.0, 2.0, 8.0])]
    cases += [(list(rng.integers(0, 3, size=na).astype(float)), list(rng.integers(0, 3, size=6 - na).astype(float)))
              for na in (1, 2, 3) for _ in range(3)]
    for a, b in cases:
        assert results.permutation_test(a, b)['p'] == pytest.approx(permutation_p_by_definition(a, b), abs=1e-12), (a, b)


def test_permutation_test_beyond_the_exact_limit_draws_seeded_splits():
    """11 runs a side have more splits than EXACT_MAX: PERMUTATION_DRAWS random ones, seeded, the observed split
    counted as one more, so that runs fully apart give 2 / (draws + 1) or a little more, never 0."""
    assert math.comb(22, 11) > results.EXACT_MAX
    r = results.permutation_test(100.0 + np.arange(11), np.arange(11.0))
    assert not r['exact'] and r['splits'] == results.PERMUTATION_DRAWS
    assert r['p_min'] == pytest.approx(2 / (results.PERMUTATION_DRAWS + 1))
    assert r['p_min'] <= r['p'] <= 3 * r['p_min']
    same = np.linspace(0.0, 1.0, 11)
    assert results.permutation_test(same, same[::-1])['p'] == 1.0
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=11), rng.normal(0.3, size=11)
    assert results.permutation_test(a, b) == results.permutation_test(a, b)  # seeded: the same on every run


def test_permutation_test_enumerates_at_the_exact_limit(monkeypatch):
    """Splits exactly EXACT_MAX: still enumerated. 3 and 3 runs fully apart have 20 splits: p = 2 / 20."""
    monkeypatch.setattr(results, 'EXACT_MAX', math.comb(6, 3))
    r = results.permutation_test([10.0, 11.0, 12.0], [0.0, 1.0, 2.0])
    assert r['exact'] and r['splits'] == 20 and r['p'] == pytest.approx(0.1)
    monkeypatch.setattr(results, 'EXACT_MAX', math.comb(6, 3) - 1)
    assert not results.permutation_test([10.0, 11.0, 12.0], [0.0, 1.0, 2.0])['exact']


def test_permutation_test_draws_with_groups_of_two_sizes(monkeypatch):
    """The random branch with 3 runs against 6: within Monte Carlo error of the exact p over every split (each
    draw's first 3 are a's group, not its first 6)."""
    a, b = [1.0, 1.6, 2.2], [0.9, 1.2, 1.0, 1.5, 0.4, 1.1]
    exact = results.permutation_test(a, b)
    assert exact['exact'] and exact['splits'] == math.comb(9, 3)
    monkeypatch.setattr(results, 'EXACT_MAX', 10)
    drawn = results.permutation_test(a, b)
    assert not drawn['exact']
    se = math.sqrt(exact['p'] * (1 - exact['p']) / results.PERMUTATION_DRAWS)
    assert abs(drawn['p'] - exact['p']) < 5 * se + 1e-4, (drawn, exact)


PERMUTATION_CASES = [  # (a, b): several sizes, ties, no spread on a side, percentages at their bounds
    ([0.3, 1.2], [0.5, -0.4]),
    ([0.5, 0.4, 0.9], [0.0, 0.7, 0.6]),  # splits that tie with the observed one only up to rounding
    ([1.3, 0.2, 2.2], [0.1, -0.5, 0.4]),
    ([2.0, 2.0, 1.0], [1.0, 0.0, 1.0, 0.0, 2.0]),
    ([50.0, 50.0, 50.0], [40.0, 61.0, 45.0]),
    ([0.0, 0.0, 100.0], [100.0, 100.0, 100.0, 0.0]),
    ([100.0, 100.0], [100.0, 100.0, 100.0]),
]


def test_permutation_test_against_scipy():
    """scipy.stats.permutation_test on the difference of means, two-sided, every split (n_resamples=np.inf)."""
    stats = pytest.importorskip('scipy.stats')

    def scipy_p(a, b):
        return stats.permutation_test((np.asarray(a, float), np.asarray(b, float)),
                                      lambda x, y, axis: x.mean(axis=axis) - y.mean(axis=axis), vectorized=True,
                                      permutation_type='independent', alternative='two-sided',
                                      n_resamples=np.inf).pvalue
    rng = np.random.default_rng(1)
    cases = list(PERMUTATION_CASES)
    for na, nb in [(2, 2), (2, 5), (3, 3), (4, 6), (5, 5), (3, 7), (10, 10)]:
        cases.append((rng.normal(size=na), rng.normal(0.8, size=nb)))
        cases.append((rng.integers(0, 4, size=na).astype(float), rng.integers(1, 5, size=nb).astype(float)))  # ties
    for a, b in cases:
        assert results.permutation_test(a, b)['p'] == pytest.approx(scipy_p(a, b), abs=1e-12), (a, b)


def test_permutation_test_draws_against_scipy():
    """Beyond EXACT_MAX splits: within Monte Carlo error of scipy's p over every split."""
    stats = pytest.importorskip('scipy.stats')
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=11), rng.normal(0.9, size=11)
    want = stats.permutation_test((a, b), lambda x, y, axis: x.mean(axis=axis) - y.mean(axis=axis), vectorized=True,
                                  permutation_type='independent', n_resamples=np.inf, batch=100_000).pvalue
    got = results.permutation_test(a, b)['p']
    assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / results.PERMUTATION_DRAWS) + 1e-4, (got, want)


# -----------------------------------------------------------------------------
# Holm's adjustment


def holm_by_definition(pvalues):
    """Each hypothesis's adjusted p as the smallest level at which Holm's procedure, run as stated, rejects it:
    in ascending order of p, reject the k-th (from 1) while p_(k) <= level / (m - k + 1), stop at the first that
    is not; the levels worth trying are the values (m - k + 1) p_(k) (capped at 1), else 1."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])

    def rejected(level):
        out = set()
        for k, i in enumerate(order, 1):
            if pvalues[i] > level / (m - k + 1) + 1e-12:  # (a level of exactly (m - k + 1) p_(k) rejects it)
                break
            out.add(i)
        return out
    levels = sorted({min(1.0, (m - k + 1) * pvalues[i]) for k, i in enumerate(order, 1)})
    return [next((lv for lv in levels if i in rejected(lv)), 1.0) for i in range(m)]


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> 0.04 rises to 0.06, the order kept
    assert results.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert results.holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1
    assert results.holm([0.02]) == [0.02]
    # no test: not counted, left as it is
    assert results.holm([None, 0.02, None, 0.04]) == pytest.approx([None, 0.04, None, 0.04])
    assert results.holm([0.01, 0.01, 0.2]) == pytest.approx([0.03, 0.03, 0.2])  # ties


def test_holm_against_its_definition():
    rng = np.random.default_rng(0)
    for _ in range(300):
        m = int(rng.integers(1, 9))
        p = [float(v) for v in np.round(rng.uniform(0, 0.6, size=m) ** 2, 3)]  # small, with ties, some capped
        assert results.holm(p) == pytest.approx(holm_by_definition(p), abs=1e-12), p


# -----------------------------------------------------------------------------
# Welch's t interval of a bounded difference, cut to the possible range


# the t distribution's 97.5% point in closed form: with 1 degree of freedom it is Cauchy's, tan(pi (p - 1/2)); with
# 2, (2p - 1) / sqrt(2 p (1 - p))
T975_DF1 = math.tan(0.475 * math.pi)  # 12.706...
T975_DF2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # 4.303...


def test_clipped_interval_by_hand():
    """Without scipy: cases whose Welch-Satterthwaite df is a whole 1 or 2, where the t quantile has a closed form."""
    # a = {50, 52}, b = {40, 40}: the difference's variance 2/2 + 0 = 1 on df = 1^2 / (1^2 / 1) = 1; 11 +- 12.71,
    # inside -100..100, so the cut leaves it (a lower end below 0 that a cut to 0..100 would lose)
    c = results.compare_means([50.0, 52.0], [40.0, 40.0], bounds=(0.0, 100.0))
    assert c['df'] == pytest.approx(1.0) and c['ci_method'] == 't, clipped'
    assert c['ci'] == pytest.approx([11 - T975_DF1, 11 + T975_DF1], rel=1e-9)
    assert c['ci'] == pytest.approx(results.compare_means([50.0, 52.0], [40.0, 40.0])['ci'], rel=1e-12)
    # two a side with the same variance 2: the difference's variance 1 + 1 = 2 on df = 2^2 / (1 + 1) = 2; -30 +- 6.08
    c = results.compare_means([30.0, 32.0], [60.0, 62.0], bounds=(0.0, 100.0))
    assert c['df'] == pytest.approx(2.0)
    assert c['ci'] == pytest.approx([-30 - T975_DF2 * math.sqrt(2), -30 + T975_DF2 * math.sqrt(2)], rel=1e-9)
    # a = {90, 100}, b = {10, 10}: 85 +- 5 x 12.71 = [21.5, 148.5], cut at +100 (not at a side's own bounds)
    c = results.compare_means([90.0, 100.0], [10.0, 10.0], bounds=(0.0, 100.0))
    assert c['ci'] == pytest.approx([85 - 5 * T975_DF1, 100.0], rel=1e-9) and c['diff'] == 85.0
    assert results.compare_means([90.0, 100.0], [10.0, 10.0])['ci'][1] == pytest.approx(85 + 5 * T975_DF1, rel=1e-9)
    # on 0..1, cut below: a = {0, 0.1}, b = {0.9, 1}: -0.9 +- 4.30 x sqrt(0.005) = [-1.204, -0.596], cut at -1
    c = results.compare_means([0.0, 0.1], [0.9, 1.0], bounds=(0.0, 1.0))
    assert c['ci'] == pytest.approx([-1.0, -0.9 + T975_DF2 * math.sqrt(0.005)], rel=1e-9)
    # cut at both ends: a = {0, 100}, b = {100, 0}: 0 +- 4.30 x 70.7, the whole range
    assert results.compare_means([0.0, 100.0], [100.0, 0.0], bounds=(0.0, 100.0))['ci'] == [-100.0, 100.0]
    # neither side varies: the difference alone, a single point
    assert results.compare_means([1.0, 1.0], [0.0, 0.0], bounds=(0.0, 1.0))['ci'] == [1.0, 1.0]
    assert results.compare_means([100.0] * 3, [0.0] * 3, bounds=(0.0, 100.0))['ci'] == [100.0, 100.0]
    assert results.compare_means([80.0] * 2, [30.0] * 3, bounds=(0.0, 100.0))['ci'] == [50.0, 50.0]
    assert results.compare_means([100.0] * 3, [100.0] * 2, bounds=(0.0, 100.0))['ci'] == [0.0, 0.0]


def test_values_outside_the_bounds_are_an_error():
    with pytest.raises(ValueError, match='outside the bounds'):
        results.compare_means([101.0, 50.0], [0.0, 1.0], bounds=(0.0, 100.0))
    with pytest.raises(ValueError, match='outside the bounds'):
        results.compare_means([0.5, 0.9], [-0.1, 0.2], bounds=(0.0, 1.0))
    with pytest.raises(ValueError, match='outside the bounds'):  # percentages given the bounds of fractions
        results.compare_means([90.0, 80.0], [0.5, 0.6], bounds=(0.0, 1.0))
    # a mean of per-length accuracies may round a hair past its bound: not an error, and the interval holds diff
    c = results.compare_means([1.0 + 1e-12, 1.0 + 1e-12], [0.0, 0.0], bounds=(0.0, 1.0))
    assert c['ci'][0] <= c['diff'] <= c['ci'][1] <= 1.0 + 1e-11
    assert results.compare_means([0.5], [101.0, 0.0], bounds=(0.0, 100.0))['status'] == 'n/a: 1 seed'  # no test


def scipy_welch_interval(stats, a, b):
    ci = stats.ttest_ind(np.asarray(a, float), np.asarray(b, float), equal_var=False).confidence_interval(0.95)
    return float(ci.low), float(ci.high)


@pytest.mark.filterwarnings('ignore:Precision loss occurred:RuntimeWarning')  # scipy, on a side without spread
def test_clipped_interval_against_scipy():
    """scipy.stats.ttest_ind(equal_var=False).confidence_interval(): the same interval where it lies within
    [lo - hi, hi - lo]; where it reaches past, the end past it cut there and the other end scipy's."""
    stats = pytest.importorskip('scipy.stats')
    rng = np.random.default_rng(4)
    inside = [((rng.uniform(60, 100, size=5), rng.uniform(0, 50, size=6)), (0.0, 100.0)),
              (([70.0, 72.0, 80.0], [60.0, 55.0, 65.0]), (0.0, 100.0)),
              (([0.2, 0.4, 0.1], [0.5, 0.6, 0.3]), (0.0, 1.0)),  # a negative difference, its interval below 0
              (([90.0, 90.0, 90.0], [10.0, 55.0, 30.0, 80.0]), (0.0, 100.0)),  # no spread on one side
              ((rng.uniform(0, 100, size=10), rng.uniform(20, 100, size=10)), (0.0, 100.0))]
    past = [(([100.0, 74.0], [0.0, 20.0, 0.0]), (0.0, 100.0)),  # the '+87 [+20, +154]' kind: past +100
            (([100.0, 100.0, 40.0], [0.0, 0.0, 60.0]), (0.0, 100.0)),
            (([0.0, 0.3], [1.0, 0.9, 1.0]), (0.0, 1.0)),  # past -1
            (([100.0, 80.0], [0.0, 0.0, 0.0, 50.0, 100.0]), (0.0, 100.0)),
            (([0.0, 100.0, 50.0], [100.0, 0.0]), (0.0, 100.0))]  # past both ends
    for (a, b), (lo, hi) in inside:
        ref = scipy_welch_interval(stats, a, b)
        assert lo - hi < ref[0] < ref[1] < hi - lo, (a, b, ref)  # (the case is what it says)
        c = results.compare_means(a, b, bounds=(lo, hi))
        assert c['ci'] == pytest.approx(ref, rel=1e-9, abs=1e-12), (a, b, c['ci'], ref)
    for (a, b), (lo, hi) in past:
        ref = scipy_welch_interval(stats, a, b)
        assert ref[0] < lo - hi or ref[1] > hi - lo, (a, b, ref)
        c = results.compare_means(a, b, bounds=(lo, hi))
        assert c['ci'] == pytest.approx([max(ref[0], lo - hi), min(ref[1], hi - lo)], rel=1e-9, abs=1e-12), (a, b)
        assert results.compare_means(a, b)['ci'] == pytest.approx(ref, rel=1e-9), (a, b)  # without bounds: uncut


def test_a_bounded_difference_keeps_within_its_bounds():
    """Where Welch's t interval of a difference of percentages leaves -100..100, compare_means with bounds cuts it
    there and keeps its other end; the p-values are the same with or without bounds."""
    a, b = [100.0, 74.0], [0.0, 20.0, 0.0]
    welch = results.compare_means(a, b)
    assert welch['ci_method'] == 't' and welch['ci'][1] > 100  # the '+87 [+20, +154]' kind
    bounded = results.compare_means(a, b, bounds=(0.0, 100.0))
    assert bounded['ci_method'] == 't, clipped' and bounded['ci'] == [welch['ci'][0], 100.0]
    assert bounded['p'] == welch['p'] and bounded['p_exact'] == welch['p_exact'] == results.permutation_test(a, b)['p']
    rng = np.random.default_rng(5)
    for _ in range(50):
        a, b = rng.choice([0.0, 1.0, 0.5, 0.9], size=rng.integers(2, 6)), rng.choice([0.0, 1.0, 0.1], size=3)
        c = results.compare_means(a, b, bounds=(0.0, 1.0))
        assert -1.0 <= c['ci'][0] <= c['diff'] <= c['ci'][1] <= 1.0, (a, b, c['ci'])
        if c['p'] is not None:  # the t interval, cut at -1 and +1
            t = results.compare_means(a, b)['ci']
            assert c['ci'] == [max(t[0], -1.0), min(t[1], 1.0)], (a, b)


def test_interval_text():
    assert results.interval_text(False) == '95% confidence interval (Welch-Satterthwaite t)'
    assert results.interval_text(True) == ('95% confidence interval (Welch-Satterthwaite t), cut to the possible range, '
                                          '-100 to +100 (a single point where neither side varies)')
    assert '-1 to +1' in results.interval_text(True, bounds=(0, 1))


# -----------------------------------------------------------------------------
# compare_means and the tables' adjustment, caption and significance


def test_compare_means_carries_both_tests():
    c = results.compare_means([70.0, 72.0, 80.0], [60.0, 55.0, 65.0])
    assert c['status'] == 'ok' and (c['n_a'], c['n_b']) == (3, 3)
    assert c['p'] == results.welch_ttest([70.0, 72.0, 80.0], [60.0, 55.0, 65.0])[2]
    assert (c['p_exact'], c['p_min'], c['exact']) == (0.1, 0.1, True) and c['p'] < c['p_min']
    assert results.compare_means([1.0], [1.0, 2.0])['status'] == 'n/a: 1 seed'
    # no spread on either side: no Welch test, and for values without bounds no interval either
    assert results.compare_means([2.0, 2.0], [3.0, 3.0])['status'] == 'n/a: zero variance'
    # bounded values at their bounds in every seed are a result: the exact test applies, the interval is the point
    c = results.compare_means([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], bounds=(0.0, 1.0))
    assert (c['status'], c['p'], c['t'], c['p_exact'], c['ci']) == ('ok', None, None, 0.1, [1.0, 1.0])
    assert results.p_text(c['p']) == 'n/a'


def test_holm_over_a_table_its_caption_and_significance():
    three = [results.compare_means([70.0, 72.0, 80.0], [60.0, 55.0, 65.0]),
             results.compare_means([70.0, 61.0, 80.0], [60.0, 75.0, 65.0]), {'status': 'n/a: 1 seed'}]
    assert results.holm_over(three) == 2 and 'p_holm' not in three[2]
    assert [c['p_holm'] for c in three[:2]] == results.holm([three[0]['p_exact'], three[1]['p_exact']])
    caption = results.tests_caption(three)
    assert 'for the 2 comparisons of this table' in caption and 'Smallest possible exact p: 0.1 with 3 and 3 seeds.' in caption
    assert caption.endswith('No comparison of this table can reach a Holm p below 0.05.')
    assert results.significance(three[0]) is None  # Welch's p is below 0.05; Holm's exact p cannot be
    ten = [results.compare_means(60.0 + np.arange(10), np.arange(10.0))]
    results.holm_over(ten)
    assert results.significance(ten[0]) == 'higher' and results.significance(dict(ten[0], diff=-1.0)) == 'lower'
    assert 'can reach' not in results.tests_caption(ten) and '1.1e-05 with 10 and 10 seeds' in results.tests_caption(ten)
    assert results.tests_caption([{'status': 'n/a: zero variance'}]) == ''


# -----------------------------------------------------------------------------
# the exact binomial interval of 'learned in k of n seeds'


def binomial_tail(k, n, p, upper):
    """P(X >= k) (upper) or P(X <= k) for X ~ Binomial(n, p), summed term by term."""
    terms = range(k, n + 1) if upper else range(0, k + 1)
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in terms)


def test_binomial_ci_by_hand():
    """The ends where a closed form exists, and the defining tail probabilities where it does not: the lower
    end p_lo has P(X >= k | p_lo) = 2.5%, the upper end p_hi has P(X <= k | p_hi) = 2.5%."""
    assert results.binomial_ci(10, 10) == pytest.approx((0.025 ** (1 / 10), 1.0), abs=1e-12)
    assert results.binomial_ci(0, 3) == pytest.approx((0.0, 1 - 0.025 ** (1 / 3)), abs=1e-12)
    assert results.binomial_ci(1, 1) == pytest.approx((0.025, 1.0), abs=1e-12)
    for k, n in [(1, 3), (2, 3), (7, 10), (1, 10), (5, 9), (3, 5)]:
        lo, hi = results.binomial_ci(k, n)
        assert 0 < lo < k / n < hi < 1
        assert binomial_tail(k, n, lo, upper=True) == pytest.approx(0.025, abs=1e-10)
        assert binomial_tail(k, n, hi, upper=False) == pytest.approx(0.025, abs=1e-10)
    assert results.k_of_n_text(7, 10) == '7 of 10 [35, 93]%'
    assert results.k_of_n_text(3, 3) == '3 of 3 [29, 100]%'
    for k, n in [(-1, 3), (4, 3), (0, 0)]:
        with pytest.raises(ValueError, match='binomial_ci needs'):
            results.binomial_ci(k, n)


def test_binomial_ci_against_scipy():
    stats = pytest.importorskip('scipy.stats')
    for n in range(1, 21):
        for k in range(n + 1):
            ci = stats.binomtest(k, n).proportion_ci(0.95, method='exact')
            assert results.binomial_ci(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9), (k, n)
    ci = stats.binomtest(4, 12).proportion_ci(0.9, method='exact')
    assert results.binomial_ci(4, 12, level=0.9) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_mean_ci_and_its_text_against_scipy():
    """The mean's 95% t interval (n - 1 degrees of freedom) as scipy computes it, cut to the bounds where
    given; as a table cell: the mean alone for one value, '-' for none, the mean inside its interval where every
    value is the same."""
    stats = pytest.importorskip('scipy.stats')
    for values in ([80.0, 70.0, 90.0], [60.0, 65.0], [0.5, 0.9, 0.7, 0.2, 0.4], [-1.0, -0.5, -3.0]):
        a, b = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
        assert results.mean_ci(values) == pytest.approx((np.mean(values), a, b), abs=1e-9)
    m, lo, hi = results.mean_ci([80.0, 70.0, 90.0], bounds=(0.0, 100.0))  # 55.2 to 104.8 before the cut
    assert (lo, hi) == (pytest.approx(55.15, abs=0.01), 100.0)
    assert results.mean_ci([-0.1, -0.2, -3.0], bounds=(-math.inf, 0.0))[2] == 0.0
    assert results.mean_ci([5.0]) is None
    assert results.mean_ci_text([80.0, 70.0, 90.0], bounds=(0.0, 100.0)) == '80.0 [55.2, 100.0]'
    assert results.mean_ci_text([1.0, 0.5], bounds=(0, 1), fmt=lambda v: f"{100 * v:.0f}", unit='%') == '75% [0, 100]'
    assert results.mean_ci_text([42.0]) == '42.0' and results.mean_ci_text([]) == '-'
    assert results.mean_ci_text([100.0, 100.0, 100.0], bounds=(0.0, 100.0)) == '100.0 [100.0, 100.0]'


# -----------------------------------------------------------------------------
# the test-retest's pieces


def test_retest_helpers():
    """kernels_of reads the kernels from machine texts; pearson is numpy's r, None where it is undefined; a run
    without a verdict under one rounding has not changed sides."""
    assert results.kernels_of(['AMD EPYC, AVX512 kernels, torch 2', 'AMD EPYC, AVX512 kernels, torch 2']) == 'AVX512'
    assert results.kernels_of(['x, DEFAULT kernels, t', 'x, AVX2 kernels, t']) == 'AVX2, DEFAULT'
    assert results.kernels_of(['unknown', None]) == 'unknown'
    x, y = [1.0, 2.0, 4.0, 3.0], [2.0, 2.5, 5.0, 2.0]
    assert results.pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert results.pearson([1.0, 2.0], [2.0, 1.0]) is None and results.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None
    assert results.changed_sides([None, True, False, True], [True, True, True, None]) == 1


def test_retest_sides_says_what_differs_between_the_two_trainings():
    """A test-retest's sides are the kernels where they differ (a rounding on one machine), the machines where the
    kernels are the same and each side ran on one machine of its own (a machine alone), and the two files otherwise;
    the caption's words say which of the three it is."""
    amd, intel = 'AMD EPYC (family 26, model 2), {} kernels, torch 2', 'Intel(R) Xeon(R) Processor (family 6, model 207), {} kernels, torch 2'
    a, b, how = results.retest_sides([(amd.format('AVX512'), amd.format('DEFAULT'))] * 3)
    assert (a, b) == ('AVX512', 'DEFAULT')
    assert how == ("under two roundings of one machine: ATen's AVX512 kernels and its DEFAULT kernels, otherwise "
                   "identical (DEFAULT: ATEN_CPU_CAPABILITY=default, ATen's plain C++ kernels)")
    a, b, how = results.retest_sides([(amd.format('AVX512'), intel.format('AVX512'))] * 3)
    assert (a, b) == ('AMD EPYC', 'Intel(R) Xeon(R) Processor')
    assert how == ("twice with ATen's AVX512 kernels, on two machines: AMD EPYC (family 26, model 2) (tables_from), "
                   "then Intel(R) Xeon(R) Processor (family 6, model 207) (rounding_from), otherwise identical")
    other = "AMD EPYC (family 25, model 1), AVX512 kernels, torch 2"  # two models of one name: named in full
    assert results.retest_sides([(amd.format('AVX512'), other)])[:2] == ('AMD EPYC (family 26, model 2)',
                                                                        'AMD EPYC (family 25, model 1)')
    a, b, how = results.retest_sides([(amd.format('AVX512'), amd.format('AVX512'))])
    assert (a, b) == ('AVX512 (tables_from)', 'AVX512 (rounding_from)')
    assert how == "twice, on one machine, with ATen's AVX512 kernels both times"
    a, b, how = results.retest_sides([(amd.format('AVX512'), None), (amd.format('AVX512'), intel.format('DEFAULT'))])
    assert (a, b) == ('AVX512', 'DEFAULT')  # two kernels, with the runs that are not the rounding's alone counted
    assert how.startswith("under two roundings of one machine per run (2 machines: AMD EPYC (family 26, model 2); "
                          "Intel(R) Xeon(R) Processor (family 6, model 207)), except 1 run retrained on another machine "
                          "(there the machine differs too) (1 run without a recorded machine): ATen's AVX512")
    # kernels recorded on one side only: not a change of rounding, the two files
    assert results.retest_sides([(amd.format('AVX512'), None)])[:2] == ('AVX512 (tables_from)', 'unknown (rounding_from)')
    # the same kernels, the runs on two machines and their retests on two others: not one machine a side
    amd2, intel2 = amd.replace('model 2', 'model 1'), intel.replace('model 207', 'model 143')
    assert results.retest_sides([(amd.format('AVX512'), intel.format('AVX512')),
                                 (amd2.format('AVX512'), intel2.format('AVX512'))])[:2] == \
        ('AVX512 (tables_from)', 'AVX512 (rounding_from)')
    a, b, how = results.retest_sides([(None, None)])
    assert (a, b) == ('unknown (tables_from)', 'unknown (rounding_from)')
    assert how.endswith("ATen's kernels as the runs record them, unknown (tables_from) and unknown (rounding_from; "
                        "unknown: not recorded)")


def _tested(a, b):
    """compare_means of accuracies a against b with its Holm p (a family of its own)."""
    c = results.compare_means(a, b, bounds=(0.0, 100.0))
    results.holm_over([c])
    return c


def test_retest_classes_each_comparison_once():
    """A comparison is a conclusion where a test's Holm p is below 0.05; it holds where the second side draws the
    same. An exact tie (100.0 against 100.0) is not counted as holding, nor is a same-signed difference that is
    not significant a conclusion. A comparison made at several lengths counts once, however many lengths hold."""
    low, high = [0.0, 1.0, 2.0, 3.0, 4.0], [10.0, 11.0, 12.0, 13.0, 14.0]
    ahead = _tested(high, low)                           # exact p 0.0079: a conclusion
    behind = _tested(low, high)
    weak = _tested(high, [9.0, 12.0, 10.0, 14.0, 11.0])  # +0.8, exact p 0.69: not one
    tie = _tested([100.0] * 3, [100.0] * 3)
    assert (results.direction([ahead]), results.direction([weak]), results.direction([tie])) == \
        (('+', '+'), (None, '+'), (None, '0'))
    assert results.retest_class([ahead], [ahead]) == 'holds' and results.retest_class([ahead], [weak]) == 'fails'
    assert results.retest_class([weak], [ahead]) == 'second'
    assert results.retest_class([weak], [dict(weak)]) == 'same'  # same sign, not significant: not a conclusion
    assert results.retest_class([tie], [tie]) == 'tie' and results.retest_class([tie], [weak]) == 'tie'
    weak_behind = _tested(low, [9.0, 1.0, 2.0, 3.0, 4.0])  # -1.8, not significant
    assert results.retest_class([weak], [weak_behind]) == 'opposite'
    assert results.retest_class([ahead], [results.compare_means([1.0], [2.0])]) == 'n/a'
    # at several lengths: one class for the comparison; significant at some length in one direction is a conclusion
    assert results.retest_class([ahead, weak, tie], [weak, ahead, weak]) == 'holds'
    assert results.retest_class([ahead, behind], [ahead, weak]) == 'fails'  # both directions: '+-', not '+'
    assert results.retest_class([weak, tie], [weak, weak]) == 'same'  # a tie at one length of several is no tie
    assert results.retest_class([weak, weak_behind], [weak, weak]) == 'opposite'  # mixed signs are not the same
    text = results.retest(('A', 'B', 'twice'), [], [('x vs y', 'm', [ahead, weak, weak], [ahead, ahead, weak]),
                                                    ('z vs y', 'm', [tie], [tie])], 'f', 'r')
    assert text.endswith("Of the 2 comparisons, 1 were conclusions under the first side, of which 1 hold under the "
                         "second and 0 do not; 0 were conclusions under the second only; of the rest, 0 kept their "
                         "sign, 0 had opposite or mixed signs and 1 were exact ties under one side or both.")
    assert results.retest_counts(['same', 'same', 'tie', 'n/a']) == (
        "No comparison was a conclusion under either side: of the 3 with a test under both, 2 kept their sign, 0 had "
        "opposite or mixed signs and 1 were exact ties under one side or both; 1 had no test under one side.")


def test_retest_reproducibility_figures():
    """The retest's first table, per group and over all runs: Pearson's r of the runs' figures across the two
    sides, their mean absolute change, the runs learned under each side and those that changed sides."""
    runs = [('g', 0, 10.0, 12.0, True, True), ('g', 1, 20.0, 36.0, True, False), ('g', 2, 30.0, 19.0, False, False),
            ('h', 0, 50.0, 50.0, False, True)]
    text = results.retest(('A', 'B', 'twice'), runs, [], 'f', 'r')
    moved, per_run = text.split('\n\n')[:2]
    rows = {line.split(' | ')[0]: line.split(' | ')[1:] for line in moved.splitlines()}
    r = np.corrcoef([10.0, 20.0, 30.0], [12.0, 36.0, 19.0])[0, 1]  # +0.24, each run with its own retest
    assert rows['| g'] == ['3', f"{r:+.2f}", '9.7', results.k_of_n_text(2, 3), results.k_of_n_text(1, 3), '1 |']
    r_all = np.corrcoef([10.0, 20.0, 30.0, 50.0], [12.0, 36.0, 19.0, 50.0])[0, 1]
    assert rows['| all'] == ['4', f"{r_all:+.2f}", '7.2', results.k_of_n_text(2, 4), results.k_of_n_text(2, 4), '2 |']
    assert rows['| h'][:2] == ['1', 'n/a']  # one run: no correlation
    assert '| g | 1 | 20.0 / 36.0 | yes / no |' in per_run.splitlines()
    unjudged = results.retest(('A', 'B', 'twice'), [('g', 0, 1.0, 2.0, None, None)], [], 'f', 'r')
    assert '| g | 1 | n/a | 1.0 |' in unjudged and 'learned' not in unjudged  # runs not judged: no such column
    half = results.retest(('A', 'B', 'twice'), [('g', 0, 1.0, 2.0, True, None)], [], 'f', 'r')
    assert f"| g | 1 | n/a | 1.0 | {results.k_of_n_text(1, 1)} | n/a | n/a |" in half  # one not judged: none changed, not 0


def test_dape_pairs_sets_each_departure_against_the_same_dape_without_it():
    """The one rule of every script's comparisons: DAPE-X against X; a DAPE-X that departs from DAPE as released
    (f zero at step 0, an edited dape.py) also against the same DAPE-X without each departure, one at a time, in
    the order of the keys; another setting is never a baseline, and two keys of one setting are refused."""
    x, d = ('s', 'none', (None, None)), ('s', 'v1', (None, None))
    zero, edit, both = ('s', 'v1', ('zero', None)), ('s', 'v1', (None, 'f00')), ('s', 'v1', ('zero', 'f00'))
    other = ('t', 'v1', ('zero', None))  # trained otherwise: no X, no default init of its own here
    assert results.dape_pairs([x, d, zero, edit, both, other], lambda k: k) == [
        (d, x), (zero, x), (zero, d), (edit, x), (edit, d), (both, x), (both, edit), (both, zero)]
    with pytest.raises(results.InputError, match="'a' and 'b' have the same setting"):
        results.dape_pairs(['a', 'b'], lambda k: ('s', 'none', (None,)))
