#!/usr/bin/env bash
# Apply every patches/*.patch inside the installed sglang package directory (patch -p1),
# refusing to apply twice.
# Used by the Dockerfile; safe to run with no patches.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
site=$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("sglang").origin))')
shopt -s nullglob
for p in patches/*.patch; do
  if patch --dry-run -R -p1 -d "$site" -s -f <"$p" >/dev/null 2>&1; then
    echo "[patches] $p already applied to $site"
    continue
  fi
  patch -p1 -d "$site" -s -f --no-backup-if-mismatch <"$p"
  echo "[patches] applied $p to $site"
done
