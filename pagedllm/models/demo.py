"""The built-in default model: a tiny deterministic Llama written to a cache folder on first use.

It makes ``pagedllm generate`` work with no download; its weights are random (seeded), so its
text is not meaningful.
"""
from __future__ import annotations

import os
import shutil
import tempfile

DEMO_VERSION = "v1"


def cache_dir() -> str:
    return os.environ.get("PAGEDLLM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagedllm"))


def demo_model_path() -> str:
    path = os.path.join(cache_dir(), f"demo-{DEMO_VERSION}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from pagedllm.testing.checkpoints import make_checkpoint

    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".demo-")
    make_checkpoint(tmp, "llama", seed=1234, num_hidden_layers=4, hidden_size=128,
                    intermediate_size=256, max_position_embeddings=2048)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path
