#!/usr/bin/env bash
# CI leg "xpu": the xpu backend's attention (intel_extension_for_pytorch's PagedAttention ops),
# run by IPEX's CPU build on the host, where no Intel GPU exists.
#
# A cached virtual environment (.ci/cached_venv.sh) holds torch 2.8.0 + IPEX 2.8.0 (IPEX 2.8
# still imports transformers 4 APIs, hence transformers 4.57); the checkout goes on PYTHONPATH.
# One pytest session runs
#   - the conformance suite with --device cpu --attention-backend ipex: the cpu backend built
#     with the same IpexPagedAttention class the xpu backend uses (cpu/ipex_attention.py), and
#   - tests/backends/test_xpu.py: IPEX against the float64 reference in three dtypes and block
#     sizes 1/16/128, the layout guard, pad slots, and Hugging Face greedy equality through
#     LLM(device="cpu", attention_backend="ipex") for llama/qwen2/opt in four engine modes.
# Env: PAGEDLLM_XPU_VENV (venv path override), PAGEDLLM_CI_CACHE, PYTHON.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=.ci/cached_venv.sh
source "$ROOT/.ci/cached_venv.sh"
REQUIREMENTS=(torch==2.8.0 intel-extension-for-pytorch==2.8.0 transformers==4.57.6 tokenizers
              safetensors numpy tqdm jinja2 pytest pytest-timeout)
VENV="$(cached_venv xpu "${REQUIREMENTS[@]}")"
[ "${1:-}" = --prepare ] && exit 0  # .ci/run builds the venv early, in the background
VPY="$VENV/bin/python"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
cd "$ROOT"

"$VPY" -c 'import torch, intel_extension_for_pytorch as ipex; print(f"xpu: torch {torch.__version__}, IPEX {ipex.__version__}")' 2>/dev/null
echo "xpu: pagedllm backends (no Intel GPU here: xpu reports why)"
"$VPY" -m pagedllm.entrypoints.cli backends 2>/dev/null

# --conformance-sweep values: the swept checks take every value of each dimension once (a few
# cases a check, keeping the leg's time; the cpu leg runs the default covering array)
"$VPY" -m pytest -q -p no:cacheprovider -p pagedllm.testing.plugin --durations=10 \
  --conformance-sweep values --pyargs pagedllm.testing tests/backends/test_xpu.py \
  --device cpu --attention-backend ipex \
  ${PAGEDLLM_CI_REPORTS:+--conformance-report "$PAGEDLLM_CI_REPORTS/xpu.json"}
