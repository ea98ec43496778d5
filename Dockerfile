# Graft on SGLang: the official SGLang image of the pinned release, plus this plugin.
#
#   docker build -t sglang-graft .
#   docker run --gpus all --shm-size 32g -p 30000:30000 \
#     -v ~/.cache/huggingface:/root/.cache/huggingface sglang-graft \
#     --model-path Qwen/Qwen3-8B --speculative-draft-model-path Tengyunw/qwen3_8b_eagle3 \
#     --host 0.0.0.0 --port 30000
#
# The base tag must name the sglang version pinned in pyproject.toml (a test checks it).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130
FROM ${SGLANG_IMAGE}

WORKDIR /opt/sglang-graft
COPY pyproject.toml README.md ./
COPY sglang_graft ./sglang_graft
COPY patches ./patches
COPY scripts/apply_patches.sh ./scripts/apply_patches.sh

# sglang, torch and flashinfer come from the base image: install only the plugin
# (its entry point is what SGLang loads), then apply any patches to that sglang.
RUN python3 -m pip install --no-cache-dir --no-deps . \
    && bash scripts/apply_patches.sh

EXPOSE 30000
ENTRYPOINT ["sglang-graft", "serve"]
CMD ["--help"]
