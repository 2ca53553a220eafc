"""README.md is a short guide and the docs hold the rest: its length, its links, and no table row in two files."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    return {slug(line.lstrip("#")) for line in read(path).splitlines() if re.match(r"#{1,6} ", line)}


def table_rows(text):
    """The rows of every markdown table that carry content: not the header, not the separator."""
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        line = line.strip()
        if not line.startswith("|") or SEPARATOR.match(line):
            continue
        if i + 1 < len(lines) and SEPARATOR.match(lines[i + 1].strip()):
            continue  # a header
        rows.append(line)
    return rows


def test_readme_is_at_most_300_lines():
    n = len(read(README).splitlines())
    assert n <= 300, f"README.md has {n} lines; move the detail to docs/"


def test_readme_states_the_test_command_and_keeps_the_demo_markers():
    text = read(README)
    assert "bash test.sh" in text  # what CI runs
    # demo_report.py rewrites what lies between these, and the demo command line before them
    assert text.count("<!-- demo-results:start -->") == 1 and text.count("<!-- demo-results:end -->") == 1
    assert re.search(r"^bash demo\.sh    #", text.split("<!-- demo-results:start -->")[0], flags=re.M)


def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(read(page)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            name = os.path.relpath(page, ROOT)
            if not os.path.exists(full):
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_no_table_row_of_the_readme_stands_in_a_docs_page():
    """Each figure stands in one file: a results row copied into docs/ would drift from the README's."""
    readme_rows = set(table_rows(read(README)))
    both = [f"{os.path.relpath(page, ROOT)}: {row}" for page in PAGES[1:]
            for row in table_rows(read(page)) if row in readme_rows]
    assert not both, "\n".join(both)


def test_the_helpers_read_tables_headings_and_links_as_github_does():
    text = "| a | b |\n| --- | --- |\n| x | 1.5 |\n\n| c |\n|:--:|\n| y |\n"
    assert table_rows(text) == ["| x | 1.5 |", "| y |"]  # neither the headers nor the separators
    assert slug("Results: the CPU demo") == "results-the-cpu-demo"
    assert slug("`rope`: rotary (Su et al.)") == "rope-rotary-su-et-al"
    assert slug("Variants (`dape_variant`)") == "variants-dape_variant"
    assert LINK.findall("see [x](docs/a.md#b) and ![p](p.png)") == ["docs/a.md#b", "p.png"]
