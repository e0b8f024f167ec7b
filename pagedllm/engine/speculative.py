"""Speculative decoding's engine-side set-up, made once when the engine starts: the checks that
need the target model, the backend and the parallel layout (each refusal names its field), the
method of a config that named only a model, the shipped draft/head of the demo model, and the
scheduler, block manager and stepper classes of the mode."""
from __future__ import annotations

import logging
import os
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.scheduler import SpecBlockManager, SpecScheduler

logger = logging.getLogger(__name__)

# the demo model's shipped proposers: folders inside pagedllm/models/demo_model/
DEMO_PROPOSERS = {"eagle": "eagle", "eagle3": "eagle", "draft_model": "draft"}


def supports_multi_token_decode(backend: Any) -> bool:
    """The backend's attention handles decode sequences of several query tokens (causal within,
    over cached context): its declaration, else what prefix caching or chunked prefill imply
    (the verification chunk runs on that path)."""
    caps = backend.capabilities
    declared = getattr(caps, "multi_token_decode", None)
    if declared is not None:
        return bool(declared)
    return bool(caps.prefix_caching or caps.chunked_prefill)


def demo_proposer_path(method: str, target: str) -> str | None:
    """The shipped draft/head folder for ``method`` when the target is the demo model."""
    from pagedllm.models.demo import DEMO_DIR

    try:
        same = os.path.samefile(target, DEMO_DIR)
    except OSError:
        same = False
    if not same or method not in DEMO_PROPOSERS:
        return None
    return os.path.join(DEMO_DIR, DEMO_PROPOSERS[method])


def check_static_shapes(backend: Any) -> None:
    """A static-shape backend (capabilities.static_shapes) speculates only where its worker
    pads verification steps to its buckets (``Worker.pads_verification_steps``: its model
    runner's ``forward_rows`` does)."""
    worker = backend.worker_cls()
    if not getattr(worker, "pads_verification_steps", False):
        raise ValueError(
            f"speculative_config is not supported by the {backend.name} backend: it needs "
            f"static shapes (capabilities.static_shapes) and its worker {worker.__name__} "
            "does not pad verification steps to its buckets (Worker.pads_verification_steps, "
            "ModelRunner.forward_rows)")


def check_speculative(config: EngineConfig, backend: Any) -> None:
    """Check ``config.speculative_config`` against the backend, the parallel layout and the
    target, and resolve it in place (the demo model's shipped draft/head when no model is
    given, the method of a config that named only a model). Called by validate_config."""
    spec: SpeculativeConfig | None = config.speculative_config
    if spec is None:
        return
    if not supports_multi_token_decode(backend):
        raise ValueError(
            f"speculative_config is not supported by the {backend.name} backend: verification "
            "needs attention over decode sequences with more than one query token "
            "(Capabilities.multi_token_decode), which it does not declare")
    if backend.capabilities.static_shapes:
        check_static_shapes(backend)
    if spec.method == "ngram":
        return
    if spec.model is None:
        path = demo_proposer_path(spec.method or "", config.model.model)
        if path is None:
            raise ValueError(f"speculative_config.model is required for method {spec.method!r} "
                             "(a local draft or head folder); only pagedllm-demo ships one")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"speculative_config: the demo model's {spec.method} proposer is "
                             f"not in {path}; train it with `python tools/train_draft_model.py` "
                             "or give speculative_config.model")
        spec.model = path
    from pagedllm.spec_decode.loading import check_draft_config, resolve_method

    if not os.path.isdir(spec.model):
        raise ValueError(f"speculative_config.model={spec.model!r} is not a local folder")
    spec.method = resolve_method(spec)
    if backend.capabilities.static_shapes:
        raise ValueError(
            f"speculative_config.method={spec.method!r} is not supported by the {backend.name} "
            "backend yet: the draft model's or EAGLE head's own steps "
            "(DeviceProposer._forward) are not padded to its static-shape buckets "
            "(capabilities.static_shapes); allowed there: 'ngram'")
    check_draft_config(spec, config)


class SpeculativeDecoding:
    """The mode's parts, chosen when the engine starts with a (checked) speculative_config:
    scheduler and block manager classes, the backend whose workers carry the proposer, the
    stepper."""

    scheduler_cls = SpecScheduler
    block_manager_cls = SpecBlockManager

    def __init__(self, config: EngineConfig, backend: Any) -> None:
        from pagedllm.spec_decode.worker import SpecBackend

        self.config = config
        self.spec: SpeculativeConfig = config.speculative_config
        self.backend = SpecBackend(backend)
        logger.info("speculative decoding: %s", self.spec.describe())

    def make_stepper(self, schedulers: list, executor: Any, guided: Any) -> Any:
        """The speculative stepper; with pipeline stages (a scheduler per virtual engine) its
        pipelined form, several verification batches in flight."""
        from pagedllm.engine.steppers.speculative import SpecStepper

        cls = SpecStepper
        if len(schedulers) > 1:
            from pagedllm.engine.steppers.spec_pipelined import PipelinedSpecStepper

            cls = PipelinedSpecStepper
        return cls(schedulers, executor, guided, speculative_config=self.spec,
                   max_model_len=self.config.model.max_model_len)
