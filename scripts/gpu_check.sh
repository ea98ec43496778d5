#!/usr/bin/env bash
# One prepared GPU check for a single-GPU host with no internet (torch, triton; no sglang).
#
# Runs Graft's core (gating + pruning, grafting, packing, greedy and sampled verification)
# and the SGLang plugin's tree step on the GPU for bs in {1, 8, 64} x n in {16, 32, 64},
# timed with CUDA events, and requires every result to equal the CPU's. When FlashInfer
# is importable (or a wheel is given in FLASHINFER_WHEEL and installs offline), its tree
# attention over a grafted mask is compared with SDPA; otherwise that part is skipped.
# Retrieval (recycling table on the GPU) runs a synthetic stream at bs 1 and 32 and must
# propose exactly what the CPU reference proposes, round for round.
# Without a GPU it runs the same checks on the CPU (device auto-detect).
#
#   bash scripts/gpu_check.sh                # results in $OUT (or ./gpu_check_out)
#   GPU_CHECK_ARGS="--reps 5" bash scripts/gpu_check.sh
#
# Budget: the Python part is stopped after GPU_CHECK_TIMEOUT seconds (default 420), so
# the whole script ends within 8 minutes. Exit status: 0 passed, 1 a result differed,
# 124 timed out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpu_check_out}
mkdir -p "$OUT_DIR"

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
  >"$OUT_DIR/gpu.txt" 2>&1 || echo "no nvidia-smi" >"$OUT_DIR/gpu.txt"
"$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' \
  | tee -a "$OUT_DIR/gpu.txt"

if [ -n "${FLASHINFER_WHEEL:-}" ] && [ -f "$FLASHINFER_WHEEL" ]; then
  target=$(mktemp -d)
  if timeout 60 "$PY" -m pip install -q --no-index --no-deps --target "$target" "$FLASHINFER_WHEEL" >"$OUT_DIR/flashinfer_install.txt" 2>&1; then
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "[gpu_check] flashinfer wheel did not install offline; see flashinfer_install.txt" >&2
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
set +e
# shellcheck disable=SC2086
timeout "${GPU_CHECK_TIMEOUT:-420}" "$PY" scripts/gpu_check.py --out "$OUT_DIR/gpu_check.json" ${GPU_CHECK_ARGS:-} \
  2>&1 | tee "$OUT_DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -eq 124 ]; then
  echo "[gpu_check] timed out after ${GPU_CHECK_TIMEOUT:-420}s" >&2
fi
exit "$rc"
