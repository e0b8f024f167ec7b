"""Multi-LoRA serving (issue 44): PEFT adapters on one base model, many adapters in one batch.

``request.py`` (``LoRARequest``) and ``config.py`` (``LoRAConfig``) are plain data any layer may
read; the rest runs beside the worker: ``peft.py`` reads an adapter folder, ``routing.py`` maps
its modules onto this engine's (fused, sharded) linears, ``layers.py`` holds the per-linear slot
buffers the shrink/expand ops read, ``worker_manager.py`` keeps the host LRU and the device
slots, ``registry.py`` is the engine's side (named adapters, validation before a request runs).
This package's own __init__ imports nothing: ``from pagedllm.lora.request import LoRARequest``
stays light.
"""
