#!/usr/bin/env bash
# Install what the tests need and run them: `bash test.sh` (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh
# Triton ships with PyTorch's CUDA builds, not its CPU build: the fused DAPE kernel's tests run it on the
# CPU through Triton's interpreter (tests/test_dape_triton.py), so a CPU machine installs it here
"${PYTHON:-python3}" -c "import triton" 2>/dev/null || "${PYTHON:-python3}" -m pip install -q triton
# the default run leaves out tests marked slow; `bash test.sh -m ""` runs everything
exec "${PYTHON:-python3}" -m pytest -m "not slow" "$@"
