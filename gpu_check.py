"""
The one command for a lent GPU: the GPU tests, then DAPE's cost at the paper's 125M, its figures written
to one JSON file and docs/gpu.md's tables printed from it. It installs nothing and needs only what a GPU
machine with PyTorch and Triton has (torch, triton, numpy, einops, pytest), so it runs where there is no
network. Its parts, in order, each with a time limit so that the whole stays within about 8 minutes:

1. tests/test_gpu.py (`pytest -m gpu`), split over --jobs processes: most of its time is Triton compiling
   a binary per kind of launch, on one CPU core per process, so the processes share the GPU and use every
   core. A part that passes its limit is stopped and reported as such.
2. `bench.py --sections=gpu`: the training step (bf16, eager: the fused kernel does not run under
   torch.compile) of Kerple, DAPE-Kerple V1 and V2 through the fused kernel and on whole maps, FoX,
   DAPE-FoX and PaTH at T = 512 and 1024, batch 32, each against Kerple in paired rounds and against its
   encoding without DAPE, with peak memory; the evaluation forward at 2048 and 8192 tokens; the fused
   kernel's targets. Models not reached by its deadline are reported as such.

$ python gpu_check.py                                      # on the GPU: writes docs/results/gpu.json
$ python gpu_check.py --dry                                # any machine: every step at tiny size, < 1 min
$ python gpu_check.py --tables_from=docs/results/gpu.json  # docs/gpu.md's tables from a saved run

--dry runs the same parts with bench.py at the tiny size (on a machine without CUDA the GPU tests are
collected and skipped, each saying why); it writes results/gpu_dry.json unless --out says otherwise, so
it never replaces a measurement.
"""

import functools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

from common import code_version, cpu_name, machine_text
from configurator import config_defaults, configure
from results import format_table, measured

# -----------------------------------------------------------------------------
# config (nanoGPT style: these globals are the defaults, overridden by --key=value)
dry = False  # tiny sizes everywhere: the command's own test, under a minute on a CPU
out = ""  # the JSON written; '' -> docs/results/gpu.json (results/gpu_dry.json with --dry)
jobs = 0  # test processes at once; 0: one per CPU core, at most 16
test_seconds = 240  # the GPU tests' limit
bench_seconds = 180  # bench.py's deadline: models not started by then are reported, not timed
tables_from = ""  # a JSON this command wrote: print its tables, run nothing
# the benchmark's settings on a GPU, and with --dry (T x batch of the training steps, evaluation lengths)
models = "kerple,kerple+v1,kerple+v1:torch,kerple+v2,kerple+v2:torch,fox,fox+v1,path,kerple/stickbreaking"
shapes, dry_shapes = "512x32,1024x32", "64x4"
eval_lengths, dry_eval_lengths = "2048,8192", "128,256"

ROOT = os.path.dirname(os.path.abspath(__file__))
TESTS = "tests/test_gpu.py"
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def summary_counts(text, finished):
    """{'passed': n, 'failed': n, 'errors': n, ...} from a pytest process's output: its summary line, which is the
    last line, and only where the process finished (a process stopped at the limit never wrote one, and a line
    before the last may be a test's own output in a failure's report). -> {} where there is none."""
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines and finished else ""
    counts = {}
    if COUNTS.search(last) and " in " in last:
        for number, what in COUNTS.findall(last):
            what = "errors" if what.startswith("error") else what
            counts[what] = counts.get(what, 0) + int(number)
    return counts


def run_tests(cfg):
    """Collect the GPU tests, run them in up to `jobs` processes at once (round-robin shards), each within
    the limit; returns their counts, failures, the processes' number and the seconds taken."""
    t0 = time.time()
    py = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu"]
    listed = subprocess.run(py + ["--collect-only", "-q", TESTS], cwd=ROOT, capture_output=True, text=True)
    ids = [line for line in listed.stdout.splitlines() if line.startswith(TESTS + "::")]
    if listed.returncode not in (0, 5) or not ids:  # 5: none collected
        return dict(error=f"collecting {TESTS} failed:\n{(listed.stdout + listed.stderr)[-2000:]}",
                    seconds=round(time.time() - t0, 1))
    n = max(1, min(cfg["jobs"] or min(os.cpu_count() or 1, 16), len(ids)))
    procs = [subprocess.Popen(py + ["-q", "-rfE"] + ids[i::n], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    res = dict(collected=len(ids), processes=n, failures=[], timed_out=0)
    counts = {}
    for p in procs:
        try:
            text = p.communicate(timeout=max(1.0, cfg["test_seconds"] - (time.time() - t0)))[0]
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0]
            res["timed_out"] += 1
        for what, number in summary_counts(text, finished=p.returncode >= 0).items():
            counts[what] = counts.get(what, 0) + number
        res["failures"] += [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    res.update(counts=counts, seconds=round(time.time() - t0, 1))
    return res


def run_bench(cfg):
    """bench.py's gpu section in a process of its own, within bench_seconds (its deadline) and a margin for
    the model it is in when the deadline passes; returns its result and the seconds taken."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        args = ["--sections=gpu", f"--gpu_models={cfg['models']}", "--gpu_compile=eager",
                f"--gpu_deadline={cfg['bench_seconds']}", f"--out={path}"]
        if cfg["dry"]:
            args += ["--gpu_size=tiny", f"--gpu_shapes={cfg['dry_shapes']}",
                     f"--gpu_eval_lengths={cfg['dry_eval_lengths']}", "--repeats=1", "--warmup=1", "--eval_repeats=1"]
        else:
            args += ["--gpu_size=125m", f"--gpu_shapes={cfg['shapes']}", f"--gpu_eval_lengths={cfg['eval_lengths']}",
                     "--repeats=5", "--warmup=2", "--eval_repeats=3"]
        try:
            run = subprocess.run([sys.executable, "bench.py"] + args, cwd=ROOT, capture_output=True, text=True,
                                 timeout=cfg["bench_seconds"] + 60)
        except subprocess.TimeoutExpired as e:
            return dict(error=f"bench.py passed its limit: {str(e.stdout or '')[-2000:]}",
                        seconds=round(time.time() - t0, 1))
        if run.returncode != 0 or not os.path.exists(path):
            return dict(error=f"bench.py failed:\n{(run.stdout + run.stderr)[-3000:]}",
                        seconds=round(time.time() - t0, 1))
        with open(path) as f:
            res = json.load(f)
    return dict(res["gpu"], seconds=round(time.time() - t0, 1))


def machine():
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(gpu=gpu, torch=torch.__version__, triton=triton_version, python=platform.python_version(),
                cpus=os.cpu_count(), cpu=cpu_name(), machine=machine_text("cuda" if gpu else "cpu"))


# -----------------------------------------------------------------------------
# tables: Markdown, a cell a figure or why the row has none (results.measured)

markdown = functools.partial(format_table, markdown=True)


def tables(res):
    """The Markdown that docs/gpu.md shows for a run: where and when, the tests' counts, the training steps,
    the evaluation and the fused kernel's targets."""
    m, tests, bench = res["meta"], res["tests"], res["bench"]
    where = m["gpu"] or f"no GPU ({m['cpu']}, {m['cpus']} cores)"
    lines = [f"{'Dry run, tiny sizes, ' if m['dry'] else ''}{where}; torch {m['torch']}, Triton {m['triton']}; "
             f"{m['started']}; {m['seconds'] / 60:.1f} min in all.", ""]
    if "error" in tests:
        lines += [f"GPU tests: not run ({tests['error'].splitlines()[0]}).", ""]
    else:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(tests["counts"].items())) or "no result"
        stopped = f", {tests['timed_out']} stopped at the limit" if tests["timed_out"] else ""
        lines += [f"GPU tests ({TESTS}, {tests['collected']} in {tests['processes']} processes): {counts}"
                  f"{stopped}; {tests['seconds']:.0f} s."]
        lines += [f"- {line}" for line in tests["failures"]] + [""]
    if "error" in bench:
        return "\n".join(lines + [f"bench.py: {bench['error'].splitlines()[0]} ({bench['seconds']:.0f} s)."])
    ref = bench["reference"]
    size = bench["size"]
    lines += [f"Training step, {size['n_layer']} layers x {size['n_head']} heads x {size['n_embd']}, bf16 autocast, "
              f"eager; x {ref}: in rounds paired with {ref}'s; x base: against the encoding without DAPE "
              f"({bench['seconds']:.0f} s for the benchmark):", ""]
    lines.append(markdown(["model", "T x batch", "ms", f"x {ref}", "x base", "peak GB"], [
        [r["model"], f"{r['T']} x {r['batch']}", measured(r, "ms", ".1f"), measured(r, "ratio", ".2f"),
         measured(r, "vs_base", ".2f"), f"{r['peak_mb'] / 1024:.1f}" if r.get("peak_mb") else "-"]
        for r in bench["rows"] if not r.get("compiled")]))
    lengths = sorted({e["T"] for e in bench["eval"]})
    names = list(dict.fromkeys(e["model"] for e in bench["eval"]))
    at = {(e["model"], e["T"]): e for e in bench["eval"]}
    lines += ["", "Evaluation forward, batch 1, bf16, loss on the last 256 tokens (ms, and x " + ref + "):", ""]
    lines.append(markdown(["model"] + [f"{T} tokens" for T in lengths] + [f"peak GB at {lengths[-1]}"], [
        [name] + [f"{measured(at[name, T], 'ms', '.1f')} ({measured(at[name, T], 'ratio', '.2f')})" for T in lengths]
        + [f"{at[name, lengths[-1]]['peak_mb'] / 1024:.1f}" if at[name, lengths[-1]].get("peak_mb") else "-"]
        for name in names]))
    lines += ["", "The fused kernel's targets:", ""]
    lines.append(markdown(["target", "verdict", "figure"],
                          [[v["target"], v["verdict"], v.get("shown") or v.get("why", "")] for v in bench["verdicts"]]))
    return "\n".join(lines)


# -----------------------------------------------------------------------------


def main(argv=None):
    cfg = configure(config_defaults(globals()), argv)
    if cfg["tables_from"]:
        if not os.path.isfile(cfg["tables_from"]):
            raise SystemExit(f"--tables_from: no file {cfg['tables_from']} (gpu_check.py on a GPU writes one)")
        with open(cfg["tables_from"]) as f:
            text = tables(json.load(f))
        print(text)
        return text
    path = cfg["out"] or os.path.join(ROOT, "results/gpu_dry.json" if cfg["dry"] else "docs/results/gpu.json")
    t0 = time.time()
    res = dict(meta=dict(machine(), dry=cfg["dry"], started=time.strftime("%Y-%m-%d %H:%M"),
                         command="python gpu_check.py" + (" --dry" if cfg["dry"] else ""), commit=code_version(),
                         date=time.strftime("%Y-%m-%d")))
    print(f"gpu_check: {res['meta']['gpu'] or 'no GPU'}, torch {res['meta']['torch']}, "
          f"Triton {res['meta']['triton']}", flush=True)
    res["tests"] = run_tests(cfg)
    print(f"GPU tests: {res['tests'].get('counts', res['tests'].get('error'))} ({res['tests']['seconds']} s)",
          flush=True)
    res["bench"] = run_bench(cfg)
    print(f"benchmark: {res['bench']['seconds']} s", flush=True)
    res["meta"]["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    text = tables(res)
    shown = os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT + os.sep) else path
    print(f"\n{text}\n\nwrote {path}; its tables again: python gpu_check.py --tables_from={shown}; to publish "
          f"them, keep it as docs/results/gpu.json, name that file in docs/gpu.md's table block and run "
          f"python tests/test_published_tables.py docs/gpu.md")
    tests = res["tests"]
    if "error" in tests or "error" in res["bench"] or tests["timed_out"] or tests["counts"].get("failed") \
            or tests["counts"].get("errors"):
        raise SystemExit("gpu_check: a part failed or passed its limit (above)")
    return text


if __name__ == "__main__":
    main()
