"""What a backend declares it can do. The engine and the conformance suite consult these fields
as data, never the backend's name; what is not declared has a safe default."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the engine and the conformance suite consult these, never names."""

    graphs: bool = False  # captures decode graphs (disabled by enforce_eager)
    swap: bool = True  # can swap KV blocks to host memory (else preemption recomputes)
    static_shapes: bool = False  # inputs must be padded to buckets
    prefix_caching: bool = True
    chunked_prefill: bool = True
    dtypes: tuple[str, ...] = ("float32",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    preferred_block_size: int = 16
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    max_tensor_parallel_size: int | None = None  # None: as many devices as the backend counts
    # the worker's launch_model returns before the device finishes, so the engine schedules and
    # launches step N+1 (inputs taken from step N's device-side draws) while step N runs
    async_output: bool = False
    # --- attention limits (plugin API 2.0); the conformance suite sweeps what is declared ---------
    # Safe defaults: what a port is expected to handle anyway; the suite sweeps 32..256 and GQA
    # groups 1-8 and reports each undeclared value NOT DECLARED, so declare only what passes.
    head_sizes: tuple[int, ...] = (64, 128)  # head sizes the attention handles
    max_gqa_group: int | None = 8  # largest num_heads // num_kv_heads (None: any)
    max_context_len: int | None = None  # longest sequence the attention was built for (None: any)
    # optional attention arguments models need (AttentionImpl kwargs): "sliding_window",
    # "logits_soft_cap"; a model needing one the backend lacks is refused, the feature named
    attention_features: tuple[str, ...] = ()
    # quantization methods whose linear the backend runs ("awq", "gptq", "compressed-tensors",
    # "fp8"); the engine refuses others, naming the backends that support them
    quantizations: tuple[str, ...] = ()
    pipeline_parallel: bool = False  # runs stages of a pipeline (activations sent between ranks)
    # (plugin API 2.1) the attention handles decode sequences of several query tokens, causal
    # within, over their cached context (speculative decoding verifies k + 1 tokens a sequence;
    # they run on the prefill-over-cached-context path). None: what prefix_caching or
    # chunked_prefill imply, the path both need. The engine refuses speculative_config without it.
    multi_token_decode: bool | None = None
    # (plugin API 2.2) runs LoRA adapters: the op table's lora_shrink / lora_expand are its
    # kernels (or the references) and the worker's linears add their deltas; enable_lora=True
    # is refused without it. The conformance suite checks the ops where declared.
    lora: bool = False
    # (plugin API 2.2) the same step (or op call) on the same inputs gives the same bits every
    # time; False where the kernels reduce in a run-dependent order (atomics, split-K chosen at
    # run time). The conformance suite checks it where declared.
    deterministic: bool = True
    # (plugin API 2.2) the cache ops export and import blocks between the device cache and host
    # staging buffers, bit-exact in every declared KV-cache dtype (CacheOps.export_blocks /
    # import_blocks); KV offload tiers and KV transfer connectors are refused without it. The
    # conformance suite checks round trips where declared (test_kv_transfer.py).
    kv_export: bool = False
    # (plugin API 2.3, with kv_export) export_blocks / import_blocks also take staging views
    # whose layer planes ``staging[:, l]`` are contiguous and whose rows are not (a [layers, n,
    # bytes] tensor transposed): the host tier then keeps its pool layer-major, so a load can
    # copy each layer's blocks on its own and an import's ``CacheTransfer.fence_layers`` can let
    # layer l's attention start once layer l has landed. The conformance suite checks round
    # trips through such views where declared.
    kv_export_layer_major: bool = False

    def __post_init__(self) -> None:
        if self.multi_token_decode is None:
            object.__setattr__(self, "multi_token_decode",
                               self.prefix_caching or self.chunked_prefill)

    def summary(self) -> str:
        flags = [name for name in ("graphs", "swap", "static_shapes", "prefix_caching",
                                   "chunked_prefill", "async_output") if getattr(self, name)]
        return f"{','.join(flags) or '-'}; dtypes={'/'.join(self.dtypes)}"
