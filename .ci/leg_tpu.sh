#!/usr/bin/env bash
# CI leg "tpu": the tpu backend's XLA path, compiled and run by XLA on the host CPU.
#
# A cached virtual environment (.ci/cached_venv.sh) holds torch 2.9.0 + torch-xla 2.9.0 (their
# own torch, so not layered on the main environment); the checkout goes on PYTHONPATH. With
# PJRT_DEVICE=CPU and the opt-in PAGEDLLM_TPU_ALLOW_CPU=1 the tpu backend reports itself
# available on the PJRT CPU device, and one pytest session runs
#   - the conformance suite with --device tpu (bucketing test included: static_shapes), and
#   - tests/backends/test_tpu.py: XLA scatter/copy behaviour, the gather attention against
#     torch_xla's ragged_paged_attention(use_kernel=False), Hugging Face greedy equality for
#     llama/qwen2/mistral/opt in four engine modes, and "no XLA compilation after warm-up";
#   - tests/backends/test_tpu_spec.py: n-gram speculation's greedy output equals transformers'
#     with drafts accepted, and its verification steps compile nothing after warm-up.
# XLA_FLAGS=--xla_backend_optimization_level=0 makes host compiles ~3x faster (CPU codegen only).
# Env: PAGEDLLM_TPU_VENV (venv path override), PAGEDLLM_CI_CACHE, PYTHON.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=.ci/cached_venv.sh
source "$ROOT/.ci/cached_venv.sh"
REQUIREMENTS=(torch==2.9.0 torch-xla==2.9.0 transformers==5.24.0 tokenizers safetensors numpy
              tqdm jinja2 pytest pytest-timeout)
VENV="$(cached_venv tpu "${REQUIREMENTS[@]}")"
[ "${1:-}" = --prepare ] && exit 0  # .ci/run builds the venv early, in the background
VPY="$VENV/bin/python"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export PJRT_DEVICE=CPU PAGEDLLM_TPU_ALLOW_CPU=1
export XLA_FLAGS="--xla_backend_optimization_level=0${XLA_FLAGS:+ $XLA_FLAGS}"
cd "$ROOT"

"$VPY" -c 'import torch, torch_xla; print(f"tpu: torch {torch.__version__}, torch_xla {torch_xla.__version__}")'
echo "tpu: pagedllm backends (PJRT_DEVICE=CPU PAGEDLLM_TPU_ALLOW_CPU=1)"
TABLE="$("$VPY" -m pagedllm.entrypoints.cli backends 2>/dev/null)"
echo "$TABLE"
grep -q "^tpu .* available" <<< "$TABLE" || {
  echo "tpu: the tpu backend is not available on the PJRT CPU device" >&2
  exit 1
}

# the pytest11 entry point needs an installed pagedllm; here the plugin is named explicitly
# --conformance-sweep values: the swept checks take every value of each dimension once
# (a few cases a check; the default covering array would compile a program per combination)
"$VPY" -m pytest -q -p no:cacheprovider -p pagedllm.testing.plugin --durations=10 \
  --conformance-sweep values --pyargs pagedllm.testing tests/backends/test_tpu.py \
  tests/backends/test_tpu_spec.py --device tpu \
  ${PAGEDLLM_CI_REPORTS:+--conformance-report "$PAGEDLLM_CI_REPORTS/tpu.json"}
