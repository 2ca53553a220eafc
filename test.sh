#!/usr/bin/env bash
# Install what the tests need and run them: `bash test.sh` (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh
# Triton ships with PyTorch's CUDA builds, not its CPU build: the fused DAPE kernel's tests run it on the
# CPU through Triton's interpreter (tests/test_dape_triton.py), so a CPU machine installs it here
"${PYTHON:-python3}" -c "import triton" 2>/dev/null || "${PYTHON:-python3}" -m pip install -q triton
# scipy, for the tests only (the code's statistics are numpy alone): tests/test_stats.py and the Welch and
# interval tests check common.py's permutation test, Holm's adjustment and t intervals against scipy.stats, and
# skip without it, which would leave CI checking them only by hand (1.11 or later: ttest_ind's confidence_interval)
"${PYTHON:-python3}" -c "import scipy" 2>/dev/null || "${PYTHON:-python3}" -m pip install -q "scipy>=1.11"
# flash-linear-attention's reference PaTH attention (fla.ops.path_attn.naive, in its fla-core package), for
# tests/test_path.py only: not a dependency of the code. Its own requirements are torch and einops, here
# already, so none are pulled in (--no-deps keeps pip from touching the installed torch)
"${PYTHON:-python3}" -c "import fla" 2>/dev/null || "${PYTHON:-python3}" -m pip install -q --no-deps "fla-core==0.6.0"
# the default run leaves out tests marked slow; `bash test.sh -m ""` runs everything
exec "${PYTHON:-python3}" -m pytest -m "not slow" "$@"
