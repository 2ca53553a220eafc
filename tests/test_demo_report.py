"""demo_report.py on small files of its own: publishing refused where it would drop what is published, and what
counts as published (the demo end to end: tests/test_demo.py; the degradation search: tests/test_degrade_search.py)."""

import json
import os
import re

import pytest

import demo_report

PARTS = ("rope_scaling/results.json", "passkey/passkey.json")
README = "intro\n<!-- demo-results:start -->\nold\n<!-- demo-results:end -->\nend\n"


def write_run(folder, seeds, parts=PARTS):
    """A results directory with {label: number of seeds} and the parts named: what dropped_rows reads."""
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"groups": [{"label": k, "n": n} for k, n in seeds.items()]}))
    (folder / "ppl_vs_length.png").write_bytes(b"png")
    for part in parts:
        (folder / part).parent.mkdir(parents=True, exist_ok=True)
        (folder / part).write_text("{}")


def files(root):
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = f.read()
    return out


STUDY = {"kerple": 4, "dape-kerple": 4, "alibi": 1}
DROPS = {  # the run's change from the published study -> what it would drop
    "a label missing": (dict(seeds={"kerple": 4, "dape-kerple": 4}), "alibi (not in this run)"),
    "a part missing": (dict(parts=PARTS[:1]), "passkey/passkey.json (not in this run)"),
    "one seed fewer": (dict(seeds=dict(STUDY, **{"dape-kerple": 3})), "dape-kerple (4 seeds, this run 3)"),
}


@pytest.mark.parametrize("case", list(DROPS))
def test_publish_refuses_a_run_that_would_drop_a_published_row(tmp_path, monkeypatch, case):
    """Each way a run can hold less than the published study is named and refused, and nothing changes: not the
    README, not docs/. The study is published both where a headline run and where a --full run would go."""
    monkeypatch.setattr(demo_report, "ROOT", str(tmp_path))
    published = tmp_path / demo_report.PUBLISHED
    write_run(published, STUDY)
    write_run(tmp_path / (demo_report.PUBLISHED + "-full"), STUDY)
    (tmp_path / "README.md").write_text(README)
    change, lost = DROPS[case]
    write_run(tmp_path / "run", **dict(dict(seeds=STUDY), **change))
    assert demo_report.dropped_rows(str(tmp_path / "run"), str(published)) == [lost]
    before = files(tmp_path / "docs")
    with pytest.raises(SystemExit, match=r"--publish refused: .* would drop what docs/results/demo\S*/ publishes: "
                                         + re.escape(lost) + r"\. "):
        demo_report.publish(str(tmp_path / "run"))
    assert files(tmp_path / "docs") == before and (tmp_path / "README.md").read_text() == README


def test_a_run_that_holds_the_published_study_drops_nothing(tmp_path):
    """More seeds, a label more, every part: nothing dropped; and nothing is dropped where nothing is published."""
    write_run(tmp_path / "published", STUDY)
    write_run(tmp_path / "run", dict(STUDY, kerple=5, fire=3))
    assert demo_report.dropped_rows(str(tmp_path / "run"), str(tmp_path / "published")) == []
    assert demo_report.dropped_rows(str(tmp_path / "run"), str(tmp_path / "none")) == []


def test_published_is_a_path_inside_docs_results():
    """docs/results/ and what lies in it are published; a folder whose name only begins the same is not."""
    docs = os.path.join(demo_report.ROOT, "docs")
    assert demo_report.is_published(os.path.join(docs, "results", "demo"))
    assert not demo_report.is_published(os.path.join(docs, "results_old", "demo"))
    assert not demo_report.is_published(os.path.join(demo_report.ROOT, "results", "demo"))


def published(name):
    """A published study's results.json (docs/results/NAME), and docs/demo_setting.md with its lines joined."""
    with open(os.path.join(demo_report.ROOT, "docs", "results", name, "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(demo_report.ROOT, "docs", "demo_setting.md")) as f:
        return results, " ".join(f.read().split())


def primary_apart(results):
    """The registered primary test of a study at its floor: every DAPE-FIRE seed below every FIRE seed at 16x,
    the exact p the smallest that the seeds allow. -> its length."""
    groups = {g["label"]: g for g in results["groups"]}
    L = demo_report.primary_length(results)
    test = demo_report.exact_tests(results)[demo_report.PRIMARY][L]
    assert test["p_exact"] == test["p_min"] < demo_report.ALPHA
    assert max(groups["dape-fire"]["ppl"][str(L)]["values"]) < min(groups["fire"]["ppl"][str(L)]["values"])
    return L


def test_the_first_headline_and_the_whole_study_agree_where_they_overlap():
    """docs/demo_setting.md says seeds 1 to 3 of Kerple, DAPE-Kerple, FIRE and DAPE-FIRE have bit for bit the same
    perplexity at 1024 in the first five-seed headline (500 steps, docs/results/demo-500) and the whole study
    (docs/results/demo-full), so that only seeds 4 and 5 were new evidence there: the files say so."""
    ppl = {}
    for name in ("demo-500", "demo-full"):
        with open(os.path.join(demo_report.ROOT, "docs", "results", name, "results.json")) as f:
            ppl[name] = {(r["label"], r["seed"]): r["results"]["1024"]["ppl"] for r in json.load(f)["runs"]}
    shared = [(label, seed) for label in ("kerple", "dape-kerple", "fire", "dape-fire") for seed in (1, 2, 3)]
    assert all(ppl["demo-500"][k] == ppl["demo-full"][k] for k in shared)
    assert {seed for label, seed in ppl["demo-500"]} == {1, 2, 3, 4, 5}
    with open(os.path.join(demo_report.ROOT, "docs", "demo_setting.md")) as f:
        assert "bit for bit the same\nperplexity at 1024 in both" in f.read()


def test_the_first_registrations_result_is_what_its_files_give():
    """The first registration's result (500 steps), which docs/demo_setting.md states in prose, recomputed from
    docs/results/demo-500: the primary test's means, difference, interval and exact p, and the secondary figures
    the paragraph quotes. A figure typed wrong, or files that moved under it, fail here."""
    with open(os.path.join(demo_report.ROOT, "docs", "results", "demo-500", "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(demo_report.ROOT, "docs", "demo_setting.md")) as f:
        page = f.read()
    first = page.split("### The first registration, at 500 steps")[1].split("\n## ")[0]
    prose = " ".join(first.split()).replace("\u2212", "-")
    groups = {g["label"]: g for g in results["groups"]}
    assert {r["iter_num"] for r in results["runs"]} == {500}
    L = demo_report.primary_length(results)
    tests = demo_report.exact_tests(results)
    (c,) = [c for c in results["comparisons"] if (c["label"], c["baseline"]) == demo_report.PRIMARY]
    p = c["p_value"][str(L)]
    a, b = (groups[label]["ppl"][str(L)]["mean"] for label in demo_report.PRIMARY)
    assert (f"{a:.3f} against {b:.3f}, difference {p['mean_diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}], "
            f"exact p {tests[demo_report.PRIMARY][L]['p_exact']:.2g}") in prose
    assert max(groups["dape-fire"]["ppl"][str(L)]["values"]) < min(groups["fire"]["ppl"][str(L)]["values"])
    kerple = tests[("dape-kerple", "kerple")]
    assert all(groups["dape-kerple"]["ppl"][str(n)]["mean"] < groups["kerple"]["ppl"][str(n)]["mean"]
               for n in results["lengths"])
    assert f"at every length (Holm {max(t['p_holm'] for t in kerple.values()):.2g})" in prose
    rises = {r["label"]: r for r in demo_report.rise_tests(results)}
    k, f = rises["dape-kerple"], rises["dape-fire"]
    assert f"({k['rise_a'][0]:.3f}x against {k['rise_b'][0]:.3f}x, Holm {k['p_holm']:.2g})" in prose
    assert f"DAPE-FIRE's rise ({f['rise_a'][0]:.3f}x)" in prose and f"FIRE's ({f['rise_b'][0]:.3f}x," in prose
    assert f"p {f['p_exact']:.2g})" in prose


def test_the_registered_results_sentence_is_what_the_headline_gives():
    """docs/demo_setting.md's sentence on the registered test's result (350 steps, docs/results/demo): every
    DAPE-FIRE seed below every FIRE seed at 1024, the exact p at its floor, significant; recomputed here."""
    results, page = published("demo")
    assert ("**Its result** (the run above, published 2026-12-02): DAPE-FIRE lower than FIRE at 1024 bytes, every "
            "DAPE-FIRE seed below every FIRE seed, exact p at its floor, significant at 0.05") in page
    assert {r["iter_num"] for r in results["runs"]} == {350} and "for 350 steps" in page
    assert primary_apart(results) == 1024


def test_the_headline_retest_sentence_is_what_its_files_give():
    """docs/demo_setting.md says the registered primary test's conclusion holds under ATen's default kernels: every
    DAPE-FIRE seed below every FIRE seed at 1024 there too, the exact p at its floor; recomputed from the retest's
    file (docs/results/demo_rounding_350), which holds the headline's seeds 1 to 5 of both at 350 steps."""
    other, page = published("demo_rounding_350")
    assert ("with ATen's default kernels too, every DAPE-FIRE seed is below every FIRE seed at 1024 bytes (exact p "
            "0.0079, the floor)") in page
    assert {r["iter_num"] for r in other["runs"]} == {350}
    assert all("DEFAULT kernels" in r["trained_by"]["machine"] for r in other["runs"])
    groups = {g["label"]: g for g in other["groups"]}
    assert groups["fire"]["seeds"] == groups["dape-fire"]["seeds"] == demo_report.PRIMARY_SEEDS
    primary_apart(other)
    assert all(groups["dape-fire"]["ppl"][str(n)]["mean"] < groups["fire"]["ppl"][str(n)]["mean"]
               for n in other["lengths"])
    native, _ = published("demo")
    at = lambda results: {r["seed"]: r["results"]["1024"]["ppl"] for r in results["runs"] if r["label"] == "fire"}
    assert f"FIRE's seed 4 by {abs(at(native)[4] - at(other)[4]):.2f} at 16x" in page


def test_the_readmes_dape_paragraph_says_what_the_files_give():
    """The figures of the README's "DAPE in a paragraph", recomputed: each seed's perplexity at 16x over its own at
    1x (the mean over seeds) for FIRE, DAPE-FIRE and Kerple in the headline (docs/results/demo), Kerple with
    log-length scaling in the whole study (docs/results/demo-full), and T5's in its one run of the search."""
    with open(os.path.join(demo_report.ROOT, "README.md")) as f:
        readme = f.read()
    paragraph = " ".join(readme.split("**DAPE in a paragraph.**")[1].split("\n\n")[0].split())
    headline, _ = published("demo")
    whole, _ = published("demo-full")
    rise = lambda results, label: demo_report.seed_ratio(
        next(g for g in results["groups"] if g["label"] == label), results["lengths"][0], 16 * results["lengths"][0])[0]
    assert f"FIRE degrades ({rise(headline, 'fire'):.2f}x at 16x over five seeds)" in paragraph
    assert f"its rise ({rise(headline, 'dape-fire'):.2f}x)" in paragraph
    assert f"Kerple barely rises ({rise(headline, 'kerple'):.2f}x)" in paragraph
    assert f"log-length scaling {rise(whole, 'kerple+logn'):.2f}x over 3 seeds" in paragraph
    with open(os.path.join(demo_report.ROOT, "docs", "results", "degrade_search.json")) as f:
        t5 = next(t for t in json.load(f)["trials"] if t["name"] == "t5")
    assert f"T5's bias rises {t5['ppl']['1024'] / t5['ppl']['64']:.1f}x at 16x in one run" in paragraph
