"""Every environment variable pagedllm reads, in one table (vLLM's ``vllm/envs.py``).

Each entry has a name, a type, a default, a one-line doc and a scope: ``runtime`` (the package
reads it), ``build`` (setup.py / the kernel build), ``test`` (the test suites), ``ci`` (.ci/
scripts) or ``bench`` (benchmarks/). Values are read when asked for, never at import:
``envs.PAGEDLLM_CPU_KERNELS`` (module ``__getattr__``) or ``envs.get(name)`` parse the variable's
current value each time, so a test's ``monkeypatch.setenv`` takes effect at once.

One grammar for every on/off switch (``parse_bool``): ``1 true yes on`` / ``0 false no off``, any
case; unset or empty is the default; anything else is a ValueError naming the variable, the value
and the allowed values. Settings that change what the engine computes are engine arguments
(``EngineArgs``), not variables. ``docs/envs.md`` is generated from this table
(``python tools/gen_env_docs.py``); tests/test_envs.py fails when it is stale or when code reads a
``PAGEDLLM_*`` name missing here. Nothing here imports pagedllm (setup.py may load it by path).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off")
SCOPES = ("runtime", "build", "test", "ci", "bench")


def parse_bool(name: str, raw: str) -> bool:
    """The one on/off grammar: TRUE_VALUES / FALSE_VALUES, any case."""
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ValueError(f"{name}={raw!r} is invalid: allowed values are "
                     f"{', '.join(TRUE_VALUES)} (on) or {', '.join(FALSE_VALUES)} (off)")


def _int_at_least(low: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            value = low - 1
        if value < low:
            raise ValueError(f"{name}={raw!r} is invalid: must be an integer >= {low}")
        return value
    return parse


def _float_above(low: float) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            value = low
        if not value > low:
            raise ValueError(f"{name}={raw!r} is invalid: must be a number > {low:g}")
        return value
    return parse


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"{name}={raw!r} is invalid: allowed values are {', '.join(allowed)}")
        return value
    return parse


def _text(name: str, raw: str) -> str:
    return raw.strip()


_PARSERS: dict[type, Callable[[str, str], Any]] = {bool: parse_bool, int: _int_at_least(0),
                                                   float: _float_above(0.0), str: _text}


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: type  # bool, int, float or str: what a read returns (or the default)
    default: Any  # returned when the variable is unset or empty; None: "unset" has a meaning
    doc: str  # one line
    scope: str = "runtime"
    parse: Callable[[str, str], Any] | None = None  # (name, raw) -> value; default by type
    choices: tuple[str, ...] = ()  # documented values of a str variable

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"{self.name}: scope={self.scope!r} is invalid: allowed values are "
                             f"{', '.join(SCOPES)}")

    def read(self) -> Any:
        raw = os.environ.get(self.name, "")
        if not raw.strip():
            return self.default
        return (self.parse or _PARSERS[self.type])(self.name, raw)


def _var(name: str, type_: type, default: Any, doc: str, scope: str = "runtime",
         choices: tuple[str, ...] = (), parse: Callable[[str, str], Any] | None = None) -> EnvVar:
    if choices and parse is None:
        parse = _choice(*choices)
    return EnvVar(name, type_, default, doc, scope, parse, choices)


_CPU_KERNELS_DOC = "the csrc/cpu kernels (attention, layer ops, sampler); off: the torch reference"
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    # --- the engine ----------------------------------------------------------------------
    _var("PAGEDLLM_ATTENTION_BACKEND", str, None,
         "attention implementation when the engine argument attention_backend is not given "
         "(like VLLM_ATTENTION_BACKEND; cpu: native, torch, ipex; cuda/rocm: kernels, torch)"),
    _var("PAGEDLLM_BACKENDS", str, None,
         "comma-separated out-of-tree backend plugins to load (unset: all installed)"),
    _var("PAGEDLLM_CACHE_DIR", str, None,
         "where JIT-built kernels are cached (unset: ~/.cache/pagedllm/kernels)"),
    _var("PAGEDLLM_VERBOSE_BUILD", bool, False, "print the compiler's output of JIT kernel builds"),
    _var("PAGEDLLM_WORKER_THREADS", int, None,
         "intra-op threads per worker process (unset: the host's CPUs shared evenly)",
         parse=_int_at_least(1)),
    _var("PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S", float, 120.0,
         "seconds the ray executor waits for its placement group"),
    _var("PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT", float, 30.0,
         "seconds a guided-decoding grammar may take to compile before the request fails"),
    _var("PAGEDLLM_GUIDED_OVERLAP", bool, None,
         "fill guided-decoding masks on a helper thread during the forward (on) or before it "
         "(off); unset: where the device runs apart from the host"),
    _var("PAGEDLLM_API_KEY", str, None, "the server's API key when --api-key is not given"),
    _var("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", bool, False,
         "the server's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
         "VLLM_ALLOW_RUNTIME_LORA_UPDATING; also --allow-runtime-lora-updating)"),
    # --- cuda / rocm -----------------------------------------------------------------------
    _var("PAGEDLLM_GEMV", bool, True,
         "the csrc GEMV for one-token linears on sm_90+ (off: cuBLAS / hipBLAS)"),
    _var("PAGEDLLM_PROGRAMMATIC_LAUNCH", bool, True,
         "programmatic dependent launch of the csrc kernels on sm_90+"),
    _var("PAGEDLLM_CUDA_PREFILL_SPLIT", bool, True,
         "the Triton prefill splits a long cached context across programs when its grid is "
         "small (a short question over a long prefix; off: one program walks the whole "
         "context)"),
    # --- cpu -------------------------------------------------------------------------------
    _var("PAGEDLLM_CPU_KERNELS", bool, True, _CPU_KERNELS_DOC),
    _var("PAGEDLLM_CPU_OMP_THREADS_BIND", str, "nobind",
         "OpenMP thread placement of a cpu worker: auto, nobind (or all), or CPU lists "
         "'0-3|4-7' one per rank (like VLLM_CPU_OMP_THREADS_BIND)"),
    _var("_PAGEDLLM_CPU_AFFINITY_BEFORE_BIND", str, None,
         "internal: the CPU mask before any binding, set by the first bound process for its "
         "children"),
    _var("PAGEDLLM_CPU_FP32_LINEAR", str, None,
         "route of float32 linears (unset: the faster one, timed at start)",
         choices=("mkl", "onednn")),
    _var("PAGEDLLM_CPU_HALF_LINEAR", str, None,
         "compute dtype of bf16/fp16 linears (unset: the faster one, timed at start)",
         choices=("native", "float32")),
    _var("PAGEDLLM_CPU_FEW_ROWS_LINEAR", str, None,
         "proposers' linears at 1-8 rows on the few-rows kernel (unset: where timed faster)",
         choices=("on", "off")),
    _var("PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS", bool, False,
         "packed linears and MoE experts keep their plain weights too (debugging)"),
    _var("PAGEDLLM_CPU_KEEP_FREED_MEMORY", bool, True,
         "glibc malloc keeps freed memory for reuse instead of returning it to the system"),
    _var("PAGEDLLM_CPU_MOE_PARALLEL", bool, True,
         "the C++ MoE op runs the experts in parallel on oneDNN's route (off: one by one)"),
    _var("PAGEDLLM_CPU_QUANT_KERNELS", bool, True,
         "the cpu INT8 / INT4 weight-only kernels (off: dequantize and multiply, the reference)"),
    _var("PAGEDLLM_CPU_QUANT_LOWP_MODE", str, "none",
         "compute mode of INT8 linears: none (activations in the model dtype) or int8 "
         "(activations quantized per token: faster, lossy)", choices=("none", "int8")),
    _var("PAGEDLLM_CPU_QUANT_DEQUANT_ROWS", int, None,
         "rows from which quantized linears dequantize and run the dense GEMM (unset: 12 INT8, "
         "32 INT4)", parse=_int_at_least(1)),
    # --- tpu / hpu -------------------------------------------------------------------------
    _var("PAGEDLLM_TPU_ALLOW_CPU", bool, False,
         "let the tpu backend run on XLA's CPU device (PJRT_DEVICE=CPU; testing)"),
    _var("PAGEDLLM_TPU_WARMUP", bool, True,
         "compile every bucket before the first request (off: on first use)"),
    _var("PAGEDLLM_TPU_KERNEL", bool, True,
         "the Pallas paged-attention kernel on a TPU (off: the gather path; debugging)"),
    _var("PAGEDLLM_HPU_WARMUP", bool, True, "warm up the HPU graphs before the first request"),
    # --- building --------------------------------------------------------------------------
    _var("PAGEDLLM_TARGET_DEVICE", str, None,
         "kernel extension to build: cuda, rocm or cpu (none); unset: detected from torch",
         scope="build", choices=("cuda", "rocm", "cpu")),
    _var("PAGEDLLM_KERNEL_FLAGS", str, None,
         "extra compiler flags of the csrc build, e.g. -DPAGEDLLM_ATTN_MAX_GROUP=16 (part of "
         "the JIT cache key)", scope="build"),
    # --- tests -----------------------------------------------------------------------------
    _var("PAGEDLLM_TEST_DEVICE", str, None,
         "the conformance suite's --device default (unset: cpu)", scope="test"),
    _var("PAGEDLLM_CONFORMANCE_SAMPLE", str, None,
         "at most N declared cases per conformance check, or all (unset: all)", scope="test"),
    _var("PAGEDLLM_QUANT_TOOL_CHECKPOINTS", str, None,
         "folder of AutoAWQ / GPTQModel / llm-compressor checkpoints for "
         "tests/quantization/test_tool_checkpoints.py", scope="test"),
    # --- CI (.ci/) -------------------------------------------------------------------------
    _var("PAGEDLLM_CI_LEGS", str, None, "the .ci/run legs to run, space-separated", scope="ci"),
    _var("PAGEDLLM_CI_REPORTS", str, None,
         "folder of the conformance legs' JSON reports (.ci/run sets it)", scope="ci"),
    _var("PAGEDLLM_CI_CACHE", str, None,
         "where CI keeps its cached venvs (unset: ~/.cache/pagedllm-ci)", scope="ci"),
    _var("PAGEDLLM_CI_IMAGE_PORT", int, 18093, "port of the container leg's server", scope="ci"),
    _var("PAGEDLLM_CUDA_EMU_SAMPLE", int, 2,
         "conformance cases per check in the emulated cuda leg", scope="ci"),
    _var("PAGEDLLM_TPU_VENV", str, None, "venv of the tpu leg (torch_xla)", scope="ci"),
    _var("PAGEDLLM_XPU_VENV", str, None, "venv of the xpu leg (IPEX)", scope="ci"),
    _var("PAGEDLLM_OOT_VENV", str, None, "venv of the out-of-tree plugin leg", scope="ci"),
    _var("PAGEDLLM_QUANT_GPTQ_VENV", str, None, "venv of the quant-tools leg's GPTQModel",
         scope="ci"),
    _var("PAGEDLLM_QUANT_LLMC_VENV", str, None, "venv of the quant-tools leg's llm-compressor",
         scope="ci"),
    # --- benchmarks ------------------------------------------------------------------------
    _var("PAGEDLLM_BENCH_VLLM_PYTHON", str, None,
         "python interpreter with vLLM installed, for the side-by-side benchmarks", scope="bench"),
    _var("PAGEDLLM_BENCH_CACHE", str, None,
         "where benchmarks write their generated checkpoints", scope="bench"),
)}


def entry(name: str) -> EnvVar:
    """The table's entry of ``name``; a KeyError naming the table when it has none."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not in pagedllm's table of environment variables "
                       f"(pagedllm/envs.py)")
    return ENV_VARS[name]


def get(name: str) -> Any:
    """The current value of ``name``, parsed; its default when unset or empty."""
    return entry(name).read()


def is_set(name: str) -> bool:
    """Whether ``name`` has a non-empty value now."""
    return bool(os.environ.get(entry(name).name, "").strip())


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return ENV_VARS[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENV_VARS))
