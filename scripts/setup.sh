#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
#
# One venv holds everything: torch (the CPU/CUDA build that sglang==0.5.23 pins, 2.14.1),
# sglang itself (so the plugin is tested against the real pinned package), transformers
# for the reference engine, and the test and benchmark tools. Re-running is cheap: the
# install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# AOTInductor (--compile-core, tests/test_compiled.py) builds the compiled core with a C++ compiler.
if ! command -v g++ >/dev/null && ! command -v c++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing g++ (AOTInductor compiles the Graft core with it)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  else
    echo "[setup] no C++ compiler found: --compile-core and its tests need one (apt-get install g++)" >&2
  fi
fi
EXTRAS=${GRAFT_EXTRAS:-sglang,engine,test,bench}
stamp=".venv/.graft-setup-$(cat pyproject.toml | sha256sum | cut -c1-16)-${EXTRAS//,/_}"
if [ -f "$stamp" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
pip_install() {
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2 || true
    echo "[setup] 'pip install $*' failed (see above)" >&2
    exit 1
  fi
  rm -f "$log"
}
echo "[setup] installing sglang-graft[$EXTRAS] into .venv (first time: about 5 minutes)"
pip_install -e ".[$EXTRAS]"
.venv/bin/python -c "import sglang_graft, torch" >/dev/null
case ",$EXTRAS," in *,sglang,*) .venv/bin/python -c "import sglang" >/dev/null ;; esac
rm -f .venv/.graft-setup-*
touch "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
