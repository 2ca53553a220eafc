"""
What the evaluation scripts make of their runs (eval_extrapolate.py, eval_passkey.py, che_tasks.py, demo_report.py):
the statistics over seeds (mean and sample std, Welch's t-test and t interval, cut to the possible range for bounded
values, the exact permutation test, Holm's adjustment, the exact binomial interval of a count of seeds), the text of
their tables, and the test-retest of the same runs trained twice (under two roundings, or on two machines).
Library code: it reads no checkpoint and runs no model.
"""

import functools
import itertools
import math
import re

import numpy as np

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


def t_quantile(p, df):
    """The t distribution's quantile: t with P(T <= t) = p, for df > 0 degrees of freedom (fractional
    df as Welch-Satterthwaite gives), by bisection on the tail that betainc computes."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    tail = 2 * min(p, 1 - p)  # two-sided tail beyond |t|
    lo, hi = 0.0, 1.0
    while betainc(df / 2.0, 0.5, df / (df + hi * hi)) > tail:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if betainc(df / 2.0, 0.5, df / (df + mid * mid)) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    t = (lo + hi) / 2
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
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if betainc(a, b, mid) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15:
            break
    return (lo + hi) / 2


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
# the test-retest of the same runs trained under two roundings (ATen's vector kernels and
# ATEN_CPU_CAPABILITY=default): what che_tasks.py and eval_passkey.py report alike


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


def verdict(c, alpha=ALPHA):
    """A comparison as the pages state it: which side is ahead ('ahead', 'behind', 'level'), with '*' where
    Holm's exact p is below alpha (significance); its status where it has no test."""
    if c['status'] != 'ok':
        return c['status']
    ahead = 'ahead' if c['diff'] > 0 else 'behind' if c['diff'] < 0 else 'level'
    return ahead + ('*' if significance(c, alpha) else '')


def holds(ca, cb):
    """Whether a comparison's conclusion (verdict) is the same under two roundings: True or False, None where
    either has no test."""
    if not ca['status'] == cb['status'] == 'ok':
        return None
    return verdict(ca) == verdict(cb)


def verdict_counts(comparisons):
    """One pair's comparisons (e.g. one a test length) in a few words: 'ahead at 17, significantly at 2; behind
    significantly at 0' (significantly: Holm's exact p below ALPHA)."""
    cs = list(comparisons)
    return (f"ahead at {sum(c['status'] == 'ok' and c['diff'] > 0 for c in cs)}, "
            f"significantly at {sum(significance(c) == 'higher' for c in cs)}; behind "
            f"significantly at {sum(significance(c) == 'lower' for c in cs)}")


def holds_at(ca, cb, keys, name):
    """Where one pair's conclusions hold under both roundings, ca and cb {key: comparison} (e.g. per length
    `name`=key): (text 'at 15 of 17; not at N=51,61' or 'n/a' where no key has a test under both, how many
    hold, how many have a test under both)."""
    none = {'status': 'n/a: not evaluated'}  # a key one rounding's file lacks has no test under both
    ca, cb = {k: ca.get(k, none) for k in keys}, {k: cb.get(k, none) for k in keys}
    tested = [k for k in keys if holds(ca[k], cb[k]) is not None]
    other = [k for k in tested if not holds(ca[k], cb[k])]
    text = (f"at {len(tested) - len(other)} of {len(tested)}" + (f"; not at {name}={','.join(map(str, other))}" if other else '')
            if tested else 'n/a')
    return text, len(tested) - len(other), len(tested)
