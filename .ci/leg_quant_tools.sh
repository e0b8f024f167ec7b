#!/usr/bin/env bash
# CI leg "quant_tools": quantized checkpoints written by the tools users run (issue 32, item 4),
# loaded by pagedllm in the main environment and compared with transformers.
#
# The tools cannot live in the main environment (gptqmodel >= 7.7 wants torch >= 2.14.1;
# gptqmodel 7.6 wants transformers >= 5.20 while llm-compressor 0.14 pins transformers <= 5.17),
# so each gets a cached side venv (.ci/cached_venv.sh) on the main leg's CPU torch 2.13.0:
#   quant_gptq: gptqmodel 7.6.0 (built from its sdist with BUILD_CUDA_EXT=0; quantizes and packs
#               GPTQ and AWQ GEMM on the CPU through its torch kernels)
#   quant_llmc: llm-compressor 0.14.0.1 + compressed-tensors 0.19.0 (oneshot, GPTQModifier /
#               QuantizationModifier; FP8 dynamic, W8A16, W4A16)
# tests/quantization/tool_checkpoints.py writes the tiny checkpoints (and, for GPTQ/AWQ, float32
# twins dequantized by gptqmodel's own code) into a temp folder; then the main venv runs
# tests/quantization/test_tool_checkpoints.py with PAGEDLLM_QUANT_TOOL_CHECKPOINTS pointing at it.
# Needs the main environment the cpu leg installed (pagedllm's test extras).
# Env: PAGEDLLM_QUANT_GPTQ_VENV / PAGEDLLM_QUANT_LLMC_VENV (venv overrides), PAGEDLLM_CI_CACHE,
#      PYTHON (the side venvs' base python), PAGEDLLM_QUANT_TOOL_CHECKPOINTS (reuse a folder).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=.ci/cached_venv.sh
source "$ROOT/.ci/cached_venv.sh"
export BUILD_CUDA_EXT=0  # gptqmodel's sdist: no CUDA extensions (no CUDA torch here)
# torch==2.13.0 is the cpu leg's pin (this machine's +cpu wheel; no CUDA libraries pulled)
GPTQ_REQ=(torch==2.13.0 gptqmodel==7.6.0 transformers==5.25.0 safetensors)
LLMC_REQ=(torch==2.13.0 llmcompressor==0.14.0.1 compressed-tensors==0.19.0 transformers==5.17.0
          safetensors)
GPTQ_VENV="$(cached_venv quant_gptq "${GPTQ_REQ[@]}")"
LLMC_VENV="$(cached_venv quant_llmc "${LLMC_REQ[@]}")"
[ "${1:-}" = --prepare ] && exit 0  # .ci/run builds the venvs early, in the background

cd "$ROOT"
if [ -n "${PAGEDLLM_QUANT_TOOL_CHECKPOINTS:-}" ]; then
  OUT="$PAGEDLLM_QUANT_TOOL_CHECKPOINTS"  # kept (and reused: the float source) as given
else
  OUT="$(mktemp -d "${TMPDIR:-/tmp}/pagedllm-quant-tools.XXXXXX")"
  trap 'rm -rf "$OUT"' EXIT
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
# gptqmodel's CPU pool must hold its 2-worker model-loader sub-pool (a 2-core machine gets 1)
export GPTQMODEL_CPU_WORKERS="${GPTQMODEL_CPU_WORKERS:-2}"
start=$SECONDS
"$GPTQ_VENV/bin/python" tests/quantization/tool_checkpoints.py gptqmodel "$OUT" \
  > /tmp/ci-quant-tools-gptqmodel.log 2>&1 || { tail -40 /tmp/ci-quant-tools-gptqmodel.log; exit 1; }
echo "quant_tools: gptqmodel checkpoints in $((SECONDS - start))s"; start=$SECONDS
"$LLMC_VENV/bin/python" tests/quantization/tool_checkpoints.py llmcompressor "$OUT" \
  > /tmp/ci-quant-tools-llmcompressor.log 2>&1 || { tail -40 /tmp/ci-quant-tools-llmcompressor.log; exit 1; }
echo "quant_tools: llmcompressor checkpoints in $((SECONDS - start))s"
cat "$OUT/gptqmodel.json" "$OUT/llmcompressor.json"

PAGEDLLM_QUANT_TOOL_CHECKPOINTS="$OUT" python -m pytest -q -p no:cacheprovider --durations=5 \
  tests/quantization/test_tool_checkpoints.py
