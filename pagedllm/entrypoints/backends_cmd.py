"""`pagedllm backends`: every known backend, where it came from, and whether it can run here.

``--verbose`` adds each backend's declared capabilities with what each flag means; ``--json``
prints the same facts machine-readably (what CI and the support matrix consume).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

# what each Capabilities field promises (and what the conformance suite checks for it)
FLAG_HELP: dict[str, str] = {
    "graphs": "captures decode steps as device graphs and replays them (checked: captures and "
              "replays counted, replay equals eager)",
    "swap": "swaps KV blocks to host memory on preemption (checked: swap out/in block by block, "
            "and an engine's preemption observed moving blocks bit for bit)",
    "static_shapes": "needs inputs padded to buckets (checked: pad rows change nothing)",
    "prefix_caching": "reuses cached prompt blocks (checked: prefill over cached context, e2e, "
                      "and a second pass observed computing fewer prefill tokens)",
    "chunked_prefill": "splits long prompts over steps (checked: prefill over earlier chunks, e2e, "
                       "and chunks observed reaching attention)",
    "dtypes": "model dtypes it runs (every check runs per declared dtype)",
    "kv_cache_dtypes": "KV-cache storage types besides the model dtype ('auto')",
    "preferred_block_size": "the KV block size used when none is asked for",
    "block_sizes": "KV block sizes it accepts (the sweep runs every one)",
    "max_tensor_parallel_size": "largest tensor-parallel group (None: as many devices as counted)",
    "async_output": "launch_model returns before the device finishes (checked: it did, at least "
                    "once, and outputs equal the synchronous path)",
    "head_sizes": "attention head sizes it handles (the sweep runs each; others NOT DECLARED)",
    "max_gqa_group": "largest query heads per KV head (None: any; the sweep runs 1-8)",
    "max_context_len": "longest sequence the attention was built for (None: any; swept to 4,100)",
    "attention_features": "optional attention arguments: sliding_window, logits_soft_cap",
    "quantizations": "quantized-checkpoint formats whose linear it runs",
    "pipeline_parallel": "runs pipeline stages (activations sent between ranks)",
    "multi_token_decode": "attends several new tokens per decoding sequence in one step "
                          "(speculative decoding's verification needs it)",
    "lora": "runs LoRA adapters through the lora_shrink/lora_expand ops (checked: the ops against "
            "the reference over ranks and slots, and mixed-adapter engine output)",
    "kv_export": "exports/imports KV blocks to host staging buffers, bit-exact (checked: round "
                 "trips per layout, block size and KV dtype); KV offload and connectors need it",
    "kv_export_layer_major": "takes layer-major staging views and fences imports layer by layer "
                             "(checked: bytes, and the attention over layer-fenced imports); the "
                             "host tier then loads layer by layer",
    "deterministic": "the same step twice gives the same bits (checked: attention steps, ops "
                     "and engine rounds compared bit for bit)",
}


def backend_facts() -> list[dict[str, Any]]:
    """One dict per known backend: identity, status, plugin API version, capabilities."""
    from pagedllm.contract.registry import discover

    out = []
    for info in discover().values():
        ok, reason = info.availability()
        row: dict[str, Any] = {"name": info.name, "source": info.source, "available": ok,
                               "reason": reason,
                               "plugin_api_version": info.extra.get("plugin_api_version")}
        if info.cls is not None:
            caps = dataclasses.asdict(info.cls.capabilities)
            row.update(torch_device=info.cls.torch_device, dist_backend=info.cls.dist_backend,
                       default_dtype=info.cls.default_dtype,
                       capabilities={k: list(v) if isinstance(v, tuple) else v
                                     for k, v in caps.items()})
        out.append(row)
    return out


def backends_table() -> list[list[str]]:
    rows = [["name", "source", "status", "torch device", "capabilities"]]
    for f in backend_facts():
        status = "available" if f["available"] else f"unavailable: {f['reason']}"
        if "capabilities" not in f:
            rows.append([f["name"], f["source"], status, "-", "-"])
            continue
        from pagedllm.contract.capabilities import Capabilities

        caps = Capabilities(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in f["capabilities"].items()})
        rows.append([f["name"], f["source"], status, f["torch_device"], caps.summary()])
    return rows


def verbose_lines() -> list[str]:
    """Each backend's capabilities, one flag a line, with what the flag means: the flag, value
    and meaning columns line up across every backend (as wide as their longest entry)."""
    facts = backend_facts()
    shown = [[(key, (", ".join(map(str, value)) if isinstance(value, list) else str(value)) or "-")
              for key, value in f.get("capabilities", {}).items()] for f in facts]
    pairs = [pair for rows in shown for pair in rows]
    key_width = max((len(k) for k, _ in pairs), default=0)
    value_width = max((len(v) for _, v in pairs), default=0)
    lines: list[str] = []
    for f, rows in zip(facts, shown):
        api = f["plugin_api_version"] or "not stated"
        lines += ["", f"{f['name']} ({f['source']}, plugin API {api}): "
                      f"{'available' if f['available'] else 'unavailable'}: {f['reason']}"]
        lines += [f"  {key:<{key_width}}  {value:<{value_width}}  {FLAG_HELP.get(key, '')}".rstrip()
                  for key, value in rows]
    return lines


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backends", help="list hardware backends and whether they are available")
    p.add_argument("--json", action="store_true",
                   help="print every backend's facts and capabilities as JSON (default: False)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also list each backend's capabilities with what each flag means "
                        "(default: False)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "json", False):
        print(json.dumps(backend_facts(), indent=1))
        return 0
    print(format_table(backends_table()))
    if getattr(args, "verbose", False):
        print("\n".join(verbose_lines()))
    return 0
