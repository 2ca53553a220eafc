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
