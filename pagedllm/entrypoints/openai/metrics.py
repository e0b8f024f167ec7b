"""Prometheus metrics (vLLM's names with a ``pagedllm:`` prefix) on a per-app registry.

Updated from the engine loop after every step (AsyncLLMEngine.add_step_listener): queue gauges and
KV-cache usage from the step's EngineStats; token counters and latency histograms from its outputs.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.llm_engine import EngineStats
from pagedllm.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"pagedllm:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running queue.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.cache_usage = gauge("gpu_cache_usage_perc",
                                 "KV-cache usage: fraction of device blocks in use (1 = full).")
        self.free_blocks = gauge("num_free_blocks",
                                 "Device KV-cache blocks not held by any request.")
        self.total_blocks = gauge("num_gpu_blocks", "Device KV-cache blocks in total.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                             E2E_BUCKETS)
        self._success = Counter("pagedllm:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self._model_name = model_name
        # vLLM's lora_requests_info: one series, its labels the adapters running and waiting,
        # its value the time of the last update (made when the engine runs LoRA)
        self._lora_info: Any = None
        self._spec: _SpecDecodeMetrics | None = None  # made when the engine reports them
        self._kv: _KVTransferMetrics | None = None  # KV offload tiers / connectors, likewise
        self._seen_preemptions = 0
        # request id -> output tokens of each choice so far
        self._tokens: dict[str, list[int]] = {}

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.cache_usage.set(stats.kv_cache_usage)
        self.free_blocks.set(stats.num_free_blocks + stats.num_cached_blocks)
        self.total_blocks.set(stats.num_blocks)
        if stats.num_preemptions > self._seen_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = stats.num_preemptions
        if getattr(stats, "max_lora", 0):
            if self._lora_info is None:
                self._lora_info = Gauge("pagedllm:lora_requests_info",
                                        "Running stats on LoRA requests.",
                                        ["running_lora_adapters", "max_lora",
                                         "waiting_lora_adapters"], registry=self.registry)
            self._lora_info.clear()
            self._lora_info.labels(",".join(stats.running_lora_adapters or ()),
                                   str(stats.max_lora),
                                   ",".join(stats.waiting_lora_adapters or ())
                                   ).set_to_current_time()
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            if self._spec is None:
                self._spec = _SpecDecodeMetrics(self.registry, self._model_name)
            self._spec.update(spec)
        kv = getattr(stats, "kv_transfer", None)
        if kv is not None:
            if self._kv is None:
                self._kv = _KVTransferMetrics(self.registry, self._model_name)
            self._kv.update(kv)
        for out in outputs:
            self._on_output(out)

    def _on_output(self, out: RequestOutput) -> None:
        """The server's outputs are deltas (streamed requests) or the one final output (the
        rest): either way an output's tokens are new."""
        new = [len(c.token_ids) for c in out.outputs]
        counts = self._tokens.get(out.request_id)
        m = out.metrics
        if counts is None:
            counts = [0] * len(new)
            if sum(new):
                self.prompt_tokens.inc(len(out.prompt_token_ids or ()))
                if m is not None and m.first_token_time is not None:
                    self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if sum(new):
            self.generation_tokens.inc(sum(new))
        counts = [a + b for a, b in zip(counts, new)] + new[len(counts):]
        if not out.finished:
            self._tokens[out.request_id] = counts
            return
        self._tokens.pop(out.request_id, None)
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self._success.labels(self._model_name, str(reason)).inc()
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        longest = max(counts, default=0)
        if longest > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.observe(max(0.0, m.last_token_time - m.first_token_time) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodeMetrics:
    """Speculative decoding (vLLM's spec_decode metrics): counters of verifications, draft,
    accepted and emitted tokens and accepted drafts by position, and gauges of the acceptance
    rate and the mean accepted length (tokens emitted per verification), all since start."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        reg, labels = registry, ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(f"pagedllm:spec_decode_{name}", doc, labels,
                           registry=reg).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"pagedllm:spec_decode_{name}", doc, labels,
                         registry=reg).labels(model_name)

        self.counters = {
            "num_drafts": counter("num_drafts", "Verifications of drafted tokens."),
            "num_draft_tokens": counter("num_draft_tokens", "Draft tokens verified."),
            "num_accepted_tokens": counter("num_accepted_tokens",
                                           "Draft tokens the target accepted."),
            "num_emitted_tokens": counter("num_emitted_tokens",
                                          "Tokens verifications emitted (accepted + 1 each)."),
        }
        self.per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted draft tokens by their position in the draft.",
                               ["model_name", "position"], registry=reg)
        self.rate = gauge("draft_acceptance_rate", "Accepted / verified draft tokens.")
        self.mean_len = gauge("mean_accepted_length",
                              "Tokens emitted per verification (1 + accepted drafts).")
        self._model_name = model_name
        self._seen: dict[str, int] = {}
        self._seen_pos: list[int] = []

    def update(self, spec: dict[str, Any]) -> None:
        """``spec``: the engine's cumulative SpecDecodeMetrics.as_dict()."""
        for name, counter in self.counters.items():
            value = int(spec.get(name, 0))
            if value > self._seen.get(name, 0):
                counter.inc(value - self._seen.get(name, 0))
                self._seen[name] = value
        for pos, value in enumerate(spec.get("accepted_per_position", [])):
            while len(self._seen_pos) <= pos:
                self._seen_pos.append(0)
            if value > self._seen_pos[pos]:
                self.per_pos.labels(self._model_name, str(pos)).inc(value - self._seen_pos[pos])
                self._seen_pos[pos] = value
        self.rate.set(float(spec.get("acceptance_rate", 0.0)))
        self.mean_len.set(float(spec.get("mean_accepted_length", 0.0)))


KV_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0)


class _KVTransferMetrics:
    """KV offload tiers and connectors (kv_transfer/engine.py stats), per tier ("device" for
    the device prefix cache, "host", "disk", "shared"): prompt blocks looked up, blocks found
    (hits), bytes loaded and saved, load failures, blocks resident and slots; the latency of
    each load (store read + import into the device cache)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "tier"]
        self._model = model_name

        def counter(name: str, doc: str, by_tier: bool = True) -> Any:
            return Counter(f"pagedllm:kv_tier_{name}", doc,
                           labels if by_tier else ["model_name"], registry=registry)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"pagedllm:kv_tier_{name}", doc, labels, registry=registry)

        self.queried = counter("queried_blocks", "Full prompt blocks looked up in the KV "
                               "tiers (once per sequence).", by_tier=False).labels(model_name)
        self.hits = counter("hit_blocks", "Prompt blocks found: in the device cache, or loaded "
                            "from a tier.")
        self.loaded = counter("loaded_bytes", "Bytes loaded from a tier into the device cache.")
        self.saved = counter("saved_bytes", "Bytes saved into a tier.")
        self.failed = counter("load_failures", "Blocks whose load failed (computed instead).")
        self.resident = gauge("resident_blocks", "Blocks held by a tier.")
        self.slots = gauge("capacity_blocks", "Blocks a tier can hold.")
        self.latency = Histogram("pagedllm:kv_transfer_latency_seconds",
                                 "Time of one load from a tier (read + import).", ["model_name"],
                                 buckets=KV_LATENCY_BUCKETS,
                                 registry=registry).labels(model_name)
        self._seen: dict[str, float] = {}

    def _inc(self, metric: Any, key: str, value: float, tier: str | None = None) -> None:
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            (metric.labels(self._model, tier) if tier is not None else metric).inc(delta)
            self._seen[key] = value

    def update(self, kv: dict[str, Any]) -> None:
        counters, moved = kv.get("counters", {}), kv.get("bytes", {})
        self._inc(self.queried, "queried", counters.get("queried", 0))
        self._inc(self.hits, "device", counters.get("device", 0), "device")
        for key, value in counters.items():
            kind, _, tier = key.partition(":")
            if kind == "loaded":
                self._inc(self.hits, key, value, tier)
            elif kind == "failed":
                self._inc(self.failed, key, value, tier)
        for key, value in moved.items():
            kind, _, tier = key.partition(":")
            metric = self.loaded if kind == "loaded" else self.saved
            self._inc(metric, "bytes:" + key, value, tier)
        for connector, tiers in kv.items():
            if connector in ("counters", "bytes", "hit_rates", "load_seconds", "num_loads",
                             "load_seconds_sum") or not isinstance(tiers, dict):
                continue
            for tier, t in tiers.items():
                if isinstance(t, dict) and "resident" in t:
                    self.resident.labels(self._model, tier).set(t["resident"])
                    self.slots.labels(self._model, tier).set(t["slots"])
        for seconds in kv.get("load_seconds", ()):
            self.latency.observe(seconds)
