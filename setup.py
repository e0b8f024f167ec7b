"""Builds pagedllm; builds the csrc/ kernels as pagedllm._C when a CUDA or ROCm torch and compiler exist."""
from __future__ import annotations

import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extensions() -> tuple[list, dict]:
    """The GPU extension and its build command, or nothing on a CPU-only machine."""
    if os.environ.get("PAGEDLLM_TARGET_DEVICE", "").lower() == "cpu":
        return [], {}
    sys.path.insert(0, os.path.join(ROOT, "csrc"))
    try:
        import setup_ext  # type: ignore[import-not-found]
    except ImportError:
        return [], {}
    finally:
        sys.path.pop(0)
    exts = setup_ext.get_extensions()
    return exts, (setup_ext.get_cmdclass() if exts else {})


ext_modules, cmdclass = _extensions()

setup(
    name="pagedllm",
    version="0.1.0",
    description="LLM inference and serving with a paged KV cache on many hardware backends",
    # csrc/ ships as pagedllm/_csrc, where the JIT builds look for it (backends/kernel_build.py):
    # the GPU kernel sources, and csrc/cpu/ that the cpu backend builds on first use
    packages=find_packages(include=["pagedllm", "pagedllm.*"]) + ["pagedllm._csrc"],
    package_dir={"pagedllm._csrc": "csrc"},
    # the built-in demo model (pagedllm/models/demo.py): weights, tokenizer, configs, model card
    package_data={"pagedllm": ["py.typed", "contract/manifest.json", "models/demo_model/*.json",
                               "models/demo_model/*.safetensors", "models/demo_model/README.md",
                               "models/demo_model/*.png",
                               # its speculative-decoding proposers (tools/train_draft_model.py)
                               "models/demo_model/draft/*.json",
                               "models/demo_model/draft/*.safetensors",
                               "models/demo_model/draft/README.md",
                               "models/demo_model/eagle/*.json",
                               "models/demo_model/eagle/*.safetensors",
                               "models/demo_model/eagle/README.md"],
                  "pagedllm._csrc": ["*.py", "*.h", "*.cuh", "*.cu", "*.cpp", "cpu/*.cpp", "cpu/*.h"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=4.45",
        "tokenizers",
        "safetensors",
        "numpy",
        "tqdm",
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "prometheus-client",
        "jinja2",
        # structured output (response_format, guided_*, tool_choice required/named), as vLLM
        # installs it; its wheels pull no torch of their own when torch is installed (tested:
        # py3.11, torch 2.13.0+cpu)
        "xgrammar>=0.2.9",
    ],
    extras_require={
        # triton: the cuda backend's Triton kernels are tested on CPU through its interpreter
        # xgrammar: guided decoding (structured output); its wheels pull no torch of their own
        # when torch is installed (tested: py3.11, torch 2.13.0+cpu)
        "guided": ["xgrammar>=0.2.9"],
        # matplotlib: `pagedllm bench --plot` and the benchmarks' --plot (binary wheels; pulls no torch)
        "bench": ["matplotlib"],
        "test": ["pytest", "pytest-timeout", "openai", "httpx", "triton; sys_platform == 'linux'",
                 "matplotlib",
                 "xgrammar>=0.2.9", "jsonschema",
                 # quantization tests write compressed-tensors checkpoints with the library
                 # llm-compressor saves through (pulls loguru, psutil; no torch of its own here)
                 "compressed-tensors>=0.20",
                 # LoRA tests make their adapters with peft itself and compare with transformers
                 # + PEFT (pulls accelerate; no torch of its own when torch is installed)
                 "peft>=0.14"],
        "ray": ["ray"],
    },
    entry_points={
        "console_scripts": ["pagedllm=pagedllm.entrypoints.cli:main"],
        # the conformance suite's --device option and capability report (named like its module,
        # so an explicit `-p pagedllm.testing.plugin` does not register it twice)
        "pytest11": ["pagedllm.testing.plugin = pagedllm.testing.plugin"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
