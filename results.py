"""
What the evaluation scripts make of their runs (eval_extrapolate.py, eval_passkey.py, che_tasks.py, demo_report.py):
the statistics over seeds (mean and sample std, Welch's t-test and t interval, cut to the possible range for bounded
values, the exact permutation test, Holm's adjustment, the exact binomial interval of a count of seeds), the text of
their tables, the test-retest of the same runs trained twice (under two roundings, or on two machines), which runs
a table compares (dape_pairs, one rule for all three scripts), and the results files that runs are merged into
(merge_rows). Then each script's own tables and figures, a section each. Library code: it reads no checkpoint and
runs no model.
"""

import csv
import functools
import itertools
import json
import math
import os
import re

import numpy as np

import che_data
import retrieval_data
from common import InputError
from passkey import chance_logp_per_digit

# -----------------------------------------------------------------------------
# table text

def format_table(header, rows, markdown=False):
    """Rows of strings under a header: aligned columns for the console, or a Markdown table."""
    if markdown:
        lines = ['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join('---' for _ in header) + ' |']
        return '\n'.join(lines + ['| ' + ' | '.join(r) + ' |' for r in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: '  '.join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return '\n'.join([fmt(header), '  '.join('-' * w for w in widths)] + [fmt(r) for r in rows])


def length_table(items, lengths, first, cell, markdown=False):
    """A row per item and a column per length, as every table over seeds or runs is laid out: first [(header,
    item -> text)], the columns before the lengths; cell(item, L), the text at length L."""
    return format_table([h for h, _ in first] + [str(L) for L in lengths],
                        [[f(x) for _, f in first] + [cell(x, L) for L in lengths] for x in items], markdown)


def measured(row, key, fmt):
    """A measured figure in a table (bench.py, gpu_check.py): row[key] formatted, or why the row has none (its
    'skipped' reason, else '-')."""
    return format(row[key], fmt) if row.get(key) is not None else row.get("skipped", "-")


def jsonable(obj):
    """For json.dump: length keys as strings, numpy scalars as Python numbers, and no NaN anywhere."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        if not math.isfinite(v):
            raise ValueError(f"non-finite value {v} in the results")
        return v
    return obj


# -----------------------------------------------------------------------------
# figures: what every plot shares


def new_figure(rows, cols, size, **kw):
    """A figure of rows x cols panels drawn without a display (matplotlib's Agg backend: the scripts run on
    servers and in tests): (fig, axes), axes[i][j] however few panels."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt.subplots(rows, cols, figsize=size, squeeze=False, **kw)


def save_figure(fig, path, dpi):
    """fig as a PNG at path, its folder made where missing; then closed, since a script may draw many."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def length_axis(ax, lengths, blocks):
    """A log2 axis of lengths, ticked at each; where the models share one training length (blocks: theirs), each
    tick also reads as a multiple of it ('64\\n1x'). -> whether the ticks give the multiples."""
    from matplotlib.ticker import NullLocator
    blocks = sorted(set(blocks))
    ax.set_xscale('log', base=2)
    ax.set_xticks(lengths, [f"{L}\n{L / blocks[0]:g}x" if len(blocks) == 1 else str(L) for L in lengths],
                  rotation=0 if len(lengths) < 8 else 45, fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    return len(blocks) == 1


def curve_colors(n):
    """n colours that tell n curves apart at a glance: tab20's ten dark shades (tab10's colours), then its
    light ones (evenly spaced hues would give neighbours two near greens); beyond twenty, such hues."""
    import matplotlib
    if n <= 20:
        tab20 = matplotlib.colormaps['tab20']
        return [tab20(i) for i in [*range(0, 20, 2), *range(1, 20, 2)][:n]]
    return [matplotlib.colormaps['hsv'](i / n) for i in range(n)]


# -----------------------------------------------------------------------------
# statistics over seeds


def mean_std(values):
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), (float(v.std(ddof=1)) if len(v) > 1 else None)


def over_seeds(values):
    """One setting's figures over its seeds: {'status': 'ok', mean, std (sample, ddof=1; None for one
    seed), n, values}."""
    m, s = mean_std(values)
    return {'status': 'ok', 'mean': m, 'std': s, 'n': len(values), 'values': [float(v) for v in values]}


def group_over_seeds(runs, label, lengths, value):
    """Runs that share label(run) form a group (in the order first seen); per length L, over_seeds of
    the members' value(run, L). value is a number, or a str saying why a run has none (not servable,
    too long, ...), which leaves that run out; where no run has a number, the group keeps the first
    reason. -> [{'label', 'members', 'stats': {L: over_seeds(...) or {'status': reason}}}]"""
    by_label = {}
    for r in runs:
        by_label.setdefault(label(r), []).append(r)
    groups = []
    for name, members in by_label.items():
        stats = {}
        for L in lengths:
            values = [value(m, L) for m in members]
            numbers = [v for v in values if not isinstance(v, str)]
            stats[L] = over_seeds(numbers) if numbers else {'status': values[0]}
        groups.append({'label': name, 'members': members, 'stats': stats})
    return groups


def mean_std_text(mean, std, fmt='{:.1f}', unit=''):
    """'mean ± std' as every table writes it (the mean alone for one seed): fmt is a format string or a
    function of a number, unit follows the mean ('%')."""
    f = fmt if callable(fmt) else fmt.format
    return f(mean) + unit + ('' if std is None else ' ± ' + f(std))


# -----------------------------------------------------------------------------
# Welch's t-test and the confidence interval of a difference, without scipy: the t distribution's tail
# through the regularized incomplete beta


def _betacf(a, b, x, max_iter=300, eps=3e-16, tiny=1e-300):
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a, b, x):
    """Regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def welch_ttest(a, b):
    """Welch's unequal-variance t-test (scipy.stats.ttest_ind(a, b, equal_var=False)): returns
    (t, df, two-sided p). Needs two or more values on each side and a nonzero variance."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's t-test needs at least two values per group")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        raise ValueError("Welch's t-test is undefined when both groups have zero variance")
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    p = betainc(df / 2.0, 0.5, df / (df + t * t))
    return float(t), float(df), float(min(1.0, p))


def bisect(below, lo, hi, rtol=0.0, atol=0.0):
    """The x in [lo, hi] where below(x), true at lo and false at hi, turns false, by bisection until the
    bracket is within rtol * hi + atol (the quantiles' search: betainc has no inverse)."""
    for _ in range(200):
        mid = (lo + hi) / 2
        if below(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo <= rtol * hi + atol:
            break
    return (lo + hi) / 2


def t_quantile(p, df):
    """The t distribution's quantile: t with P(T <= t) = p, for df > 0 degrees of freedom (fractional
    df as Welch-Satterthwaite gives), by bisection on the tail that betainc computes."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    tail = 2 * min(p, 1 - p)  # two-sided tail beyond |t|
    beyond = lambda t: betainc(df / 2.0, 0.5, df / (df + t * t)) > tail
    hi = 1.0
    while beyond(hi):
        hi *= 2
    t = bisect(beyond, 0.0, hi, rtol=1e-12)
    return t if p >= 0.5 else -t


def mean_ci(values, level=0.95, bounds=None):
    """The mean of values with its confidence interval (Student's t, n - 1 degrees of freedom): (mean, lo, hi),
    or None with fewer than two values. bounds=(lo, hi) for values that cannot leave [lo, hi] (accuracies): the
    interval is cut to them, which removes no possible mean (so keeps its coverage) and stays in bounds."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return None
    m = float(v.mean())
    half = t_quantile(0.5 + level / 2, len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    lo, hi = m - half, m + half
    if bounds is not None:  # (widened to hold the mean, which can round an ulp past a bound)
        lo, hi = max(lo, min(bounds[0], m)), min(hi, max(bounds[1], m))
    return m, lo, hi


def mean_ci_text(values, bounds=None, fmt='{:.1f}', unit=''):
    """'mean [lo, hi]' with mean_ci's 95% interval as every table over seeds writes it (the mean alone for one
    value, '-' for none): fmt is a format string or a function of a number, unit follows the mean ('%')."""
    f = fmt if callable(fmt) else fmt.format
    if len(values) == 0:
        return '-'
    ci = mean_ci(values, bounds=bounds)
    if ci is None:
        return f(float(values[0])) + unit
    m, lo, hi = ci
    return f"{f(m)}{unit} [{f(lo)}, {f(hi)}]"


def beta_quantile(q, a, b):
    """x with I_x(a, b) = q, by bisection on betainc (monotone in x)."""
    return bisect(lambda x: betainc(a, b, x) < q, 0.0, 1.0, atol=1e-15)


def binomial_ci(k, n, level=0.95):
    """The exact (Clopper-Pearson) confidence interval of a proportion, k successes of n: (lo, hi), each in
    [0, 1]. Its coverage is at least `level` for every true proportion, which is what 'learned in k of n seeds'
    with n of 3 to 10 needs: a normal interval would cover 10 of 10 with [1, 1]."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"binomial_ci needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    tail = (1 - level) / 2
    lo = 0.0 if k == 0 else beta_quantile(tail, k, n - k + 1)
    hi = 1.0 if k == n else beta_quantile(1 - tail, k + 1, n - k)
    return lo, hi


def k_of_n_text(k, n, level=0.95):
    """'7 of 10 [35, 93]%': a count of seeds with its exact binomial interval, in percent."""
    lo, hi = binomial_ci(k, n, level)
    return f"{k} of {n} [{100 * lo:.0f}, {100 * hi:.0f}]%"

# -----------------------------------------------------------------------------
# statistics that fit a few seeds a side: the exact permutation test (its p cannot go below what the sample
# sizes allow, where Welch's can), Holm's adjustment for the comparisons of one table, and Welch's t interval,
# cut for a bounded quantity (accuracies) to the differences that are possible at all

ALPHA = 0.05                 # the level at which generated text calls a difference significant
EXACT_MAX = 200_000          # enumerate every split of the runs up to this many: 10 runs a side (C(20, 10) splits)
PERMUTATION_DRAWS = 100_000  # beyond that, this many seeded random splits
STATS_SEED = 0               # the random splits are seeded: a table is the same on every rerun
ROUNDING_TOL = 100 * np.finfo(np.float64).eps  # relative to the data: the same values summed in another order differ


@functools.lru_cache(maxsize=16)
def _splits(n, k):
    """Every k-subset of range(n), as the rows of a read-only (C(n, k), k) index array."""
    rows = np.fromiter(itertools.combinations(range(n), k), dtype=np.dtype((np.intp, k)), count=math.comb(n, k))
    rows.flags.writeable = False
    return rows


def permutation_test(a, b, seed=STATS_SEED):
    """Two-sided permutation test of mean(a) - mean(b). The null distribution is the difference over every
    split of the pooled values into groups of len(a) and len(b) (each set of runs once, as
    scipy.stats.permutation_test(permutation_type='independent', n_resamples=np.inf) enumerates them), and
    p = 2 x the smaller share of splits at most / at least the observed difference, capped at 1, as scipy
    computes it. Splits count as equal to the observed one within 100 machine epsilons relative, scipy's
    tolerance, but relative to the data's scale where the difference itself is smaller (identical groups
    then give p = 1 whatever the rounding). Beyond EXACT_MAX splits, PERMUTATION_DRAWS seeded random
    ones, the observed split counted as one more (the +1 correction, so that p is never 0).
    -> {'p', 'p_min': the smallest p these two sample sizes allow (2 / the number of splits, where the
    observed split is the one most extreme), 'splits': how many were counted, 'exact': all of them or not}."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = len(a), len(b)
    if na < 1 or nb < 1:
        raise ValueError("a permutation test needs at least one value per group")
    x = np.concatenate([a, b])
    n, total = na + nb, x.sum()
    exact = math.comb(n, na) <= EXACT_MAX
    if exact:
        sums = x[_splits(n, na)].sum(axis=1)
        extra = 0
    else:
        rng, sums = np.random.default_rng(seed), []
        for start in range(0, PERMUTATION_DRAWS, 10_000):  # in batches, to bound the memory
            order = rng.permuted(np.broadcast_to(np.arange(n), (min(10_000, PERMUTATION_DRAWS - start), n)), axis=1)
            sums.append(x[order[:, :na]].sum(axis=1))
        sums, extra = np.concatenate(sums), 1
    # a's sum fixes the difference (the total is fixed): the same arithmetic for every split and the observed one
    null = sums / na - (total - sums) / nb
    observed = a.sum() / na - (total - a.sum()) / nb
    tol = ROUNDING_TOL * max(abs(observed), float(np.abs(x).max()))
    count = len(null) + extra
    less = (np.count_nonzero(null <= observed + tol) + extra) / count
    greater = (np.count_nonzero(null >= observed - tol) + extra) / count
    return {'p': float(min(1.0, 2 * min(less, greater))), 'p_min': min(1.0, 2 / count), 'splits': len(null),
            'exact': exact}


def holm(pvalues):
    """Holm's step-down adjustment of m p-values (statsmodels' multipletests(method='holm')): in ascending
    order, the i-th (from 0) becomes the largest (m - j) p_j over j <= i, capped at 1, so that the adjusted
    values keep the order of the raw ones. An entry None (no test) stays None and is not counted in m.
    -> the adjusted p-values, in the order given."""
    order = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    out, running = list(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * pvalues[i]))  # never below a smaller p's
        out[i] = running
    return out


def compare_means(a, b, level=0.95, bounds=None):
    """a against b: the difference of their means with its confidence interval, Welch's two-sided p and the
    exact permutation test's (permutation_test). The interval is Welch's t interval (Welch-Satterthwaite
    degrees of freedom). bounds=(lo, hi) for values that cannot leave [lo, hi] (accuracies): the interval is
    then cut to [lo - hi, hi - lo], the differences that are possible at all (the cut removes no possible true
    difference, so the interval keeps its coverage, and stays in bounds), and groups without spread (every
    seed at 100%) are compared too, by the exact test alone, their interval the single point [diff, diff]
    (there is nothing to estimate a spread from: not a claim of certainty). Values outside the bounds are an
    error (a wrong scale, 0-1 against 0-100).
    -> {'status': 'ok', n_a, n_b, mean_a, mean_b, diff, ci: [lo, hi], ci_method ('t', or 't, clipped' where
    bounds were given, whether or not the cut changed it), level, t, df, p (Welch's; None where neither side
    varies), p_exact, p_min (the smallest p_exact these sample sizes allow), exact (every split counted)}, or
    {'status': why not} with fewer than two values a side or, without bounds, no spread on either. Holm's
    adjustment is per table: holm_over adds 'p_holm'."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) < 2 or len(b) < 2:
        return {'status': f"n/a: {min(len(a), len(b))} seed{'s' if min(len(a), len(b)) != 1 else ''}",
                'n_a': len(a), 'n_b': len(b)}
    if bounds is not None:
        lo, hi = bounds
        slack = 1e-9 * (hi - lo)  # a mean of per-length accuracies may round past its bound; a wrong scale may not
        if min(a + b) < lo - slack or max(a + b) > hi + slack:
            raise ValueError(f"values outside the bounds {tuple(bounds)} given for them")
    spread = np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b)
    if spread == 0 and bounds is None:
        return {'status': 'n/a: zero variance', 'n_a': len(a), 'n_b': len(b)}
    t, df, p = welch_ttest(a, b) if spread > 0 else (None, None, None)
    diff = float(np.mean(a) - np.mean(b))
    if abs(diff) <= ROUNDING_TOL * max(map(abs, a + b)):
        diff = 0.0  # the same values summed in another order: rounding, not a side ahead (verdict reads its sign)
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(spread) if spread > 0 else 0.0
    ci, method = [diff - half, diff + half], 't'
    if bounds is not None:
        # (widened to hold diff itself, which a mean of values at a bound can round an ulp past)
        ci = [float(max(ci[0], min(lo - hi, diff))), float(min(ci[1], max(hi - lo, diff)))]
        method = 't, clipped'
    perm = permutation_test(a, b)
    return {'status': 'ok', 'n_a': len(a), 'n_b': len(b), 'mean_a': float(np.mean(a)), 'mean_b': float(np.mean(b)),
            'diff': diff, 'ci': ci, 'ci_method': method, 'level': level, 't': t, 'df': df, 'p': p,
            'p_exact': perm['p'], 'p_min': perm['p_min'], 'exact': perm['exact']}


def holm_over(comparisons):
    """Holm's adjustment of the exact p over the comparisons of one table (compare_means results, or any dicts
    with status, p_exact; those without a test are not counted): sets each tested one's 'p_holm', in place.
    -> the number of comparisons counted."""
    tested = [c for c in comparisons if c['status'] == 'ok']
    for c, p in zip(tested, holm([c['p_exact'] for c in tested])):
        c['p_holm'] = p
    return len(tested)


def p_text(p):
    """A p-value as the tables write it: two significant digits, '< 0.001' below that, 'n/a' for no test."""
    if p is None:
        return 'n/a'
    return '< 0.001' if p < 0.001 else f"{p:.2g}"


def exact_holm_text(c):
    """'exact 0.031, Holm 0.12': a compare_means result's exact p and its Holm adjustment (holm_over)."""
    return f"exact {p_text(c['p_exact'])}, Holm {p_text(c['p_holm'])}"


# what the learned column of a comparison tests, in the captions of both scripts' tables over seeds
SHARES_TEST = ("the exact p of the difference between the shares of seeds that learned (the same permutation test on "
               "each seed's 1, learned, or 0: a conditional test like Fisher's, two-sided by doubling the smaller tail) "
               "and its Holm adjustment")


def shares_text(counts, c=None):
    """The learned cell of a comparison, counts (learned, seeds, learned, seeds): '2 of 3 vs 3 of 3', followed by
    the test of the two shares (c, SHARES_TEST) where it has one: ', exact 1, Holm 1'."""
    return "{} of {} vs {} of {}".format(*counts) + (f", {exact_holm_text(c)}" if c and c['status'] == 'ok' else '')


def interval_text(bounded, level=0.95, bounds=(0, 100)):
    """What a table's interval is, for its caption: Welch's t interval, and for bounded values (compare_means
    with bounds) that it is cut to the possible range of a difference; bounds: the values' range as the table
    writes them (percent, or percentage points of exact match: both tables that use it)."""
    text = f"{100 * level:.0f}% confidence interval (Welch-Satterthwaite t)"
    if bounded:
        lo, hi = bounds
        text += f", cut to the possible range, {lo - hi:+g} to {hi - lo:+g} (a single point where neither side varies)"
    return text


def tests_caption(comparisons, alpha=ALPHA):
    """The caption line of a table of comparisons (compare_means results after holm_over): what its p-values
    are, how many comparisons Holm's adjustment counts, and the smallest exact p each pair of seed counts
    allows; where even the smallest cannot reach alpha after the adjustment, that nothing in the table can.
    '' for a table without a test."""
    tested = [c for c in comparisons if c['status'] == 'ok']
    if not tested:
        return ''
    smallest = {}
    for c in tested:
        smallest.setdefault(tuple(sorted((c['n_a'], c['n_b']))), (c['p_min'], c['exact']))
    sizes = ', '.join(f"{p:.2g} with {na} and {nb} seeds" + ('' if exact else f" ({PERMUTATION_DRAWS} random splits)")
                      for (na, nb), (p, exact) in sorted(smallest.items()))
    m = len(tested)
    text = (f"p: Welch's t-test; exact: the two-sided permutation test over every split of the seeds between "
            f"the two sides; Holm: the exact p adjusted by Holm's method for the {m} comparison"
            f"{'s' if m != 1 else ''} of this table. Smallest possible exact p: {sizes}.")
    if m * min(p for p, _ in smallest.values()) >= alpha:
        text += f" No comparison of this table can reach a Holm p below {alpha:g}."
    return text


def difference_text(c, fmt='{:+.1f}'):
    """A compare_means result in a table: '+15.0 [-2.1, +32.1]' (the difference and its confidence
    interval), or its status."""
    if c['status'] != 'ok':
        return c['status']
    f = fmt if callable(fmt) else fmt.format
    return f"{f(c['diff'])} [{f(c['ci'][0])}, {f(c['ci'][1])}]"


def significance(c, alpha=ALPHA):
    """'higher', 'lower' (a against b, where the exact p adjusted by Holm's method over its table is below
    alpha) or None. Needs holm_over to have been applied to c's table."""
    if c['status'] != 'ok' or c.get('p_holm') is None or not c['p_holm'] < alpha:
        return None
    return 'higher' if c['diff'] > 0 else 'lower'


# -----------------------------------------------------------------------------
# the test-retest of the same runs trained twice (under two roundings of one machine, ATen's vector kernels and
# ATEN_CPU_CAPABILITY=default, or on two machines), as che_tasks.py, eval_passkey.py and demo_report.py report it
# alike (retest): only the runs in both files count; first how each run's figure moved, then each comparison the
# published tables make, once however many lengths it has, classed by whether it was a conclusion (a Holm p below
# ALPHA) under the first side and holds under the second; ties and non-significant differences apart


def kernels_of(machines):
    """Which of ATen's vector kernels trained runs, from their recorded machine texts (machine_text:
    '..., AVX512 kernels, ...'): 'AVX512', 'DEFAULT', several joined, or 'unknown'."""
    found = {m.group(1) for text in machines for m in re.finditer(r'(\w+) kernels', text or '')}
    return ', '.join(sorted(found)) or 'unknown'


def cpu_of(machine):
    """The machine alone of a recorded machine text (machine_text): 'AMD EPYC (family 26, model 2), AVX512 kernels,
    torch 2.13.0+cpu' -> 'AMD EPYC (family 26, model 2)'; None where none was recorded."""
    if not machine or machine == 'unknown':
        return None
    return re.sub(r', (\w+ kernels|torch ).*$', '', machine)


def retest_machines(pairs):
    """Where a test-retest's runs were trained, pairs [(machine text, its retest's)]: 'one machine', or 'one machine
    per run (2 machines: A; B)' where the runs were spread over several; and the runs whose retest ran on another
    machine than the run itself (their difference is not the rounding's alone), and those without a recorded
    machine, are counted."""
    cpus = [(cpu_of(a), cpu_of(b)) for a, b in pairs]
    names = sorted({c for pair in cpus for c in pair if c})
    apart = sum(a != b for a, b in cpus if a and b)
    unknown = sum(not (a and b) for a, b in cpus)
    text = 'one machine' if len(names) <= 1 else f"one machine per run ({len(names)} machines: {'; '.join(names)})"
    if apart:
        text += (f", except {apart} run{'s' if apart != 1 else ''} retrained on another machine (there the machine "
                 f"differs too)")
    if unknown:
        text += f" ({unknown} run{'s' if unknown != 1 else ''} without a recorded machine)"
    return text


def retest_sides(pairs):
    """What a test-retest's two sides differ in, from its runs' recorded machine texts, pairs [(run's, its
    retest's)]: (a_name, b_name, how), the sides' names for the tables' columns and, for the caption, how the same
    runs were trained twice. Two kernels: the sides are the kernels, a change of rounding on one machine (as
    retest_machines says where). The same kernels on two machines, one a side: the sides are the machines, a change
    of machine alone. Otherwise (the same kernels on the same machines, or kernels not recorded) the sides are the
    two files, tables_from and rounding_from."""
    ka, kb = kernels_of(a for a, _ in pairs), kernels_of(b for _, b in pairs)
    if 'unknown' not in (ka, kb) and ka != kb:
        return ka, kb, (f"under two roundings of {retest_machines(pairs)}: ATen's {ka} kernels and its {kb} kernels, "
                        f"otherwise identical" + (" (DEFAULT: ATEN_CPU_CAPABILITY=default, ATen's plain C++ kernels)"
                                                  if 'DEFAULT' in (ka, kb) else ''))
    cpus_a, cpus_b = {cpu_of(a) for a, _ in pairs}, {cpu_of(b) for _, b in pairs}
    if ka == kb != 'unknown' and len(cpus_a) == len(cpus_b) == 1 and None not in cpus_a | cpus_b and cpus_a != cpus_b:
        (ma,), (mb,) = cpus_a, cpus_b
        na, nb = (re.sub(r' \(family .*\)$', '', m) for m in (ma, mb))
        if na == nb:  # two models of one name: the names in full
            na, nb = ma, mb
        return na, nb, (
            f"twice with ATen's {ka} kernels, on two machines: {ma} (tables_from), then {mb} (rounding_from), "
            f"otherwise identical")
    kernels = (f"ATen's {ka} kernels both times" if ka == kb != 'unknown' else
               f"ATen's kernels as the runs record them, {ka} (tables_from) and {kb} (rounding_from; unknown: not recorded)")
    return f"{ka} (tables_from)", f"{kb} (rounding_from)", f"twice, on {retest_machines(pairs)}, with {kernels}"


def pearson(x, y):
    """Pearson's correlation of two equally long lists; None where either does not vary or has fewer than 3."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):  # (a constant's std can round to 1e-17, not 0)
        return None
    return float(np.corrcoef(x, y)[0, 1])


def learned_cell(flags):
    """How many seeds learned (their flags), with the exact 95% interval; 'n/a' where one was not judged."""
    return 'n/a' if not flags or None in flags else k_of_n_text(sum(flags), len(flags))


def changed_sides(flags_a, flags_b):
    """How many runs learned on one side of a test-retest and not on the other."""
    return sum(x is not None and y is not None and x != y for x, y in zip(flags_a, flags_b))


def yes_no(flag):
    return 'n/a' if flag is None else 'yes' if flag else 'no'


def direction(tests, alpha=ALPHA):
    """One comparison under one side of a test-retest, its tests (one, or one a length, each a compare_means result
    with its Holm p): (conclusion, sign). conclusion: '+' or '-' where some test's Holm p is below alpha, all such
    tests of that sign ('+-' where they disagree), else None; sign: that of every nonzero tested difference ('+-'
    where they disagree), '0' where every one is 0 (an exact tie); (None, None) where none has a test."""
    ok = [c for c in tests if c['status'] == 'ok']
    if not ok:
        return None, None
    sign = lambda cs: ''.join(s for s in '+-' if any((c['diff'] > 0) == (s == '+') and c['diff'] for c in cs))
    significant = [c for c in ok if c.get('p_holm') is not None and c['p_holm'] < alpha]
    return sign(significant) or None, sign(ok) or '0'


RETEST_CLASSES = {'holds': 'holds', 'fails': 'fails', 'second': 'conclusion under the second only', 'tie': 'tie',
                  'same': 'same sign, not significant', 'opposite': 'opposite or mixed sign, not significant',
                  'n/a': 'n/a: no test under one side'}


def retest_class(ca, cb):
    """What a comparison (its tests under each side, direction) does across a test-retest, a key of RETEST_CLASSES:
    a conclusion under the first side that holds (the same under the second) or fails; a conclusion under the
    second only; else an exact tie under either side, never counted as holding, a same-signed difference or one of
    opposite or mixed sign."""
    (ka, sa), (kb, sb) = direction(ca), direction(cb)
    if sa is None or sb is None:
        return 'n/a'
    if ka:
        return 'holds' if ka == kb else 'fails'
    if kb:
        return 'second'
    if '0' in (sa, sb):
        return 'tie'
    return 'same' if sa == sb and len(sa) == 1 else 'opposite'


def retest_counts(classes):
    """The caption's count of retest_class's classes, one a comparison."""
    n = {k: classes.count(k) for k in RETEST_CLASSES}
    rest = (f"{n['same']} kept their sign, {n['opposite']} had opposite or mixed signs and {n['tie']} were exact "
            f"ties under one side or both")
    if n['holds'] + n['fails'] + n['second'] == 0:
        text = (f"No comparison was a conclusion under either side: of the {len(classes) - n['n/a']} with a test under "
                f"both, {rest}")
    else:
        text = (f"Of the {len(classes)} comparisons, {n['holds'] + n['fails']} were conclusions under the first side, "
                f"of which {n['holds']} hold under the second and {n['fails']} do not; {n['second']} were conclusions "
                f"under the second only; of the rest, {rest}")
    return text + (f"; {n['n/a']} had no test under one side." if n['n/a'] else '.')


def retest_cell(tests, fmt):
    """A comparison's tests under one side as the retest writes them: one test, its difference [95% interval] (or
    the shares that learned) and Holm p; several, at how many the difference is higher and lower, and the least
    Holm p."""
    ok = [c for c in tests if c['status'] == 'ok']
    if not ok:
        return tests[0]['status'] if tests else 'n/a'
    p = f"Holm p {p_text(min(c['p_holm'] for c in ok))}"
    if len(tests) == 1:
        return f"{tests[0].get('shares') or difference_text(tests[0], fmt)}, {p}"
    return (f"higher at {sum(c['diff'] > 0 for c in ok)}, lower at {sum(c['diff'] < 0 for c in ok)} of "
            f"{len(tests)}; least {p}")


def retest(sides, runs, comparisons, figure, rule, fmt='{:+.1f}', run_fmt='{:.1f}'):
    """The test-retest's tables, one layout for every script. sides: retest_sides' (name, name, how); runs: [(group,
    seed, its figure under each side, whether it learned under each (None: not judged))]; comparisons: [(name,
    measure, its tests under the first side, under the second)], each comparison once, its tests one or one a
    length (retest_cell); figure and rule: what a run's figure is and what a comparison's tests are, for the
    caption. First how each run's figure moved (Pearson's r across the sides, the mean absolute change, the runs
    that changed sides between learned and not), per group and over all; then each run; then each comparison with
    its class (retest_class), counted in the caption (retest_counts)."""
    a, b, how = sides

    def moved(rs):
        xs, ys = [r[2] for r in rs], [r[3] for r in rs]
        if not rs or None in xs + ys:
            return ['n/a', 'n/a']
        r = pearson(xs, ys)
        return ['n/a' if r is None else f"{r:+.2f}", run_fmt.format(np.mean(np.abs(np.subtract(xs, ys))))]

    def learned(rs):
        la, lb = [r[4] for r in rs], [r[5] for r in rs]
        return [learned_cell(la), learned_cell(lb), 'n/a' if None in la + lb else str(changed_sides(la, lb))]

    groups = {r[0]: [s for s in runs if s[0] == r[0]] for r in runs}
    judged = any(r[4] is not None or r[5] is not None for r in runs)  # the demo's runs are not judged learned
    fig = lambda v: 'n/a' if v is None else run_fmt.format(v)
    classes = [retest_class(ca, cb) for *_, ca, cb in comparisons]
    seeds = sorted({r[1] for r in runs}, key=lambda s: (s is None, s or 0))
    learned_columns = [f"learned, {a}", f"learned, {b}", 'changed sides'] * judged
    text = [format_table(['model', 'runs', 'r', 'mean change'] + learned_columns,
                         [[g, str(len(rs))] + moved(rs) + learned(rs) * judged
                          for g, rs in list(groups.items()) + [('all', runs)]], True),
            format_table(['model', 'seed', f"{a} / {b}"] + [f"learned, {a} / {b}"] * judged,
                         [[g, str(s), f"{fig(x)} / {fig(y)}"] + [f"{yes_no(lx)} / {yes_no(ly)}"] * judged
                          for g, s, x, y, lx, ly in runs], True)]
    if comparisons:
        text.append(format_table(['comparison', 'measure', a, b, 'across the two'],
                                 [[name, measure, retest_cell(ca, fmt), retest_cell(cb, fmt), RETEST_CLASSES[k]]
                                  for (name, measure, ca, cb), k in zip(comparisons, classes)], True))
    caption = (f"The same runs (seeds {','.join(map(str, seeds))}) trained {how}. A run's figure: {figure}. r: "
               f"Pearson's correlation of the runs' figures across the two sides (n/a: fewer than 3 runs, a side that "
               f"does not vary, or a figure missing); mean change: their mean absolute difference"
               + ("; learned, with the exact 95% interval, under each side, and the runs that changed sides between "
                  "learned and not" if judged else '')
               + f". Each comparison counts once: {rule}. It is a conclusion under a side where a test's Holm p, as "
               f"its table computes it there, is below {ALPHA:g}, and holds where the second side draws the same "
               f"conclusion; an exact tie (the two groups equal) is never counted as holding. "
               + (retest_counts(classes) if comparisons else "No comparison: no pair of this table is in both files."))
    return '\n\n'.join(text + [caption])


# -----------------------------------------------------------------------------
# which runs a table compares


def dape_pairs(keys, parts):
    """Which rows a table compares, keys in table order: each DAPE-X against X, its setting without DAPE, and a
    DAPE-X that departs from DAPE as released (f zero at step 0, an edited dape.py) also against the same DAPE-X
    without that departure. parts(key) -> (the setting without DAPE's options, which DAPE ('none' without), a
    tuple of its departures, each None where it has not that one). Two keys of the same parts are an error: which
    of them is the baseline would be a guess. -> [(key, base key)], in the order of keys."""
    by_parts = {}
    for k in keys:
        if parts(k) in by_parts:
            raise InputError(f"{by_parts[parts(k)]!r} and {k!r} have the same setting: give them one label (or name "
                             f"the comparisons)")
        by_parts[parts(k)] = k
    pairs = []
    for (setting, dape, departs), k in by_parts.items():
        if dape != 'none':
            without = [departs[:i] + (None,) + departs[i + 1:] for i, d in enumerate(departs) if d is not None]
            bases = [(setting, 'none', (None,) * len(departs))] + [(setting, dape, w) for w in without]
            pairs += [(k, by_parts[b]) for b in bases if b in by_parts]
    return pairs


# -----------------------------------------------------------------------------
# results files: the runs' figures that a results page's tables are made of, kept in the repository


def write_json(path, obj):
    """obj as JSON at path, written whole or not at all (a failed write leaves the previous file)."""
    text = json.dumps(obj, indent=1)  # (a value json cannot write raises before the file is touched)
    with open(path + '.tmp', 'w') as f:
        f.write(text)
    os.replace(path + '.tmp', path)


def read_results(path, option, fix, field='runs', keys=(), what='che_tasks'):
    """The results file `path`, read and never written: a JSON object whose list `field` holds the runs, each
    naming `keys`; an InputError naming `option`, the file and `fix` where it is missing, not JSON or not such a
    file."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{option}={path}: no such file; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{option}={path} cannot be read as JSON ({e}): not a readable results file; "
                         f"{fix}") from None
    runs = saved.get(field) if isinstance(saved, dict) else None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and set(keys) <= r.keys() for r in runs):
        raise InputError(f"{option}={path} is not a {what} results file (a JSON object whose '{field}' each name "
                         f"{', '.join(keys)}); {fix}")
    return saved


def merge_rows(path, saved, rows, key, group, field='runs'):
    """Merge runs (rows) into the results file `path`, whose content (read_results) is `saved`, each marked source: run:
    a run of the same key(run) is replaced in place (a rerun of a seed replaces its earlier figures), a new one
    goes among its group(run)'s runs by seed (before the first of a larger seed; after the file's runs where its
    group has none); the file's other runs and fields are kept. The same group and seed under another key would
    count as two seeds: an error, the file left as it was. Written whole or not at all."""
    kept = list(saved[field])
    for run in rows:
        run = dict(run, source='run')
        twice = [r for r in kept if key(r) != key(run) and run['seed'] is not None
                 and (group(r), r['seed']) == (group(run), run['seed'])]
        if twice:
            raise InputError(f"--save_runs: {path} holds {key(twice[0])}, a run of {group(run)} with seed "
                             f"{run['seed']}, and this saves it again as {key(run)}: save it under the same name, or "
                             f"remove that run first")
        same = [i for i, r in enumerate(kept) if key(r) == key(run)]
        if same:
            kept[same[0]] = run
            continue
        ours = [i for i, r in enumerate(kept) if group(r) == group(run)]
        later = [i for i in ours if (kept[i]['seed'] or 0) > (run['seed'] or 0)]
        kept.insert(later[0] if later else ours[-1] + 1 if ours else len(kept), run)
    write_json(path, dict(saved, **{field: kept}))
    print(f"{len(rows)} run(s) saved in {path}")


# -----------------------------------------------------------------------------
# eval_extrapolate.py: the perplexity tables over seeds, DAPE-X against X, how long the compared runs were trained,
# and its files and figures

def plot_loss_by_position(runs, path):
    """Mean loss against position (log2 axis), one colour per label (seeds share it), training lengths
    marked: where past the training length each model's loss starts to rise."""
    labels = list(dict.fromkeys(r['label'] for r in runs if r.get('position_loss')))
    colors = dict(zip(labels, curve_colors(len(labels))))
    fig, axes = new_figure(1, 1, (7.5, 4.5))
    ax = axes[0][0]
    seen = set()
    for r in runs:
        pl = r.get('position_loss')
        if not pl:
            continue
        xs = [(a + b - 1) / 2 + 1 for a, b, _ in pl['buckets']]  # bucket centre, 1-based for the log axis
        ax.plot(xs, [v for _, _, v in pl['buckets']], color=colors[r['label']], marker='.', ms=3,
                label=None if r['label'] in seen else r['label'])
        seen.add(r['label'])
    for b in sorted({r['model_args']['block_size'] for r in runs if r.get('position_loss')}):
        ax.axvline(b, color='grey', linestyle=':', linewidth=1.2)
    ax.set_xscale('log', base=2)
    ax.set_xlabel('position in the window (tokens of context + 1; dotted: training length)')
    ax.set_ylabel('mean loss (nats)')
    ax.set_title('Loss by position, longest evaluation length', fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, 130)


def split_pairs(text):
    """--pairs 'a:b,c:d' as ['a:b', 'c:d'], keeping commas inside brackets (kerple[lr=1,dropout=0])."""
    items, depth, cur = [], 0, ''
    for ch in text:
        depth += (ch == '[') - (ch == ']')
        if ch == ',' and depth == 0:
            items.append(cur)
            cur = ''
        else:
            cur += ch
    return [p.strip() for p in items + [cur] if p.strip()]


def parse_pairs(text, labels):
    """--pairs as [(dape label, baseline label)], checked against the runs' labels before anything is
    evaluated. A label may hold ':' itself, so every ':' is tried as the separator."""
    known = sorted(set(labels))
    out = []
    for pair in split_pairs(text):
        splits = [(pair[:i], pair[i + 1:]) for i, ch in enumerate(pair) if ch == ':' and 0 < i < len(pair) - 1]
        if not splits:
            raise InputError(f"--pairs: {pair!r} is not 'dape_label:baseline_label' (pairs are separated by ','); "
                            f"the labels are {known}")
        found = [(a, b) for a, b in splits if a in known and b in known]
        if len(found) != 1:
            missing = [x for x in splits[0] if x not in known]
            raise InputError(f"--pairs: {pair!r}: " + (f"no run is labelled {missing}" if missing else
                            "ambiguous") + f"; the labels are {known} (see --labels to name runs yourself)")
        if found[0][0] == found[0][1]:
            raise InputError(f"--pairs: {pair!r} compares {found[0][0]!r} with itself")
        out += found
    return out


def group_runs(runs, eval_lengths):
    """Runs with the same label form a group: per length, mean and sample std of ppl (and bpb) over
    the runs that have a value (group_over_seeds); a length none of them has keeps the first
    reason."""
    def value(metric):
        def of(run, L):
            res = run['results'][L]
            if res['status'] != 'ok':
                return res['status']
            return 'n/a: not byte data' if res[metric] is None else res[metric]
        return of
    label = lambda r: r['label']
    ppl, bpb = (group_over_seeds(runs, label, eval_lengths, value(m)) for m in ('ppl', 'bpb'))
    out = []
    for gp, gb in zip(ppl, bpb):
        members = gp['members']
        out.append({'label': gp['label'], 'runs': [m['path'] for m in members], 'n': len(members),
                    'seeds': [m['seed'] for m in members], 'model_args': members[0]['model_args'],
                    'training': members[0].get('training'), 'data_dir': members[0]['data_dir'],
                    'rope_scaling': members[0].get('rope_scaling', 'none'),  # part of the setting (setting_of)
                    'dape_py': members[0].get('dape_py'),  # so is an edited dape.py
                    'block_size': members[0]['model_args']['block_size'], 'ppl': gp['stats'], 'bpb': gb['stats']})
    return out


def compare(dape_group, base_group, eval_lengths):
    """Per length: DAPE-X's mean perplexity minus X's with its 95% confidence interval, Welch's t-test and
    the exact permutation test of the per-seed perplexities (compare_means; holm_table adds the
    Holm-adjusted p once every comparison of the table is made)."""
    out = {'label': dape_group['label'], 'baseline': base_group['label'], 'p_value': {}, 't': {}}
    for L in eval_lengths:
        a, b = dape_group['ppl'][L], base_group['ppl'][L]
        if a['status'] != 'ok' or b['status'] != 'ok':
            out['p_value'][L] = {'status': a['status'] if a['status'] != 'ok' else b['status']}
            continue
        c = compare_means(a['values'], b['values'])  # ('n/a: 1 seed', 'n/a: zero variance' where it has no test)
        ok = c['status'] == 'ok'
        kept = ('status', 'p', 't', 'df', 'ci', 'p_exact', 'p_min', 'exact', 'n_a', 'n_b') if ok else ('status',)
        out['p_value'][L] = dict({k: c[k] for k in kept}, **({'mean_diff': c['diff']} if ok else {}))
    return out


def holm_table(comparisons, eval_lengths):
    """Holm's adjustment of the exact p over every test of the p-value table (each pair at each length): sets
    'p_holm' in place. -> the number of tests."""
    return holm_over([c['p_value'][L] for c in comparisons for L in eval_lengths])


def fmt_value(v, digits):
    if v >= 1e5:
        return f"{v:.3g}"
    return f"{v:.{digits}f}"


def ppl_cell(stat, digits=3):
    if stat['status'] != 'ok':
        return stat['status']
    return mean_std_text(stat['mean'], stat['std'], lambda v: fmt_value(v, digits))


def ppl_table(groups, metric, eval_lengths, markdown=False):
    return length_table(groups, eval_lengths, [('model', lambda g: g['label']), ('n', lambda g: str(g['n']))],
                        lambda g, L: ppl_cell(g[metric][L], 4 if metric == 'bpb' else 3), markdown)


def ppl_run_table(runs, eval_lengths, markdown=False):
    first = [('run', lambda r: r['name']), ('model', lambda r: r['label']), ('seed', lambda r: str(r['seed'])),
             ('iter', lambda r: str(r['iter_num']))]
    ppl = lambda s: fmt_value(s['ppl'], 3) if s['status'] == 'ok' else s['status']
    return length_table(runs, eval_lengths, first, lambda r, L: ppl(r['results'][L]), markdown)


def pvalue_table(comparisons, eval_lengths, markdown=False):
    """Per pair and length: Welch's p, and in brackets the exact p and its Holm adjustment (holm_table); then
    the caption (tests_caption) and the pairs trained unequally."""
    pair = lambda c: f"{c['label']} vs {c['baseline']}" + (' (!)' if c.get('unequal_training') else '')
    cell = lambda s: s['status'] if s['status'] != 'ok' else f"{s['p']:.3g} ({exact_holm_text(s)})"
    table = length_table(comparisons, eval_lengths, [('DAPE-X vs X', pair)], lambda c, L: cell(c['p_value'][L]),
                         markdown)
    caption = tests_caption([c['p_value'][L] for c in comparisons for L in eval_lengths])
    if caption:
        table += '\n\n' + caption
    if any(c.get('unequal_training') for c in comparisons):
        table += '\n\n(!) the two models were not trained for as long as each other: ' + '; '.join(
            f"{c['label']} vs {c['baseline']}: {c['unequal_training']}" for c in comparisons if c.get('unequal_training'))
    return table


def difference_table(comparisons, eval_lengths, markdown=False):
    """DAPE-X's mean perplexity minus X's, per length, with its 95% confidence interval (Welch-
    Satterthwaite): negative is DAPE lower."""
    difference = lambda s: difference_text(dict(s, diff=s.get('mean_diff')), '{:+.3f}')
    return length_table(comparisons, eval_lengths, [('DAPE-X minus X', lambda c: f"{c['label']} - {c['baseline']}")],
                        lambda c, L: difference(c['p_value'][L]), markdown)


def protocol_text(protocol):
    counts = sorted({d['num_windows'] for d in protocol.get('data', {}).values() if 'num_windows' in d})
    n = f"{counts[0]} to {counts[-1]} (by validation split)" if len(counts) > 1 else protocol['num_windows']
    return (f"Perplexity of the last {protocol['eval_tokens']} tokens of each window (whole window through "
            f"the model), {n} windows per length at the same seeded end positions "
            f"(seed {protocol['seed']}) for every length and checkpoint. Mean ± sample std over seeds where "
            f"several runs share a setting.")


def write_ppl_results(out, protocol, runs, groups, comparisons, eval_lengths, make_plot=True, notes=()):
    os.makedirs(out, exist_ok=True)
    has_bpb = any(g['bpb'][L]['status'] == 'ok' for g in groups for L in eval_lengths)
    result = {'protocol': protocol, 'lengths': eval_lengths, 'runs': runs, 'groups': groups,
              'comparisons': comparisons, 'notes': list(notes)}
    write_json(os.path.join(out, 'results.json'), jsonable(result))  # (jsonable refuses a NaN before a file is touched)

    md = ['# Length extrapolation', '', protocol_text(protocol), '']
    if notes:
        md += ['## Notes', ''] + [f"- {n}" for n in notes] + ['']
    md += ['## Perplexity', '',
          ppl_table(groups, 'ppl', eval_lengths, markdown=True), '']
    if has_bpb:
        md += ['## Bits per byte', '', ppl_table(groups, 'bpb', eval_lengths, markdown=True), '']
    if comparisons:
        md += ["## DAPE-X vs X: Welch's t-test and the exact permutation test (two-sided p, per-seed perplexities)", '',
               pvalue_table(comparisons, eval_lengths, markdown=True), '',
               "## DAPE-X minus X: difference of mean perplexities [95% confidence interval]", '',
               difference_table(comparisons, eval_lengths, markdown=True), '']
    md += ['## Runs (perplexity)', '', ppl_run_table(runs, eval_lengths, markdown=True), '']
    with open(os.path.join(out, 'results.md'), 'w') as f:
        f.write('\n'.join(md))

    with open(os.path.join(out, 'results.csv'), 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['run', 'model', 'seed', 'metric'] + [str(L) for L in eval_lengths])
        for r in runs:
            for metric in ('ppl', 'bpb') if has_bpb else ('ppl',):
                row = []
                for L in eval_lengths:
                    s = r['results'][L]
                    row.append(s['status'] if s['status'] != 'ok' else
                               ('' if s[metric] is None else f"{s[metric]:.6g}"))
                w.writerow([r['path'], r['label'], r['seed'], metric] + row)

    if make_plot:
        plot_ppl(groups, eval_lengths, protocol, os.path.join(out, 'ppl_vs_length.png'))


def ppl_ticks(lo, hi):
    """Tick values for a log perplexity axis from lo to hi: a narrow range (as in a zoom) gets evenly
    spaced round numbers, a wide one 1, 2, 5 x 10^k, so that every axis shows a few plain numbers."""
    from matplotlib.ticker import LogLocator, MaxNLocator
    if hi / lo < 3:
        ticks = MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
    else:
        ticks = LogLocator(subs=(1, 2, 5)).tick_values(lo, hi)
        if sum(lo <= t <= hi for t in ticks) < 3:
            ticks = LogLocator(subs=(1, 1.5, 2, 3, 4, 5, 6, 8)).tick_values(lo, hi)
    return [t for t in ticks if lo <= t <= hi]


def plot_ppl(groups, eval_lengths, protocol, path):
    """Figure 2 for these runs: perplexity (log axis) against evaluation length (log2 axis, also as
    multiples of the training length), one colour per model, mean with a band and error bars of one std
    where there are several seeds. When some curves rise far above the others (RoPE past its training
    length), a second panel zooms on those that stay within 2x of the best perplexity, where the
    differences between similar encodings (X against DAPE-X) are. Returns the figure."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    curves = []  # (label, dape, xs, means, stds)
    for g in groups:
        pts = [(L, g['ppl'][L]) for L in eval_lengths if g['ppl'][L]['status'] == 'ok']
        if pts:
            curves.append((g['label'] + (f" (n={g['n']})" if g['n'] > 1 else ''), g['model_args'].get('dape', 'none'),
                           [L for L, _ in pts], [s['mean'] for _, s in pts], [s['std'] or 0.0 for _, s in pts]))
    best = min((min(m) for *_, m, _ in curves), default=1.0)
    near = [c for c in curves if max(c[3]) <= 2 * best]
    panels = [(curves, 'all models')] + ([(near, 'zoom on the models within 2x of the best (same colours)')]
                                         if 0 < len(near) < len(curves) else [])
    blocks = sorted({g['block_size'] for g in groups})

    fig, axes = new_figure(1, len(panels), (6.5 * len(panels), 4.8))
    # the colour tells the models apart; the line style and marker say which DAPE, if any (X dashed
    # with circles, DAPE V1 solid with squares, V2 dash-dotted with triangles)
    color = dict(zip([c[0] for c in curves], curve_colors(len(curves))))
    styles = {'none': ('--', 'o'), 'v1': ('-', 's'), 'v2': ('-.', '^')}
    for ax, (shown, title) in zip(axes[0], panels):
        for label, dape, xs, ys, errs in shown:
            style, marker = styles.get(dape, ('-', 'D'))
            ax.plot(xs, ys, linestyle=style, marker=marker, ms=4, color=color[label], label=label)
            if any(errs):
                lo_, hi_ = [y - e for y, e in zip(ys, errs)], [y + e for y, e in zip(ys, errs)]
                ax.fill_between(xs, lo_, hi_, color=color[label], alpha=0.15, linewidth=0)
                ax.errorbar(xs, ys, yerr=errs, fmt='none', ecolor=color[label], capsize=3)
        for i, b in enumerate(blocks):
            ax.axvline(b, color='grey', linestyle=':', linewidth=1.2, label='training length' if i == 0 else None)
        multiples = length_axis(ax, eval_lengths, blocks)
        ax.set_yscale('log')
        # (a std as large as the mean would put the axis at or below 0, where a log axis has nothing)
        values = [v for *_, ys, errs in shown for y, e in zip(ys, errs) for v in (max(y - e, y / 2), y + e)]
        if values:
            lo, hi = min(values), max(values)
            pad = (hi / lo) ** 0.06 if hi > lo else 1.02
            ax.set_ylim(lo / pad, hi * pad)
            ax.yaxis.set_major_locator(FixedLocator(ppl_ticks(lo / pad, hi * pad)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel('evaluation length (tokens' + (' and multiple of the training length)' if multiples else ')'))
        ax.set_ylabel('perplexity (log scale)')
        ax.set_title(title, fontsize=10)
        ax.grid(True, which='major', alpha=0.3)
    axes[0][0].legend(fontsize=8)  # the zoom has the same colours; a legend there would hide its curves
    fig.suptitle(f"Perplexity of the last {protocol['eval_tokens']} tokens vs evaluation length "
                 f"({protocol['num_windows']} windows per length; lower is better)", fontsize=10)
    save_figure(fig, path, 130)
    return fig


def tokens_seen(ckpt):
    """Training tokens a checkpoint has seen (iterations x sequences per step x training length), or None
    for a checkpoint saved without its config."""
    conf = ckpt.get('config') or {}
    per_step = [conf.get(k) for k in ('batch_size', 'gradient_accumulation_steps')]
    if ckpt.get('iter_num') is None or None in per_step:
        return None
    return ckpt['iter_num'] * per_step[0] * per_step[1] * ckpt['model_args']['block_size']


def per_label(runs, key):
    """{label: the distinct values of run[key] among its runs}, leaving out None (not recorded)."""
    out = {}
    for r in runs:
        out.setdefault(r['label'], set())
        if r.get(key) is not None:
            out[r['label']].add(r[key])
    return out


def unequal_training(runs):
    """Why these runs (of one or more labels) were not trained for as long as each other, or None:
    different iterations or tokens seen, or a checkpoint saved before its own max_iters."""
    why = []
    for key, what in (('iter_num', 'iterations'), ('tokens_seen', 'tokens seen')):
        if len(set().union(*per_label(runs, key).values())) > 1:
            why.append(f"different {what}")
    if any(r.get('max_iters') is not None and r['iter_num'] is not None and r['iter_num'] < r['max_iters']
           for r in runs):
        why.append('stopped before max_iters')
    return ', '.join(why) or None


def training_notes(runs):
    """Notes on runs that are compared but were not trained alike for as long: the seeds of one label
    saved at different iterations, labels trained for different iterations or tokens, and checkpoints
    saved before their own max_iters (an interrupted run, or the best-val-loss checkpoint)."""
    notes = []
    iters = per_label(runs, 'iter_num')
    for lab in iters:
        saved = [r['iter_num'] for r in runs if r['label'] == lab]
        if len(set(saved)) > 1:  # seeds of one training, but not all at its end
            notes.append(f"the runs of {lab} were saved at different iterations {saved}")
    if len(iters) > 1:
        for key, what in (('iter_num', 'iterations'), ('tokens_seen', 'tokens')):
            values = per_label(runs, key)
            if len(set().union(*values.values())) > 1:
                listed = ', '.join(f"{lab} {'/'.join(f'{v:,}' for v in sorted(vs)) or '?'}"
                                   for lab, vs in values.items())
                notes.append(f"the compared models were trained for different numbers of {what}: {listed}")
    for r in runs:
        if r['max_iters'] is not None and r['iter_num'] is not None and r['iter_num'] < r['max_iters']:
            notes.append(f"{r['name']} ({r['label']}) was saved at iteration {r['iter_num']:,} of its max_iters "
                         f"{r['max_iters']:,}: an interrupted run, or not its last checkpoint")
    return notes


# -----------------------------------------------------------------------------


# Each kind of task's rule for 'learned' (CHE's and retrieval's learned_frac in their configs, the passkey's
# learned_exact) and the day it was set (git log -S): a table states the rule it applied with that day, so that a
# rule moved after the runs were made shows
LEARNED_RULES = {'CHE': (0.5, '2026-11-24'), 'retrieval': (0.9, '2026-11-25'), 'passkey': (0.5, '2026-11-24')}


# -----------------------------------------------------------------------------
# che_tasks.py: the CHE and retrieval tables over seeds and per test length, its results files and their
# test-retest

TASKS = {**che_data.TASKS, **retrieval_data.TASKS}  # every task che_tasks.py runs
POS_NAMES = {'nope': 'NoPE', 'learned': 'Learned', 'sinusoidal': 'Sinusoidal', 'rope': 'RoPE',
             't5': 'T5', 'alibi': 'ALiBi', 'kerple': 'Kerple', 'kerple_power': 'Kerple-power',
             'fire': 'FIRE', 'cope': 'CoPE', 'xl': 'XL', 'fox': 'FoX', 'path': 'PaTH', 'path_fox': 'PaTH-FoX'}

# # the DAPE paper's Table 2 (accuracy %, test lengths 41-500, max over seeds and learning rates),
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


def encoding_label(pos, dape):
    """'ALiBi', 'DAPE-ALiBi', 'DAPEv2-Kerple', 'DAPE-Kerple (zero init)' (dape 'v1:zero'); the attention's options
    as pos spells them ('NoPE+sb': stick-breaking, common.pos_options)."""
    base, _, options = pos.partition('+')
    name = POS_NAMES.get(base, base) + ('+' + options if options else '')
    version, _, init = dape.partition(':')
    if version == 'none':
        return name
    return f"{'DAPE' if version == 'v1' else 'DAPEv2'}-{name}" + (f" ({init} init)" if init else '')


def summarize(runs):
    """The paper's statistic over a cell's runs, the max (of the extrapolation score, and separately of
    the ID accuracy), with the mean beside it. None where any run could not be served."""
    def stats(key, values):
        if not values or None in values:
            return {key: None, key + '_mean': None}
        return {key: float(max(values)), key + '_mean': float(np.mean(values))}
    out = {}
    for key in ('score', 'id_score', 'final_train_acc'):
        out.update(stats(key, [r.get(key) for r in runs]))
    # a task's other test distributions, each its OOD score
    out['variants'] = {v: stats('score', [r['variants'][v]['score'] for r in runs])
                       for v in (runs[0].get('variants', {}) if runs else {})}
    if out['score'] is not None:  # the run the max picks, and what it learned in distribution
        best = max(runs, key=lambda r: r['score'])
        out['best_run'] = {'seed': best['seed'], 'learning_rate': best['learning_rate'],
                           'id_score': best['id_score']}
    return out


def _fmt(score):
    return 'n/s' if score is None else f"{score:.2f}"


def plot_per_length(cells, task, path, train_max_len, n_runs, how):
    """Accuracy against length over the whole axis, the training range shaded: one line per encoding
    (the mean over its runs, their min..max as a band), the random-guess level dashed; a panel per test
    distribution where the task has several (flip-flop's sparse and dense). n_runs: how many runs each cell has;
    how: what each length's accuracy rests on."""
    panels = [None] + list(task.variants)
    fig, axes = new_figure(1, len(panels), (5 * len(panels) + 2.5, 4), sharey=True)
    for ax, v in zip(axes[0], panels):
        ax.axvspan(0.5, train_max_len + 0.5, color='0.92', label='training lengths (ID)')
        for i, (label, cell) in enumerate(cells.items()):
            runs = [r for r in cell.get('runs', []) if r.get('per_length') or r.get('id_per_length')]
            if not runs:
                continue
            if v is None:  # the training distribution: ID and OOD lengths
                curves = [{**r.get('id_per_length', {}), **r.get('per_length', {})} for r in runs]
                text = f"{label}: ID {_fmt(cell.get('id_score'))} / OOD {_fmt(cell.get('score'))}"
            else:
                curves = [r['variants'][v]['per_length'] for r in runs]
                text = f"{label}: OOD {_fmt(cell['variants'][v]['score'])}"
            Ns = sorted(set.intersection(*(set(map(int, c)) for c in curves)))
            acc = np.array([[c[str(n)] for n in Ns] for c in curves])
            ax.plot(Ns, acc.mean(axis=0), lw=1.2, color=f"C{i}", label=text)
            if len(runs) > 1:
                ax.fill_between(Ns, acc.min(axis=0), acc.max(axis=0), color=f"C{i}", alpha=0.2, lw=0)
        ax.axhline(100 * task.random_baseline, color='gray', ls='--', lw=1, label='random')
        ax.set_xlabel(f"length N (trained on {task.min_len}..{train_max_len})")
        ax.set_ylim(0, 101)
        ax.set_title(task.name if v is None else f"{task.name}, {v} (OOD lengths)", fontsize=10)
        ax.legend(fontsize=7, loc='lower left')
    axes[0][0].set_ylabel('accuracy (%)')
    fig.suptitle(f"{'CHE ' if not task.causal else ''}{task.name}: "
                 + (f"mean of {n_runs} runs (band: min..max), legend: max;" if n_runs > 1 else "") + "\n" + how,
                 fontsize=10)
    save_figure(fig, path, 120)


def max_mean_text(cell, key, several, variant=None):
    """A cell of the Table 2-shaped grid: the max over its runs (the paper's statistic), the mean in brackets
    where several; 'n/s' where a run was not servable, 'err' where the cell failed."""
    if cell is None or 'runs' not in cell:
        return 'err'
    stats = cell['variants'][variant] if variant else cell
    if stats[key] is None:
        return 'n/s'
    return f"{stats[key]:.2f} ({stats[key + '_mean']:.2f})" if several else f"{stats[key]:.2f}"


def paper_table(tasks):
    return format_table(['Task'] + [encoding_label(p, d) for p, d in PAPER_TABLE2_COLUMNS],
                        [[t] + [f'{v:.2f}' for v in PAPER_TABLE2[t]] for t in tasks if t in PAPER_TABLE2], True)


def cells_of(cells, t, columns):
    """Task t's cells in column order, [(pos, dape, cell)], leaving out those that did not run ('err' cells)."""
    return [(p, d, cells[(t, p, d)]) for p, d in columns if 'runs' in (cells.get((t, p, d)) or {})]


def summary_table(cells, tasks, columns):
    """A row per (task, encoding): ID and OOD accuracy (max and mean over runs), the final training
    accuracy, and the paper's figure where Table 2 has one."""
    variants = sorted({v for t in tasks for v in TASKS[t].variants})  # the other test distributions of some tasks
    header = (['Task', 'Encoding', 'Random', 'ID max', 'ID mean', 'OOD max', 'OOD mean', 'final train acc (mean)',
               'runs'] + [f"OOD {v} {stat}" for v in variants for stat in ('max', 'mean')] + ['Paper (OOD)'])
    rows = []
    for t in tasks:
        for p, d, c in cells_of(cells, t, columns):
            paper = PAPER_TABLE2.get(t)
            k = PAPER_TABLE2_COLUMNS.index((p, d)) if (p, d) in PAPER_TABLE2_COLUMNS else None
            own = ('id_score', 'id_score_mean', 'score', 'score_mean', 'final_train_acc_mean')
            rows.append([t, c['encoding'], f"{c['random_baseline']:.0f}"] + [_fmt(c[key]) for key in own]
                        + [str(c['n_runs'])]
                        + [_fmt(c['variants'][v][key]) if v in c.get('variants', {}) else '-'
                           for v in variants for key in ('score', 'score_mean')]
                        + [f'{paper[k]:.2f}' if paper and k is not None else '-'])
    return format_table(header, rows, True)


def task_family(task):
    """'retrieval' for retrieval_data.py's tasks, 'CHE' for che_data.py's: whose rule for 'learned' applies."""
    return 'retrieval' if task in retrieval_data.TASKS else 'CHE'


def learned_rule_text(tasks, cfg):
    """The rule for 'learned' a table applied, with the day each family's standing rule was set."""
    out = []
    for family in sorted({task_family(t) for t in tasks}):
        rule, since = LEARNED_RULES[family]
        out.append(f"{family}'s rule since {since}" if cfg['learned_frac'] == rule else
                   f"this run's rule; {family}'s, set on {since}, is {rule:g}")
    return '; '.join(out)


def learned_threshold(task, cfg):
    """The ID accuracy (%) from which a run counts as having learned its task: learned_frac of the way
    from the random-guess level to 100% (by default halfway: 75% where chance is 50%, 60% where it is 20%)."""
    chance = 100 * task.random_baseline
    return chance + cfg['learned_frac'] * (100 - chance)


def parse_learning_rates(cfg):
    """che_tasks.py's learning rates: learning_rates, comma-separated, else learning_rate."""
    return [float(s) for s in cfg['learning_rates'].split(',') if s.strip()] or [cfg['learning_rate']]


def dape_parts(key):
    """A row key (task, pos, dape, lr) as dape_pairs reads it: 'v1:zero' is V1 with f zero at step 0."""
    t, p, d, lr = key
    version, _, init = d.partition(':')
    return (t, p, lr), version, (init or None,)


MEAN_CI_TEXT = ("the mean with the 95% t interval of the mean (n - 1 degrees of freedom), cut to 0-100; the mean "
                "alone for one seed")


def _mean_ci_text(values):
    """Accuracies (%) over seeds as the tables write them: the mean with its 95% t interval cut to 0-100
    (common.mean_ci_text); 'n/s' where a run was not servable."""
    if any(v is None for v in values):
        return 'n/s'
    return mean_ci_text(values, bounds=(0.0, 100.0))


def _compare(a, b):
    """compare_means of accuracies (%) a against b, or {'status': 'n/s'} where a run was not servable."""
    if any(v is None for v in a + b):
        return {'status': 'n/s'}
    return compare_means(a, b, bounds=(0.0, 100.0))


def _difference_cells(c):
    """A comparison as four table cells: the difference [95% interval], Welch's p, the exact p and its Holm
    adjustment (holm_over)."""
    if c['status'] == 'n/s':
        return ['n/s'] * 4
    if c['status'] != 'ok':
        return [c['status'], '-', '-', '-']
    return [difference_text(c), p_text(c['p']), p_text(c['p_exact']), p_text(c['p_holm'])]


def is_learned(run, threshold):
    return run['id_score'] is not None and run['id_score'] >= threshold


def seed_rows(cells, tasks, columns, cfg):
    """[(task, pos, dape, lr, runs in seed order, learned threshold)]: the rows of the tables over seeds."""
    out = []
    for t in tasks:
        for lr in parse_learning_rates(cfg):
            for p, d, c in cells_of(cells, t, columns):
                runs = sorted((r for r in c['runs'] if r['learning_rate'] == lr), key=lambda r: r['seed'])
                if runs:
                    out.append((t, p, d, lr, runs, learned_threshold(TASKS[t], cfg)))
    return out


def _compare_shares(a, b, threshold):
    """The share of seeds that learned, runs a against runs b: compare_means of each seed's 1 (learned) or 0, whose
    exact p is then a conditional test like Fisher's; {'status': 'n/s'} where a run has no ID score."""
    if any(r['id_score'] is None for r in a + b):
        return {'status': 'n/s'}
    return compare_means([float(is_learned(r, threshold)) for r in a], [float(is_learned(r, threshold)) for r in b],
                         bounds=(0.0, 1.0))


def seed_comparisons(rows):
    """The comparisons of the tables over seeds, rows from seed_rows: for each pair of dape_pairs,
    [OOD over the seeds that learned, OOD over every seed, ID over every seed, the share of seeds that learned]
    (compare_means), with Holm's adjustment over all of them (one table). -> [(key, base key, [four comparisons])]."""
    by_key = {(t, p, d, lr): (runs, threshold) for t, p, d, lr, runs, threshold in rows}
    out = []
    for key, base_key in dape_pairs(by_key, dape_parts):
        (runs, threshold), (base, _) = by_key[key], by_key[base_key]
        ood = lambda rs, only_learned: [r['score'] for r in rs if is_learned(r, threshold) or not only_learned]
        out.append((key, base_key, [_compare(ood(runs, True), ood(base, True)), _compare(ood(runs, False), ood(base, False)),
                                    _compare([r['id_score'] for r in runs], [r['id_score'] for r in base]),
                                    _compare_shares(runs, base, threshold)]))
    holm_over([c for *_, cs in out for c in cs])
    return out


def share_cell(runs, base, threshold, c=None):
    """The learned cell of a comparison row of runs against base (shares_text), c the test of the two shares."""
    k = lambda rs: sum(is_learned(r, threshold) for r in rs)
    return shares_text([k(runs), len(runs), k(base), len(base)], c)


def seeds_table(cells, tasks, columns, cfg):
    """The tables over seeds. First a row per (task, encoding, learning rate): how many seeds learned
    the task (ID at least learned_threshold) with the exact binomial interval of that share, ID accuracy
    over every seed and the extrapolation (OOD) scores over the seeds that learned it, as the mean with
    its 95% t interval (_mean_ci_text), with the per-seed figures (those of seeds that did not learn it in
    brackets: they say nothing about extrapolation). Then a row per comparison of seed_comparisons: how many
    seeds learned on each side with the exact p of the two shares, and for OOD and ID the difference of the
    means with its 95% t interval cut to the possible range, Welch's two-sided p, the exact p; each exact p
    with its Holm adjustment over every comparison of the table. -> the Markdown tables with their caption."""
    several_rates = len(parse_learning_rates(cfg)) > 1
    rows = seed_rows(cells, tasks, columns, cfg)
    variants = sorted({v for t in tasks for v in TASKS[t].variants})
    lr = lambda lr: [f"{lr:g}"] * several_rates  # a learning rate column where the table has several
    fig = lambda v: 'n/s' if v is None else f"{v:.1f}"
    table, by_key = [], {}
    for t, p, d, rate, runs, threshold in rows:
        by_key[(t, p, d, rate)] = (runs, threshold)
        learned = [r for r in runs if is_learned(r, threshold)]
        per_seed = ', '.join(fig(r['score']) if is_learned(r, threshold) else f"({fig(r['score'])})" for r in runs)
        table.append([t, encoding_label(p, d)] + lr(rate)
                     + [f"{100 * TASKS[t].random_baseline:.0f}", k_of_n_text(len(learned), len(runs)),
                        _mean_ci_text([r['id_score'] for r in runs]), ', '.join(fig(r['id_score']) for r in runs),
                        _mean_ci_text([r['score'] for r in learned]), per_seed]
                     + [_mean_ci_text([r['variants'][v]['score'] for r in learned]) if v in TASKS[t].variants else '-'
                        for v in variants])
    text = [format_table(['Task', 'Encoding'] + ['lr'] * several_rates + ['Random', 'learned [95% interval]', 'ID',
                                                                          'ID per seed', 'OOD (learned seeds)',
                                                                          'OOD per seed']
                         + [f"OOD {v} (learned seeds)" for v in variants], table, True)]
    compared = seed_comparisons(rows)
    if compared:
        table = []
        for (t, p, d, rate), base_key, cs in compared:
            (runs, threshold), (base, _) = by_key[(t, p, d, rate)], by_key[base_key]
            table.append([t, f"{encoding_label(p, d)} vs {encoding_label(p, base_key[2])}"] + lr(rate)
                         + [share_cell(runs, base, threshold, cs[3])]
                         + [x for c in cs[:3] for x in _difference_cells(c)])
        text.append(format_table(['Task', 'DAPE-X vs X'] + ['lr'] * several_rates + ['learned']
                                 + [h for what, seeds in (('OOD', 'learned'), ('OOD', 'all'), ('ID', 'all'))
                                    for h in (f"{what} difference, {seeds} seeds [95% interval]", 'Welch p', 'exact p',
                                              'Holm p')], table, True))
    seeds = sorted({r['seed'] for *_, runs, _ in rows for r in runs})
    thresholds = [f"{learned_threshold(TASKS[t], cfg):.4g}% for {t}" for t in tasks]
    caption = [f"Accuracy (%) over seeds {','.join(map(str, seeds))}: {MEAN_CI_TEXT}; per seed in seed order. "
               f"learned: ID accuracy at least {cfg['learned_frac']:g} of the way from chance to 100% "
               f"({', '.join(thresholds)}; {learned_rule_text(tasks, cfg)}), with the exact (Clopper-Pearson) 95% "
               f"interval of the share of seeds. ID over every seed; OOD over the seeds that learned the task (in "
               f"brackets, those that did not). Differences: DAPE-X's mean minus X's with its "
               f"{interval_text(bounded=True)}; n/a: fewer than two seeds a side. n/s: not servable at the test "
               f"lengths."]
    if compared:
        caption.append(f"In the learned column of a comparison, {SHARES_TEST}.")
    caption.append(tests_caption([c for *_, cs in compared for c in cs]))
    return '\n\n'.join(text + [' '.join(x for x in caption if x)])


def per_length(run):
    """A run's OOD accuracy (%) per test length, {N: accuracy}; {} where its record has none (results
    files written before save_runs kept them)."""
    return {int(N): a for N, a in (run.get('per_length') or {}).items()}


def length_comparisons(rows):
    """DAPE-X against X (dape_pairs) at every test length, over every seed that has the length (no
    threshold: a seed that did not learn is scored like any other), with Holm's adjustment over all of them
    (one table). -> ([(key, base key, {N: compare_means})], the lengths)."""
    curves = {(t, p, d, lr): [per_length(r) for r in runs] for t, p, d, lr, runs, _ in rows}
    lengths = sorted({N for cs in curves.values() for c in cs for N in c})
    out = []
    for key, base_key in dape_pairs(curves, dape_parts):
        at = lambda cs, N: [c[N] for c in cs if N in c]
        out.append((key, base_key, {N: _compare(at(curves[key], N), at(curves[base_key], N)) for N in lengths}))
    holm_over([c for *_, cs in out for c in cs.values()])
    return out, lengths


def length_tables(cells, tasks, columns, cfg):
    """The extrapolation at every test length, for runs whose records keep their per-length accuracies:
    per task, a row per length with each encoding's accuracy (the mean over every seed with its 95% t
    interval), then a row per DAPE-X minus X and length (length_comparisons): the difference of the means
    [95% interval], Welch's p, the exact p and that p adjusted by Holm's method over the table. '' where no
    run has per-length figures."""
    rows = [r for r in seed_rows(cells, tasks, columns, cfg) if any(per_length(x) for x in r[4])]
    if not rows:
        return ''
    several_rates = len(parse_learning_rates(cfg)) > 1
    label = lambda t, p, d, lr: encoding_label(p, d) + (f" (lr {lr:g})" if several_rates else '')
    out = []
    for t in tasks:
        task_rows = [r for r in rows if r[0] == t]
        if not task_rows:
            continue
        compared, lengths = length_comparisons(task_rows)
        seeds = sorted({x['seed'] for r in task_rows for x in r[4] if per_length(x)})  # those the figures are over
        curves = [[per_length(x) for x in r[4]] for r in task_rows]
        out += [format_table([f"{t}: N"] + [label(*r[:4]) for r in task_rows],
                             [[str(N)] + [_mean_ci_text([c[N] for c in cs if N in c]) for cs in curves] for N in lengths],
                             True),
                f"OOD accuracy (%) per test length N over every seed ({','.join(map(str, seeds))}), whether or not it "
                f"learned the task: {MEAN_CI_TEXT}; random {100 * TASKS[t].random_baseline:.0f}%."]
        if compared:
            out += [format_table([f"{t}: DAPE-X minus X", 'N', 'difference [95% interval]', 'Welch p', 'exact p',
                                  'Holm p'], [[f"{label(*k)} minus {label(*b)}", str(N)] + _difference_cells(cs[N])
                                              for k, b, cs in compared for N in lengths], True),
                    f"Differences of the means at each length, over every seed, with the {interval_text(bounded=True)}. "
                    + tests_caption([c for *_, cs in compared for c in cs.values()])]
    return '\n\n'.join(out)


RUN_KEYS = ('task', 'pos', 'dape', 'learning_rate', 'seed')
MERGE_FIX = "the runs are merged into it: repair it or name a new file"  # a save_runs file read_results refuses


def run_key(r):
    """What names one run in a results file: its task, encoding, learning rate and seed."""
    return tuple(r[k] for k in RUN_KEYS)


def compact_runs(cells):
    """Each run's figures that the tables over seeds and per length are made of, one small dict a run (what a
    results file in the repository holds; the runs' own JSON in out_dir/runs/ has everything else), with where
    it was trained (commit, command, machine, date) where its record says."""
    keep = ('task', 'pos', 'dape', 'seed', 'learning_rate', 'id_score', 'score', 'device', 'id_per_length', 'per_length')
    out = []
    for c in cells.values():
        for r in c.get('runs', []):
            run = {k: r[k] for k in keep if k in r}
            run['variants'] = {v: x['score'] for v, x in r.get('variants', {}).items()}
            if 'train' in r:
                run['train_time_s'] = round(r['train']['time_s'], 1)
            run.update(r.get('trained', {}))
            if (r.get('dape_py') or {}).get('tag'):  # an edited f's runs (che_tasks.run_one)
                run['dape_tag'] = r['dape_py']['tag']
            out.append(run)
    return sorted(out, key=run_key)


def cells_from_runs(runs):
    """compact_runs' list back into cells, as seeds_table reads them."""
    cells = {}
    for r in runs:
        cell = cells.setdefault((r['task'], r['pos'], r['dape']), {'task': r['task'], 'pos': r['pos'],
                                                                    'dape': r['dape'], 'runs': []})
        cell['runs'].append(dict(r, variants={v: {'score': x} for v, x in r.get('variants', {}).items()}))
    return cells


def load_cells(path, option):
    """The cells (cells_from_runs) of the runs in a results file that save_runs wrote (read_results, as
    --`option`), and the file."""
    saved = read_results(path, option, "name a file that --save_runs wrote", keys=RUN_KEYS)
    return cells_from_runs(saved['runs']), saved


def check_selection(path, runs, tasks, columns, cfg):
    """A ValueError unless the results file `path` (its runs) holds a run of the tables' tasks, encodings and
    learning rates (else a table of its header only): what it holds, and which options select it."""
    if seed_rows(cells_from_runs(runs), tasks, columns, cfg):
        return
    held = (f"it holds tasks {', '.join(sorted({r['task'] for r in runs}))}; encodings (pos/dape) "
            f"{', '.join(sorted({r['pos'] + '/' + r['dape'] for r in runs}))}; learning rates "
            f"{', '.join(f'{lr:g}' for lr in sorted({r['learning_rate'] for r in runs}))}" if runs else
            "it holds no runs")
    raise ValueError(f"tables_from={path} holds no run of task {', '.join(tasks)}, encoding "
                     f"{', '.join(f'{p}/{d}' for p, d in columns)} at learning rate "
                     f"{', '.join(f'{lr:g}' for lr in parse_learning_rates(cfg))}: {held}; select those with --task, --pos, "
                     f"--dape and --learning_rate(s) (with --grid=True: --grid_tasks, --grid_pos, --grid_dape)")


def retest_tables(cells_a, cells_b, tasks, columns, cfg):
    """The test-retest (retest) of the runs of cells_a and cells_b, a run being its task, encoding, rate and seed:
    each run's OOD score; each DAPE-X against X of the tables over seeds in OOD and ID over every seed and in the
    share of seeds that learned."""
    key = lambda r: (r['seed'], r['learning_rate'])
    common_cells = {}
    for k in cells_a.keys() & cells_b.keys():
        seeds = {key(r) for r in cells_a[k]['runs']} & {key(r) for r in cells_b[k]['runs']}
        if seeds:
            common_cells[k] = tuple(dict(c, runs=[r for r in c['runs'] if key(r) in seeds]) for c in (cells_a[k], cells_b[k]))
    one = lambda i: {k: v[i] for k, v in common_cells.items()}
    rows_a, rows_b = seed_rows(one(0), tasks, columns, cfg), seed_rows(one(1), tasks, columns, cfg)
    if not rows_a:
        return 'no run of these tasks and encodings is in both files'
    several_rates = len(parse_learning_rates(cfg)) > 1
    label = lambda t, p, d, lr: (encoding_label(p, d) + (f" ({t})" if len(tasks) > 1 else '')
                                 + (f" lr {lr:g}" if several_rates else ''))
    runs, machines = [], []
    for (t, p, d, lr, ra, threshold), (*_, rb, _) in zip(rows_a, rows_b):
        for x, y in zip(ra, rb):
            runs.append((label(t, p, d, lr), x['seed'], x['score'], y['score'], is_learned(x, threshold),
                         is_learned(y, threshold)))
            machines.append((x.get('machine'), y.get('machine')))

    def tests(rows):  # a side's comparisons as its own table computes them
        by_key = {(t, p, d, lr): (rs, threshold) for t, p, d, lr, rs, threshold in rows}
        return [(k, base, [[cs[1]], [cs[2]], [dict(cs[3], shares=share_cell(by_key[k][0], by_key[base][0],
                                                                            by_key[k][1]))]])
                for k, base, cs in seed_comparisons(rows)]
    comparisons = [(f"{label(*k)} vs {label(*base)}", m, x, y)
                   for (k, base, ta), (_, _, tb) in zip(tests(rows_a), tests(rows_b))
                   for m, x, y in zip(('OOD, every seed', 'ID, every seed', 'share of seeds that learned'), ta, tb)]
    return retest(retest_sides(machines), runs, comparisons,
                  "its OOD score (%, the tables' OOD column: the mean accuracy over the test lengths beyond training; "
                  "n/a: not servable), learned as in the tables over seeds",
                  "each DAPE-X against X of the tables over seeds, in OOD and in ID accuracy over every seed and in "
                  "the share of seeds that learned, as that table computes it under each side (Holm over its "
                  "comparisons); the OOD score is already the mean over the lengths, and OOD over the seeds that "
                  "learned is left out, since which seeds learned is what a rounding moves")


# -----------------------------------------------------------------------------
# eval_passkey.py: the tables over seeds of exact match and of the log-likelihood per answer token, and the
# test-retest of its results files

def passkey_summary_table(rows, lens, metric, markdown=False):
    """All models: a row each, a column per length; the metric averaged over depths."""
    figure = lambda c: (c if isinstance(c, str) else
                        f"{100 * c['accuracy']:.0f}%" if metric == 'accuracy' else f"{c['logp_mean']:.3f}")
    return length_table(rows, lens, [('model', lambda r: r['label'])], lambda r, L: figure(r['per_length'][L]),
                        markdown)


# the two measures of every table over seeds: exact match, and the log-likelihood per answer token, the continuous
# one, so that no conclusion hangs on the threshold of exact match (or of 'learned'); what a run's figure can be
# (a log-likelihood is at most 0), and so where a mean's interval is cut; only exact match's range is finite, so
# only it bounds a difference
MEASURES = {'accuracy': 'exact match', 'logp_mean': 'log-likelihood per answer token'}
BOUNDS = {'accuracy': (0.0, 1.0), 'logp_mean': (-math.inf, 0.0)}
DIFFERENCE_BOUNDS = {'accuracy': (0.0, 1.0), 'logp_mean': None}


def group_text(metric, over):
    """What group_table's cells are, for its caption; over: which seeds."""
    agree = " (a single point where the seeds agree: nothing to estimate a spread from)"
    if metric == 'accuracy':
        return (f"Exact match, mean over depths: the mean over {over} with the 95% t interval of the mean, cut "
                f"to 0-100%{agree}")
    return (f"Log-likelihood per answer token (nats; chance {chance_logp_per_digit():.3f}), mean over depths: the "
            f"mean over {over} with the 95% t interval of the mean, cut at 0{agree}")


def group_table(groups, lens, metric, markdown=False):
    """The groups of seeds: a row each, a column per length; the metric's mean over seeds (of the per-seed means
    over depths) with the 95% t interval of that mean (mean_ci, cut to the possible range, BOUNDS;
    the mean alone for one seed, a single point where the seeds agree), and how many seeds learned the task at
    the training length, with the exact binomial interval of that share."""
    scale, fmt, unit = (100, '{:.0f}', '%') if metric == 'accuracy' else (1, '{:.3f}', '')

    def cell(c):
        if isinstance(c, str):
            return c
        if metric not in c:
            return 'n/a: not kept'
        return mean_ci_text(c[metric]['values'], BOUNDS[metric], lambda v: fmt.format(scale * v), unit)
    m = lambda g: g['measures'][metric]  # the seeds that have this measure: those its means are over
    first = [('model', lambda g: g['label']), ('seeds', lambda g: ','.join(str(s) for s in m(g)['seeds']) or 'none'),
             ('learned [95% interval]', lambda g: 'n/a' if m(g)['learned'] is None or not m(g)['n'] else
              k_of_n_text(m(g)['learned'], m(g)['n']))]
    return length_table(groups, lens, first, lambda g, L: cell(g['per_length'][L]), markdown)


def plot_groups(panels, lens, path):
    """The tables over seeds as curves against length: a column per results file (panels: [(title, group_rows'
    groups)]), a row per measure of MEASURES; per model the mean over its seeds with the 95% t interval of that mean
    as a band (group_table's figures: mean_ci cut to BOUNDS; the mean alone for one seed) and each seed's
    figure as a dot, the legend saying how many seeds learned. A model keeps its colour in every panel, so that two
    roundings read side by side.
    -> {(title, label, metric): [(L, mean, lo, hi)]}: what was drawn (percent for exact match)."""
    labels = list(dict.fromkeys(g['label'] for _, groups in panels for g in groups))
    fig, axes = new_figure(len(MEASURES), len(panels), (5.5 * len(panels) + 1, 8), sharex=True, sharey='row')
    drawn = {}
    for j, (title, groups) in enumerate(panels):
        for i, (metric, name) in enumerate(MEASURES.items()):
            ax, scale = axes[i][j], 100 if metric == 'accuracy' else 1
            for k, g in enumerate(groups):
                points, seeds = [], []
                for L in lens:
                    c = g['per_length'][L]
                    if isinstance(c, str) or metric not in c:
                        continue
                    values = c[metric]['values']
                    m, lo, hi = mean_ci(values, bounds=BOUNDS[metric]) or (float(np.mean(values)),) * 3
                    points.append((L, scale * m, scale * lo, scale * hi))
                    seeds += [(L, scale * v) for v in values]
                drawn[(title, g['label'], metric)] = points
                if not points:
                    continue
                x, m, lo, hi = map(list, zip(*points))
                color = f"C{labels.index(g['label']) % 10}"
                kept = g['measures'][metric]
                learned = '' if kept['learned'] is None else f", {kept['learned']} learned"
                ax.plot(x, m, marker='o', ms=3, lw=1.3, color=color, label=f"{g['label']} ({kept['n']} seeds{learned})")
                ax.fill_between(x, lo, hi, color=color, alpha=0.1, lw=0)
                # every seed's figure, each model's a little apart along the length, so that the distribution
                # (at this scale often two clusters, learned and not) shows beside its mean
                shift = 2 ** (0.05 * (k - (len(groups) - 1) / 2))
                ax.scatter([L * shift for L, _ in seeds], [v for _, v in seeds], s=12, color=color, alpha=0.6, lw=0)
            if metric == 'logp_mean':
                ax.axhline(chance_logp_per_digit(), color='gray', ls='--', lw=1, label='chance (a digit, not which)')
            multiples = length_axis(ax, lens, [g['block_size'] for g in groups])
            ax.set_title(f"{title}: {name}", fontsize=9)
            ax.legend(fontsize=7)
            if j == 0:
                ax.set_ylabel('exact match (%)' if metric == 'accuracy' else 'nats per answer token')
            if i == len(MEASURES) - 1:
                ax.set_xlabel('prompt length (tokens' + (', multiple of the training length)' if multiples else ')'))
    axes[0][0].set_ylim(-2, 102)
    fig.suptitle("passkey retrieval over seeds, per length: each seed's mean over depths (dots), their mean (line) "
                 "and its 95% t interval (band)", fontsize=10)
    save_figure(fig, path, 110)
    return drawn


def learned_at_training_length(row, learned_exact):
    """Whether a run retrieves at its own training length (exact match of at least learned_exact);
    None where that length was not evaluated."""
    c = row['per_length'].get(row['block_size'])
    return None if c is None or isinstance(c, str) else c['accuracy'] >= learned_exact


def group_rows(rows, lens, learned_exact):
    """Rows that differ only by their seed (the same 'setting') form a group (group_over_seeds):
    per length, the mean and sample std over its seeds of the exact match and the log-likelihood per
    token (each seed's figure the mean over depths), with `kept`, the members (indices) whose figures they are,
    and `learned`, how many seeds reach an exact match of learned_exact at their training length (None where
    that length was not evaluated). A results file may lack a measure for some runs (the log-likelihood of runs
    evaluated before it was kept): `measures` says, per measure, which seeds have it at some length and how many
    of those learned, the seeds a table of that measure is over."""
    def value(metric):
        def of(row, L):
            c = row['per_length'][L]
            return c if isinstance(c, str) else c.get(metric, 'n/a: not kept')
        return of
    setting = lambda r: r['setting']
    by_metric = {m: group_over_seeds(rows, setting, lens, value(m)) for m in ('accuracy', 'logp_mean')}
    groups = []
    for i, acc in enumerate(by_metric['accuracy']):
        members = acc['members']
        g = {'label': acc['label'], 'n': len(members), 'seeds': [m['seed'] for m in members],
             'rows': [m['label'] for m in members], 'block_size': members[0]['block_size'], 'per_length': {}}
        for L in lens:
            stats = {m: by_metric[m][i]['stats'][L] for m in by_metric}
            if stats['accuracy']['status'] != 'ok':  # no seed could be evaluated here: the first one's reason
                g['per_length'][L] = stats['accuracy']['status']
                continue
            g['per_length'][L] = {'n': stats['accuracy']['n']}
            for metric, st in stats.items():
                if st['status'] == 'ok':
                    kept = [j for j, m in enumerate(members) if not isinstance(value(metric)(m, L), str)]
                    g['per_length'][L][metric] = {'mean': st['mean'], 'std': st['std'], 'values': st['values'],
                                                  'kept': kept}
        flags = [learned_at_training_length(m, learned_exact) for m in members]
        g['learned_seeds'] = flags
        g['learned'] = None if any(f is None for f in flags) else sum(flags)
        g['measures'] = {}
        for metric in by_metric:
            kept = sorted({j for c in g['per_length'].values() if isinstance(c, dict) and metric in c
                           for j in c[metric]['kept']})
            g['measures'][metric] = {'seeds': [g['seeds'][j] for j in kept], 'n': len(kept),
                                     'learned': None if any(flags[j] is None for j in kept) else
                                     sum(flags[j] for j in kept)}
        groups.append(g)
    return groups


def label_parts(label):
    """A passkey table's setting label as dape_pairs reads it: 'dape-kerple-zero' is DAPE V1 ('dape') on
    'kerple' with f zero at step 0 (common.base_label spells the settings so)."""
    if not label.startswith(('dape-', 'dapev2-')):
        return label, 'none', (None,)
    dape, setting = label.removesuffix('-zero').split('-', 1)
    return setting, dape, ('zero' if label.endswith('-zero') else None,)


def compare_groups(groups, lens, metric='accuracy'):
    """DAPE-X against X per length, in one of MEASURES: the difference of their means with its 95% t interval
    (cut to the possible range for exact match, which lies in [0, 1]), Welch's p and the exact p
    (compare_means), over the seeds that learned retrieval at the training length and, apart, over every
    seed; and the exact p adjusted by Holm's method over all of them, the comparisons of one table (one per
    measure). Over the seeds that have the measure (group_rows' `measures`): `learned` counts those.
    -> [{label, baseline, metric, learned, learned_seeds: {L: comparison}, all_seeds: {L: comparison}, and for
    exact match learned_share: the share of seeds that learned, by compare_means of each seed's 1 or 0}]."""
    out = []
    by_label = {g['label']: g for g in groups}
    for a, b in ((by_label[x], by_label[y]) for x, y in dape_pairs(by_label, label_parts)):
        ma, mb = a['measures'][metric], b['measures'][metric]
        c = {'label': a['label'], 'baseline': b['label'], 'metric': metric,
             'learned': [ma['learned'], ma['n'], mb['learned'], mb['n']], 'learned_seeds': {}, 'all_seeds': {}}
        for L in lens:
            ca, cb = a['per_length'][L], b['per_length'][L]
            if isinstance(ca, str) or isinstance(cb, str) or ca['n'] < a['n'] or cb['n'] < b['n']:
                c['learned_seeds'][L] = c['all_seeds'][L] = {'status': 'n/a: not evaluated'}
                continue
            if metric not in ca or metric not in cb:
                c['learned_seeds'][L] = c['all_seeds'][L] = {'status': 'n/a: not kept'}
                continue
            va, vb = ca[metric]['values'], cb[metric]['values']
            # a value is a member's (kept), so that 'learned' is that seed's, not the one at its position
            learned = lambda g, c: [v for v, j in zip(c[metric]['values'], c[metric]['kept']) if g['learned_seeds'][j]]
            c['all_seeds'][L] = compare_means(va, vb, bounds=DIFFERENCE_BOUNDS[metric])
            c['learned_seeds'][L] = compare_means(learned(a, ca), learned(b, cb), bounds=DIFFERENCE_BOUNDS[metric])
        if metric == 'accuracy':  # the share of seeds that learned, by the same exact test on each seed's 1 or 0
            fa, fb = a['learned_seeds'], b['learned_seeds']
            c['learned_share'] = ({'status': 'n/a: not evaluated'} if any(f is None for f in fa + fb) else
                                  compare_means([float(f) for f in fa], [float(f) for f in fb], bounds=(0, 1)))
        out.append(c)
    holm_over(table_tests(out, lens))
    return out


def table_tests(comparisons, lens):
    """Every comparison of comparison_table, in its order: per pair, each length over the learned seeds and over
    all, then (exact match) the share of seeds that learned."""
    return [t for c in comparisons for t in [c[which][L] for which in ('learned_seeds', 'all_seeds') for L in lens]
            + ([c['learned_share']] if 'learned_share' in c else [])]


def learned_text(learned_exact):
    """The rule for 'learned' as a table states it, with the day the standing rule was set."""
    rule, since = LEARNED_RULES['passkey']
    when = (f"the rule since {since}" if learned_exact == rule else
            f"this evaluation's rule; the standing one, set on {since}, is {100 * rule:.0f}%")
    return (f"learned: seeds with an exact match of at least {100 * learned_exact:.0f}% at their training length "
            f"({when}), with the exact (Clopper-Pearson) 95% interval of the share of seeds")


def comparison_caption(comparisons, lens):
    """What comparison_table's cells are (the measure its comparisons were made in), and its tests
    (tests_caption)."""
    metric = comparisons[0]['metric']
    what = ("exact match in percentage points" if metric == 'accuracy' else
            "log-likelihood per answer token in nats (higher: the answer more likely)")
    share = f"; in the learned column of the row 'all', {SHARES_TEST}" if metric == 'accuracy' else ''
    return (f"DAPE-X minus X, {what}: the difference of the means ["
            + interval_text(bounded=DIFFERENCE_BOUNDS[metric] is not None) + "], Welch's two-sided p, the exact p and its Holm "
            "adjustment, over the seeds that learned retrieval at the training length (learned) and over every seed "
            f"(all){share}. " + tests_caption(table_tests(comparisons, lens)))


def comparison_table(comparisons, lens, markdown=False):
    """A row per DAPE-X against X and per set of seeds: the difference of the means, of exact match in
    percentage points [95% t interval cut to the possible range] or of log-likelihood in nats [95% t interval],
    Welch's p, the exact p and its Holm adjustment (compare_groups, one measure)."""
    def cell(c, metric):
        if c['status'] != 'ok':
            return c['status']
        scale, fmt = (100, '{:+.0f}') if metric == 'accuracy' else (1, '{:+.2f}')
        d = dict(c, diff=scale * c['diff'], ci=[scale * x for x in c['ci']])
        return f"{difference_text(d, fmt)}, p {p_text(c['p'])}, {exact_holm_text(c)}"
    rows = []
    for c in comparisons:
        for which, name in (('learned_seeds', 'learned'), ('all_seeds', 'all')):
            share = c.get('learned_share') if which == 'all_seeds' else None  # its test, in the row of every seed
            rows.append([f"{c['label']} - {c['baseline']}", name, shares_text(c['learned'], share)]
                        + [cell(c[which][L], c['metric']) for L in lens])
    return format_table(['DAPE-X minus X', 'seeds', 'learned'] + [str(L) for L in lens], rows, markdown)


def seed_tables(protocol, rows, lens, markdown=True):
    """The tables over seeds of a passkey.json's rows, as the results pages show them: per group the exact match
    and the log-likelihood per answer token (the mean with its interval, learned), DAPE-X against X in each, and
    every run's exact match."""
    groups = group_rows(rows, lens, protocol['learned_exact'])
    text = []
    for metric in MEASURES:
        # the caption names one set of seeds only where every model has it for this measure
        seed_sets = {tuple(g['measures'][metric]['seeds']) for g in groups}
        over = (f"seeds {','.join(map(str, next(iter(seed_sets))))}" if len(seed_sets) == 1
                else "each model's seeds with this measure (its seeds column)")
        learned = f"; {learned_text(protocol['learned_exact'])}" if metric == 'accuracy' else ''
        text += [f"{group_text(metric, over)}{learned}.", '', group_table(groups, lens, metric, markdown), '']
    for metric in MEASURES:
        comparisons = compare_groups(groups, lens, metric)
        if comparisons:
            text += [comparison_caption(comparisons, lens), '', comparison_table(comparisons, lens, markdown), '']
    text += ['Every run: exact match, mean over depths.', '', passkey_summary_table(rows, lens, 'accuracy', markdown)]
    return '\n'.join(text)


def read_passkey_results(path):
    """A passkey.json (as this script writes it, or the runs' figures alone: protocol with lengths and
    learned_exact, and rows with label, setting, seed, block_size and per-length accuracy) -> (protocol, rows)."""
    with open(path) as f:
        saved = json.load(f)
    return saved['protocol'], [dict(r, per_length={int(L): c for L, c in r['per_length'].items()})
                               for r in saved['rows']]


SAME_PROTOCOL = ('lengths', 'depths', 'trials', 'filler', 'seed', 'digits')  # what makes two runs' figures comparable


# -----------------------------------------------------------------------------
# the test-retest: the same runs trained under two roundings


def _by_run(rows, which):
    """{(setting, seed): row} of one file's rows: what pairs a run with its retest (the labels may differ between
    the files). A (setting, seed) twice is an error: its retest would be ambiguous."""
    out = {}
    for r in rows:
        k = (r['setting'], r['seed'])
        if k in out:
            raise InputError(f"--{which}: two runs of {k[0]} with seed {k[1]} ({out[k]['label']} and {r['label']}): "
                             f"keep one, so that each run has one counterpart under the other rounding")
        out[k] = r
    return out


def passkey_retest_tables(protocol, rows_a, rows_b, lens):
    """The test-retest (retest) of rows_a (--tables_from) and rows_b (--rounding_from), a run being its setting and
    seed: each run's exact match, the mean over the lengths both have; each comparison of compare_groups over every
    seed, in each of MEASURES at any length, and in the share of seeds that learned."""
    by_a, by_b = _by_run(rows_a, 'tables_from'), _by_run(rows_b, 'rounding_from')
    both = [k for k in by_a if k in by_b]  # in the first file's order: the groups of both come out alike
    if not both:
        return 'no run (setting and seed) is in both files'
    ra, rb = [by_a[k] for k in both], [by_b[k] for k in both]
    ga, gb = group_rows(ra, lens, protocol['learned_exact']), group_rows(rb, lens, protocol['learned_exact'])
    runs = []
    for g, h in zip(ga, gb):
        for s, fa, fb in zip(g['seeds'], g['learned_seeds'], h['learned_seeds']):
            x, y = by_a[(g['label'], s)], by_b[(g['label'], s)]
            at = [L for L in lens if all(isinstance(r['per_length'].get(L), dict) for r in (x, y))]
            mean = lambda r: 100 * np.mean([r['per_length'][L]['accuracy'] for L in at]) if at else None
            runs.append((g['label'], s, mean(x), mean(y), fa, fb))
    comparisons = []
    for metric, measure in MEASURES.items():
        for ca, cb in zip(compare_groups(ga, lens, metric), compare_groups(gb, lens, metric)):
            name = f"{ca['label']} vs {ca['baseline']}"
            comparisons.append((name, f"{measure}, every seed", *([c['all_seeds'][L] for L in lens] for c in (ca, cb))))
            if 'learned_share' in ca:
                shares = lambda c: dict(c['learned_share'], shares=shares_text(c['learned']))
                comparisons.append((name, 'share of seeds that learned', [shares(ca)], [shares(cb)]))
    return retest(retest_sides([(x.get('machine'), y.get('machine')) for x, y in zip(ra, rb)]), runs, comparisons,
                  f"its exact match (%), the mean over the lengths both sides have; {learned_text(protocol['learned_exact'])}",
                  f"DAPE-X against X over every seed in {' and in '.join(MEASURES.values())}, at any of the "
                  f"{len(lens)} lengths (a conclusion where the Holm p is below the level at some length, all such "
                  "of one sign), and in the share of seeds that learned, as its table computes it under each side "
                  "(Holm over that table); the comparisons over the seeds that learned are left out, since which "
                  "seeds learned is what a rounding moves")


def figure_from_files(paths, out):
    """plot_groups of results files (read_results; the lengths of the first), a column each, titled by its file and
    the kernels its runs were trained with."""
    panels, lens = [], None
    for path in paths:
        protocol, rows = read_passkey_results(path)
        lens = lens or protocol['lengths']
        kernels = kernels_of(r.get('machine') for r in rows)
        panels.append((os.path.basename(path) + ('' if kernels == 'unknown' else f" ({kernels} kernels)"),
                       group_rows(rows, protocol['lengths'], protocol['learned_exact'])))
    return plot_groups(panels, lens, out)


def retest_tables_from_files(path_a, path_b):
    """retest_tables of two results files (as tables_from_file reads them) that hold the same runs trained under two
    roundings; files evaluated with another protocol (SAME_PROTOCOL) are an error: their figures differ for
    reasons other than the rounding."""
    (pa, rows_a), (pb, rows_b) = read_passkey_results(path_a), read_passkey_results(path_b)
    differ = [k for k in SAME_PROTOCOL if pa.get(k) != pb.get(k)]
    if differ:
        raise InputError("--rounding_from: the two files were evaluated differently, "
                         + ', '.join(f"{k} {pa.get(k)!r} in {path_a} and {pb.get(k)!r} in {path_b}" for k in differ)
                         + ": a test-retest needs the same evaluation of both; evaluate them alike")
    return passkey_retest_tables(pa, rows_a, rows_b, pa['lengths'])
