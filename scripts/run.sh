#!/usr/bin/env bash
# The main job. Sets up .venv (idempotent), then:
#   * on a host with a CUDA GPU and sglang: starts SGLang's server with Graft
#     (`sglang-graft serve --model-path $GRAFT_MODEL_PATH`, extra arguments passed on);
#   * otherwise: the reference engine on CPU. It fetches the Qwen2.5-Coder 1.5B/0.5B pair
#     (scripts/fetch_cpu_models.py, once, ~5 GB in ~/.cache/sglang-graft) and decodes a
#     sample prompt with `sglang-graft generate` (extra arguments passed on).
#
# Options:  --tiny (or GRAFT_TINY=1): tiny in-process random models, a smoke run in seconds.
# Env:      GRAFT_PROMPT, GRAFT_MAX_NEW_TOKENS (64), GRAFT_POLICY (graft), GRAFT_THREADS (all cores),
#           GRAFT_CPU_FLAGS (the CPU tree settings, see below), GRAFT_MODEL_PATH (GPU server
#           target), GRAFT_MODEL_CACHE (where the CPU pair is kept).
set -euo pipefail
cd "$(dirname "$0")/.."

tiny=${GRAFT_TINY:-0}
args=()
for a in "$@"; do
  if [ "$a" = "--tiny" ]; then tiny=1; else args+=("$a"); fi
done

bash scripts/setup.sh
bin=.venv/bin
prompt=${GRAFT_PROMPT:-"Write a Python function that returns the n-th Fibonacci number, with a docstring."}
gen=(--policy "${GRAFT_POLICY:-graft}" --max-new-tokens "${GRAFT_MAX_NEW_TOKENS:-64}" --prompt "$prompt")

if [ "$tiny" = "1" ]; then
  echo "[run] tiny in-process models (smoke run)" >&2
  exec "$bin/sglang-graft" generate --target tiny --draft tiny "${gen[@]}" "${args[@]}"
fi

if "$bin/python" -c "import importlib.util, sys, torch; sys.exit(0 if torch.cuda.is_available() and importlib.util.find_spec('sglang') else 1)"; then
  model=${GRAFT_MODEL_PATH:-Qwen/Qwen3-8B}
  echo "[run] CUDA GPU and sglang found: starting SGLang with Graft on $model" >&2
  exec "$bin/sglang-graft" serve --model-path "$model" "${args[@]}"
fi

echo "[run] no CUDA GPU with sglang here: running the reference engine on CPU" >&2
paths=$("$bin/python" scripts/fetch_cpu_models.py | tail -n 1)
target=$("$bin/python" -c 'import json, sys; print(json.loads(sys.argv[1])["target"])' "$paths")
draft=$("$bin/python" -c 'import json, sys; print(json.loads(sys.argv[1])["draft"])' "$paths")
threads=${GRAFT_THREADS:-$(nproc)}
# The tree settings measured fastest for this pair on 2-core CPUs (README, "Benchmarks"): a
# 12-node budget, 4 children per level, the draft's head over its 32768 lowest ids, the draft
# in int8, the verify-cost curve timed on this host first (a few seconds) and then kept
# fitted to the rounds' own timings (--online-costs: the draft's price too). Later flags
# win; GRAFT_CPU_FLAGS replaces the set (e.g. GRAFT_CPU_FLAGS= for the engine's defaults).
# The dtype is bfloat16; on CPUs without native bf16 matmul the linear layers then run through
# the project's AVX2 kernel (--cpu-kernel auto; see --help).
read -r -a cpu_flags <<< "${GRAFT_CPU_FLAGS---num-nodes 12 --draft-topk 4 --draft-vocab 32768 --draft-int8 --verify-costs auto --online-costs}"
exec "$bin/sglang-graft" generate --target "$target" --draft "$draft" --threads "$threads" \
  "${cpu_flags[@]}" "${gen[@]}" "${args[@]}"
