"""
The search for a setting where a static encoding degrades past its training length (docs/demo_setting.md): one
trial per change of the demo's setting, each a checkpoint trained by train.py and evaluated by
eval_extrapolate.py --far_mass=True, recorded from the evaluation's results directory into one file, whose
tables this script prints.

    python degrade_search.py --add_trial=out-search/eval/NAME --search=docs/results/degrade_search.json \\
        --name=NAME --changes=TEXT                                   # record a trial (a rerun replaces it)
    python degrade_search.py --search_from=docs/results/degrade_search.json    # the search's tables

A trial is what the evaluation's results.json holds and nothing typed by hand but its name and the words
for its change: where its training and its evaluation came from (commit, command, machine, date; the
training's as train.py recorded it in the checkpoint), the bytes it scored (how many, the evaluation seed,
the windows' ends), its perplexity at every length, the attention mass each head puts beyond the training
length and what the encoding learned per head. A field the run did not record is written UNRECORDED.
"""

import json
import os
import sys

from results import write_json

UNRECORDED = "unrecorded"
PROVENANCE = ("commit", "command", "machine", "date")
# every field a trial has, in the order it is written: tests/test_published_tables.py holds the published
# file to exactly these
FIELDS = ("name", "changes", "pos", "block_size", "n_head", "iters", "seed", "trained_by", "evaluated_by",
          "eval_tokens", "num_windows", "scored_tokens", "eval_seed", "window_ends", "lengths", "ppl",
          "far_mass", "far_mass_windows", "head_values")
WHAT = ("The search for a setting of config/demo_cpu.py where a static encoding degrades past its training "
        "length (docs/demo_setting.md): one trial per change, each trained by train.py and evaluated by "
        "eval_extrapolate.py --max_length=4096 --num_windows=64 --far_mass=True (the same last K bytes of 64 "
        "windows at every length, K half the training length; the attention mass beyond the training length "
        "over the scored queries of the first far_mass_windows windows), and recorded from the evaluation's "
        "results directory by python degrade_search.py --add_trial: each trial's training and evaluation "
        f"provenance are the runs' own records ('{UNRECORDED}' where a run recorded none). Printed by "
        "python degrade_search.py --search_from=docs/results/degrade_search.json")


def recorded(record):
    """A run's {commit, command, machine, date} as it recorded them; a field it did not record (absent, empty,
    or 'unknown' as common.trained_by writes for checkpoints older than the record) is UNRECORDED."""
    record = record if isinstance(record, dict) else {}
    value = lambda v: v if isinstance(v, str) and v.strip() and v != "unknown" else UNRECORDED
    return {k: value(record.get(k)) for k in PROVENANCE}


def trial_of(results_dir, name, changes):
    """One trial from its evaluation's results.json (one checkpoint, evaluated with --far_mass=True)."""
    with open(os.path.join(results_dir, "results.json")) as f:
        res = json.load(f)
    if len(res["runs"]) != 1:
        sys.exit(f"--add_trial: {results_dir}/results.json holds {len(res['runs'])} runs; a trial is one checkpoint")
    (run,) = res["runs"]
    if "far_mass" not in run:
        sys.exit(f"--add_trial: {results_dir} was evaluated without --far_mass=True")
    protocol = res["protocol"]
    ends = protocol.get("data", {}).get(run["data_dir"], {}).get("window_ends", UNRECORDED)
    trial = {"name": name, "changes": changes, "pos": run["model_args"]["pos"],
             "block_size": run["model_args"]["block_size"], "n_head": run["model_args"]["n_head"],
             "iters": run["iter_num"], "seed": run["seed"], "trained_by": recorded(run.get("trained_by")),
             "evaluated_by": recorded(protocol.get("evaluated_by")), "eval_tokens": protocol["eval_tokens"],
             "num_windows": protocol["num_windows"],
             # which bytes were scored: enough to score the same ones again, or to tell two trials' apart
             "scored_tokens": protocol["eval_tokens"] * protocol["num_windows"],
             "eval_seed": protocol.get("seed", UNRECORDED), "window_ends": ends, "lengths": res["lengths"],
             "ppl": {str(L): run["results"][str(L)]["ppl"] for L in res["lengths"]},
             "far_mass": run["far_mass"], "far_mass_windows": run["far_mass_windows"],
             "head_values": run["head_values"]}
    assert tuple(trial) == FIELDS
    return trial


def add_trial(search_path, trial):
    """Add the trial to the search file (a rerun replaces the trial of its name where it stands), written whole or
    not at all."""
    search = {"what": WHAT, "trials": []}
    if os.path.exists(search_path):
        with open(search_path) as f:
            search = json.load(f)
    search["what"] = WHAT
    names = [t["name"] for t in search["trials"]]
    if trial["name"] in names:
        search["trials"][names.index(trial["name"])] = trial
    else:
        search["trials"].append(trial)
    write_json(search_path, search)


def heads(t, L):
    """The attention mass beyond the training length of every head of every layer at length L."""
    return [v for layer in t["far_mass"][str(L)] for v in layer]


def search_tables(search):
    """The search's tables: the perplexity at each multiple of the training length over its value at 1x (the
    same scored bytes at every length); the attention mass beyond the training length at each multiple (the
    mean over all heads of all layers, and the largest head at the longest) with what the heads learned; and
    where each trial came from and which bytes it scored."""
    trials = search["trials"]
    multiples = sorted({int(L) // t["block_size"] for t in trials for L in t["ppl"]})[1:]
    at = lambda t, m: str(m * t["block_size"])
    ppl = ["| trial | changes | ppl at 1x | " + " | ".join(f"{m}x / 1x" for m in multiples) + " |",
           "| --- " * (len(multiples) + 3) + "|"]
    for t in trials:
        base = t["ppl"][str(t["block_size"])]
        ratio = lambda m: f"{t['ppl'][at(t, m)] / base:.3f}" if at(t, m) in t["ppl"] else "-"
        ppl.append(f"| {t['name']} | {t['changes']} | {base:.3f} | " + " | ".join(ratio(m) for m in multiples) + " |")
    mass = ["| trial | heads | " + " | ".join(f"{m}x" for m in multiples)
            + " | largest head at the longest | learned values per head, lowest to highest |",
            "| --- " * (len(multiples) + 4) + "|"]
    for t in trials:
        longest = max(int(L) for L in t["far_mass"])
        mean = lambda m: f"{sum(heads(t, at(t, m))) / len(heads(t, at(t, m))):.3f}" if at(t, m) in t["far_mass"] \
            else "-"
        values = {}
        for layer in t["head_values"]:
            for k, v in layer.items():
                if k != "bias_at":
                    values.setdefault(k, []).extend(v)
        learned = ", ".join(f"{k} {min(v):.3g} to {max(v):.3g}" for k, v in values.items()
                            if len(v) == len(heads(t, longest))) or "none per head"
        mass.append(f"| {t['name']} | {len(heads(t, longest))} | " + " | ".join(mean(m) for m in multiples)
                    + f" | {max(heads(t, longest)):.3f} | {learned} |")
    origin = ["| trial | trained: steps, commit, date | evaluated: commit, date | scored bytes a length | "
              "evaluation seed |", "| --- " * 5 + "|"]
    for t in trials:
        tb, eb = t["trained_by"], t["evaluated_by"]
        origin.append(f"| {t['name']} | {t['iters']}, {tb['commit']}, {tb['date']} | {eb['commit']}, {eb['date']} | "
                      f"{t['scored_tokens']} ({t['eval_tokens']} of {t['num_windows']} windows) | {t['eval_seed']} |")
    return "\n".join(ppl) + "\n\n" + "\n".join(mass) + "\n\n" + "\n".join(origin)


USAGE = ("usage: python degrade_search.py --search_from=docs/results/degrade_search.json\n"
         "       python degrade_search.py --add_trial=EVAL_DIR --search=FILE --name=NAME --changes=TEXT")


def main(argv):
    """The command line; returns what it printed."""
    options = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if len(options) != len(argv) or set(options) not in ({"search_from"}, {"add_trial", "search", "name", "changes"}):
        sys.exit(USAGE)
    if "search_from" in options:
        with open(options["search_from"]) as f:
            text = search_tables(json.load(f))
        print(text)
        return text
    t = trial_of(options["add_trial"], options["name"], options["changes"])
    add_trial(options["search"], t)
    print(f"added {t['name']} to {options['search']}")
    return ""


if __name__ == "__main__":
    main(sys.argv[1:])
