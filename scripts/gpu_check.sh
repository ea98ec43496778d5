#!/usr/bin/env bash
# One prepared GPU check for a single-GPU host with no internet (torch, triton and
# transformers; no sglang). Three parts, each under its own time limit; a failing part does
# not stop the next one, and every part's log lands in $OUT:
#
# 1. core (scripts/gpu_check.py): Graft's core (gating + pruning, grafting, packing, greedy
#    and sampled verification) and the SGLang plugin's tree step on the GPU for bs in
#    {1, 8, 64} x n in {16, 32, 64}, timed with CUDA events, every result equal to the CPU's;
#    prune+graft captured in a CUDA graph (replay vs eager); retrieval on the GPU against the
#    CPU reference, round for round; FlashInfer's tree attention vs SDPA when flashinfer is
#    importable (or a wheel is given in FLASHINFER_WHEEL and installs offline).
# 2. engine: the reference engine's own lossless, sampling and KV tests with their models on
#    the GPU (SGLANG_GRAFT_TEST_DEVICE=cuda): every policy equals plain decoding there; and
#    the core's CUDA graphs (round, gate, engine with --compile-core, the plugin's tree step)
#    against the eager ops; retrieval on the host handing its proposals to the GPU.
# 3. cli: `sglang-graft generate --device cuda` for every policy (token ids must agree) and a
#    small `sglang-graft bench --device cuda` on the tiny pair, transformers' baselines too.
#    The bench reads GPU_CHECK_QUESTIONS (default ../shared/data/spec_bench_question.jsonl,
#    which does not travel to a device machine: copy it into a carried folder).
#
#   bash scripts/gpu_check.sh                # results in $OUT (or ./gpu_check_out)
#   GPU_CHECK_ARGS="--reps 5" bash scripts/gpu_check.sh
#   GPU_CHECK_PARTS="core" bash scripts/gpu_check.sh
#
# Without a GPU, part 1 runs on the CPU (device auto-detect) and parts 2-3 are skipped.
# Budget: parts stop after 240 / 150 / 120 s (GPU_CHECK_TIMEOUT sets the first), so the
# script ends within 9 minutes. Exit status: 0 all passed, else the first failing part's
# status (1 a result differed, 124 timed out).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpu_check_out}
PARTS=${GPU_CHECK_PARTS:-core engine cli}
QUESTIONS=${GPU_CHECK_QUESTIONS:-../shared/data/spec_bench_question.jsonl}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
  >"$OUT_DIR/gpu.txt" 2>&1 || echo "no nvidia-smi" >"$OUT_DIR/gpu.txt"
"$PY" -c 'import sys, torch, importlib.util as u
tf = __import__("transformers").__version__ if u.find_spec("transformers") else "absent"
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "transformers", tf)' | tee -a "$OUT_DIR/gpu.txt"
has_cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')

status=0
# part NAME SECONDS CMD...: runs CMD under a time limit, its output into $OUT/NAME.log.
part() {
  local name=$1 limit=$2 rc
  shift 2
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  echo "[gpu_check] part '$name' (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) echo "[gpu_check] part '$name': passed" ;;
    124) echo "[gpu_check] part '$name': timed out after ${limit}s" ;;
    *) echo "[gpu_check] part '$name': FAILED (exit $rc)" ;;
  esac
  [ "$status" -eq 0 ] && status=$rc
  return 0
}

if [ -n "${FLASHINFER_WHEEL:-}" ] && [ -f "$FLASHINFER_WHEEL" ]; then
  target=$(mktemp -d)
  if timeout 60 "$PY" -m pip install -q --no-index --no-deps --target "$target" "$FLASHINFER_WHEEL" >"$OUT_DIR/flashinfer_install.txt" 2>&1; then
    export PYTHONPATH="$target:$PYTHONPATH"
  else
    echo "[gpu_check] flashinfer wheel did not install offline; see flashinfer_install.txt" >&2
  fi
fi

# shellcheck disable=SC2086
part core "${GPU_CHECK_TIMEOUT:-240}" "$PY" scripts/gpu_check.py --out "$OUT_DIR/gpu_check.json" ${GPU_CHECK_ARGS:-}

if [ "$has_cuda" = 1 ]; then
  part engine 150 env SGLANG_GRAFT_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider --tb=short \
    tests/test_engine_lossless.py tests/test_engine_sampling.py tests/test_engine_kv.py \
    tests/test_continue_drafts.py tests/test_draft_seeds.py \
    tests/test_compiled.py::test_cuda_graph_round_equals_eager_and_reads_live_calibration \
    tests/test_compiled.py::test_cuda_graph_gate_equals_eager_and_runs_eagerly_inside_a_capture \
    tests/test_compiled.py::test_engine_with_cuda_graph_core_is_lossless \
    tests/test_compiled.py::test_sglang_tree_builder_replays_the_round_on_cuda \
    tests/test_retrieval_retriever.py::test_rounds_on_the_host_with_proposals_handed_to_another_device
  part cli 120 "$PY" scripts/gpu_cli_check.py --device cuda --questions "$QUESTIONS" --out "$OUT_DIR/bench"
else
  echo "[gpu_check] no CUDA device: parts 'engine' and 'cli' skipped"
fi
echo "[gpu_check] $([ "$status" -eq 0 ] && echo passed || echo "FAILED (first failing part's exit status $status)")"
exit "$status"
