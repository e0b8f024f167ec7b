#!/usr/bin/env bash
# The H200 runs recorded in RESULTS.md, in stages that each fit one 10-minute device call:
#
#   bash benchmarks/h200_run.sh tests        # JIT-build csrc/, tests/kernels, cuda backend tests
#                                            # (+ the Triton sampling kernel's)
#   bash benchmarks/h200_run.sh kernel       # decode kernel vs copy bandwidth
#   bash benchmarks/h200_run.sh throughput   # Llama-3-8B shape, 1000 x 128/128, pagedllm vs HF
#   bash benchmarks/h200_run.sh alone        # the same, pagedllm alone (~40 s instead of ~3 min)
#   bash benchmarks/h200_run.sh steps        # the same workload's step timeline (step_timeline.py)
#   bash benchmarks/h200_run.sh latency      # Llama-3-8B shape, batch 1, 128/128, pagedllm vs HF
#   bash benchmarks/h200_run.sh conformance  # the porting kit's suite with --device cuda
#   bash benchmarks/h200_run.sh profile      # ms per decode step at batch 256 and 1, with and
#                                            # without steps scheduled ahead, + the GPU timeline
#   bash benchmarks/h200_run.sh models [PRESET] # issue 31: Mixtral-8x7B and Qwen3-8B shapes (dummy
#                                            # weights), 256 x 128/128, pagedllm vs HF + HBM
#                                            # roofline (models_bench.py); ~4 min per preset, so
#                                            # one call per preset: models mixtral-8x7b-shape,
#                                            # then models qwen3-8b-shape
#   bash benchmarks/h200_run.sh quant        # issue 32: Llama-3-8B shape, GPTQ 4-bit vs bf16 batch 1
#                                            # 128/128, then FP8 vs bf16 1000 x 128/128 (quant-int4,
#                                            # quant-fp8: one of the two)
#   bash benchmarks/h200_run.sh guided       # issue 33: JSON schema on every request vs none,
#                                            # demo model bf16, 256 x 64 tokens, + cold-schema TTFT
#   bash benchmarks/h200_run.sh draft        # issue 43: train the demo model's draft and EAGLE-3
#                                            # head (tools/train_draft_model.py, ~3 min) into $OUT
#   bash benchmarks/h200_run.sh spec         # issue 43: step graphs' tests, verification step (k=4)
#                                            # vs decode step (graphs, eager) at batch 1 and 64,
#                                            # + every method's tokens and speed vs none on cuda
#   bash benchmarks/h200_run.sh spectests    # issue 43: the step graphs' tests alone (every method's
#                                            # greedy tokens equal to plain decoding's on the GPU)
#   bash benchmarks/h200_run.sh specprof     # issue 43: the verification step's cost with torch
#                                            # profiler tables: demo fp32 / bf16, 8B shape bf16
#   bash benchmarks/h200_run.sh lora         # issue 44: 8 adapters vs base, Llama-3-8B shape, 256
#   bash benchmarks/h200_run.sh kvoff        # issue 45: host tier vs recompute vs device prefix
#                                            # hits, 64 docs x 4k tokens
#   bash benchmarks/h200_run.sh kvnosplit    # the same with the prefill's context split off
#
# Arguments after the stage go to throughput.py (e.g. throughput --max-num-seqs 512).
# Several stages in one device call, with a deadline and a summary: benchmarks/gpu_batch.sh.
# From the repository root; logs go to $OUT (default ./h200-logs). The kernel build is cached
# under .carry/pc (ignored by git) so later stages on a warm machine reuse it. A fresh machine
# skips the ~90 s build when the call carries .carry/pc holding the library of an earlier build
# (.carry/pc/<hash>/pagedllm_C.so, the hash being that of the unchanged csrc/, flags and torch):
# bring it back once with `cp .carry/pc/*/pagedllm_C.so $OUT/` and put it under the same hash.
# A/B of kernel build flags (e.g. PAGEDLLM_KERNEL_FLAGS=-DPL_RELEASE_BEFORE_WAIT=0): the flags are
# part of the hash, so build each variant on the CPU machine with the same PAGEDLLM_KERNEL_FLAGS
# (torch 2.11.0+cu130 venv, TORCH_CUDA_ARCH_LIST=9.0, PAGEDLLM_CACHE_DIR=.carry/pc), carry
# .carry/pc, and run each stage here with the variant's PAGEDLLM_KERNEL_FLAGS set.
set -uo pipefail
OUT="${OUT:-h200-logs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PAGEDLLM_CACHE_DIR="$PWD/.carry/pc"
export TOKENIZERS_PARALLELISM=false
MODEL=.carry/llama3-8b-shape
BENCH=(python benchmarks/throughput.py --model "$MODEL" --load-format dummy --dtype bfloat16
       --device cuda --input-len 128 --output-len 128 --kv-cache-gib 0)

env_report() {
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python -c 'import torch, transformers, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__)'
    nvcc --version | tail -2; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

model() {
  [ -f "$MODEL/config.json" ] || python benchmarks/make_model.py "$MODEL" --preset llama3-8b-shape \
    --dtype bfloat16
}

case "${1:?stage: tests|kernel|throughput|alone|steps|latency|conformance|profile|models}" in
  tests)
    env_report
    /usr/bin/time -f "kernel build %e s" python -c \
      'from pagedllm.backends.cuda import ops; ops.load_kernels()' 2>&1 | tail -3
    timeout 280 python -m pytest -q -p no:cacheprovider tests/kernels -k "not emulated" \
      -x --durations=5 2>&1 | tee "$OUT/kernels.log" | tail -15
    timeout 200 python -m pytest -q -p no:cacheprovider tests/backends/test_cuda_backend.py \
      tests/backends/test_triton_sampling.py tests/backends/test_triton_moe.py \
      tests/backends/test_triton_bitmask.py tests/backends/test_triton_fp8.py \
      tests/quantization/test_fp8_kv_cache.py tests/engine/test_release.py --durations=5 2>&1 | tee "$OUT/cuda_backend.log" | tail -8
    ;;
  kernel)
    python benchmarks/gpu_kernel_check.py 2>&1 | tee "$OUT/kernel_check.log"
    ;;
  throughput|alone)
    model
    backends=pagedllm,hf
    [ "$1" = alone ] && backends=pagedllm
    "${BENCH[@]}" --backend "$backends" --num-prompts 1000 --hf-batch-size 256 --warmup-prompts 256 \
      --log-dir "$OUT/throughput" --output-json "$OUT/throughput.json" "${@:2}" 2>&1 | tail -14
    ;;
  steps)
    model
    python benchmarks/step_timeline.py --model "$MODEL" --load-format dummy --device cuda \
      --dtype bfloat16 "${@:2}" 2>&1 | grep -v "^pagedllm" | tee "$OUT/steps.log"
    ;;
  latency)
    model
    "${BENCH[@]}" --backend pagedllm,hf --num-prompts 1 --hf-batch-size 1 --warmup-prompts 1 \
      --log-dir "$OUT/latency" --output-json "$OUT/latency.json" "${@:2}" 2>&1 | tail -14
    ;;
  conformance)
    timeout 400 python -m pytest -q -p no:cacheprovider -p pagedllm.testing.plugin \
      --pyargs pagedllm.testing --device cuda \
      --conformance-report "$OUT/cuda.json" 2>&1 | tee "$OUT/conformance.log" | tail -6
    ;;
  profile)
    model
    for flag in "" --disable-async-output-proc; do
      python benchmarks/profile_decode.py --model "$MODEL" --load-format dummy --device cuda \
        --dtype bfloat16 --batch 256 --batch 1 --steps 20 --timeline $flag "${@:2}" \
        > "$OUT/profile${flag:+-plain}.log" 2>&1
      grep -A22 "ms per decode\|GPU timeline" "$OUT/profile${flag:+-plain}.log" | grep -v "^ \|^--\|^$"
    done
    ;;
  models)
    for preset in ${2:-mixtral-8x7b-shape qwen3-8b-shape}; do
      timeout 290 python benchmarks/models_bench.py --device cuda --preset "$preset" \
        --cache .carry --out-dir "$OUT/models" "${@:3}" 2>&1 | grep -v "^pagedllm" \
        | tee "$OUT/models-$preset.log" | tail -12
    done
    ;;
  quant|quant-int4|quant-fp8)
    Q=(python benchmarks/quant.py --device cuda --preset llama3-8b-shape --input-len 128
       --output-len 128 --repeats 1)
    [ "$1" = quant-fp8 ] || timeout 280 "${Q[@]}" --variants bf16,int4 --num-prompts 1 "${@:2}" \
      2>&1 | tee "$OUT/quant-batch1.log" | tail -6
    [ "$1" = quant-int4 ] || timeout 280 "${Q[@]}" --variants bf16,fp8 --num-prompts 1000 \
      "${@:2}" 2>&1 | tee "$OUT/quant-fp8.log" | tail -6
    ;;
  guided)
    timeout 280 python benchmarks/guided.py --device cuda --dtype bfloat16 --num-prompts 256 \
      --repeats 3 2>&1 | tee "$OUT/guided.log" | tail -6
    ;;
  draft)
    env_report
    python tools/train_draft_model.py --corpus .carry/stdlib-3.11.7.jsonl.gz \
      --out-draft "$OUT/draft" --out-eagle "$OUT/eagle" "${@:2}" 2>&1 | tee "$OUT/draft.log" \
      | grep -v "step " | tail -20
    ;;
  spec)
    # the speculative runner's step graphs (plain and verification) give plain decoding's tokens
    timeout 200 python -m pytest -q -p no:cacheprovider tests/backends/test_cuda_spec_graphs.py \
      --durations=3 2>&1 | tee "$OUT/spec_graphs.log" | tail -6
    timeout 150 python benchmarks/spec_decode.py --step-cost --device cuda --batch 1 --batch 64 \
      --output-json "$OUT/spec_step_cost.json" "${@:2}" 2>&1 | tee "$OUT/spec_step.log" | tail -8
    # greedy tokens with each method equal to those without, on the GPU (pagedllm only)
    timeout 260 python benchmarks/spec_decode.py --device cuda --engine pagedllm --method none \
      --method ngram --method draft --method eagle --batch 1 --batch 8 --waves 2 \
      --output-json "$OUT/spec_cuda.json" 2>&1 | grep -v "^20" | tee "$OUT/spec_cuda.log" | tail -12
    ;;
  spectests)
    timeout 200 python -m pytest -q -p no:cacheprovider tests/backends/test_cuda_spec_graphs.py \
      --durations=3 2>&1 | tee "$OUT/spec_graphs.log" | tail -6
    ;;
  specprof)
    # the verification step's cost, profiled: the demo model in float32 (the recorded figure)
    # and bfloat16, and the Llama-3-8B shape in bfloat16 (weights dominate), graphs and eager
    timeout 120 python -m pytest -q -p no:cacheprovider tests/backends/test_cuda_spec_graphs.py \
      --durations=3 2>&1 | tee "$OUT/spec_graphs.log" | tail -4
    for dtype in float32 bfloat16; do
      timeout 100 python benchmarks/spec_decode.py --step-cost --device cuda --batch 1 \
        --batch 64 --dtype $dtype --profile-dir "$OUT/specprof-demo-$dtype" \
        --output-json "$OUT/spec_step_demo_$dtype.json" 2>&1 | tail -6
    done
    model
    timeout 150 python benchmarks/spec_decode.py --step-cost --device cuda --batch 1 --batch 64 \
      --dtype bfloat16 --model "$MODEL" --load-format dummy --profile-dir "$OUT/specprof-8b" \
      --output-json "$OUT/spec_step_8b.json" 2>&1 | tail -6
    ;;
  lora)
    model
    timeout 280 python benchmarks/lora.py --device cuda --model "$MODEL" --num-prompts 256 \
      --engine pagedllm --dtype bfloat16 --config base --config 8 --kv-cache-gib 20 \
      --output-json "$OUT/lora.json" "${@:2}" 2>&1 | tee "$OUT/lora.log" | tail -8
    ;;
  kvoff)
    # the cache ops' export/import (layer-major views and layer-wise fences included) on the GPU
    timeout 90 python -m pytest -q -p no:cacheprovider -p pagedllm.testing.plugin \
      --pyargs pagedllm.testing.test_kv_transfer --device cuda 2>&1 | tee "$OUT/kv_transfer.log" \
      | tail -3
    # the prefill kernel with its context split (a short question over a long prefix), compiled
    timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_prefill.py \
      2>&1 | tee "$OUT/triton_prefill.log" | tail -2
    model
    timeout 480 python benchmarks/kv_offload.py --device cuda --model "$MODEL" --docs 64 \
      --doc-tokens 4096 --device-docs 8 --disagg-requests 0 --config recompute --config host \
      --config device \
      --output-json "$OUT/kv_offload.json" "${@:2}" 2>&1 | tee "$OUT/kv_offload.log" | tail -10
    ;;
  kvnosplit)
    # issue 45: the host-tier workload with the prefill's context split off (after kvoff in one
    # call: the same card, so the TTFTs compare; the split is on by default since 2026-12-08)
    model
    PAGEDLLM_CUDA_PREFILL_SPLIT=0 timeout 480 python benchmarks/kv_offload.py --device cuda \
      --model "$MODEL" --docs 64 --doc-tokens 4096 --device-docs 8 --disagg-requests 0 \
      --config host --config device \
      --output-json "$OUT/kv_offload_nosplit.json" "${@:2}" 2>&1 \
      | tee "$OUT/kv_offload_nosplit.log" | tail -10
    ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
