#!/usr/bin/env bash
# Install the requirements: `bash install.sh` (test.sh and demo.sh call it).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

# torch first, deliberately: requirements.txt asks only for torch>=2.6 so that a GPU machine keeps its
# CUDA build. With no torch installed, pin 2.13.0, which these machines hold as a CPU wheel on disk
# (an unpinned `torch` would download a multi-GB CUDA build from PyPI).
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -r requirements.txt
