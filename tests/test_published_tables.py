"""Every results table in README.md and docs/ is the output of the command written above it, from the results
files in the repository (docs/results/): the test finds each such block wherever it stands, runs its command
and compares the output with the page, character for character. A table on a results page outside such a
block is a dated search log that says why it cannot be rerun."""
import glob
import json
import os
import re
import shlex
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the pages of measured figures; tables on the others (README's file list, docs/encodings.md's flags) are
# reference, not results
PAGES = ['docs/che_results.md', 'docs/passkey_results.md', 'docs/retrieval.md', 'docs/gpu.md', 'docs/benchmark.md',
         'docs/demo_setting.md', 'docs/dape_init.md']
# a block's text never holds another block's start, so an empty or unclosed block cannot swallow the page
BLOCK = re.compile(r'<!-- table: (?P<command>[^\n]*?) -->\n(?P<text>(?:(?!<!-- table:).)*?)<!-- end table -->', re.S)
KEPT = re.compile(r'<!-- search log, not regenerated: (?P<date>\d{4}-\d\d-\d\d), (?P<why>[^\n]+?) -->\n'
                  r'(?P<text>.*?)\n<!-- end search log -->', re.S)


def markdown_files():
    return ['README.md'] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'),
                                                                               recursive=True))


def blocks():
    out = []
    for page in markdown_files():
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
        if script == 'demo_report.py':
            import demo_report
            return demo_report.main(args)
        if script == 'degrade_search.py':
            import degrade_search
            return degrade_search.main(args)
    finally:
        os.chdir(cwd)
    raise AssertionError(f"no way to run {command!r} here")


@pytest.mark.parametrize('page, command, text', blocks(), ids=lambda v: v if isinstance(v, str) and len(v) < 120 else '')
def test_each_published_table_is_what_its_command_writes(page, command, text, capsys):
    assert '_from=docs/results/' in command, (page, command)
    assert run(command).strip() == text.strip(), f"{page}: the table under `{command}` is not what it prints"


def test_every_block_is_closed():
    """Each '<!-- table:' opens exactly one block that its '<!-- end table -->' closes."""
    for page in markdown_files():
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        n = len(BLOCK.findall(text))
        assert text.count('<!-- table:') == n == text.count('<!-- end table -->'), f"{page}: an unclosed block"


def test_the_blocks_are_found_wherever_they_stand():
    """Blocks outside the results pages are rerun too (the README, any page under docs/)."""
    found = {page for page, _, _ in blocks()}
    assert set(PAGES) - {'docs/demo_setting.md'} <= found, set(PAGES) - found


def test_every_results_page_table_is_regenerated_or_says_why_not():
    """On the results pages every Markdown table row lies in a block a command writes, or in a search log
    dated and saying why it cannot be rerun (its runs were not kept, or the code it measured is gone)."""
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        assert BLOCK.search(text) or KEPT.search(text), f"{page} has no table written by a command"
        assert text.count('<!-- search log') == len(KEPT.findall(text)), \
            f"{page}: a search log without its date and reason (<!-- search log, not regenerated: YYYY-MM-DD, why -->)"
        rest = KEPT.sub('', BLOCK.sub('', text))
        stray = [line for line in rest.splitlines() if line.startswith('|')]
        assert not stray, f"{page}: table rows that no command writes: {stray[:3]}"


def test_every_run_in_the_results_files_was_measured():
    """Each run in docs/results/ is as its evaluation wrote it (the scripts' merge marks it `source: run`), never
    a row rebuilt from a page's figures: a table, mean or p-value over rebuilt rows would not be a measurement."""
    files = sorted(glob.glob(os.path.join(ROOT, 'docs', 'results', '*.json')))
    counted = 0
    for path in files:
        with open(path) as f:
            saved = json.load(f)
        for r in saved.get('runs', saved.get('rows', [])):
            assert r.get('source') == 'run', \
                f"{os.path.relpath(path, ROOT)}: {r.get('label', r)} has source {r.get('source')!r}; train and evaluate it " \
                f"again and merge what the evaluation writes (eval_passkey.merge_runs, che_tasks.merge_runs)"
            counted += 1
    assert counted > 0, "no runs found in docs/results/*.json"


def test_every_run_says_where_it_came_from():
    """Each run, row or trial in docs/results/ (and each benchmark's meta) names the code's commit, the command,
    the machine and the date (those of its training where it has one: `trained_by`), so that a later rerun can
    tell a change of code from a change of machine; 'unknown' (a search trial's: 'unrecorded') only where nothing
    recorded it."""
    counted = 0
    for path in sorted(glob.glob(os.path.join(ROOT, 'docs', 'results', '**', '*.json'), recursive=True)):
        with open(path) as f:
            saved = json.load(f)
        records = saved.get('runs') or saved.get('rows') or saved.get('trials') or \
            ([saved['meta']] if 'meta' in saved else [])
        for r in records:
            origin = r.get('trained_by', r)
            missing = [k for k in ('commit', 'command', 'machine', 'date') if not isinstance(origin.get(k), str)
                       or not origin[k].strip()]
            assert not missing, f"{os.path.relpath(path, ROOT)}: {r.get('label', r.get('name', '?'))} lacks {missing}"
            counted += 1
    assert counted > 0


def test_every_search_trial_is_what_the_trial_writer_writes():
    """Each trial in docs/results/degrade_search.json has exactly the fields degrade_search.py --add_trial writes;
    its training's and evaluation's commit, command, machine and date are a run's record or 'unrecorded', never
    words typed in their place; and the bytes it scored are eval_tokens of each of num_windows windows whose
    ends it lists (or 'unrecorded' for a trial whose evaluation did not record them)."""
    import degrade_search
    from degrade_search import UNRECORDED
    with open(os.path.join(ROOT, 'docs', 'results', 'degrade_search.json')) as f:
        search = json.load(f)
    assert search['what'] == degrade_search.WHAT, "the file's 'what' is the trial writer's"
    # what a recorded field looks like: a commit as `git describe --always --dirty` names it, a date as
    # datetime.date.isoformat() writes it, a command that runs the script named, a machine as
    # common.machine_text writes it
    shapes = {'commit': r'[0-9a-f]{7,40}(-dirty)?', 'date': r'\d{4}-\d\d-\d\d',
              'machine': r'[^;]+, (\w+ kernels, )?torch \S+'}
    command = {'trained_by': r'(OMP_NUM_THREADS=1 )?python train\.py \S.*', 'evaluated_by':
               r'(OMP_NUM_THREADS=1 )?python eval_extrapolate\.py \S.*'}
    assert search['trials']
    for t in search['trials']:
        where = f"degrade_search.json: trial {t.get('name')!r}"
        assert tuple(t) == degrade_search.FIELDS, f"{where} has fields {list(t)}, not the trial writer's"
        for run in ('trained_by', 'evaluated_by'):
            assert tuple(t[run]) == degrade_search.PROVENANCE, f"{where}: {run} has {list(t[run])}"
            for k, v in t[run].items():
                shape = command[run] if k == 'command' else shapes[k]
                assert v == UNRECORDED or re.fullmatch(shape, v), f"{where}: {run}.{k} {v!r} is not a recorded value"
        assert t['scored_tokens'] == t['eval_tokens'] * t['num_windows'], where
        assert t['window_ends'] == UNRECORDED or (len(t['window_ends']) == t['num_windows'] and
                                                  all(isinstance(e, int) for e in t['window_ends'])), where
        assert t['eval_seed'] == UNRECORDED or isinstance(t['eval_seed'], int), where
        assert sorted(t['ppl'], key=int) == [str(L) for L in t['lengths']], where


def test_the_demo_section_and_page_are_what_demo_report_prints():
    """The README's demo section and docs/demo_results.md are what `demo_report.py --tables_from=docs/results/demo`
    prints from the files the demo kept."""
    import demo_report
    with open(os.path.join(ROOT, 'README.md')) as f:
        readme = f.read()
    with open(os.path.join(ROOT, 'docs', 'demo_results.md')) as f:
        page = f.read()
    section = demo_report.START + readme.split(demo_report.START)[1].split(demo_report.END)[0] + demo_report.END
    saved = os.path.join(ROOT, 'docs', 'results', 'demo')
    assert demo_report.tables_from(saved) == f"{section}\n\n{page}", "rewrite them: python demo_report.py results/demo"


def demo_rewrite(page, text):
    """The README's demo section, or the whole of docs/demo_results.md, as demo_report.py renders them from the
    published run (docs/results/demo/); any other page as it is."""
    import demo_report
    if page not in ('README.md', os.path.join('docs', 'demo_results.md')):
        return text
    section, rendered = demo_report.render(os.path.join(ROOT, demo_report.PUBLISHED))
    if page == 'README.md':
        head, rest = text.split(demo_report.START, 1)
        return head + section + rest.split(demo_report.END, 1)[1]
    return rendered



# Tests of the tests above: each run on a copy of docs/results/ and a page, planted with what it must catch.

def copy_of_the_pages(tmp_path, monkeypatch, page):
    """README.md, `page` and docs/results/ copied into tmp_path, which this module then takes for the repository."""
    shutil.copytree(os.path.join(ROOT, 'docs', 'results'), tmp_path / 'docs' / 'results')
    for name in ('README.md', page):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.setattr(sys.modules[__name__], 'ROOT', str(tmp_path))
    return tmp_path


def test_the_run_check_fails_on_a_passkey_row_rebuilt_from_a_page(tmp_path, monkeypatch):
    """Passkey files keep their runs under 'rows', not 'runs': a row there that is not `source: run` fails."""
    copy = copy_of_the_pages(tmp_path, monkeypatch, 'docs/passkey_results.md')
    test_every_run_in_the_results_files_was_measured()
    path = copy / 'docs' / 'results' / 'passkey_cpu.json'
    saved = json.loads(path.read_text())
    saved['rows'][0]['source'] = 'page'
    path.write_text(json.dumps(saved))
    with pytest.raises(AssertionError, match=r"docs/results/passkey_cpu\.json: .* has source 'page'"):
        test_every_run_in_the_results_files_was_measured()


@pytest.mark.parametrize('field, value', [('commit', 'f207690 or c490ff8'), ('date', '2026-11-27 (by hand)'),
                                          ('command', 'as on the page')])
def test_the_trial_check_fails_on_a_hand_typed_field(tmp_path, monkeypatch, field, value):
    """A search trial whose provenance holds words typed in place of a record fails, and so does one with a
    field the trial writer does not write (the old hard-coded `source`)."""
    copy = copy_of_the_pages(tmp_path, monkeypatch, 'docs/demo_setting.md')
    test_every_search_trial_is_what_the_trial_writer_writes()
    path = copy / 'docs' / 'results' / 'degrade_search.json'
    saved = json.loads(path.read_text())
    saved['trials'][0]['trained_by'][field] = value
    path.write_text(json.dumps(saved))
    with pytest.raises(AssertionError, match=f"trained_by.{field} .* is not a recorded value"):
        test_every_search_trial_is_what_the_trial_writer_writes()
    saved['trials'][0] = dict(saved['trials'][0], source='run')
    saved['trials'][0]['trained_by'][field] = 'unrecorded'
    path.write_text(json.dumps(saved))
    with pytest.raises(AssertionError, match="not the trial writer's"):
        test_every_search_trial_is_what_the_trial_writer_writes()


@pytest.mark.parametrize('cut', ['last line', 'first line'])
def test_the_table_check_fails_on_a_block_that_lost_a_line(tmp_path, monkeypatch, capsys, cut):
    """A page's block that is a part of its command's output, not all of it, fails."""
    page = 'docs/passkey_results.md'
    copy = copy_of_the_pages(tmp_path, monkeypatch, page)
    (_, command, text), *_ = [b for b in blocks() if b[0] == page]
    test_each_published_table_is_what_its_command_writes(page, command, text, capsys)
    lines = text.strip().splitlines()
    part = '\n'.join(lines[:-1] if cut == 'last line' else lines[1:]) + '\n'
    (copy / page).write_text((copy / page).read_text().replace(text, part, 1))
    (found,) = [b for b in blocks() if b[0] == page and b[1] == command]
    assert found[2] == part
    with pytest.raises(AssertionError, match="is not what it prints"):
        test_each_published_table_is_what_its_command_writes(*found, capsys)


if __name__ == '__main__':
    # python tests/test_published_tables.py [PAGE ...]: rewrite every block of the pages (default: all) with what
    # its command prints now, after the results files or the code that writes the tables changed, and the
    # README's demo section and docs/demo_results.md with what demo_report.py renders; the tests then check the
    # pages as written
    import contextlib
    import io
    import sys
    sys.path.insert(0, ROOT)
    pages = sys.argv[1:] or markdown_files()
    for page in pages:
        path = os.path.join(ROOT, page) if not os.path.isabs(page) else page
        with open(path) as f:
            text = f.read()

        def rewrite(m):
            with contextlib.redirect_stdout(io.StringIO()):
                printed = run(m['command'])
            return f"<!-- table: {m['command']} -->\n{printed.strip()}\n<!-- end table -->"
        new = demo_rewrite(os.path.relpath(path, ROOT), BLOCK.sub(rewrite, text))
        if new != text:
            with open(path, 'w') as f:
                f.write(new)
            print(f"rewrote {page}")
