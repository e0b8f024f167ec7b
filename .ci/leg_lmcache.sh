#!/usr/bin/env bash
# CI leg "lmcache": the LMCacheConnector (pagedllm/kv_transfer/lmcache*.py, issue 45) against the
# real LMCache engine, whose tests skip in the main environment (lmcache is not installed there).
#
# A cached virtual environment (.ci/cached_venv.sh) holds the cpu leg's torch 2.13.0 (this
# machine's +cpu wheel), lmcache 0.5.6 and pagedllm's runtime dependencies; the checkout goes on
# PYTHONPATH. lmcache 0.5.6 leaves torch unpinned and imports on a CPU-only torch (its CUDA
# extension and cupy/cuda-python are installed but not loaded there); it pins numpy <= 2.2.6,
# protobuf < 7 and prometheus_client <= 0.24.1, which is why it is not in the main environment.
# First build ~2.5-3 min (pip, mostly downloads; 1.9 GB), then reused; the leg takes ~35 s on
# 2 cores (6 tests, one of them a subprocess).
# Env: PAGEDLLM_LMCACHE_VENV (venv path override), PAGEDLLM_CI_CACHE, PYTHON.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=.ci/cached_venv.sh
source "$ROOT/.ci/cached_venv.sh"
REQUIREMENTS=(torch==2.13.0 lmcache==0.5.6 transformers==5.25.0 tokenizers safetensors numpy tqdm
              fastapi uvicorn "pydantic>=2" prometheus-client jinja2 openai httpx pytest
              pytest-timeout)
VENV="$(cached_venv lmcache "${REQUIREMENTS[@]}")"
[ "${1:-}" = --prepare ] && exit 0  # .ci/run builds the venv early, in the background
VPY="$VENV/bin/python"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
cd "$ROOT"
"$VPY" -c 'import torch, importlib.metadata as m; print("lmcache: torch", torch.__version__, "lmcache", m.version("lmcache"))'
# -rs: a skip here (lmcache not importable) is shown; the leg fails unless every test ran
# (+ serve producer / serve consumer / proxy over LMCacheConnectorV1: test_disaggregated's
# LMCache case; its other connectors run in the cpu leg)
"$VPY" -m pytest -q -p no:cacheprovider -rs --durations=5 \
  tests/kv_offload/test_lmcache_connector.py \
  "tests/kv_offload/test_disaggregated.py" -k "not test_disaggregated or LMCache" 2>&1 \
  | tee /tmp/ci-lmcache-pytest.log
! grep -Eq '[0-9]+ skipped' /tmp/ci-lmcache-pytest.log ||
  { echo "lmcache: tests were skipped (lmcache not importable in $VENV)" >&2; exit 1; }
