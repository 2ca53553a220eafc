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
    assert "training 5/5: rope" in run.stdout and "done: table" in run.stdout
    res = tmp_path / "results" / "demo-smoke"
    for name in ("results.json", "results.md", "results.csv", "ppl_vs_length.png"):
        assert (res / name).stat().st_size > 0, name
    results = json.loads((res / "results.json").read_text())
    assert [r["label"] for r in results["runs"]] == ["kerple", "dape-kerple", "dapev2-kerple", "alibi", "rope"]
    assert results["lengths"] == [16, 32, 64, 128, 256]  # 1x .. 16x the training length
    for run_ in results["runs"]:
        assert all(run_["results"][str(L)]["ppl"] > 1 for L in results["lengths"])
    scaling = json.loads((res / "rope_scaling" / "results.json").read_text())
    assert [r["label"] for r in scaling["runs"]][:4] == ["rope", "rope+pi(s=L/16)", "rope+ntk(s=L/16)",
                                                          "rope+yarn(s=L/16)"]
    assert (res / "rope_scaling" / "loss_by_position.png").stat().st_size > 0
    passkey = json.loads((res / "passkey" / "passkey.json").read_text())
    assert {r["label"] for r in passkey["rows"]} >= {"passkey_kerple", "passkey_dape_kerple", "passkey_rope"}

    # a re-run reuses the data and the finished checkpoints
    again = subprocess.run(["bash", "demo.sh", "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already prepared" in again.stdout and again.stdout.count(", resume)") == 8  # 5 + 3 passkey models

    # the README section is rewritten from results.json, and only that section
    readme = tmp_path / "README.md"
    before = readme.read_text()
    subprocess.run([sys.executable, "demo_report.py", str(res)], cwd=tmp_path, check=True, capture_output=True)
    after = readme.read_text()
    assert after.split("<!-- demo-results:start -->")[0] == before.split("<!-- demo-results:start -->")[0]
    assert "| dape-kerple |" in after and "below kerple at" in after and "docs/demo_ppl_vs_length.png" in after
    assert (tmp_path / "docs" / "demo_ppl_vs_length.png").exists()
    assert "RoPE context extension at evaluation" in after and "Passkey retrieval" in after
    assert (tmp_path / "docs" / "demo_loss_by_position.png").exists()
