#!/usr/bin/env bash
# Set up on a fresh machine (idempotent) and run the whole test suite. CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: the suite is missing or mis-configured" >&2
  exit 1
fi
exit "$rc"
