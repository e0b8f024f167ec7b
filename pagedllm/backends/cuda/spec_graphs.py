"""CUDA graphs for speculative decoding's target steps: one per (batch size, query rows, context
bucket) of ``SpecStepGraphs`` (spec_decode/graphs.py), captured into one memory pool."""
from __future__ import annotations

import logging

import torch

from pagedllm.backends.cuda.graphs import capture_graph
from pagedllm.spec_decode.graphs import MAX_VERIFY_GRAPH_BATCH, SpecStepGraphs

logger = logging.getLogger(__name__)


def verify_graph_sizes(sizes: list[int]) -> list[int]:
    """The decode graph sizes up to MAX_VERIFY_GRAPH_BATCH."""
    return [b for b in sizes if b <= MAX_VERIFY_GRAPH_BATCH]


@torch.inference_mode()
def capture(graphs: SpecStepGraphs) -> None:
    """One CUDA graph per key of ``graphs``, largest first (smaller graphs reuse its pool). A
    forward that cannot be captured (e.g. a length-switched rotary reading the step's lengths on
    the host) leaves its steps eager, logged."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    keys = graphs.keys()
    graphs.forward_static(*keys[0])  # sizes the shared outputs outside any graph
    captured = {}
    for key in keys:
        try:
            graph = capture_graph(lambda: graphs.forward_static(*key), pool, stream)
        except RuntimeError as exc:
            torch.cuda.synchronize()
            logger.warning("speculative step graph (size, q, context) = %s not captured (%s): "
                           "such steps run eagerly", key, exc)
            continue
        captured[key] = graph
    torch.cuda.synchronize()
    graphs.graphs = captured
    logger.info("captured %d speculative step graphs: decode sizes %s x contexts %s, "
                "verification (q=%d) sizes %s", len(captured), graphs.sizes, graphs.context_lens,
                graphs.q, graphs.verify_sizes)
