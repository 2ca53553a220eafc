"""bench.py's quick mode runs end to end on a tiny size, writes the JSON it promises, and its optimized
DAPE modules are equal to the plain form (Appendix J) it times them against."""

import json

import pytest

import bench


@pytest.mark.recorded_dape
def test_bench_quick_writes_every_section(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--pos=kerple", "--repeats=1", "--warmup=0", "--module_lengths=48",
                "--module_repeats=1", "--eval_lengths=96", "--eval_repeats=1", "--gpu_models=kerple,kerple+v1,fox,fox+v2:torch",
                "--sections=train,module,eval,gpu,timing,decide", "--timing_methods=kerple,dape-kerple,dapev2-alibi",
                "--timing_lengths=16,32", "--timing_repeats=1", "--decide_context=32", f"--out={out}"])
    res = json.loads(out.read_text())
    assert set(res) >= {"meta", "train", "module", "eval", "gpu", "timing", "decide"}
    decide = res["decide"]
    assert decide["per_call_us"] > 0 and decide["step_ms"] > 0 and decide["context"] == 32
    assert decide["share"] == pytest.approx(decide["per_call_us"] * 1e-3 * decide["n_layer"] / decide["step_ms"])

    train = {(r["pos"], r["dape"]): r for r in res["train"]["rows"]}
    assert set(train) == {("kerple", d) for d in ("none", "v1", "v2", "plain-manual", "plain-sdpa")}
    assert all(r["ms"] > 0 for r in train.values())
    assert train[("kerple", "none")]["ratio"] == 1.0 and train[("kerple", "v1")]["ratio"] > 0

    rows = res["module"]["rows"]
    assert {(r["module"], r["mode"]) for r in rows} == {(m, mode) for m in ("v1", "v2") for mode in ("causal", "full")}
    for r in rows:  # the equality check between naive and optimized modules passed
        assert r["equal"] is True and r["max_rel_err"] < 1e-3, r
        assert {"naive_ms", "ours_ms", "speedup", "naive_mb", "ours_mb", "mem_ratio"} <= set(r)

    ev = res["eval"]["rows"]
    assert {(r["dape"], r["blocked"]) for r in ev} == {(d, b) for d in ("none", "v1", "v2") for b in (True, False)}
    assert all(r["us_per_token"] > 0 and r["rss_peak_mb"] > 0 for r in ev)

    gpu = res["gpu"]
    assert gpu["fallback"] == (gpu["device"] == "cpu") and gpu["reference"] == "kerple"
    models = ["kerple", "kerple+v1", "fox", "fox+v2:torch"]
    assert [r["model"] for r in gpu["rows"]] == models and all(r["ms"] > 0 for r in gpu["rows"])
    steps = {r["model"]: r for r in gpu["rows"]}
    assert steps["kerple"]["ratio"] == 1.0 and steps["kerple"]["vs_base"] == 1.0
    assert steps["fox+v2:torch"]["vs_base"] == steps["fox+v2:torch"]["ms"] / steps["fox"]["ms"]
    assert [(e["model"], e["T"]) for e in gpu["eval"]] == [(m, T) for T in (128, 256) for m in models]
    assert all(e["ratio"] == e["ms"] / next(b["ms"] for b in gpu["eval"] if b["model"] == "kerple" and b["T"] == e["T"])
               for e in gpu["eval"])
    assert len(gpu["verdicts"]) == 5 and all(v["verdict"] == "not measured" and v["why"] == "no CUDA GPU"
                                             for v in gpu["verdicts"])

    timing = {r["method"]: r for r in res["timing"]["rows"]}
    assert list(timing) == ["kerple", "dape-kerple", "dapev2-alibi"]
    assert timing["kerple"]["ratio"] == 1.0 and all(r["16_ms"] > 0 and r["32_ms"] > 0 for r in timing.values())

    # docs/benchmark.md's tables, printed again from the file: the command that wrote it, a table per section,
    # each row's figures as the file holds them
    assert res["meta"]["command"].startswith("python bench.py --quick --pos=kerple")
    text = bench.main([f"--tables_from={out}"])
    assert text.startswith(f"`{res['meta']['command']}`: {res['meta']['cpu']}")
    k1 = train[("kerple", "v1")]
    assert f"| kerple | v1 | {k1['ms']:.1f} ({k1['ms_min']:.1f}) | {k1['ratio']:.2f} | - |" in text
    r = rows[0]
    assert f"| {r['module']} | {r['mode']} | 48 | {r['naive_ms']:.1f} / {r['ours_ms']:.1f} | {r['speedup']:.1f} |" in text
    e = ev[-1]
    assert f"| kerple | {e['dape']} | 96 | {'yes' if e['blocked'] else 'no'} | {e['ms']:.0f} |" in text
    assert f"| dapev2-alibi | {timing['dapev2-alibi']['16_ms']:.0f} |" in text
    assert f"| fox+v2:torch | 64 x 4 | no | {steps['fox+v2:torch']['ms']:.1f} |" in text
    assert f"{decide['per_call_us']:.1f} us per layer" in text
    for title in ("Training step", "DAPE alone", "Evaluation forward", "Table 1's timing", "The gpu section"):
        assert text.count(title) == 1, title


def test_attention_variants_against_softmax(tmp_path):
    """--attn adds stick-breaking and log-length scaling to every pos x dape of the train section, each with its
    ratio to the same model with softmax (and the ratio to no DAPE within its own variant); /attn in
    --gpu_models does the same in the gpu section (its default list has stick-breaking); an unknown variant
    is an error that lists them."""
    assert "kerple/stickbreaking" in bench.gpu_models.split(",")
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--sections=train,gpu", "--pos=kerple", "--dape=none,v1", "--repeats=1", "--warmup=0",
                "--attn=softmax,stickbreaking,logn", "--eval_repeats=1",
                "--gpu_models=kerple,kerple/stickbreaking,kerple+v1/stickbreaking", f"--out={out}"])
    res = json.loads(out.read_text())
    train = {(r["pos"], r["dape"], r["attn"]): r for r in res["train"]["rows"]}
    assert set(train) == {("kerple", d, a) for d in ("none", "v1") for a in ("softmax", "stickbreaking", "logn")} | {
        ("kerple", d, "softmax") for d in ("plain-manual", "plain-sdpa")}
    for (_, d, a), r in train.items():  # one round: each ratio is the quotient of the two steps' times
        if a != "softmax":
            assert r["vs_softmax"] == pytest.approx(r["ms"] / train[("kerple", d, "softmax")]["ms"])
            assert r["ratio"] == pytest.approx(r["ms"] / train[("kerple", "none", a)]["ms"])
        else:
            assert r["vs_softmax"] is None
    r = train[("kerple", "v1", "stickbreaking")]
    text = bench.main([f"--tables_from={out}"])
    assert (f"| kerple | v1 | stickbreaking | {r['ms']:.1f} ({r['ms_min']:.1f}) | {r['ratio']:.2f} | - | "
            f"{r['vs_softmax']:.2f} |") in text
    steps = {r["model"]: r for r in res["gpu"]["rows"]}
    assert steps["kerple/stickbreaking"]["attn"] == "stickbreaking" and steps["kerple/stickbreaking"]["vs_base"] == 1.0
    assert steps["kerple+v1/stickbreaking"]["vs_base"] == (steps["kerple+v1/stickbreaking"]["ms"]
                                                        / steps["kerple/stickbreaking"]["ms"])
    with pytest.raises(SystemExit, match="--attn: unknown sigmoid; choose from softmax, stickbreaking"):
        bench.main(["--quick", "--sections=train", "--attn=sigmoid", "--out="])


def test_module_section_measures_memory_of_the_path_it_timed(monkeypatch):
    """Memory is measured after every timing: each module must still run the path it was timed on (the fast
    one for ours, dape.py's plain form for the copy), not whichever module was made last."""
    calls, seen = {}, []
    module_call = bench.module_call

    def spy(mod, *args, fast=False):
        seen.append(mod)  # kept alive: a module freed after its row could hand its id to the next one
        calls.setdefault(id(mod), set()).add(fast)
        return module_call(mod, *args, fast=fast)
    monkeypatch.setattr(bench, "module_call", spy)
    res = bench.module_section(dict(bench.config_defaults(vars(bench)), module_lengths="24,40", module_repeats=1,
                                    module_modes="causal"), dict(n_head=2))
    bench.run_memory_jobs()
    assert len(res["rows"]) == 4 and all("mem_ratio" in r for r in res["rows"])
    assert sorted(map(len, calls.values())) == [1] * len(calls), "a module ran both paths"
    assert sum(fast == {True} for fast in calls.values()) == 4  # ours, one per row


def test_tables_from_names_a_missing_or_foreign_file(tmp_path):
    with pytest.raises(SystemExit, match="no file .*python bench.py --out="):
        bench.main([f"--tables_from={tmp_path / 'none.json'}"])
    (tmp_path / "other.json").write_text('{"runs": []}')
    with pytest.raises(SystemExit, match="neither a bench.py --out file nor a fit file"):
        bench.main([f"--tables_from={tmp_path / 'other.json'}"])


def test_timing_rejects_an_unknown_method():
    import pytest
    with pytest.raises(SystemExit, match="dape-<encoding>"):
        bench.main(["--quick", "--sections=timing", "--timing_methods=kerple,v3-kerple", "--out="])


def test_peak_memory_sees_a_large_allocation():
    import torch
    extra, total = bench.peak_memory(lambda: torch.ones(64, 2 ** 20).sum(), "cpu")  # 256 MB
    assert 200 * 2 ** 20 < extra < 400 * 2 ** 20 and total > extra


def gpu_result(v1=1.1, v2=1.4, mem=(1000.0, 1250.0), fit=70 * 1024.0, eval_ratio=1.6):
    """A gpu section's result as a GPU run would leave it (eager rows at 512x32 and 1024x32, compiled ones
    that must be ignored, the evaluation's ratios)."""
    rows = [dict(pos="kerple", dape="none", T=512, batch=32, compiled=False, ms=100.0, peak_mb=mem[0]),
            dict(pos="kerple", dape="v1", T=512, batch=32, compiled=False, ms=100.0 * v1, peak_mb=mem[1]),
            dict(pos="kerple", dape="v2", T=512, batch=32, compiled=False, ms=100.0 * v2, peak_mb=900.0),
            dict(pos="kerple", dape="v1", T=512, batch=32, compiled=True, ms=50.0, peak_mb=1.0),
            dict(pos="fox", dape="none", T=512, batch=32, compiled=False, ms=1000.0, peak_mb=1.0),
            dict(pos="kerple", dape="v1", T=1024, batch=32, compiled=True, skipped="out of memory")]
    rows.append(dict(pos="kerple", dape="v1", T=1024, batch=32, compiled=False, skipped="out of memory")
                if fit is None else
                dict(pos="kerple", dape="v1", T=1024, batch=32, compiled=False, ms=1.0, peak_mb=fit))
    evals = [dict(pos="kerple", dape="none", T=T, ms=10.0 * T) for T in (2048, 8192)]
    evals += [dict(pos="kerple", dape="v1", T=2048, ms=1.0), dict(pos="kerple", dape="v1", T=8192, ms=81920 * eval_ratio),
              dict(pos="fox", dape="none", T=8192, ms=1.0)]
    return dict(device="cuda", rows=rows, eval=evals)


def test_gpu_verdicts_read_the_right_rows(monkeypatch):
    """Each target from its own figure: the eager step ratios at T=512, batch 32 (not the compiled ones),
    the V1 step's peak memory over the encoding's, the T=1024 step's peak memory (out of memory on an
    80 GB GPU, which reports about 79.2 GiB to CUDA, is 'not met'), the evaluation's ratio; all 'not
    measured' when the kernel failed its check against dape.py."""
    import types
    import dape_paths
    import torch
    memory = lambda gib: lambda i: types.SimpleNamespace(total_memory=int(gib * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", memory(79.2))
    monkeypatch.setattr(dape_paths, "VERDICTS", {("cuda", "a kind of call"): None})  # the kernel passed
    cfg = dict(bench.config_defaults(vars(bench)))
    verdicts = [(v["verdict"], v.get("shown")) for v in bench.gpu_verdicts(gpu_result(), cfg)]
    assert bench.gpu_verdicts(gpu_result(), cfg)[4]["target"] == "DAPE V1 evaluation at 8192 tokens / without DAPE"
    assert verdicts == [("met", "1.10"), ("not met", "1.40"), ("not met", "1.25"), ("met", "75.2 GB"),
                        ("not met", "1.60")]
    verdicts = [v["verdict"] for v in bench.gpu_verdicts(gpu_result(1.2, 1.3, (1000.0, 1200.0), None, 1.5), cfg)]
    assert verdicts == ["not met", "met", "met", "not met", "met"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", memory(47.5))  # a 48 GB card cannot tell
    assert [v["verdict"] for v in bench.gpu_verdicts(gpu_result(fit=None), cfg)][3] == "not measured"
    monkeypatch.setattr(dape_paths, "VERDICTS", {("cuda", "a kind of call"): "the fused kernel failed "
                                                                              "(OutOfResources: shared memory)"})
    verdicts = bench.gpu_verdicts(gpu_result(), cfg)
    assert all(v["verdict"] == "not measured" and "OutOfResources" in v["why"] for v in verdicts)


def test_fit_table_marks_what_does_not_fit():
    """docs/gpu.md's fit table: per shape and architecture, the largest figures over the entries of a
    dtype group; a kernel over the GPU's shared memory is 'refused' when dape_triton refuses it, else
    flagged."""
    kernel = lambda kb, regs=255, spill=0: dict(shared=kb * 1024, registers=regs, spill_stores=spill)
    e = lambda arch, dtype, H, kb, refused=None, spill=0, regs=255: dict(
        arch=arch, dtype=dtype, n_head=H, head_size=64, width=32, kernel_size=1, bias=True, causal=True,
        forward=kernel(30, regs), backward=kernel(kb, spill=spill), refused=refused)
    shapes = {(12, 64, 32): ["arxiv_128"], (32, 64, 32): ["big"]}
    entries = [e(86, "bfloat16", 12, 48, spill=100), e(86, "float16", 12, 50, spill=40, regs=200),
               e(90, "bfloat16", 12, 40), e(86, "float16", 32, 120), e(90, "float16", 32, 80),
               e(86, "float32", 32, 120, refused="float32 ..."), e(90, "float32", 32, 230)]
    lines = bench.fit_markdown(entries, shapes).splitlines()
    assert lines[0] == "| heads x size, D (configs) | f | sm_86 (99 KB) | sm_90 (227 KB) |"
    assert lines[2] == "| 12x64, 32 (arxiv_128) | V1 | 30 / 50 KB, 0 / 100 B | 30 / 40 KB, 0 / 0 B |"
    assert lines[3] == "| 32x64, 32 (big) | V1 | 30 / 120 KB, 0 / 0 B **no** | 30 / 80 KB, 0 / 0 B |"
    assert lines[-1] == "Registers per thread: 200 to 255." and len(lines) == 6
    lines = bench.fit_markdown(entries, shapes, "float32").splitlines()
    assert lines[2] == "| 32x64, 32 (big) | V1 | 30 / 120 KB, 0 / 0 B refused | 30 / 230 KB, 0 / 0 B **no** |"


def test_config_head_shapes_reads_every_config_that_sets_heads():
    """Every config file that sets the heads, or runs another that does, is read, with __file__ set as
    configurator.py sets it: config/passkey_cpu_2layer.py runs the file beside it through __file__ (2 of
    passkey_cpu.py's layers, its heads)."""
    import glob
    import os
    where = {name.split(" (")[0]: shape for shape, names in bench.config_head_shapes().items() for name in names}
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")
    for path in glob.glob(os.path.join(root, "*.py")):
        with open(path) as f:
            text = f.read()
        if "n_head" in text or "exec(" in text:
            assert os.path.basename(path)[:-3] in where, path
    assert where["passkey_cpu_2layer"] == where["passkey_cpu"]
