#!/usr/bin/env bash
# Install what the tests need and run them: `bash test.sh` (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh
# the default run leaves out tests marked slow; `bash test.sh -m ""` runs everything
exec "${PYTHON:-python3}" -m pytest -m "not slow" "$@"
