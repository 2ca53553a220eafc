"""gpu_check.py, the one command for a lent GPU: its dry run goes through every part at tiny size (the GPU
tests collected and, without CUDA, skipped; the benchmark of every model; the JSON; the tables); its test
runner counts passes, failures and errors from each process's summary line, stops the processes at the
part's limit and runs no more processes than tests; a failure, an error or a stopped process alone fails
the command."""

import json
import os
import subprocess
import sys

import pytest

import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = gpu_check.models.split(",")


@pytest.mark.recorded_dape
def test_the_dry_run_goes_through_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "gpu_check.py", "--dry", "--jobs=2", f"--out={out}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["dry"] is True and res["meta"]["seconds"] > 0
    tests = res["tests"]
    assert tests["collected"] >= 60 and sum(tests["counts"].values()) == tests["collected"], tests
    assert tests["processes"] == 2 and not tests["failures"] and not tests["timed_out"]
    bench = res["bench"]
    assert [r["model"] for r in bench["rows"]] == MODELS and all(r["ms"] > 0 for r in bench["rows"])
    assert {(e["model"], e["T"]) for e in bench["eval"]} == {(m, T) for m in MODELS for T in (128, 256)}
    assert all(e["ms"] > 0 for e in bench["eval"]) and len(bench["verdicts"]) == 5
    text = gpu_check.main([f"--tables_from={out}"])
    assert text in run.stdout  # what it printed is what the saved file prints
    # its last line names the commands that print the file again and publish it, not a page that does not show it
    assert f"its tables again: python gpu_check.py --tables_from={out};" in run.stdout
    assert "python tests/test_published_tables.py docs/gpu.md" in run.stdout.splitlines()[-1]
    assert text.startswith("Dry run, tiny sizes, ") and "| kerple+v1:torch | 64 x 4 |" in text


SHARDS = (  # 8 tests in 4 processes (round robin): each process's tests, and the summary line it ends with
    "import time, pytest\n"
    "pytestmark = pytest.mark.gpu\n"
    "@pytest.fixture\n"
    "def broken():\n"
    "    raise RuntimeError('setup')\n"
    "def test_0(): pass\n"  # 1 failed, 1 passed
    "def test_1(broken): pass\n"  # 2 errors
    "def test_2(broken): pass\n"  # 1 passed, 1 error
    "def test_3(): time.sleep(120)\n"  # stopped at the limit
    "def test_4():\n"
    "    time.sleep(3)\n"  # the last process waited for starts its wait late
    "    print('7 passed in 0.01s')\n"  # a test's own output, shown in its failure's report
    "    assert 1 == 2\n"
    "def test_5(broken): pass\n"
    "def test_6(): pass\n"
    "def test_7(): pass\n")


def run_tests(tmp_path, monkeypatch, text, **cfg):
    (tmp_path / "test_x.py").write_text(text)
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    monkeypatch.setattr(gpu_check, "TESTS", "test_x.py")
    return gpu_check.run_tests(dict(gpu_check.config_defaults(vars(gpu_check)), **cfg))


def test_the_counts_are_the_last_line_of_a_process_that_finished():
    """A test's own output in a failure's report ('7 passed in 0.01s') is not the summary: only the last line is;
    a process stopped at the limit (killed between the report and its summary line) counts nothing."""
    report = ("F.\n=== FAILURES ===\n___ test_4 ___\n----- Captured stdout call -----\n7 passed in 0.01s\n"
              "FAILED test_x.py::test_4 - assert 1 == 2\n")
    assert gpu_check.summary_counts(report + "1 failed, 1 passed in 3.2s\n\n", finished=True) == {"failed": 1, "passed": 1}
    assert gpu_check.summary_counts(report, finished=False) == {}
    cut = report[:report.index("FAILED")]  # stopped just after printing the test's output
    assert gpu_check.summary_counts(cut, finished=False) == {}
    assert gpu_check.summary_counts(report + "1 failed, 1 passed in 3.2s\nbye\n", finished=True) == {}
    assert gpu_check.summary_counts("2 errors in 0.1s", finished=True) == {"errors": 2}
    assert gpu_check.summary_counts("1 error, 1 passed in 0.1s", finished=True) == {"errors": 1, "passed": 1}
    # a last line with counts but no ' in <seconds>' is a test's output (printed at the end with -s), not the summary
    assert gpu_check.summary_counts(".\n3 passed\n", finished=True) == {}


def test_the_test_runner_counts_and_stops(tmp_path, monkeypatch):
    """Failures, errors ('1 error' and '2 errors' alike) and passes counted from each process's summary line
    alone, not from a test's output; a process still running at the part's limit stopped there, the limit
    being for the whole part, not for each process in turn."""
    res = run_tests(tmp_path, monkeypatch, SHARDS, jobs=4, test_seconds=30)  # room for 4 pytest starts on a busy CPU
    assert res["collected"] == 8 and res["processes"] == 4
    assert res["counts"] == {"passed": 2, "failed": 1, "errors": 3} and res["timed_out"] == 1, res
    assert res["seconds"] < 30 + 5, res  # one limit for the part: not 30 s for each process in turn
    assert res["failures"][0].startswith("FAILED test_x.py::test_4") and len(res["failures"]) == 4
    text = gpu_check.tables(dict(run_on_a_gpu(), tests=res))
    assert "3 errors, 1 failed, 2 passed, 1 stopped at the limit" in text and "- FAILED test_x.py::test_4" in text


def test_the_limit_is_for_the_whole_part_when_every_process_hangs(tmp_path, monkeypatch):
    """Two processes that both run past the limit are both stopped at it: the part takes the limit once, not
    the limit for each process in turn."""
    res = run_tests(tmp_path, monkeypatch, "import time, pytest\npytestmark = pytest.mark.gpu\n"
                    "def test_a(): time.sleep(120)\ndef test_b(): time.sleep(120)\n", jobs=2, test_seconds=20)
    assert res["processes"] == 2 and res["timed_out"] == 2 and res["counts"] == {}, res
    assert res["seconds"] < 1.5 * 20, res  # each process in turn: at least 2 x 20 s


def test_no_more_processes_than_tests(tmp_path, monkeypatch):
    """An empty shard would run every test of the file again."""
    res = run_tests(tmp_path, monkeypatch, "import pytest\npytestmark = pytest.mark.gpu\ndef test_a(): pass\n",
                    jobs=2, test_seconds=60)
    assert res["processes"] == 1 and res["counts"] == {"passed": 1}, res


TESTS_RAN = dict(collected=3, processes=3, failures=[], timed_out=0, seconds=1.0)


@pytest.mark.parametrize("tests,fails", [(dict(counts={"passed": 3}), False),
                                         (dict(counts={"passed": 2, "failed": 1}), True),
                                         (dict(counts={"passed": 2}, timed_out=1), True),
                                         (dict(counts={"passed": 2, "errors": 1}), True)],
                         ids=["passed", "failed", "stopped", "errors"])
def test_a_failed_or_stopped_part_fails_the_command(tmp_path, monkeypatch, tests, fails):
    """Each alone: a failed test, a process stopped at the limit, an error, or the benchmark's failure."""
    monkeypatch.setattr(gpu_check, "run_tests", lambda cfg: dict(TESTS_RAN, **tests))
    monkeypatch.setattr(gpu_check, "run_bench", lambda cfg: run_on_a_gpu()["bench"])
    out = tmp_path / "gpu.json"
    if fails:
        with pytest.raises(SystemExit, match="a part failed"):
            gpu_check.main([f"--out={out}"])
    else:
        gpu_check.main([f"--out={out}"])
    monkeypatch.setattr(gpu_check, "run_bench", lambda cfg: dict(error="bench.py failed:\nbecause", seconds=1.0))
    with pytest.raises(SystemExit, match="a part failed"):
        gpu_check.main([f"--out={out}"])
    assert gpu_check.tables(json.loads(out.read_text())).endswith("bench.py: bench.py failed: (1 s).")


def run_on_a_gpu():
    """A GPU run's results, with a model out of memory, one past the deadline and the evaluation's figures."""
    row = lambda model, **kw: dict(dict(model=model, pos="kerple", dape="none", T=512, batch=32, compiled=False), **kw)
    return dict(meta=dict(gpu="NVIDIA H100 80GB HBM3", torch="2.11.0", triton="3.6.0", cpus=16, cpu="x86_64",
                          dry=False, started="2026-11-26 12:00", seconds=300.0),
                tests=dict(collected=66, processes=16, counts={"passed": 66}, failures=[], timed_out=0, seconds=80.0),
                bench=dict(reference="kerple", seconds=200.0, size=dict(n_layer=12, n_head=12, n_embd=768),
                           rows=[row("kerple", ms=30.0, ratio=1.0, vs_base=1.0, peak_mb=10240.0),
                                 row("kerple+v2:torch", skipped="out of memory"),
                                 row("path", skipped="past --gpu_deadline"),
                                 row("kerple", compiled=True, ms=20.0)],
                           eval=[dict(model="kerple", T=T, ms=T / 100, ratio=1.0, peak_mb=2048.0)
                                 for T in (2048, 8192)],
                           verdicts=[dict(target="a target", verdict="met", shown="1.10")]))


def test_tables_show_what_did_not_run():
    """A model out of memory, one past the deadline and the evaluation's figures, as a GPU run leaves them."""
    res = run_on_a_gpu()
    text = gpu_check.tables(res)
    assert text.startswith("NVIDIA H100 80GB HBM3; torch 2.11.0, Triton 3.6.0; 2026-11-26 12:00; 5.0 min in all.")
    assert "66 in 16 processes): 66 passed; 80 s." in text
    assert "| kerple | 512 x 32 | 30.0 | 1.00 | 1.00 | 10.0 |" in text and "20.0" not in text  # eager rows only
    assert "| kerple+v2:torch | 512 x 32 | out of memory | out of memory | out of memory | - |" in text
    assert "| path | 512 x 32 | past --gpu_deadline |" in text
    assert "| kerple | 20.5 (1.00) | 81.9 (1.00) | 2.0 |" in text and "| a target | met | 1.10 |" in text
