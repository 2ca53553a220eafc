import os
import sys

# the codebase is a flat folder of scripts: make them importable from the tests
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Without a GPU the Triton kernels (dape_triton.py) run under Triton's interpreter. Triton reads this
# switch when its language module is imported, and any test (or torch itself) may import it first, so it
# is set here, before the test modules are collected.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# A reader's edit of dape.py (an ablation of f, say) is meant to run: dape_paths.py then takes the plain form,
# with one warning. Unedited, that warning is a false alarm, which pytest.ini makes an error. Edited, the
# suite says so at its end, shows the warning instead of failing on it, and skips the tests that check the
# fast paths against the dape.py they record (tests marked recorded_dape); what still fails is meant to:
# the record itself (tests/test_dape.py says what to update) and the plain form against Appendix J.
# In CI (CI=true) the suite stops instead, at its start.
import dape  # noqa: E402
import dape_paths  # noqa: E402
import pytest  # noqa: E402

DAPE_EDITED = next(filter(None, (dape_paths.code_differs(cls(4)) for cls in (dape.DAPEV1, dape.DAPEV2))), None)


def pytest_configure(config):
    # in CI the committed dape.py is never a reader's edit: taken for one, the fingerprint or its record is
    # wrong, and skipping the recorded_dape tests would hide it
    if DAPE_EDITED and os.environ.get("CI", "").lower() == "true":
        raise pytest.UsageError(
            f"CI=true and the committed dape.py is taken for an edit: {DAPE_EDITED}. Either fingerprint.py or "
            f"dape_paths.py misreads dape.py, or dape.py changed without its record (dape_torch.IMPLEMENTS: "
            f"tests/test_dape.py's record test says what to set). Outside CI a reader's edit runs as the plain form")
    if DAPE_EDITED:  # the last matching filter applies: this one over pytest.ini's error
        config.addinivalue_line("filterwarnings", "default:DAPE. .*running the plain form:UserWarning")


def pytest_terminal_summary(terminalreporter):
    if DAPE_EDITED:  # at the end, where pytest.ini's -q still prints it
        terminalreporter.write_sep("=", "dape.py is edited", yellow=True)
        terminalreporter.write_line(f"{DAPE_EDITED}: the plain form ran it everywhere, and the tests of the fast "
                                    f"paths against the dape.py they record were skipped. test_dape.py's record test "
                                    f"says what to update for the fast paths to run it; its tests against Appendix J "
                                    f"fail where the edit changes f")


def pytest_collection_modifyitems(config, items):
    if DAPE_EDITED:
        skip = pytest.mark.skip(reason=f"dape.py is edited ({DAPE_EDITED}): this checks the fast paths against "
                                       f"the dape.py that they implement")
        for item in items:
            if "recorded_dape" in item.keywords:
                item.add_marker(skip)
