"""The demo (demo.sh) end to end in smoke mode, in a copy of the repository, and its README report."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_repo(dst):
    for name in os.listdir(ROOT):
        src = os.path.join(ROOT, name)
        if name.endswith((".py", ".sh", ".md", ".txt")):
            shutil.copy(src, dst)
    for folder in ("config", "data"):
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(dst, folder),
                        ignore=shutil.ignore_patterns("*.bin", "meta.json", "raw", "__pycache__"))


def counts_of(stdout):
    """The progress lines' counts ('[4/11'), each once, in order. Two runs that finish together take counts
    apart but may print them in either order, so the order printed is not the test."""
    counts = [line.split("]")[0].strip() for line in stdout.splitlines() if re.match(r"\s*\[\d+/\d+\]", line)]
    return sorted(counts, key=lambda c: int(c[1:].split("/")[0]))


def snapshot(root):
    """{path: bytes} of the repository's own files in the copy (what git would track): what a run must not touch."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.split(os.sep)[0] in ("results", "out-demo-smoke", "__pycache__") or "raw" in rel.split(os.sep):
            continue
        for name in filenames:
            if not name.endswith((".bin", ".pyc")) and name != "meta.json" or rel.startswith("docs"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    out[os.path.join(rel, name)] = f.read()
    return out


def test_demo_smoke_runs_end_to_end(tmp_path):
    copy_repo(tmp_path)
    env = dict(os.environ, DEMO_SKIP_INSTALL="1", PYTHON=sys.executable)
    before_runs = snapshot(tmp_path)
    # the headline: Kerple, DAPE-Kerple, FIRE and DAPE-FIRE with every seed
    run = subprocess.run(["bash", "demo.sh", "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "training 8 models, 2 at a time" in run.stdout and "done in" in run.stdout
    assert counts_of(run.stdout) == [f"[{k}/8" for k in range(1, 9)], counts_of(run.stdout)
    assert "about 0 min of training left" in run.stdout and "training the passkey model" not in run.stdout
    head = tmp_path / "results" / "demo-smoke"
    results = json.loads((head / "results.json").read_text())
    labels = ["kerple", "dape-kerple", "fire", "dape-fire"]
    assert [(g["label"], g["n"]) for g in results["groups"]] == [(l, 2) for l in labels]
    assert [(c["label"], c["baseline"]) for c in results["comparisons"]] == [("dape-kerple", "kerple"),
                                                                           ("dape-fire", "fire")]
    assert not (head / "rope_scaling").exists() and not (head / "passkey").exists()
    # the run's report is in its results directory, and no file of the repository changed
    assert "Measured by `bash demo.sh --seeds=2`" in (head / "report.md").read_text()
    assert "python demo_report.py results/demo-smoke --publish" in run.stdout
    assert json.loads((head / "meta.json").read_text())["models"] == 8

    # --full: the rest of the study, reusing the headline's models
    run = subprocess.run(["bash", "demo.sh", "--smoke", "--full"], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "training 34 models, 2 at a time" in run.stdout and run.stdout.count(", resume)") == 8
    # the headline's models were trained to the end: counted, but not in the time per model
    headline = [f"{name}_s{k}" for name in ("kerple", "dape_kerple", "fire", "dape_fire") for k in (1, 2)]
    assert sorted(line.split()[2] for line in run.stdout.splitlines() if "] reused " in line) == sorted(headline)
    assert counts_of(run.stdout) == [f"[{k}/35" for k in range(1, 36)], counts_of(run.stdout)
    assert "[35/35] done  passkey_rope_s1 in" in run.stdout
    res = tmp_path / "results" / "demo-smoke-full"
    for name in ("results.json", "results.md", "results.csv", "ppl_vs_length.png"):
        assert (res / name).stat().st_size > 0, name
    results = json.loads((res / "results.json").read_text())
    labels = ["kerple", "dape-kerple", "fire", "dape-fire", "dapev2-kerple", "alibi", "rope", "fox", "dape-fox", "path",
              "dape-path", "path_fox", "dape-path_fox", "dape-kerple-zero", "nope+sb", "dape-nope+sb", "kerple+logn",
              "dape-kerple+logn"]
    several = [label for label in labels if label not in ("alibi", "rope")]
    assert [r["label"] for r in results["runs"]] == [l for l in labels for _ in range(2 if l in several else 1)]
    assert [(g["label"], g["n"]) for g in results["groups"]] == [(l, 2 if l in several else 1) for l in labels]
    inits = {r["label"]: r["model_args"].get("dape_init") for r in results["runs"]
             if r["label"] in ("dape-kerple", "dape-kerple-zero")}
    assert inits == {"dape-kerple": "default", "dape-kerple-zero": "zero"}
    # DAPE-X against X: every pair has two seeds a side, so a p-value at every length
    assert [(c["label"], c["baseline"]) for c in results["comparisons"]] == [
        ("dape-kerple", "kerple"), ("dape-fire", "fire"), ("dapev2-kerple", "kerple"), ("dape-fox", "fox"), ("dape-path", "path"),
        ("dape-path_fox", "path_fox"), ("dape-kerple-zero", "kerple"), ("dape-kerple-zero", "dape-kerple"),
        ("dape-nope+sb", "nope+sb"), ("dape-kerple+logn", "kerple+logn")]
    assert all(p["status"] == "ok" for c in results["comparisons"] for p in c["p_value"].values())
    assert results["lengths"] == [16, 32, 64, 128, 256]  # 1x .. 16x the training length
    for run_ in results["runs"]:
        assert all(run_["results"][str(L)]["ppl"] > 1 for L in results["lengths"])
    scaling = json.loads((res / "rope_scaling" / "results.json").read_text())
    assert [r["label"] for r in scaling["runs"]][:4] == ["rope", "rope+pi(s=L/16)", "rope+ntk(s=L/16)",
                                                          "rope+yarn(s=L/16)"]
    assert (res / "rope_scaling" / "loss_by_position.png").stat().st_size > 0
    passkey = json.loads((res / "passkey" / "passkey.json").read_text())
    assert [r["label"] for r in passkey["rows"]][:2] == ["passkey_rope_s1", "passkey_rope_s1+pi(s=L/128)"]

    # a re-run reuses the data and the finished checkpoints (the headline's eight: --full above showed that a
    # finished model of the other list is resumed too)
    again = subprocess.run(["bash", "demo.sh", "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already prepared" in again.stdout and again.stdout.count(", resume)") == 8
    assert counts_of(again.stdout) == [f"[{k}/8" for k in range(1, 9)], counts_of(again.stdout)
    assert again.stdout.count("] reused ") == 8 and "min of training left" not in again.stdout
    log = (tmp_path / "out-demo-smoke" / "logs" / "dape_kerple_s2.log").read_text()
    assert "iter 4:" in log.split("resumed from")[0] and log.count("resumed from") == 2  # appended, not replaced

    # nothing that the repository tracks changed: publishing is a step of its own
    assert snapshot(tmp_path) == before_runs
    # the README section and docs/demo_results.md are rewritten from results.json, and nothing else; this
    # repository's published runs are replaced on purpose (git rm -r), as the refusal below says
    readme = tmp_path / "README.md"
    before = readme.read_text()
    subprocess.run([sys.executable, "demo_report.py", str(res), "--minutes=7", "--models=27"], cwd=tmp_path,
                   check=True, capture_output=True)
    assert readme.read_text() == before and "This run trained 27 models and took 7 min" in (res / "report.md").read_text()
    for published in ("demo", "demo-full"):
        shutil.rmtree(tmp_path / "docs" / "results" / published, ignore_errors=True)
    for run_dir in (head, res):
        subprocess.run([sys.executable, "demo_report.py", str(run_dir), "--publish"], cwd=tmp_path, check=True,
                       capture_output=True)
    after = readme.read_text()
    # outside the section nothing changes: the first command line gives the demo's measured time
    assert before.split("<!-- demo-results:start -->")[0] == after.split("<!-- demo-results:start -->")[0]
    assert before.split("<!-- demo-results:end -->")[1] == after.split("<!-- demo-results:end -->")[1]
    section = after.split("<!-- demo-results:start -->")[1]
    # the README gives the headline: the registered primary test's sentence first (seeds 1 and 2 do not carry it)
    assert section.split("\n\n")[1].startswith("The primary test registered in")
    assert "Measured by `bash demo.sh --seeds=2`" in section and "the whole study (`bash demo.sh --full --seeds=2`)" in section
    kerple = next(g for g in json.loads((head / "results.json").read_text())["groups"] if g["label"] == "kerple")
    assert f"| kerple | 2 | {kerple['ppl']['16']['mean']:.3f} ± {kerple['ppl']['16']['std']:.3f} |" in section
    assert "| fire | 2 |" in section and "| fox |" not in section
    assert "docs/demo_ppl_vs_length.png" in section and "docs/demo_results.md" in section
    page = (tmp_path / "docs" / "demo_results.md").read_text()
    headline_page, whole = page.split("\n## The whole study\n")
    p = results["comparisons"][0]["p_value"]["16"]
    assert f"| dape-kerple vs kerple | {p['p']:.3g} (exact " in whole and "| dape-fox vs fox |" in whole
    assert f"| dape-kerple - kerple | {p['mean_diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] |" in whole
    assert "| dape-fox vs fox |" not in headline_page and "| dape-fire vs fire |" in headline_page
    assert "DAPE lower, Holm-adjusted exact p < 0.05, at" in page and "below kerple at" in page
    assert "with 2 seeds of the pairs" in page and "three seeds" not in page and "runs three" not in page
    assert "Measured by `bash demo.sh --full --seeds=2`" in whole and "This run trained 27 models and took 7 min" in whole
    assert (tmp_path / "docs" / "demo_ppl_vs_length.png").exists()
    assert "RoPE context extension at evaluation" in whole and "Passkey retrieval" in whole
    assert (tmp_path / "docs" / "demo_loss_by_position.png").exists()
    # what they are made of is kept in docs/results/demo/ and demo-full/, from which --tables_from prints them again
    saved = tmp_path / "docs" / "results"
    assert sorted(str(p.relative_to(saved)) for d in ("demo", "demo-full") for p in (saved / d).rglob("*")
                  if p.is_file()) == [
        "demo-full/meta.json", "demo-full/passkey/passkey.json", "demo-full/passkey/passkey.md",
        "demo-full/results.json", "demo-full/rope_scaling/results.json", "demo/meta.json", "demo/results.json"]
    again = subprocess.run([sys.executable, "demo_report.py", "--tables_from=docs/results/demo"], cwd=tmp_path,
                           check=True, capture_output=True, text=True).stdout
    written = "<!-- demo-results:start -->" + section.split("<!-- demo-results:end -->")[0] + "<!-- demo-results:end -->"
    assert again == f"{written}\n\n{page}\n"
    # a run with fewer rows than the one published in its place would drop them: refused, nothing written
    published = snapshot(tmp_path)
    fewer = tmp_path / "results" / "fewer"
    shutil.copytree(head, fewer)
    data = json.loads((fewer / "results.json").read_text())
    data["groups"] = [g for g in data["groups"] if g["label"] != "fire"]
    (fewer / "results.json").write_text(json.dumps(data))
    refused = subprocess.run([sys.executable, "demo_report.py", str(fewer), "--publish"], cwd=tmp_path,
                             capture_output=True, text=True)
    assert refused.returncode == 1 and "--publish refused" in refused.stderr, refused.stderr
    assert "fire (not in this run)" in refused.stderr and "git rm -r docs/results/demo first" in refused.stderr
    assert snapshot(tmp_path) == published


def test_demo_and_its_report_refuse_bad_arguments(tmp_path):
    for args, message in ((["--seeds=0"], "--seeds must be a positive integer, got '0'"),
                          (["--fast"], "unknown argument '--fast'")):
        run = subprocess.run(["bash", os.path.join(ROOT, "demo.sh"), *args], capture_output=True, text=True,
                             env=dict(os.environ, DEMO_SKIP_INSTALL="1"))
        assert run.returncode == 2 and message in run.stderr, run.stderr
    run = subprocess.run([sys.executable, os.path.join(ROOT, "demo_report.py"), str(tmp_path), "--minute=3"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.startswith("usage: python demo_report.py"), run.stderr
    run = subprocess.run([sys.executable, os.path.join(ROOT, "demo_report.py"), str(tmp_path)], capture_output=True,
                         text=True)
    assert run.returncode == 1 and run.stderr.startswith(f"no {tmp_path}/results.json: eval_extrapolate.py"), run.stderr
    run = subprocess.run([sys.executable, os.path.join(ROOT, "demo_report.py"), f"--tables_from={tmp_path}"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.startswith(f"--tables_from: no {tmp_path}/results.json"), run.stderr


def _comparison(pvalues):
    """eval_extrapolate's comparison of dape-kerple with kerple from {length: (p, DAPE's mean minus X's)
    or a status}."""
    return {"label": "dape-kerple", "baseline": "kerple",
            "p_value": {str(L): {"status": v} if isinstance(v, str) else
                        {"status": "ok", "p": v[0], "mean_diff": v[1], "ci": [v[1] - 1, v[1] + 1]}
                        for L, v in pvalues.items()}}


def _seeds(mean, n=3):
    """n seeds' perplexities around mean, as a group's stats at one length hold them."""
    values = [mean + 0.01 * (k - (n - 1) / 2) for k in range(n)]
    return {"status": "ok", "mean": mean, "std": 0.01 if n > 1 else None, "n": n, "values": values}


def test_significance_is_counted_with_its_direction():
    """A length where DAPE is significantly worse is never counted as support: lower and higher apart. Significant
    means the exact p adjusted by Holm's method below 0.05 (exact_tests), whatever Welch's p."""
    import demo_report
    c = _comparison({64: (0.01, -0.1), 128: (0.01, +0.2), 256: (0.3, -0.05), 512: (0.001, -0.3), 1024: "n/a: 1 seed"})
    holm = {64: 0.01, 128: 0.02, 256: 0.3, 512: 0.2}  # at 512 Welch's p is small and the exact test's is not
    tests = {("dape-kerple", "kerple"): {L: {"status": "ok", "p_holm": p} for L, p in holm.items()}}
    assert demo_report.significance_text(c, tests) == ("DAPE lower, Holm-adjusted exact p < 0.05, at 1 of 4 lengths; "
                                                       "DAPE higher, Holm p < 0.05, at 1 of 4")
    assert demo_report.significance_text(_comparison({64: "n/a: 1 seed"}), {("dape-kerple", "kerple"): {}}) is None


def test_exact_tests_are_the_permutation_tests_of_the_seeds_with_holm_per_family():
    """exact_tests: the permutation test of the seeds' perplexities wherever the evaluation made Welch's test, and
    Holm's adjustment within each pair's lengths; the registered primary cell (DAPE-FIRE against FIRE at 16x the
    training length, over seeds 1 to 5) is a family of its own, unadjusted, and only over those seeds."""
    from results import holm, permutation_test
    import demo_report
    five = lambda label, m64, m128, block=8: {"label": label, "n": 5, "seeds": [1, 2, 3, 4, 5], "block_size": block,
                                              "ppl": {"64": _seeds(m64, 5), "128": _seeds(m128, 5)}}
    groups = [five("kerple", 7.0, 7.1), five("dape-kerple", 6.0, 7.1), five("dapev2-kerple", 5.0, 6.0),
              {"label": "fox", "n": 1, "ppl": {"64": _seeds(6.0, 1), "128": _seeds(6.0, 1)}},
              five("fire", 7.0, 9.0), five("dape-fire", 6.0, 8.0)]
    results = {"lengths": [64, 128], "groups": groups, "comparisons": [
        _comparison({64: (0.001, -1.0), 128: (1.0, 0.0)}),
        dict(_comparison({64: (0.001, -2.0), 128: (0.001, -1.1)}), label="dapev2-kerple"),
        dict(_comparison({64: "n/a: 1 seed", 128: "n/a: 1 seed"}), label="dape-fox", baseline="fox"),
        dict(_comparison({64: (0.001, -1.0), 128: (0.001, -1.0)}), label="dape-fire", baseline="fire")]}
    tests = demo_report.exact_tests(results)
    assert tests[("dape-fox", "fox")] == {} and set(tests[("dape-kerple", "kerple")]) == {64, 128}
    t64, t128 = tests[("dape-kerple", "kerple")][64], tests[("dape-kerple", "kerple")][128]
    assert t64["p_exact"] == permutation_test(groups[1]["ppl"]["64"]["values"], groups[0]["ppl"]["64"]["values"])["p"]
    assert (t64["p_exact"], t128["p_exact"]) == (pytest.approx(2 / 252), 1.0)
    for pair in (("dape-kerple", "kerple"), ("dapev2-kerple", "kerple")):  # each pair's lengths: one family
        family = list(tests[pair].values())
        assert [t["p_holm"] for t in family] == holm([t["p_exact"] for t in family])
    assert "| dape-kerple vs kerple | 0.001 (exact 0.0079, Holm 0.016) | 1 (exact 1, Holm 1) |" in \
        demo_report.pvalue_table(results, tests)
    # the primary: 16 x 8 = 128, unadjusted; the pair's other length is a family of one
    fire = tests[("dape-fire", "fire")]
    assert demo_report.primary_length(results) == 128 and fire[128]["primary"] and "primary" not in fire[64]
    assert fire[128]["p_holm"] == fire[128]["p_exact"] == pytest.approx(2 / 252) == fire[64]["p_holm"]
    text = demo_report.primary_text(results, tests)
    assert text.startswith("**The primary test**") and "exact two-sided permutation p = 0.0079" in text
    assert text.endswith("dape-fire lower, significant at 0.05.")
    # over other seeds the run does not carry it: the cell stays in its pair's family, and the text says so
    for g in groups[4:]:
        g["seeds"] = [1, 2, 3, 4, 6]
    tests = demo_report.exact_tests(results)
    assert demo_report.primary_length(results) is None and fire[128]["p_holm"] != tests[("dape-fire", "fire")][128][
        "p_holm"] == pytest.approx(2 * 2 / 252)
    assert "is not this run's: it has seeds 1, 2, 3, 4, 6 and 1, 2, 3, 4, 6" in demo_report.primary_text(results, tests)


def test_the_rises_are_compared_per_seed_in_one_family():
    """rise_tests: each seed's perplexity at the longest length over its own at the first, DAPE-X against X with
    the exact permutation test, Holm over the pairs (one family); with 3 seeds a side the table says the family
    is a description."""
    from results import holm, permutation_test
    import demo_report
    group = lambda label, first, last: {"label": label, "n": 3, "ppl": {"64": _seeds(first), "128": _seeds(last)}}
    groups = [group("kerple", 7.0, 7.1), group("dape-kerple", 6.0, 6.5), group("fire", 7.0, 14.0),
              group("dape-fire", 6.5, 13.0)]
    results = {"lengths": [64, 128], "groups": groups, "comparisons": [
        _comparison({64: (0.01, -1.0), 128: (0.01, -0.6)}),
        dict(_comparison({64: (0.01, -0.5), 128: (0.01, -1.0)}), label="dape-fire", baseline="fire")]}
    rises = demo_report.rise_tests(results)
    ratio = lambda g: [b / a for a, b in zip(g["ppl"]["64"]["values"], g["ppl"]["128"]["values"])]
    assert [(r["label"], r["baseline"]) for r in rises] == [("dape-kerple", "kerple"), ("dape-fire", "fire")]
    for r, (a, b) in zip(rises, ((groups[1], groups[0]), (groups[3], groups[2]))):
        assert r["p_exact"] == permutation_test(ratio(a), ratio(b))["p"]
        assert r["diff"] == pytest.approx(sum(ratio(a)) / 3 - sum(ratio(b)) / 3)
    assert [r["p_holm"] for r in rises] == holm([r["p_exact"] for r in rises])
    table = demo_report.rise_table(results, rises)
    assert "| dape-fire vs fire | " in table and "over the 2 pairs (one family)" in table
    assert table.endswith("No comparison of this family can reach a Holm p below 0.05: it is a description.")


def test_pvalue_table_keeps_a_pair_with_a_test_at_any_length():
    """A pair with a p-value at some lengths and none at others (a length a seed could not serve) keeps
    its row; a pair without a test at any length has none."""
    import demo_report
    groups = [{"label": label, "n": n, "ppl": {"64": _seeds(m, n), "128": {"status": "too long"}}}
              for label, m, n in [("kerple", 7.0, 3), ("dape-kerple", 6.9, 3), ("fox", 6.0, 1), ("dape-fox", 6.1, 1)]]
    results = {"lengths": [64, 128], "groups": groups, "comparisons": [
        _comparison({64: (0.02, -0.1), 128: "too long"}),
        dict(_comparison({64: "n/a: 1 seed", 128: "n/a: 1 seed"}), label="dape-fox", baseline="fox")]}
    table = demo_report.pvalue_table(results, demo_report.exact_tests(results))
    assert "| dape-kerple vs kerple | 0.02 (exact 0.1, Holm 0.1) | too long |" in table and "dape-fox" not in table
    assert "| dape-kerple - kerple | -0.100 [-1.100, +0.900] | too long |" in demo_report.difference_table(results)


def test_report_states_the_seeds_it_was_given(tmp_path, monkeypatch):
    """The number of seeds in the text is the number in results.json (here 6; demo.sh runs 5 by default), never a fixed one."""
    import demo_report
    lengths = [64, 128]
    groups = [{"label": label, "n": n, "seeds": list(range(1, n + 1)),
               "ppl": {str(L): _seeds(6.0 - i, n) for L in lengths}, "bpb": {str(L): _seeds(2.5, n) for L in lengths}}
              for i, (label, n) in enumerate([("kerple", 6), ("dape-kerple", 6), ("alibi", 1)])]
    results = {"lengths": lengths, "protocol": {"eval_tokens": 8, "num_windows": 2},
               "runs": [{"model_args": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 64}, "iter_num": 10}],
               "groups": groups, "comparisons": [_comparison({64: (0.01, -1.0), 128: (0.2, -1.0)})]}
    res = tmp_path / "res"
    res.mkdir()
    (res / "results.json").write_text(json.dumps(results))
    (res / "ppl_vs_length.png").write_bytes(b"png")
    (tmp_path / "README.md").write_text("intro\n<!-- demo-results:start -->\nold\n<!-- demo-results:end -->\nend\n")
    monkeypatch.setattr(demo_report, "ROOT", str(tmp_path))
    demo_report.publish(str(res))
    readme, page = (tmp_path / "README.md").read_text(), (tmp_path / "docs" / "demo_results.md").read_text()
    assert "Measured by `bash demo.sh --seeds=6`" in readme and "6 seeds of kerple, dape-kerple" in readme
    assert readme.startswith("intro\n") and readme.endswith("\nend\n")
    assert "two-sided p (6 seeds a side)" in page and "with 6 seeds of the pairs" in page
    assert "three" not in page + readme
    # 6 seeds a side fully apart: exact p 2/924 at each length, Holm over the pair's 2 lengths below 0.05 at both
    assert "DAPE lower, Holm-adjusted exact p < 0.05, at 2 of 2 lengths" in page
    assert "Smallest possible exact p: 0.0022 with 6 and 6 seeds." in page and "can reach" not in page


def _demo_results(counts):
    lengths = [64, 128]
    groups = [{"label": label, "n": n, "seeds": list(range(1, n + 1)),
               "ppl": {str(L): _seeds(6.0 - i, n) for L in lengths}, "bpb": {str(L): _seeds(2.5, n) for L in lengths}}
              for i, (label, n) in enumerate(counts)]
    return {"lengths": lengths, "protocol": {"eval_tokens": 8, "num_windows": 2},
            "runs": [{"model_args": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 64}, "iter_num": 10}],
            "groups": groups, "comparisons": [_comparison({64: (0.01, -1.0), 128: (0.2, -1.0)})]}


def test_report_names_each_models_seeds_where_their_counts_differ(tmp_path, monkeypatch):
    """Kerple over 5 seeds against DAPE-Kerple over 3: the text says which model has how many, and the smallest
    exact p that 5 against 3 allows, not the 5 against 5 that the largest count would suggest."""
    import demo_report
    res = tmp_path / "res"
    res.mkdir()
    results = _demo_results([("kerple", 5), ("dape-kerple", 3), ("alibi", 3), ("dape-alibi", 3), ("rope", 1)])
    results["comparisons"].append(dict(results["comparisons"][0], label="dape-alibi", baseline="alibi"))
    (res / "results.json").write_text(json.dumps(results))
    monkeypatch.setattr(demo_report, "ROOT", str(tmp_path))
    text = demo_report.report(str(res))
    assert "5 seeds of kerple; 3 seeds of dape-kerple, alibi, dape-alibi, one of the others" in text
    # 5 against 3 allows 2/56, 3 against 3 only 2/20
    assert "with 3 or 5 seeds of the pairs" in text and "cannot go below 0.1 for some and 0.036 for others" in text


def test_a_report_keeps_the_runs_provenance_and_a_failed_publish_changes_nothing(tmp_path, monkeypatch):
    """meta.json is written by the run's own report (demo.sh gives --minutes and --models); a later report of the
    same directory keeps it, and a report of the published study is refused (it writes where it reads). A
    publish that lacks a file it needs (the plot) stops before docs/ or README.md change."""
    import demo_report
    monkeypatch.setattr(demo_report, "ROOT", str(tmp_path))
    res = tmp_path / "res"
    res.mkdir()
    (res / "results.json").write_text(json.dumps(_demo_results([("kerple", 3), ("dape-kerple", 3)])))
    demo_report.report(str(res), 22, 12)
    meta = json.loads((res / "meta.json").read_text())
    assert (meta["minutes"], meta["models"]) == (22, 12)
    demo_report.report(str(res))
    assert json.loads((res / "meta.json").read_text()) == meta
    published = tmp_path / "docs" / "results" / "demo"
    published.mkdir(parents=True)
    before = json.dumps(_demo_results([("kerple", 3), ("dape-kerple", 3)]))
    (published / "results.json").write_text(before)
    with pytest.raises(SystemExit, match="is a published study"):
        demo_report.report(str(published))
    (tmp_path / "README.md").write_text("intro\n<!-- demo-results:start -->\nold\n<!-- demo-results:end -->\n")
    with pytest.raises(SystemExit, match="no .*ppl_vs_length.png"):
        demo_report.publish(str(res))
    assert (published / "results.json").read_text() == before and "old" in (tmp_path / "README.md").read_text()
    assert not (tmp_path / "docs" / "demo_results.md").exists()


def test_observations_cover_every_pair_the_evaluation_made():
    """DAPE-X with f zero at step 0 is set against X and against DAPE-X (the evaluation's pairs), though its
    label is not 'dape-' + X; a DAPE group without a pair gets no line."""
    import demo_report
    groups = [{"label": label, "n": 3, "ppl": {"64": _seeds(m), "128": _seeds(m + 0.1)}}
              for label, m in [("kerple", 7.0), ("dape-kerple", 6.8), ("dape-kerple-zero", 6.9), ("dape-fox", 6.5)]]
    pair = lambda a, b: dict(_comparison({64: (0.01, -0.2), 128: (0.3, -0.1)}), label=a, baseline=b)
    results = {"lengths": [64, 128], "groups": groups,
               "comparisons": [pair("dape-kerple", "kerple"), pair("dape-kerple-zero", "kerple"),
                               pair("dape-kerple-zero", "dape-kerple")]}
    lines = [line for line in demo_report.observations(results).splitlines() if " below " in line]
    assert [line.split(" (")[0] for line in lines] == [
        "- dape-kerple below kerple at 2 of 2 lengths", "- dape-kerple-zero below kerple at 2 of 2 lengths",
        "- dape-kerple-zero below dape-kerple at 0 of 2 lengths"]
    # 3 seeds a side: the exact p is 0.1 at best, so nothing is significant, whatever Welch's p
    assert all(line.endswith("DAPE lower, Holm-adjusted exact p < 0.05, at 0 of 2 lengths; DAPE higher, Holm p < 0.05, "
                             "at 0 of 2") for line in lines)


def test_every_figure_of_the_report_comes_from_its_files(tmp_path):
    """The published run's files with every measured number changed: no figure of the original report is
    left in the new one, so none is typed into a template. What stays is cited (the paper's Table 5) or a
    rule (the significance level, the smallest p the seed counts allow); the exact test's p, which takes few
    values, is checked against the test recomputed from the changed files."""
    import re as _re
    import demo_report
    import results
    saved = os.path.join(ROOT, "docs", "results", "demo")
    copy = tmp_path / "demo"
    studies = [name for name in ("demo", "demo-full") if os.path.isdir(os.path.join(ROOT, "docs", "results", name))]
    for name in studies:  # the headline and the whole study the page renders after it
        shutil.copytree(os.path.join(ROOT, "docs", "results", name), tmp_path / name)

    def perturb(x, key=None):
        if isinstance(x, dict):
            return {k: perturb(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return x if key in ("lengths", "window_ends") else [perturb(v, key) for v in x]
        if isinstance(x, bool) or key in ("seed", "seeds", "n", "lengths", "trials", "digits"):
            return x
        if key in ("yarn_alpha", "yarn_beta"):  # settings printed as whole numbers: kept whole
            return x + 3.0
        if isinstance(x, float) and key == "p":  # kept a probability, so that it prints in the same form
            return x * 0.5 + 0.0017
        if isinstance(x, float):
            # up by at least 0.5, by an amount that varies with the value: no figure maps to itself, nor does
            # a ratio of two
            return x + 0.5 + 0.37 * abs(x) + (x * 7919.123) % 0.5
        # block_size kept, as the lengths are: the primary test's length is 16 times it, and must stay one of them
        if isinstance(x, int) and key in ("minutes", "models", "iter_num", "n_layer", "n_head", "n_embd",
                                          "max_iters"):
            return x + 3
        return x
    for path in tmp_path.rglob("*.json"):
        path.write_text(json.dumps(perturb(json.loads(path.read_text()))))
    for md in tmp_path.rglob("passkey.md"):  # eval_passkey's tables: every decimal figure in it changed too
        md.write_text(_re.sub(r"\d+(\.\d+)?", lambda m: f"{float(m[0]) + 1.2345:.{len(m[1] or '.') - 1}f}",
                              md.read_text()))
    # The exact test's p takes only the few values k / C(n_a + n_b, n_a) that the seed counts (kept) allow, so a
    # changed file may leave one where it was: those cells are checked against the test recomputed from the
    # changed file instead, and the smallest p the seed counts allow is a rule, as the significance level is
    exact_cell = _re.compile(r" \(exact [^,]+, Holm [^)]+\)")
    cells, tests = [], {}
    for name in studies:  # per study, in the page's order: the tests per length, then the rises
        changed_results = json.loads((tmp_path / name / "results.json").read_text())
        per_length = demo_report.exact_tests(changed_results)
        tests.update({(name, key): pair for key, pair in per_length.items()})
        rises = demo_report.rise_tests(changed_results)
        cells += [(t["p_exact"], t["p_holm"]) for c in changed_results["comparisons"]
                  for t in per_length[(c["label"], c["baseline"])].values()]
        cells += [(r["p_exact"], r["p_holm"]) for r in rises]
        tests.update({(name, "rise", r["label"], r["baseline"]): {0: r} for r in rises})
    changed_text = "\n".join(demo_report.render(str(copy)))
    assert exact_cell.findall(changed_text.split("\n<!-- demo-results:end -->")[1]) == [
        f" (exact {results.p_text(p)}, Holm {results.p_text(h)})" for p, h in cells]
    # the primary test's exact p likewise, where the run carries it (README and page state it)
    primary_cell = _re.compile(r" = \S+ \(the smallest that \d+ against \d+ seeds allow: \S+\)")
    headline = json.loads((copy / "results.json").read_text())
    length = demo_report.primary_length(headline)
    if length is not None:
        t = demo_report.exact_tests(headline)[demo_report.PRIMARY][length]
        assert primary_cell.findall(changed_text)[:1] == [
            f" = {results.p_text(t['p_exact'])} (the smallest that {t['n_a']} against {t['n_b']} seeds allow: "
            f"{results.p_text(t['p_min'])})"]
    # the two texts have the same shape, so their figures pair up in order: a figure typed into a template is
    # one that stays where it was
    number = _re.compile(r"[-+]?(?<![\w.])\d+\.\d+(?:e[-+]\d+)?(?![\w.])")  # 6.7e-05 too
    strip = lambda text: primary_cell.sub("", exact_cell.sub("", text))
    original = number.findall(strip("\n".join(demo_report.render(saved))))
    changed = number.findall(strip(changed_text))
    assert len(original) == len(changed) > 100
    smallest = {f"{t['p_min']:.2g}" for pair in tests.values() for t in pair.values()}
    cited = set(number.findall(demo_report.PAPER_TABLE_5)) | {"0.05"} | smallest
    # and what follows from the kept block size alone: the turns of RoPE's fastest dimension over it
    cited |= {f"{r['model_args']['block_size'] / (2 * math.pi):.1f}" for name in studies
              for r in json.loads((tmp_path / name / "results.json").read_text())["runs"]}
    left = [a for a, b in zip(original, changed) if a == b and a not in cited]
    assert not left, f"figures that did not change with the files: {left[:20]}"
    # percentages ('60% in one seed') may come and go with the numbers, so they are compared as sets
    percent = _re.compile(r"(?<![\w.])\d+(?:\.\d+)?%")
    kept = set(percent.findall("\n".join(demo_report.render(saved)))) & set(
        percent.findall("\n".join(demo_report.render(str(copy))))) - {"95%"}  # the confidence level: a rule
    assert not kept, f"percentages that did not change with the files: {sorted(kept)}"
    meta = json.loads((copy / "meta.json").read_text())
    assert f"took {meta['minutes']} min" in changed_text or meta["minutes"] is None


def test_below_counts_strict_differences_at_lengths_with_both_perplexities():
    """'below X at k of n lengths': a tie is not below, and a length where either model has no perplexity is
    not counted at all."""
    import demo_report
    stat = lambda m: _seeds(m) if m else {"status": "too long"}
    groups = [{"label": label, "n": 3, "ppl": {L: stat(m) for L, m in zip(("64", "128", "256"), values)}}
              for label, values in [("kerple", (6.5, 7.0, 6.0)), ("dape-kerple", (6.0, 7.0, None))]]
    results = {"lengths": [64, 128, 256], "groups": groups,
               "comparisons": [_comparison({64: (0.01, -0.5), 128: (0.9, 0.0), 256: "too long"})]}
    (line,) = [line for line in demo_report.observations(results).splitlines() if " below " in line]
    assert line.startswith("- dape-kerple below kerple at 1 of 2 lengths"), line


def test_progress_count_is_the_runs_own_line(tmp_path):
    """Two runs that end at once: each counts by the line its own name landed on, not by the file's length
    when it reads it (which would give both the same count)."""
    with open(os.path.join(ROOT, "demo.sh")) as f:
        (definition,) = [line for line in f if line.startswith("progress_count()")]
    progress = tmp_path / "finished"
    progress.write_text("a trained\nb trained\n")
    out = subprocess.run(["bash", "-c", definition + "progress_count a; progress_count b"], capture_output=True,
                         text=True, env=dict(os.environ, PROGRESS=str(progress)))
    assert out.stdout.split() == ["1", "2"], out.stdout + out.stderr


def test_the_ratio_to_the_training_length_is_per_seed_with_its_interval():
    """Each seed's perplexity at the longest length over its own at the training length, the mean with the 95%
    t interval over seeds (results.mean_ci), as scipy computes it."""
    import numpy as np
    import demo_report
    scipy_stats = pytest.importorskip("scipy.stats")
    first, last = [7.0, 7.2, 6.9], [14.0, 15.1, 13.2]
    group = {"label": "fire", "n": 3, "ppl": {"64": {"status": "ok", "values": first},
                                              "1024": {"status": "ok", "values": last}}}
    ratios = [b / a for a, b in zip(first, last)]
    want = scipy_stats.t.interval(0.95, 2, loc=np.mean(ratios), scale=scipy_stats.sem(ratios))
    mean, lo, hi = demo_report.seed_ratio(group, 64, 1024)
    assert mean == pytest.approx(np.mean(ratios)) and (lo, hi) == pytest.approx(want, rel=1e-9)
    group["ppl"]["64"]["values"] = first[:2]  # a seed without a value at one length: no interval
    assert demo_report.seed_ratio(group, 64, 1024) is None


def test_rounding_tables_are_the_test_retest_of_results_py():
    """demo_report.py --rounding_from: results.retest of the same runs under two roundings, each run's perplexity at
    the longest length and each DAPE-X against X pair once over its lengths: identical runs move by 0 (r = +1.00),
    and a difference whose sign flips at one length, significant under neither, is of mixed sign, not a conclusion."""
    import demo_report
    with open(os.path.join(ROOT, "docs", "results", "demo_rounding", "results.json")) as f:
        native = json.load(f)
    other = json.loads(json.dumps(native).replace("DEFAULT kernels", "AVX512 kernels"))
    flipped = next(c for c in other["comparisons"] if (c["label"], c["baseline"]) == ("dape-fire", "fire"))
    L = str(native["lengths"][1])
    flipped["p_value"][L]["mean_diff"] = -flipped["p_value"][L]["mean_diff"]
    text = demo_report.rounding_tables(native, other)
    assert text.startswith("| model | runs | r | mean change |\n")  # the runs are not judged learned or not
    assert "| fire | 3 | +1.00 | 0.000 |" in text
    assert "| dape-fire vs fire | perplexity | higher at 0, lower at 5 of 5; least Holm p 0.5 | higher at 1, lower at 4 " \
           "of 5; least Holm p 0.5 | opposite or mixed sign, not significant |" in text
    assert text.endswith("No comparison was a conclusion under either side: of the 1 with a test under both, 0 kept "
                         "their sign, 1 had opposite or mixed signs and 0 were exact ties under one side or both.")


def test_the_estimate_counts_the_runs_trained_up_to_this_runs_line(tmp_path):
    """A run that ended at once with a later one (whose line landed after its own before it counted): its estimate
    of the training left divides the time so far by the runs trained up to its own line, not the file's."""
    import time
    with open(os.path.join(ROOT, "demo.sh")) as f:
        text = f.read()
    start = text.index("progress_count() {")
    functions = text[start:text.index("\n}\n", text.index("train_one() {")) + 3]
    later = ('eval "$(declare -f progress_count | sed 1s/progress_count/own_line/)"\n'
             'progress_count() { echo "c trained" >> "$PROGRESS"; own_line "$@"; }\n')  # c lands before b counts
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "finished").write_text("a trained\n")
    env = dict(os.environ, OUT=str(tmp_path), PROGRESS=str(tmp_path / "logs" / "finished"), PY="true", TOTAL="4",
               THREADS="1", DATA_ROOT="data", TRAIN_T0=str(int(time.time()) - 600))
    out = subprocess.run(["bash", "-c", functions + later + "train_one " + str(tmp_path / "b") + " kerple none 1"],
                         capture_output=True, text=True, env=env)
    # 600 s for the 2 runs trained up to b's line, 2 of 4 left: 10 min (the file's 3 trained would say 7)
    assert "[2/4] done  b in" in out.stdout and "about 10 min of training left" in out.stdout, out.stdout + out.stderr
