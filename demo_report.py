"""
The CPU demo's report: the README section between the demo-results markers (the primary test, the setting, the
perplexity table and the plot) and docs/demo_results.md (the rest of the same run, then the whole study's), made
from the runs' files alone.

    python demo_report.py results/demo --minutes=18 --models=20    # what demo.sh runs: the report of this run,
                                                                    # into results/demo/ and on the screen
    python demo_report.py results/demo --publish                   # into README.md, docs/ and docs/results/demo/
                                                                    # (a --full run's: docs/results/demo-full/)
    python demo_report.py --tables_from=docs/results/demo          # what is published, printed again

A run writes only under its results directory: meta.json (when, where, which commit, how long), report.md
(the README section and the page as they would be published) and nothing tracked by git. Publishing is a
separate, explicit step, refused when it would drop rows the run published in its place has (fewer models,
fewer seeds): a newcomer's first `bash demo.sh` leaves the repository as it found it.

The primary test comes first, whatever it is: the one comparison docs/demo_setting.md registered before the
headline's runs (PRIMARY: DAPE-FIRE against FIRE at 16x the training length, seeds 1 to 5 a side, the exact
permutation test of the difference of the mean perplexities, unadjusted). Every other comparison is secondary,
in Holm families: each DAPE-X against X pair's lengths, and the pairs' rises (each seed's perplexity at the
longest length over its own at the first); a family whose smallest Holm p cannot fall below 0.05 is called a
description. Every figure in the text comes from the run's files: the machine, the date, the commit, the
training steps and the seeds, the perplexity and bits-per-byte tables (mean ± sample std over seeds), the
differences with their 95% intervals, Welch's p and the exact permutation test's p, computed here from the seeds'
perplexities, and observations computed from the numbers; beside them, the paper's Table 5, cited as published.
"""

import json
import math
import os
import platform
import shutil
import sys

from common import machine_text, provenance
from results import (ALPHA, compare_means, difference_text, exact_holm_text, format_table, holm_over, length_table,
                     mean_ci, mean_std_text, p_text, permutation_test, retest, retest_sides, significance)

ROOT = os.path.dirname(os.path.abspath(__file__))
START, END = "<!-- demo-results:start -->", "<!-- demo-results:end -->"
# The headline's primary test as docs/demo_setting.md registered it before its runs: DAPE-FIRE against FIRE at 16x
# the training length, the difference of the mean perplexities over seeds 1 to 5 a side, the exact two-sided
# permutation test at ALPHA without adjustment
PRIMARY, PRIMARY_MULTIPLE, PRIMARY_SEEDS = ("dape-fire", "fire"), 16, [1, 2, 3, 4, 5]
DEFAULT_SEEDS = 5  # demo.sh's --seeds when none is given

PAPER_TABLE_5 = """| method (paper, 125M, Arxiv, BPE, trained at 512) | 512 | 1024 | 2048 | 4096 | 8192 |
| --- | --- | --- | --- | --- | --- |
| RoPE | 4.58 | 45.20 | 134.16 | 222.33 | 265.45 |
| ALiBi | 4.61 | 4.55 | 4.87 | 5.03 | 4.77 |
| Kerple | 4.58 | 4.35 | 5.44 | 8.75 | 13.35 |
| DAPE-Kerple | 4.51 | 4.17 | 4.05 | 4.00 | 3.86 |"""


def machine():
    return f"{machine_text('cpu')}, {os.cpu_count()} cores, {platform.system()}"


def table(results, key, fmt):
    """A row per group of seeds (a row per run where each has one seed): the mean ± sample std."""
    first = [("model", lambda g: g["label"])]
    if any(g["n"] > 1 for g in results["groups"]):
        first.append(("seeds", lambda g: str(g["n"])))
    stat = lambda s: s["status"] if s["status"] != "ok" else mean_std_text(s["mean"], s["std"], fmt)
    return length_table(results["groups"], results["lengths"], first, lambda g, L: stat(g[key][str(L)]), True)


def exact_tests(results):
    """The exact permutation test of DAPE-X against X at each length where the evaluation made Welch's, from the
    seeds' perplexities in the groups (results files written before the evaluation kept it have them too), with
    the exact p adjusted by Holm's method within each pair's family of lengths; the primary test's cell
    (primary_length) is a family of its own, unadjusted, as docs/demo_setting.md registers it.
    -> {(label, baseline): {length: {status, n_a, n_b, p_exact, p_min, exact, p_holm[, primary]}}}."""
    groups = {g["label"]: g for g in results["groups"]}
    out = {}
    for c in results["comparisons"]:
        key = (c["label"], c["baseline"])
        tests = out.setdefault(key, {})
        for L in results["lengths"]:
            if c["p_value"][str(L)]["status"] == "ok":
                a, b = (groups[label]["ppl"][str(L)]["values"] for label in key)
                test = permutation_test(a, b)
                tests[L] = {"status": "ok", "n_a": len(a), "n_b": len(b), "p_exact": test["p"],
                            "p_min": test["p_min"], "exact": test["exact"]}
        primary = primary_length(results) if key == PRIMARY else None
        if primary in tests:
            tests[primary].update(primary=True, p_holm=tests[primary]["p_exact"])
        holm_over([t for L, t in tests.items() if L != primary])
    return out


def primary_length(results):
    """The primary test's length (PRIMARY_MULTIPLE times its baseline's training length), where the run has its pair
    over the registered seeds; else None (its comparison then stays in its pair's family)."""
    groups = {g["label"]: g for g in results["groups"]}
    if not all(label in groups and groups[label]["seeds"] == PRIMARY_SEEDS for label in PRIMARY):
        return None
    return PRIMARY_MULTIPLE * groups[PRIMARY[1]]["block_size"]


def families_caption(tests, alpha=ALPHA):
    """What the exact p and its Holm adjustment are in pvalue_table, the smallest p each pair of seed counts
    allows, and which families cannot reach alpha (their comparisons are descriptions)."""
    sizes = sorted({(t["n_a"], t["n_b"], t["p_min"]) for pair in tests.values() for t in pair.values()})
    floors = ", ".join(f"{p:.2g} with {na} and {nb} seeds" for na, nb, p in sizes)
    weak = [f"{a} vs {b}" for (a, b), pair in tests.items()
            if pair and len([t for t in pair.values() if not t.get("primary")]) * min(
                t["p_min"] for t in pair.values()) >= alpha]
    text = ("p: Welch's t-test; exact: the two-sided permutation test over every split of the seeds between the "
            "two sides; Holm: the exact p adjusted by Holm's method within each pair's family of lengths"
            + (" (the primary test's cell, registered before the run, is a family of its own and unadjusted)"
               if any(t.get("primary") for pair in tests.values() for t in pair.values()) else "")
            + f". Smallest possible exact p: {floors}.")
    if weak:
        text += (f" No comparison of {', '.join(weak)} can reach a Holm p below {alpha:g}: "
                 f"{'that family is a description' if len(weak) == 1 else 'those families are descriptions'}.")
    return text


def rise_tests(results):
    """Each seed's perplexity at the longest length over its own at the first (the rise), DAPE-X against X for
    every pair with two seeds or more a side: the difference of the mean rises with its 95% interval (Welch),
    the exact permutation test, and Holm's adjustment over the pairs (one family).
    -> [compare_means of the rises, with label, baseline, rise_a and rise_b (mean, lo, hi) and p_holm]."""
    groups = {g["label"]: g for g in results["groups"]}
    first, last = results["lengths"][0], results["lengths"][-1]
    out = []
    for c in results["comparisons"]:
        a, b = (seed_rises(groups[label], first, last) for label in (c["label"], c["baseline"]))
        if len(a) >= 2 and len(b) >= 2:
            out.append(dict(compare_means(a, b), label=c["label"], baseline=c["baseline"], rise_a=mean_ci(a),
                            rise_b=mean_ci(b)))
    holm_over(out)
    return [r for r in out if r["status"] == "ok"]


def rise_table(results, rises, alpha=ALPHA):
    """rise_tests as a table, with its caption; '' where no pair has two seeds a side."""
    if not rises:
        return ""
    first, last = results["lengths"][0], results["lengths"][-1]
    ci = lambda m: f"{m[0]:.3f} [{m[1]:.3f}, {m[2]:.3f}]"
    table = format_table(["DAPE-X vs X", f"DAPE-X's {last} / {first}", "X's", "difference", "p"],
                         [[f"{r['label']} vs {r['baseline']}", ci(r["rise_a"]), ci(r["rise_b"]),
                           difference_text(r, "{:+.3f}"), f"{r['p']:.3g} ({exact_holm_text(r)})"] for r in rises],
                         markdown=True)
    reachable = len(rises) * min(r["p_min"] for r in rises) < alpha
    return (table + f"\n\nEach seed's perplexity at {last} over its own at {first}, mean and 95% interval "
            f"over seeds; the difference with its Welch interval and Welch's p; the exact permutation test, and its "
            f"Holm adjustment over the {len(rises)} pair{'s' if len(rises) != 1 else ''} (one family)."
            + ("" if reachable else f" No comparison of this family can reach a Holm p below {alpha:g}: it is a "
               f"description."))


def primary_text(results, tests, alpha=ALPHA, docs="docs/"):
    """The registered primary test's result in one paragraph, whatever it is; where the run has its pair over
    other seeds, a sentence saying that it does not carry the test; None where it lacks the pair."""
    groups = {g["label"]: g for g in results["groups"]}
    if not all(label in groups for label in PRIMARY):
        return None
    where = (f"[docs/demo_setting.md]({docs}demo_setting.md#the-headlines-primary-test-registered-before-its-runs)")
    L = primary_length(results)
    if L is None or L not in tests.get(PRIMARY, {}):
        seeds = " and ".join(", ".join(map(str, groups[label]["seeds"])) for label in PRIMARY)
        return (f"The primary test registered in {where} ({PRIMARY[0]} against {PRIMARY[1]} at {PRIMARY_MULTIPLE}x "
                f"the training length, seeds {PRIMARY_SEEDS[0]} to {PRIMARY_SEEDS[-1]} a side) is not this run's: "
                f"it has seeds {seeds}, so that comparison stays in its pair's family below.")
    cell = tests[PRIMARY][L]
    (p,) = [c["p_value"][str(L)] for c in results["comparisons"] if (c["label"], c["baseline"]) == PRIMARY]
    a, b = (groups[label]["ppl"][str(L)]["mean"] for label in PRIMARY)
    which = (("lower" if p["mean_diff"] < 0 else "higher") + ", significant" if cell["p_exact"] < alpha else
             "not significantly different")
    return (f"**The primary test** (registered in {where} before the runs): {PRIMARY[0]} minus {PRIMARY[1]} at {L} "
            f"bytes ({PRIMARY_MULTIPLE}x the training length), the mean perplexity over seeds {PRIMARY_SEEDS[0]} to "
            f"{PRIMARY_SEEDS[-1]} a side: {a:.3f} against {b:.3f}, difference {p['mean_diff']:+.3f} "
            f"[{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] (95% Welch interval), exact two-sided permutation p = "
            f"{p_text(cell['p_exact'])} (the smallest that {cell['n_a']} against {cell['n_b']} seeds allow: "
            f"{p_text(cell['p_min'])}): {PRIMARY[0]} {which} at {alpha:g}.")


def tested(results):
    """The comparisons with a test at some length (a single seed on either side leaves a length without one)."""
    return [c for c in results["comparisons"] if any(p["status"] == "ok" for p in c["p_value"].values())]


def pvalue_table(results, tests):
    """Per length, DAPE-X against X, for every pair with a test at any length: Welch's two-sided p, and in
    brackets the exact p and its Holm adjustment (exact_tests)."""
    def p_cell(c, L):
        p, exact = c["p_value"][str(L)], tests[(c["label"], c["baseline"])].get(L)
        if p["status"] != "ok":
            return p["status"]
        return f"{p['p']:.3g} ({exact_holm_text(exact)})"
    return length_table(tested(results), results["lengths"],
                        [("DAPE-X vs X", lambda c: f"{c['label']} vs {c['baseline']}")], p_cell, True)


def difference_table(results):
    """DAPE-X's mean perplexity minus X's per length with its 95% confidence interval, for the pairs of
    pvalue_table (negative: DAPE lower)."""
    difference = lambda p: difference_text(dict(p, diff=p.get("mean_diff")), "{:+.3f}")
    return length_table(tested(results), results["lengths"],
                        [("DAPE-X minus X", lambda c: f"{c['label']} - {c['baseline']}")],
                        lambda c, L: difference(c["p_value"][str(L)]), True)


def significance_text(comparison, tests, alpha=ALPHA):
    """The significant lengths with their direction, by the exact p adjusted by Holm's method over the table
    (common.significance of exact_tests' figures; Welch's p can go below what a few seeds support): 'DAPE lower,
    Holm p < 0.05, at k of n lengths; higher at m' (n: the lengths with a test). A difference in DAPE's
    disfavour is counted apart, never with the lengths where it is lower."""
    exact = tests[(comparison["label"], comparison["baseline"])]
    found = [significance(dict(exact[int(L)], diff=p["mean_diff"]), alpha)
             for L, p in comparison["p_value"].items() if p["status"] == "ok"]
    if not found:
        return None
    return (f"DAPE lower, Holm-adjusted exact p < {alpha:g}, at {found.count('lower')} of {len(found)} lengths; "
            f"DAPE higher, Holm p < {alpha:g}, at {found.count('higher')} of {len(found)}")


def ppl_by_label(results):
    """{label: [mean perplexity or None at each evaluation length]} of an eval_extrapolate results.json."""
    return {g["label"]: [g["ppl"][str(L)].get("mean") for L in results["lengths"]] for g in results["groups"]}


def seed_rises(group, first, last):
    """Each seed's perplexity at length `last` over its own at `first`; [] where the group lacks the seeds'
    values at either."""
    a, b = (group["ppl"][str(L)].get("values") or [] for L in (first, last))
    return [y / x for x, y in zip(a, b)] if len(a) == len(b) else []


def seed_ratio(group, first, last):
    """seed_rises' (mean, lo, hi) of the 95% CI over seeds, or None with fewer than two seeds that have both."""
    return mean_ci(seed_rises(group, first, last))


def observations(results):
    """Sentences stating what the numbers show, for the paper's qualitative claims."""
    lengths = results["lengths"]
    ppl = ppl_by_label(results)
    tests = exact_tests(results)
    first, last = lengths[0], lengths[-1]
    notes = []
    for g in results["groups"]:
        values = ppl[g["label"]]
        if values[0] and values[-1]:
            note = (f"{g['label']}: {values[0]:.3f} at {first} (the training length), {values[-1]:.3f} at {last} "
                    f"({values[-1] / values[0]:.3f}x)")
            ratio = seed_ratio(g, first, last)
            if ratio:
                note += (f"; per seed, {last} over {first}: {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}] "
                         f"(mean, 95% CI over {g['n']} seeds)")
            notes.append(note)
    # the evaluation's own pairs: DAPE-X with X, and DAPE-X with f zero at step 0 with X and with DAPE-X
    for c in results["comparisons"]:
        dape_label, base = c["label"], c["baseline"]
        pairs = [(d, b) for d, b in zip(ppl[dape_label], ppl[base]) if d and b]
        note = f"{dape_label} below {base} at {sum(d < b for d, b in pairs)} of {len(pairs)} lengths"
        signed = significance_text(c, tests)
        if signed:
            note += f" (mean over seeds); {signed}"
        notes.append(note)
    return "\n".join(f"- {n}" for n in notes)


def md_sections(path, titles):
    """The Markdown sections of `path` whose '## ' titles start with one of `titles`, their bodies only."""
    with open(path) as f:
        text = f.read()
    out = []
    for part in text.split("\n## ")[1:]:
        title, _, body = part.partition("\n")
        if any(title.startswith(t) for t in titles):
            out.append(f"{title}:\n\n{body.strip()}")
    return "\n\n".join(out)


def rope_section(results_dir, has_plot):
    """RoPE read with PI, NTK-aware and YaRN beside Kerple, DAPE-Kerple and ALiBi, and the loss by position
    (has_plot: docs/ shows its plot)."""
    path = os.path.join(results_dir, "rope_scaling", "results.json")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        results = json.load(f)
    lengths = results["lengths"]
    ppl = ppl_by_label(results)
    best = min(ppl, key=lambda k: ppl[k][-1] or float("inf"))
    notes = [f"{label}: {v[-1]:.3f} at {lengths[-1]} ({v[-1] / v[0]:.2f}x its value at {lengths[0]})"
             for label, v in ppl.items() if v[0] and v[-1]]
    notes.append(f"lowest at {lengths[-1]}: {best}")
    plain = next((run for run in results["runs"]
                  if run["model_args"]["pos"] == "rope" and run.get("rope_scaling", "none") == "none"), None)
    if plain is not None:
        below = [label for label in ppl
                 if label.startswith(plain["label"] + "+") and ppl[label][-1] < ppl[plain["label"]][-1]]
        notes.append(f"below plain RoPE at {lengths[-1]}: {', '.join(below) or 'none of the three readings'}")
        turns = plain["model_args"]["block_size"] / (2 * math.pi)
        beta = results["protocol"].get("yarn_beta")
        # YaRN keeps the frequency of dimensions that turn more than beta times over the training length.
        if beta is not None and turns < beta:
            notes.append(f"RoPE's fastest dimension turns {turns:.1f} times over the training length, fewer than "
                         f"YaRN's beta = {beta:g} (its default was chosen for LLaMA's training length): at this length "
                         f"YaRN interpolates every dimension at least in part, as PI does")
    seeds = sorted({run["seed"] for run in results["runs"]})
    runs = (f"one run a row, seed {seeds[0]}" if len(seeds) == 1 else
            f"one run a row, seeds {', '.join(map(str, seeds))}")
    figure = ""
    if has_plot:
        figure = ("\n\n![loss by position in the longest windows](demo_loss_by_position.png)\n\n"
                  "Mean loss at each position of the longest windows (log-spaced buckets; dotted: the training "
                  "length): where past the training length each model starts to lose the thread.")
    return f"""

**RoPE context extension at evaluation** (`eval_extrapolate.py --rope_scaling=none,pi,ntk,yarn`, s = L / training
length at each length; the same RoPE checkpoint read four ways, without the fine-tuning at the longer length that PI
and YaRN are used with in their papers; NTK-aware scaling was proposed for use without it), beside Kerple,
DAPE-Kerple and ALiBi; {runs}, so no row is a mean over seeds; perplexity per byte:

{table(results, 'ppl', '{:.3f}')}

{chr(10).join('- ' + n for n in notes)}{figure}"""


def passkey_section(results_dir):
    """The passkey tables, from eval_passkey.py's passkey.md."""
    path = os.path.join(results_dir, "passkey", "passkey.md")
    if not os.path.exists(os.path.join(results_dir, "passkey", "passkey.json")):
        return ""
    with open(os.path.join(results_dir, "passkey", "passkey.json")) as f:
        pk = json.load(f)
    proto = pk["protocol"]
    block = pk["rows"][0]["block_size"]
    lines = []
    for row in pk["rows"]:
        logp = [row["per_length"][str(L)]["logp_mean"] for L in proto["lengths"] if str(L) in row["per_length"]]
        above = sum(v > proto["chance_logp_per_digit"] + 0.05 for v in logp)
        at_train = row["per_length"].get(str(row["block_size"]), {}).get("accuracy")
        beyond = [row["per_length"][str(L)]["accuracy"] for L in proto["lengths"]
                  if L > row["block_size"] and str(L) in row["per_length"]]
        at_train_text = "" if at_train is None else f"{100 * at_train:.0f}% at the training length, "
        note = (f"{row['label']}: exact match {at_train_text}"
                f"{100 * max(beyond, default=0):.0f}% at best beyond it; log-likelihood per digit above chance "
                f"({proto['chance_logp_per_digit']:.2f}) by more than 0.05 at {above} of {len(logp)} lengths")
        if at_train is not None and at_train < proto["learned_exact"]:
            # A model that cannot retrieve at its own length says nothing about extrapolation.
            note += " (not learned at the training length, so the longer lengths do not test extrapolation)"
        lines.append(note)
    models = sorted({row["pos"] for row in pk["rows"]})
    return f"""

**Passkey retrieval** (`eval_passkey.py`, Mohtashami & Jaggi 2023): "The pass key is NNNNN. Remember it." hidden
at depths {', '.join(map(str, proto['depths']))} of held-out text, then "What is the pass key? The pass key is";
{proto['trials']} samples per length and depth. The prompt does not fit in the perplexity models'
training length, so the demo trains a passkey model of its own ({', '.join(models)}, one seed) at {block} bytes
with `--passkey_frac` of the training rows replaced by passkey samples (filler from the training books):
retrieval past {block} bytes tests extrapolation alone, here of RoPE read plainly and with PI, NTK-aware and
YaRN (s = L / {block}). At this budget Kerple and DAPE-Kerple do not learn retrieval reliably, even at their
training length; a setting in which they do, and what was tried, are in
[docs/passkey_results.md](passkey_results.md).

{md_sections(path, ('Exact match', 'Log-likelihood'))}

{chr(10).join('- ' + n for n in lines)}"""


SAVED = ("results.json", "meta.json", "rope_scaling/results.json", "passkey/passkey.json", "passkey/passkey.md")
PUBLISHED = os.path.join("docs", "results", "demo")  # the headline's run; a --full run's beside it, in PUBLISHED-full


def write_meta(results_dir, minutes=None, models=None):
    """RESULTS_DIR/meta.json: when and where the run was made, by which commit, how long it took."""
    if not os.path.isfile(os.path.join(results_dir, "results.json")):
        sys.exit(f"no {results_dir}/results.json: eval_extrapolate.py --out_dir={results_dir} writes it (demo.sh runs both)")
    plot = os.path.join(results_dir, "rope_scaling", "loss_by_position.png")
    meta = dict(provenance("python demo_report.py " + results_dir), machine=machine(), minutes=minutes, models=models,
                loss_by_position_plot=os.path.exists(plot))
    with open(os.path.join(results_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def dropped_rows(results_dir, published):
    """What publishing results_dir over the study in `published` would lose: its labels that the run lacks or
    has fewer seeds of, and its RoPE-scaling and passkey parts. Empty where nothing would be lost."""
    if not os.path.isfile(os.path.join(published, "results.json")):
        return []
    with open(os.path.join(published, "results.json")) as f:
        old = {g["label"]: g["n"] for g in json.load(f)["groups"]}
    with open(os.path.join(results_dir, "results.json")) as f:
        new = {g["label"]: g["n"] for g in json.load(f)["groups"]}
    lost = [f"{label} (not in this run)" for label in old if label not in new]
    lost += [f"{label} ({old[label]} seeds, this run {new[label]})" for label in old if label in new and new[label] < old[label]]
    lost += [f"{part} (not in this run)" for part in ("rope_scaling/results.json", "passkey/passkey.json")
             if os.path.exists(os.path.join(published, part)) and not os.path.exists(os.path.join(results_dir, part))]
    return lost


def save(results_dir, target):
    """Copy what the tables are made of into target (the files of SAVED that the run wrote), replacing the
    published run's there, and the plots into docs/: the perplexity plot of the headline (target PUBLISHED), the
    loss by position of a --full run."""
    saved = os.path.join(ROOT, target)
    tmp = saved + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in SAVED:
        if os.path.exists(os.path.join(results_dir, name)):
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            shutil.copyfile(os.path.join(results_dir, name), os.path.join(tmp, name))
    shutil.rmtree(saved, ignore_errors=True)
    os.replace(tmp, saved)
    if target == PUBLISHED:
        shutil.copyfile(os.path.join(results_dir, "ppl_vs_length.png"), os.path.join(ROOT, "docs", "demo_ppl_vs_length.png"))
    plot = os.path.join(results_dir, "rope_scaling", "loss_by_position.png")
    if os.path.exists(plot):
        shutil.copyfile(plot, os.path.join(ROOT, "docs", "demo_loss_by_position.png"))
    return saved


def study(saved, docs=""):
    """The texts of one run from the files save() wrote (docs: the path from the page to docs/, "" on a page in
    docs/, "docs/" in the README): {results, meta, full, command, measured (its setting in a paragraph), ppl (its
    perplexity table), primary (the registered primary test's paragraph, or None), body (the rest: bits per
    byte, the tests by family, the rises, observations, the paper's table, RoPE scaling and passkey)}."""
    with open(os.path.join(saved, "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(saved, "meta.json")) as f:
        meta = json.load(f)
    args = results["runs"][0]["model_args"]
    iters = sorted({run["iter_num"] for run in results["runs"]})
    protocol = results["protocol"]
    seeds = max(g["n"] for g in results["groups"])
    several = [g["label"] for g in results["groups"] if g["n"] > 1]
    counts = sorted({g["n"] for g in results["groups"] if g["n"] > 1}, reverse=True)
    of = "; ".join(f"{n} seeds of {', '.join(g['label'] for g in results['groups'] if g['n'] == n)}" for n in counts)
    ones = [g["label"] for g in results["groups"] if g["n"] == 1]
    seeds_text = (of + (", one of the others" if ones else "") + "; tables give the mean ± sample std over seeds"
                  if several else "one seed each")
    full = os.path.exists(os.path.join(saved, "rope_scaling", "results.json"))  # only --full reads RoPE four ways
    command = "bash demo.sh" + (" --full" if full else "") + ("" if seeds == DEFAULT_SEEDS else f" --seeds={seeds}")
    pairs = tested(results)
    sizes = sorted({(g["n"]) for c in pairs for g in results["groups"] if g["label"] in (c["label"], c["baseline"])})
    tests = exact_tests(results)
    exact = [t for pair in tests.values() for t in pair.values()]
    rises = rise_tests(results)
    pvalues = (f"""

DAPE-X against X on the per-seed perplexities, two-sided p ({' or '.join(map(str, sizes))} seeds a side): Welch's
t-test, and in brackets the exact permutation test and its Holm adjustment:

{pvalue_table(results, tests)}

{families_caption(tests)}

DAPE-X's mean perplexity minus X's, with the 95% confidence interval of the difference (Welch-Satterthwaite;
negative: DAPE lower):

{difference_table(results)}""" if pairs else "")
    rise = f"\n\nThe rise, DAPE-X against X:\n\n{rise_table(results, rises)}" if rises else ""
    floors = sorted({round(t['p_min'], 12) for t in exact}, reverse=True)
    floor = f"{floors[0]:.2g}" if len(floors) == 1 else f"{floors[0]:.2g} for some and {floors[-1]:.2g} for others"
    scope = (f"with {' or '.join(map(str, sizes))} seeds of the pairs that carry the claim, so that the exact test's "
             f"p cannot go below {floor} (Welch's can, by assuming normal errors)" if exact else
             f"with {seeds} seeds of some models but no DAPE-X and X both over several, so no p-value" if several else
             f"with one seed, so no p-value can be computed (`bash demo.sh` runs {DEFAULT_SEEDS})")
    took = ("" if meta["minutes"] is None or meta["models"] is None else
            f" This run trained {meta['models']} model{'s' if meta['models'] != 1 else ''} and took {meta['minutes']} "
            f"min from start to end on that machine (a model an earlier run trained is reused, not counted).")
    measured = f"""Measured by `{command}` at commit {meta['commit']} on {meta['date']}: {meta['machine']}.{took}
Byte-level models on `gutenberg_char` (validation: two held-out books), {args['n_layer']} layers,
{args['n_head']} heads, {args['n_embd']} wide, trained at length {args['block_size']} for
{', '.join(map(str, iters))} steps, {seeds_text}. Evaluation: the paper's protocol, the last
{protocol['eval_tokens']} bytes of {protocol['num_windows']} windows per length scored, the same bytes at every length."""
    body = f"""Bits per byte:

{table(results, 'bpb', '{:.4f}')}{pvalues}{rise}

What these numbers show (computed by `demo_report.py` from the perplexity table and the comparisons above):

{observations(results)}

For comparison, the paper's Table 5 (mean of 3 seeds; subword perplexity, so the scale differs):

{PAPER_TABLE_5}

What a CPU-scale run does and does not reproduce: the models are far smaller than the paper's 125M,
trained for minutes on bytes rather than days on BPE tokens, {scope}; absolute perplexities
and the size of the gaps are not comparable. It does test the qualitative claims (a static encoding
degrading past its training length, DAPE-X at or below X), with every model seeing the same scored bytes;
where the list above disagrees with the paper, that is the result of this run, not tuned away.{
rope_section(saved, meta["loss_by_position_plot"])}{passkey_section(saved)}"""
    return {"results": results, "meta": meta, "full": full, "command": command, "measured": measured,
            "ppl": table(results, "ppl", "{:.3f}"), "primary": primary_text(results, tests, docs=docs), "body": body}


def render(saved):
    """The README section and docs/demo_results.md from the files save() wrote. A whole study kept beside the
    headline (SAVED-full, as demo.sh writes results/demo and results/demo-full) follows on the page with its own
    tests."""
    head = study(saved, docs="docs/")
    whole = saved.rstrip(os.sep) + "-full"
    whole = None if head["full"] or not os.path.isfile(os.path.join(whole, "results.json")) else study(whole)
    rest = (f"; the whole study (`{whole['command']}`) after it" if whole else
            ", RoPE context extension and passkey retrieval from the same run" if head["full"] else
            " (`bash demo.sh --full` adds DAPE V2, ALiBi, RoPE, FoX and PaTH with and without DAPE, RoPE context "
            "extension and passkey retrieval)")
    primary = f"{head['primary']}\n\n" if head["primary"] else ""
    section = f"""{START}
## Results: the CPU demo

{primary}{head['measured']}

Perplexity per byte:

{head['ppl']}

![perplexity against evaluation length, one colour per model](docs/demo_ppl_vs_length.png)

Perplexity on a log axis against the evaluation length (log2 axis, with its multiple of the training
length); when some curves rise past twice the best perplexity, the right panel zooms on the others.

Bits per byte, DAPE-X against X (the difference with its confidence interval, Welch's and the exact p), the
rise, what the numbers show, the paper's Table 5 beside them{rest}: [docs/demo_results.md](docs/demo_results.md).
{END}"""
    again = study(saved)["primary"]
    page = f"""# The CPU demo: the rest of its results

Written by `demo_report.py` from the same run as the README's [Results: the CPU
demo](../README.md#results-the-cpu-demo), which gives the setting, the perplexity table and the plot.

{f"{again}{chr(10)}{chr(10)}" if again else ""}{head['measured']}

{head['body']}
"""
    if whole:
        page += f"""
## The whole study

{f"{whole['primary']}{chr(10)}{chr(10)}" if whole['primary'] else ""}{whole['measured']}
Its tests are its own families, apart from the headline's.

Perplexity per byte:

{whole['ppl']}

{whole['body']}
"""
    return section, page


def is_published(results_dir):
    """Whether results_dir lies in docs/results/, where what is published is kept."""
    published = os.path.realpath(os.path.join(ROOT, "docs", "results"))
    return os.path.realpath(results_dir).startswith(published + os.sep)


def report(results_dir, minutes=None, models=None):
    """What demo.sh runs: the run's meta.json, and report.md (the README section and the page as they would be
    published), both in results_dir; prints them. Changes no file outside results_dir. meta.json is the run's
    provenance: written by the run's own report (demo.sh gives --minutes and --models) or where there is none,
    never rewritten by a later report of the same directory."""
    if is_published(results_dir):
        sys.exit(f"{results_dir} is a published study: print its report with python demo_report.py "
                 f"--tables_from={results_dir} (a report writes into the directory it reads)")
    if minutes is not None or models is not None or not os.path.isfile(os.path.join(results_dir, "meta.json")):
        write_meta(results_dir, minutes, models)
    section, page = render(results_dir)
    text = f"{section}\n\n{page}"
    with open(os.path.join(results_dir, "report.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"\nwrote {results_dir}/meta.json and report.md; to publish this run into README.md, docs/ and "
          f"{PUBLISHED}/: python demo_report.py {results_dir} --publish")
    return text


def publish(results_dir):
    """The README section, docs/demo_results.md, the plots and the run's files: a headline run's into PUBLISHED, a
    --full run's into PUBLISHED-full (the page renders both), unless that would drop rows of the run published
    there."""
    if not os.path.isfile(os.path.join(results_dir, "results.json")):
        sys.exit(f"no {results_dir}/results.json: eval_extrapolate.py --out_dir={results_dir} writes it (demo.sh runs both)")
    full = os.path.exists(os.path.join(results_dir, "rope_scaling", "results.json"))
    target = PUBLISHED + "-full" if full else PUBLISHED
    lost = dropped_rows(results_dir, os.path.join(ROOT, target))
    if lost:
        sys.exit(f"--publish refused: {results_dir} would drop what {target}/ publishes: {'; '.join(lost)}. "
                 f"Run the same study (bash demo.sh{' --full' if full else ''}, with as many --seeds) and publish "
                 f"its results directory, or, to replace the study on purpose, git rm -r {target} first")
    if is_published(results_dir):
        sys.exit(f"--publish: {results_dir} is already published (print it with --tables_from={results_dir})")
    readme_path = os.path.join(ROOT, "README.md")
    with open(readme_path) as f:
        readme = f.read()
    if START not in readme or END not in readme:
        sys.exit(f"README.md has no {START} ... {END} section to replace")
    plot = os.path.join(results_dir, "ppl_vs_length.png")
    if not full and not os.path.isfile(plot):
        sys.exit(f"--publish: no {plot}, the README's plot: evaluate the run again with eval_extrapolate.py "
                 f"--out_dir={results_dir} --plot=True")
    if not os.path.isfile(os.path.join(results_dir, "meta.json")):
        write_meta(results_dir)
    # rendered from the run's files, which save copies as they are: a file the texts need that is missing or
    # unreadable stops here, before docs/ changes
    render(results_dir)
    save(results_dir, target)
    headline = os.path.join(ROOT, PUBLISHED)
    section, page = render(headline if os.path.isfile(os.path.join(headline, "results.json")) else
                           os.path.join(ROOT, target))
    head, rest = readme.split(START, 1)
    tail = rest.split(END, 1)[1]
    for path, text in ((readme_path, head + section + tail), (os.path.join(ROOT, "docs", "demo_results.md"), page)):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    print(f"README.md (its results section) and docs/demo_results.md rewritten from {target}/, copied from "
          f"{results_dir}; plots in docs/")


def tables_from(saved):
    """What main() writes, printed from a saved run: the README section, then docs/demo_results.md."""
    if not os.path.isfile(os.path.join(saved, "results.json")):
        sys.exit(f"--tables_from: no {saved}/results.json (demo_report.py RESULTS_DIR writes docs/results/demo/)")
    section, page = render(saved)
    text = f"{section}\n\n{page}"
    print(text)
    return text


def rounding_tables(native, other):
    """The test-retest (results.retest) of the same models trained and evaluated under two roundings (a machine's
    own vector kernels and ATen's default ones): each run's perplexity at the longest length; each DAPE-X against X
    pair both files have, by the exact tests of its family of lengths (exact_tests)."""
    lengths = [L for L in native["lengths"] if L in other["lengths"]]
    groups = [{g["label"]: g for g in results["groups"]} for results in (native, other)]
    machines = [{(r["label"], r["seed"]): r.get("trained_by", {}).get("machine") for r in results["runs"]}
                for results in (native, other)]
    at_last = lambda g: dict(zip(g["seeds"], g["ppl"][str(lengths[-1])].get("values") or []))
    runs, sides = [], []
    for label, g in groups[0].items():
        h = groups[1].get(label, {"seeds": []})
        for seed in [s for s in g["seeds"] if s in h["seeds"]]:
            runs.append((label, seed, at_last(g).get(seed), at_last(h).get(seed), None, None))
            sides.append(tuple(m.get((label, seed)) for m in machines))
    exact = [exact_tests(native), exact_tests(other)]
    tests = lambda i, c: [dict(exact[i][(c["label"], c["baseline"])][L], diff=c["p_value"][str(L)]["mean_diff"],
                               ci=c["p_value"][str(L)]["ci"]) if c["p_value"][str(L)]["status"] == "ok"
                          else c["p_value"][str(L)] for L in lengths]
    comparisons = [(f"{c['label']} vs {c['baseline']}", "perplexity", tests(0, c), tests(1, d))
                   for c in native["comparisons"] for d in other["comparisons"]
                   if (c["label"], c["baseline"]) == (d["label"], d["baseline"])]
    return retest(retest_sides(sides), runs, comparisons,
                  f"its perplexity at the longest length, {lengths[-1]}",
                  f"each DAPE-X against X pair in perplexity at any of the {len(lengths)} lengths, by the exact "
                  "tests of its family of lengths (Holm within the pair's lengths; the registered primary test's "
                  "cell unadjusted)", fmt="{:+.3f}", run_fmt="{:.3f}")


USAGE = ("usage: python demo_report.py [RESULTS_DIR] [--minutes=M --models=N]   (the run's report)\n"
         "       python demo_report.py RESULTS_DIR --publish                    (into README.md and docs/)\n"
         "       python demo_report.py --tables_from=docs/results/demo\n"
         "       python demo_report.py --rounding_from=FILE --against=docs/results/demo-full/results.json")


def main(argv):
    """The command line; returns what it printed."""
    options = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    flags = [a for a in argv if a.startswith("--") and "=" not in a]
    positional = [a for a in argv if not a.startswith("--")]
    alone = {"tables_from"} & set(options)
    rounding = {"rounding_from", "against"}
    if (set(options) - {"minutes", "models", "tables_from"} - rounding
            or set(flags) - {"--publish"} or len(positional) > 1
            or (alone and (len(options) > 1 or flags or positional)) or (flags and options)
            or (rounding & set(options) and (set(options) != rounding or flags or positional))):
        sys.exit(USAGE)
    if "rounding_from" in options:
        with open(options["against"]) as f, open(options["rounding_from"]) as g:
            text = rounding_tables(json.load(f), json.load(g))
        print(text)
        return text
    if "tables_from" in options:
        return tables_from(options["tables_from"])
    if flags:
        return publish(positional[0] if positional else "results/demo")
    return report(positional[0] if positional else "results/demo",
                  *(int(options[k]) if k in options else None for k in ("minutes", "models")))


if __name__ == "__main__":
    main(sys.argv[1:])
