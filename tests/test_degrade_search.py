"""degrade_search.py on small files of its own: a trial is what its evaluation's results.json recorded (nothing typed
in place of a missing record), one entry per trial name, and the tables' columns (the published file against the
trial writer: tests/test_published_tables.py)."""

import json

import pytest

import degrade_search
from degrade_search import UNRECORDED

TRAINED = {"commit": "abc1234", "command": "python train.py config/demo_cpu.py --pos=fire", "machine": "m",
           "date": "2026-12-01"}
EVALUATED = {"commit": "def5678", "command": "python eval_extrapolate.py out-search/fire", "machine": "m",
             "date": "2026-12-02"}


def evaluation(folder, trained_by=TRAINED, evaluated_by=EVALUATED, ppl_2x=7.7):
    """eval_extrapolate.py's results.json of one checkpoint evaluated with --far_mass=True, at 1x and 2x."""
    folder.mkdir(parents=True, exist_ok=True)
    run = {"model_args": {"pos": "fire", "block_size": 64, "n_head": 2}, "iter_num": 500, "seed": 1,
           "data_dir": "data/gutenberg_char", "results": {"64": {"ppl": 7.0}, "128": {"ppl": ppl_2x}},
           "far_mass": {"128": [[0.1, 0.3]]}, "far_mass_windows": 2, "head_values": [{"r1": [0.5, 1.0]}]}
    if trained_by is not None:
        run["trained_by"] = trained_by
    protocol = {"eval_tokens": 32, "num_windows": 2, "seed": 1337,
                "data": {"data/gutenberg_char": {"window_ends": [900, 4000]}}}
    if evaluated_by is not None:
        protocol["evaluated_by"] = evaluated_by
    (folder / "results.json").write_text(json.dumps({"protocol": protocol, "lengths": [64, 128], "runs": [run]}))
    return str(folder)


def test_a_trial_is_what_its_evaluation_recorded(tmp_path):
    """The training's provenance from the checkpoint's record, the evaluation's from the protocol, the bytes it
    scored (eval_tokens of each window, the evaluation seed, the windows' ends), in the writer's fields."""
    t = degrade_search.trial_of(evaluation(tmp_path), "fire", "FIRE instead of Kerple")
    assert tuple(t) == degrade_search.FIELDS
    assert t["trained_by"] == TRAINED and t["evaluated_by"] == EVALUATED
    assert (t["scored_tokens"], t["eval_seed"], t["window_ends"]) == (32 * 2, 1337, [900, 4000])
    assert t["ppl"] == {"64": 7.0, "128": 7.7} and (t["iters"], t["seed"], t["pos"]) == (500, 1, "fire")


def test_what_a_run_did_not_record_is_written_unrecorded(tmp_path):
    """A checkpoint older than train.py's record (common.trained_by gives 'unknown'), an evaluation without
    `evaluated_by`, a field left empty: each written 'unrecorded', and the command line takes no values to
    put in their place."""
    unknown = dict.fromkeys(degrade_search.PROVENANCE, "unknown")
    t = degrade_search.trial_of(evaluation(tmp_path / "a", unknown, None), "old", "none")
    assert t["trained_by"] == t["evaluated_by"] == dict.fromkeys(degrade_search.PROVENANCE, UNRECORDED)
    t = degrade_search.trial_of(evaluation(tmp_path / "b", dict(TRAINED, date=""), None), "old", "none")
    assert t["trained_by"] == dict(TRAINED, date=UNRECORDED)
    for typed in ("--commit=f207690", "--train_command=python train.py"):
        with pytest.raises(SystemExit, match="usage"):
            degrade_search.main([f"--add_trial={tmp_path / 'a'}", f"--search={tmp_path / 's.json'}", "--name=old",
                                 "--changes=none", typed])


def test_a_rerun_replaces_its_trial_and_the_tables_show_each(tmp_path):
    """--add_trial keeps one entry per trial name (a rerun replaces it where it stands) and writes the file's
    'what'; --search_from prints the ratios to 1x on the same bytes, the mean mass beyond the training length
    at each multiple with the largest head at the longest, and where each trial came from."""
    path = str(tmp_path / "search.json")
    for name, ppl_2x in (("fire", 21.0), ("kerple", 7.1), ("fire", 7.7)):
        degrade_search.main([f"--add_trial={evaluation(tmp_path / name, ppl_2x=ppl_2x)}", f"--search={path}",
                             f"--name={name}", "--changes=x"])
    with open(path) as f:
        saved = json.load(f)
    assert saved["what"] == degrade_search.WHAT and [t["name"] for t in saved["trials"]] == ["fire", "kerple"]
    text = degrade_search.main([f"--search_from={path}"])
    lines = text.splitlines()
    assert lines[0] == "| trial | changes | ppl at 1x | 2x / 1x |" and "| fire | x | 7.000 | 1.100 |" in lines
    assert "| fire | 2 | 0.200 | 0.300 | r1 0.5 to 1 |" in lines
    assert "| fire | 500, abc1234, 2026-12-01 | def5678, 2026-12-02 | 64 (32 of 2 windows) | 1337 |" in lines


def test_the_tables_have_a_column_for_every_multiple_of_any_trial():
    """Trials evaluated at different lengths: the header has every multiple that any trial reached, and a trial
    without it shows '-' there."""
    def trial(name, ppl):
        return {"name": name, "changes": "x", "block_size": 64, "ppl": ppl, "iters": 500,
                "far_mass": {L: [[0.1, 0.2]] for L in ppl if L != "64"}, "head_values": [{"r1": [1.0, 0.2]}],
                "trained_by": TRAINED, "evaluated_by": EVALUATED, "scored_tokens": 64, "eval_tokens": 32,
                "num_windows": 2, "eval_seed": 1337}
    text = degrade_search.search_tables({"trials": [trial("short", {"64": 7.0, "128": 7.7}),
                                                    trial("long", {"64": 7.0, "128": 7.7, "1024": 14.0})]})
    lines = text.splitlines()
    assert lines[0] == "| trial | changes | ppl at 1x | 2x / 1x | 16x / 1x |"
    assert "| short | x | 7.000 | 1.100 | - |" in lines and "| long | x | 7.000 | 1.100 | 2.000 |" in lines
    assert "| short | 2 | 0.150 | - | 0.200 | r1 0.2 to 1 |" in lines
