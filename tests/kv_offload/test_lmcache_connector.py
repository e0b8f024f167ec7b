"""LMCacheConnector against the real LMCache (``pip install lmcache``; the engine tests skip
where it is not importable): a producer's prompt blocks go into LMCache's backends and a
consumer engine loads them instead of computing them, its greedy output token for token the
producer's: across two LMCache engines through LMCache's shared-folder store (the "fs" remote
plugin; unreadable blocks are computed instead), and through one LMCache engine (its local
disk backend) shared by two pagedllm engines. The engines run on $PAGEDLLM_TEST_DEVICE (default
cpu). The settings checks and the missing-package error run everywhere."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams, envs
from pagedllm.kv_transfer.config import KVTransferConfig
from pagedllm.kv_transfer.lmcache import lmcache_settings

BS = 16
DEVICE = envs.PAGEDLLM_TEST_DEVICE or "cpu"  # the engines' device (cuda on the GPU machine)


@pytest.fixture(scope="module")
def lmcache() -> object:
    from pagedllm.kv_transfer.lmcache_worker import import_lmcache

    try:
        return import_lmcache()
    except ImportError as exc:
        pytest.skip(f"lmcache is not importable: {exc}")


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randint(3, 258) for _ in range(n)] for n in (70, 49, 90, 33)]


def _engine(path: str, role: str | None, extra: dict | None = None, blocks: int = 64) -> LLM:
    transfer = None if role is None else {"kv_connector": "LMCacheConnector", "kv_role": role,
                                          "kv_connector_extra_config": extra or {}}
    return LLM(path, device=DEVICE, dtype="float32", block_size=BS, seed=0,
               num_gpu_blocks_override=blocks, kv_transfer_config=transfer)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _shared_folder(path: str) -> dict:
    """LMCache's "fs" remote storage plugin: one file per chunk in a folder engines share."""
    return {"lmcache.remote_storage_plugins": ["fs"],
            "lmcache.extra_config": {"remote_storage_plugin.fs.base_path": path}}


def _counters(llm: LLM) -> dict:
    return llm.llm_engine.stats().kv_transfer["counters"]


def test_consumer_loads_what_the_producer_stored(lmcache, llama_path, tmp_path) -> None:
    """Two LMCache engines (one per pagedllm engine) over one shared folder."""
    prompts, folder = _prompts(), tmp_path / "kv"
    producer = _engine(llama_path, "kv_producer", _shared_folder(str(folder)))
    expected = _greedy(producer, prompts)  # computed by the producer itself
    saved = _counters(producer)["saved:lmcache"]
    # every full block its prefix cache gained: the prompts' and the decoded ones'
    assert saved == sum((len(p) + 7) // BS for p in prompts)
    producer.llm_engine.shutdown()  # its LMCache engine is gone; the folder stays
    assert len(list(folder.iterdir())) == saved  # LMCache's files, written before return

    consumer = _engine(llama_path, "kv_consumer", _shared_folder(str(folder)))
    assert _greedy(consumer, prompts) == expected
    counters = _counters(consumer)
    # a hit never covers the last token: (len - 1) // BS blocks of each prompt, none computed
    assert counters["loaded:lmcache"] == sum((len(p) - 1) // BS for p in prompts)
    assert "failed:lmcache" not in counters and "saved:lmcache" not in counters
    assert consumer.llm_engine.kv.check_idle() == []
    consumer.llm_engine.shutdown()

    # three prompt blocks truncated (the first files written: the decoded blocks came later)
    for f in sorted(folder.iterdir(), key=lambda f: f.stat().st_mtime_ns)[:3]:
        f.write_bytes(f.read_bytes()[:100])
    consumer = _engine(llama_path, "kv_consumer", _shared_folder(str(folder)))
    assert _greedy(consumer, prompts) == expected  # those blocks computed instead
    counters = _counters(consumer)
    assert counters["failed:lmcache"] == 3 and counters["loaded:lmcache"] > 0
    assert consumer.llm_engine.kv.check_idle() == []
    consumer.llm_engine.shutdown()


def test_two_engines_share_one_lmcache_engine(lmcache, llama_path, tmp_path) -> None:
    """Both name one LMCache instance (its local disk backend only): the consumer loads while
    the producer runs and after it shut down; the last one to close destroys it."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    prompts, name = _prompts(), "pagedllm-test-shared"
    extra = {"lmcache.lmcache_instance_id": name, "lmcache.local_cpu": False,
             "lmcache.local_disk": str(tmp_path / "disk"), "lmcache.max_local_disk_size": 0.05}
    producer = _engine(llama_path, "kv_both", extra)
    expected = _greedy(producer, prompts)
    consumer = _engine(llama_path, "kv_consumer", extra)
    assert _greedy(consumer, prompts[:2]) == expected[:2]
    producer.llm_engine.shutdown()
    assert LMCacheEngineBuilder.get(name) is not None
    assert _greedy(consumer, prompts[2:]) == expected[2:]
    assert _counters(consumer)["loaded:lmcache"] == sum((len(p) - 1) // BS for p in prompts)
    assert consumer.llm_engine.kv.check_idle() == []
    consumer.llm_engine.shutdown()
    assert LMCacheEngineBuilder.get(name) is None


def test_one_engine_reloads_what_its_device_cache_evicted(lmcache, llama_path) -> None:
    """kv_both with LMCache's CPU backend: a device cache of 12 blocks, prompts asked again
    after the others evicted them, loaded from LMCache instead of computed."""
    prompts = _prompts()
    llm = _engine(llama_path, "kv_both", {"lmcache.max_local_cpu_size": 0.05}, blocks=12)
    first = _greedy(llm, prompts[:1]) + _greedy(llm, prompts[1:])  # the first is evicted
    saved = _counters(llm)["saved:lmcache"]
    assert _greedy(llm, prompts) == first
    counters = _counters(llm)
    # the second pass computes no prompt block: each is a device hit or loaded (and nothing
    # is saved again: LMCache holds it)
    assert counters["device"] + counters["loaded:lmcache"] >= sum((len(p) - 1) // BS
                                                                  for p in prompts)
    assert counters["saved:lmcache"] == saved and "failed:lmcache" not in counters
    assert llm.llm_engine.kv.check_idle() == []
    llm.llm_engine.shutdown()


def test_a_process_that_never_shut_its_engine_down_exits(lmcache, llama_path) -> None:
    """LMCache's event loop thread is not a daemon: the engines left open are destroyed once
    the main thread ends, so the interpreter still exits."""
    script = f"""if True:
        from pagedllm import LLM, SamplingParams
        llm = LLM({llama_path!r}, device={DEVICE!r}, dtype="float32", block_size={BS},
                  num_gpu_blocks_override=64, kv_transfer_config={{
                      "kv_connector": "LMCacheConnector", "kv_role": "kv_both"}})
        llm.generate([{{"prompt_token_ids": list(range(3, 40))}}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
        print("generated")
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "generated" in done.stdout, done.stderr[-2000:]


def _config(extra: dict, block_size: int = BS) -> SimpleNamespace:
    transfer = KVTransferConfig(kv_connector="LMCacheConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=transfer,
                           cache=SimpleNamespace(block_size=block_size),
                           model=SimpleNamespace(model="/models/llama-tiny/"),
                           parallel=SimpleNamespace(tensor_parallel_size=1,
                                                    pipeline_parallel_size=1))


def test_settings() -> None:
    spec = lmcache_settings(_config({"lmcache.max_local_cpu_size": 1.5,
                                     "lmcache.lmcache_instance_id": "a", "put_timeout_s": 3}))
    assert spec["overrides"] == {"max_local_cpu_size": 1.5} and spec["instance_id"] == "a"
    assert spec["model_name"] == "llama-tiny" and spec["put_timeout_s"] == 3.0
    config = _config({})
    assert lmcache_settings(config)["instance_id"] == lmcache_settings(config)["instance_id"]
    assert lmcache_settings(config)["instance_id"] != lmcache_settings(_config({}))["instance_id"]
    with pytest.raises(ValueError, match="unknown key.*local_cpu.*lmcache.<name>"):
        lmcache_settings(_config({"local_cpu": True}))
    with pytest.raises(ValueError, match=r"\['lmcache.chunk_size'\]=256 is invalid.*\(16\)"):
        lmcache_settings(_config({"lmcache.chunk_size": 256}))
    assert lmcache_settings(_config({"lmcache.chunk_size": 16}))  # the block size: fine
    with pytest.raises(ValueError, match="use_layerwise'\\]=True is not supported"):
        lmcache_settings(_config({"lmcache.use_layerwise": True}))
    with pytest.raises(ValueError, match="put_timeout_s'\\]=0 is invalid"):
        lmcache_settings(_config({"put_timeout_s": 0}))


def test_missing_lmcache_is_named(llama_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "lmcache", None)  # `import lmcache` raises ImportError
    with pytest.raises(ImportError, match="needs the lmcache package.*pip install lmcache"):
        _engine(llama_path, "kv_both")
