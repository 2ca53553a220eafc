"""docs/reading.md's reading path stays true: each `file:a-b` is exactly the definition it names (a whole file, a
module's docstring, or a class, function or method with its decorators), and the whole is one teaching session's
length."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| `([\w.]+\.py):(\d+)-(\d+)` \| (?:`([\w.]+)`|(\(whole file\)|\(docstring\))) \|", re.M)


def lines_of(path, name):
    """The first and last line of a definition of path: '(whole file)', '(docstring)' or a dotted name."""
    text = open(os.path.join(ROOT, path)).read()
    tree = ast.parse(text)
    if name == "(whole file)":
        return 1, len(text.splitlines())
    if name == "(docstring)":
        return tree.body[0].lineno, tree.body[0].end_lineno
    node = tree
    for part in name.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node.lineno - len(node.decorator_list), node.end_lineno


def entries(text):
    return [(m[1], int(m[2]), int(m[3]), m[4] or m[5]) for m in ROW.finditer(text)]


def stale(text):
    """The rows of a page whose range is not the definition they name, each with its range now."""
    return [(f, a, b, name, lines_of(f, name)) for f, a, b, name in entries(text) if (a, b) != lines_of(f, name)]


PAGE = open(os.path.join(ROOT, "docs", "reading.md")).read()


def test_every_range_is_the_definition_it_names():
    assert len(entries(PAGE)) >= 10
    wrong = stale(PAGE)
    assert not wrong, "docs/reading.md: update these ranges:\n" + "\n".join(
        f"`{f}:{a}-{b}` {name} is now `{f}:{x}-{y}`" for f, a, b, name, (x, y) in wrong)


def test_the_path_is_one_session_long():
    total = sum(b - a + 1 for _, a, b, _ in entries(PAGE))
    assert 300 <= total <= 500, total


def test_a_range_off_by_one_line_is_caught():
    f, a, b, name = entries(PAGE)[2]
    planted = PAGE.replace(f"`{f}:{a}-{b}`", f"`{f}:{a}-{b + 1}`")
    assert [row[:4] for row in stale(planted)] == [(f, a, b + 1, name)]
