import os
import sys

# the codebase is a flat folder of scripts: make them importable from the tests
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
