"""bench.py's quick mode runs end to end on a tiny size, writes the JSON it promises, and its optimized
DAPE modules are equal to the plain form (Appendix J) it times them against."""

import json

import bench


def test_bench_quick_writes_every_section(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--pos=kerple", "--repeats=1", "--warmup=0", "--module_lengths=48",
                "--module_repeats=1", "--eval_lengths=96", "--eval_repeats=1", "--gpu_pos=kerple",
                "--sections=train,module,eval,gpu,timing", "--timing_methods=kerple,dape-kerple,dapev2-alibi",
                "--timing_lengths=16,32", "--timing_repeats=1", f"--out={out}"])
    res = json.loads(out.read_text())
    assert set(res) >= {"meta", "train", "module", "eval", "gpu", "timing"}

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
    assert gpu["fallback"] == (gpu["device"] == "cpu") and gpu["rows"]
    assert {r["dape"] for r in gpu["rows"]} == {"none", "v1:torch", "v2:torch"}

    timing = {r["method"]: r for r in res["timing"]["rows"]}
    assert list(timing) == ["kerple", "dape-kerple", "dapev2-alibi"]
    assert timing["kerple"]["ratio"] == 1.0 and all(r["16_ms"] > 0 and r["32_ms"] > 0 for r in timing.values())


def test_timing_rejects_an_unknown_method():
    import pytest
    with pytest.raises(SystemExit, match="dape-<encoding>"):
        bench.main(["--quick", "--sections=timing", "--timing_methods=kerple,v3-kerple", "--out="])


def test_peak_memory_sees_a_large_allocation():
    import torch
    extra, total = bench.peak_memory(lambda: torch.ones(64, 2 ** 20).sum(), "cpu")  # 256 MB
    assert 200 * 2 ** 20 < extra < 400 * 2 ** 20 and total > extra
