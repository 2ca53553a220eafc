"""The demo (demo.sh) end to end in smoke mode, in a copy of the repository, and its README report."""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_repo(dst):
    for name in os.listdir(ROOT):
        src = os.path.join(ROOT, name)
        if name.endswith((".py", ".sh", ".md", ".txt")):
            shutil.copy(src, dst)
    for folder in ("config", "data"):
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(dst, folder),
                        ignore=shutil.ignore_patterns("*.bin", "meta.json", "raw", "__pycache__"))


def test_demo_smoke_runs_end_to_end(tmp_path):
    copy_repo(tmp_path)
    env = dict(os.environ, DEMO_SKIP_INSTALL="1", PYTHON=sys.executable)
    run = subprocess.run(["bash", "demo.sh", "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "training 10 models, 2 at a time" in run.stdout and "done  dape_fox_s1 in" in run.stdout
    assert "done in" in run.stdout
    res = tmp_path / "results" / "demo-smoke"
    for name in ("results.json", "results.md", "results.csv", "ppl_vs_length.png"):
        assert (res / name).stat().st_size > 0, name
    results = json.loads((res / "results.json").read_text())
    labels = ["kerple", "dape-kerple", "dapev2-kerple", "alibi", "rope", "fox", "dape-fox"]
    assert [r["label"] for r in results["runs"]] == [l for l in labels[:3] for _ in (1, 2)] + labels[3:]
    assert [(g["label"], g["n"], g["seeds"]) for g in results["groups"]] == [
        (l, 2, [1, 2]) for l in labels[:3]] + [(l, 1, [1]) for l in labels[3:]]
    # DAPE-X against X: p-values where both have two seeds (Kerple's), none for FoX's single runs
    assert [(c["label"], c["baseline"]) for c in results["comparisons"]] == [
        ("dape-kerple", "kerple"), ("dapev2-kerple", "kerple"), ("dape-fox", "fox")]
    assert [{p["status"] == "ok" for p in c["p_value"].values()} for c in results["comparisons"]] == [
        {True}, {True}, {False}]
    assert results["lengths"] == [16, 32, 64, 128, 256]  # 1x .. 16x the training length
    for run_ in results["runs"]:
        assert all(run_["results"][str(L)]["ppl"] > 1 for L in results["lengths"])
    scaling = json.loads((res / "rope_scaling" / "results.json").read_text())
    assert [r["label"] for r in scaling["runs"]][:4] == ["rope", "rope+pi(s=L/16)", "rope+ntk(s=L/16)",
                                                          "rope+yarn(s=L/16)"]
    assert (res / "rope_scaling" / "loss_by_position.png").stat().st_size > 0
    passkey = json.loads((res / "passkey" / "passkey.json").read_text())
    assert [r["label"] for r in passkey["rows"]][:2] == ["passkey_rope_s1", "passkey_rope_s1+pi(s=L/128)"]

    # a re-run reuses the data and the finished checkpoints
    again = subprocess.run(["bash", "demo.sh", "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already prepared" in again.stdout and again.stdout.count(", resume)") == 11  # 10 + the passkey model
    log = (tmp_path / "out-demo-smoke" / "logs" / "dape_kerple_s2.log").read_text()
    assert "iter 4:" in log.split("resumed from")[0] and log.count("resumed from") == 1  # appended, not replaced

    # the README section is rewritten from results.json, and only that section
    readme = tmp_path / "README.md"
    before = readme.read_text()
    subprocess.run([sys.executable, "demo_report.py", str(res), "--minutes=7", "--models=11"], cwd=tmp_path,
                   check=True, capture_output=True)
    after = readme.read_text()
    # outside the section, only the first command line changes: what the demo trained and how long it took
    head_before, head_after = (t.split("<!-- demo-results:start -->")[0].splitlines() for t in (before, after))
    changed = [(a, b) for a, b in zip(head_before, head_after) if a != b]
    assert len(head_before) == len(head_after) and len(changed) == 1, changed
    assert changed[0][1] == ("bash demo.sh    # installs, prepares the embedded books, trains 11 CPU models (2 seeds of "
                             "the Kerple trio), evaluates them to 16x their length (7 min, measured)")
    section = after.split("<!-- demo-results:start -->")[1]
    assert "Measured by `bash demo.sh --seeds=2`" in section
    kerple = next(g for g in results["groups"] if g["label"] == "kerple")["ppl"]["16"]
    assert f"| kerple | 2 | {kerple['mean']:.3f} ± {kerple['std']:.3f} |" in section
    assert "| fox | 1 |" in section and "| dape-fox | 1 |" in section and "dape-fox vs fox" not in section
    p = results["comparisons"][0]["p_value"]["16"]
    assert f"| dape-kerple vs kerple | {p['p']:.3g} |" in section and "Welch p < 0.05 at" in section
    assert "below kerple at" in after and "docs/demo_ppl_vs_length.png" in after
    assert (tmp_path / "docs" / "demo_ppl_vs_length.png").exists()
    assert "RoPE context extension at evaluation" in after and "Passkey retrieval" in after
    assert (tmp_path / "docs" / "demo_loss_by_position.png").exists()


def test_demo_and_its_report_refuse_bad_arguments(tmp_path):
    for args, message in ((["--seeds=0"], "--seeds must be a positive integer, got '0'"),
                          (["--fast"], "unknown argument '--fast'")):
        run = subprocess.run(["bash", os.path.join(ROOT, "demo.sh"), *args], capture_output=True, text=True,
                             env=dict(os.environ, DEMO_SKIP_INSTALL="1"))
        assert run.returncode == 2 and message in run.stderr, run.stderr
    run = subprocess.run([sys.executable, os.path.join(ROOT, "demo_report.py"), str(tmp_path), "--minute=3"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.startswith("usage: python demo_report.py"), run.stderr
