#!/usr/bin/env bash
# Qwen3-235B-A22B served by SGLang with Graft on one 8-GPU node (tensor parallel 8), over
# the EAGLE-3 draft head lmsys/Qwen3-235B-A22B-EAGLE3.
#
#   bash scripts/launch_qwen3_235b.sh                          # serve on 0.0.0.0:30000
#   GRAFT_PORT=31000 bash scripts/launch_qwen3_235b.sh --graft-policy pruned
#   bash scripts/launch_qwen3_235b.sh --print-args             # show the flags, launch nothing
#
# It runs `sglang-graft serve` (which checks for sglang and a CUDA GPU, then execs
# `python -m sglang.launch_server`). Extra arguments go after the recipe's flags, and
# SGLang keeps the last value of a repeated option, so `--speculative-num-draft-tokens 32`
# on the command line overrides the recipe's 16 (switches such as
# --disable-overlap-schedule cannot be undone that way).
#
# Environment overrides (defaults in brackets):
#   GRAFT_MODEL_PATH [Qwen/Qwen3-235B-A22B]   target: a hub id or a local checkpoint
#   GRAFT_DRAFT_PATH [lmsys/Qwen3-235B-A22B-EAGLE3]  EAGLE-3 head; nvidia/Qwen3-235B-A22B-Eagle3 also fits
#   GRAFT_HOST [0.0.0.0]  GRAFT_PORT [30000]  GRAFT_TP [8]
#   GRAFT_MEM_FRACTION [0.85]  GRAFT_CONTEXT_LENGTH [32768]  GRAFT_MAX_BS [32]
#   SGLANG_GRAFT [sglang-graft]  the launcher (e.g. a venv's bin/sglang-graft)
#
# Memory (bf16, per GPU at --tp-size 8):
#   * weights: 235B parameters x 2 bytes = ~470 GB, so ~59 GB per GPU; the EAGLE-3 head
#     (one decoder layer plus embeddings and lm_head, a few GB in all) adds little.
#   * --mem-fraction-static 0.85 on an 80 GB H100 reserves ~68 GB for weights + KV cache:
#     ~8 GB of KV. A token costs 94 layers x (K+V) x 1 KV head x 128 x 2 bytes = ~47 KB
#     per GPU (the 4 KV heads are replicated across 8 ranks, one per rank), so the pool
#     holds ~170k tokens: 32 concurrent requests of ~5k tokens. The other ~12 GB is for
#     activations, NCCL buffers and the CUDA graphs of the draft and verify passes.
#     If graph capture runs out of memory, lower GRAFT_MEM_FRACTION to 0.80 or
#     GRAFT_MAX_BS to 16. On 141 GB H200s the same line leaves ~60 GB of KV per GPU.
#   * GPUs with less than ~70 GB: use the FP8 checkpoint, GRAFT_MODEL_PATH=
#     Qwen/Qwen3-235B-A22B-FP8 (~30 GB of weights per GPU at tp 8; the same EAGLE-3 head
#     applies). Its 128x128 weight blocks do not divide the per-rank expert width at tp 8
#     (1536 / 8 = 192), so add `--ep-size 8` (experts split whole across ranks), or run
#     it at GRAFT_TP=4 on four 80 GB GPUs.
#
# Context: the checkpoint is trained for 32,768 tokens (its config allows 40,960 positions,
# the extra 8k reserved for output). Longer contexts need YaRN, e.g. GRAFT_CONTEXT_LENGTH=131072
# plus --json-model-override-args '{"rope_scaling":{"rope_type":"yarn","factor":4.0,
# "original_max_position_embeddings":32768}}'; static YaRN can cost quality on short
# prompts, so enable it only when long inputs are expected.
#
# Graft's draft shape: 5 draft steps of top-4 (SGLang's documented EAGLE defaults) feed a
# verify budget of 16 tree nodes per request, root included. topk must be > 1 (Graft
# grafts retrieved chains into a tree; with topk 1 SGLang verifies a single chain) and
# the overlap scheduler must be off (the next tree depends on this round's verified
# tokens); the plugin refuses either at startup. Attention: leave SGLang's default. With
# topk > 1 it picks FlashInfer on Hopper and Blackwell, which reads the tree mask;
# trtllm_mha accepts topk 1 only.
set -euo pipefail

print_args=0
passthrough=()
for a in "$@"; do
  if [ "$a" = "--print-args" ]; then print_args=1; else passthrough+=("$a"); fi
done

# BEGIN RECIPE ARGS (the one place the flags live; tests/test_recipes.py checks them
# against SGLang's ServerArgs through --print-args)
ARGS=(
  --model-path "${GRAFT_MODEL_PATH:-Qwen/Qwen3-235B-A22B}"
  --tp-size "${GRAFT_TP:-8}"
  --host "${GRAFT_HOST:-0.0.0.0}"
  --port "${GRAFT_PORT:-30000}"
  --speculative-algorithm GRAFT
  --speculative-draft-model-path "${GRAFT_DRAFT_PATH:-lmsys/Qwen3-235B-A22B-EAGLE3}"
  --speculative-num-steps 5
  --speculative-eagle-topk 4
  --speculative-num-draft-tokens 16
  --disable-overlap-schedule
  --mem-fraction-static "${GRAFT_MEM_FRACTION:-0.85}"
  --context-length "${GRAFT_CONTEXT_LENGTH:-32768}"
  # Decode CUDA graphs up to this batch, and no more running requests than graphs cover
  # (SGLang's default for EAGLE-family launches would be 48, beyond the captured sizes).
  --cuda-graph-max-bs-decode "${GRAFT_MAX_BS:-32}"
  --max-running-requests "${GRAFT_MAX_BS:-32}"
  # Split Qwen3's <think> block into reasoning_content in the OpenAI-compatible API.
  --reasoning-parser qwen3
  # Graft's retrieval sources: token recycling, the request's own context, and a history
  # index fed from the radix cache, bounded at 4M tokens per rank (LRU beyond that).
  --graft-policy graft
  --graft-sources recycling,context,history
  --graft-history-max-tokens 4194304
  # Log accepted tokens per source every 200 verify rounds (tensor-parallel rank 0 only).
  --graft-log-interval 200
)
# END RECIPE ARGS

if [ "$print_args" = "1" ]; then
  printf '%s\n' "${ARGS[@]}" "${passthrough[@]}"
  exit 0
fi

launcher=${SGLANG_GRAFT:-sglang-graft}
if ! command -v "$launcher" >/dev/null 2>&1; then
  echo "launch_qwen3_235b: '$launcher' not found; install the plugin on the GPU host" \
       "(pip install 'sglang-graft[sglang]') or use the Docker image (see README)" >&2
  exit 127
fi
exec "$launcher" serve "${ARGS[@]}" "${passthrough[@]}"
