"""Every results table on the results pages is the output of the command written above it, from the results
files in the repository (docs/results/): the test runs each command and compares its output with the page,
character for character. A table on those pages outside such a block must say why it is not regenerated."""
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ['docs/che_results.md', 'docs/passkey_results.md', 'docs/retrieval.md', 'docs/gpu.md']
BLOCK = re.compile(r'<!-- table: (?P<command>[^\n]*?) -->\n(?P<text>.*?)\n<!-- end table -->', re.S)
KEPT = re.compile(r'<!-- search log, not regenerated: [^\n]*? -->\n(?P<text>.*?)\n<!-- end search log -->', re.S)


def blocks():
    out = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        out += [(page, m['command'], m['text']) for m in BLOCK.finditer(text)]
    return out


def run(command):
    """A page's command, run in this process: python <script> <args> -> the text it prints."""
    argv = shlex.split(command)
    assert argv[0] == 'python', command
    script, args = argv[1], argv[2:]
    cwd = os.getcwd()
    os.chdir(ROOT)  # the commands name files relative to the repository
    try:
        if script == 'che_tasks.py':
            import che_tasks
            return che_tasks.main(args)
        if script == 'eval_passkey.py':
            import eval_passkey
            return eval_passkey.main(args)
        if script == 'gpu_check.py':
            import gpu_check
            return gpu_check.main(args)
        if script == 'bench.py':
            import bench
            return bench.main(args)
    finally:
        os.chdir(cwd)
    raise AssertionError(f"no way to run {command!r} here")


@pytest.mark.parametrize('page, command, text', blocks(), ids=lambda v: v if isinstance(v, str) and len(v) < 120 else '')
def test_each_published_table_is_what_its_command_writes(page, command, text, capsys):
    assert '--tables_from=docs/results/' in command, (page, command)
    assert run(command).strip() == text.strip(), f"{page}: the table under `{command}` is not what it prints"


def test_every_results_page_table_is_regenerated_or_says_why_not():
    """On the results pages every Markdown table row lies in a block a command writes, or in a search log
    that states why it cannot be (its runs were not kept)."""
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        assert BLOCK.search(text), f"{page} has no table written by a command"
        rest = KEPT.sub('', BLOCK.sub('', text))
        stray = [line for line in rest.splitlines() if line.startswith('|')]
        assert not stray, f"{page}: table rows that no command writes: {stray[:3]}"


def test_the_demo_section_and_page_are_what_demo_report_prints():
    """The README's demo section and docs/demo_results.md are what `demo_report.py --tables_from=docs/results/demo`
    prints from the files the demo kept; a section measured before those files were kept says so."""
    import demo_report
    with open(os.path.join(ROOT, 'README.md')) as f:
        readme = f.read()
    with open(os.path.join(ROOT, 'docs', 'demo_results.md')) as f:
        page = f.read()
    section = demo_report.START + readme.split(demo_report.START)[1].split(demo_report.END)[0] + demo_report.END
    saved = os.path.join(ROOT, 'docs', 'results', 'demo')
    if not os.path.exists(os.path.join(saved, 'results.json')):
        exempt = '<!-- not regenerated: measured before demo_report.py kept its inputs in docs/results/demo/'
        assert section.startswith(demo_report.START + exempt) and exempt in page.splitlines()[1]
        return
    assert demo_report.tables_from(saved) == f"{section}\n\n{page}", "rewrite them: python demo_report.py results/demo"
