"""KV offload / KV transfer configuration: field checks name the field, and the engine's one
configuration check refuses them on a backend that does not declare block export/import."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.config import ParallelConfig
from pagedllm.contract.capabilities import Capabilities
from pagedllm.engine.config_validation import check_kv_transfer
from pagedllm.kv_offload.config import DEFAULT_DISK_GIB, KVOffloadConfig
from pagedllm.kv_transfer.config import KVTransferConfig


def test_offload_config_fields(tmp_path) -> None:
    assert KVOffloadConfig.from_args(0, None, None) is None
    cfg = KVOffloadConfig.from_args(2, str(tmp_path), None)
    assert cfg.size_gib == 2 and cfg.disk_size_gib == DEFAULT_DISK_GIB
    with pytest.raises(ValueError, match="kv_offload_size=-1"):
        KVOffloadConfig(size_gib=-1)
    with pytest.raises(ValueError, match="kv_offload_disk_size=0"):
        KVOffloadConfig(disk_path=str(tmp_path), disk_size_gib=0)
    with pytest.raises(ValueError, match="needs kv_offload_disk"):
        KVOffloadConfig(disk_size_gib=3)
    file = tmp_path / "f"
    file.write_text("x")
    with pytest.raises(ValueError, match="kv_offload_disk=.*it is a file"):
        KVOffloadConfig(disk_path=str(file))


def test_transfer_config_parses_vllm_json() -> None:
    cfg = KVTransferConfig.from_value('{"kv_connector": "SharedStorageConnector", '
                                      '"kv_role": "kv_consumer", '
                                      '"kv_connector_extra_config": {"shared_storage_path": "/x"}}')
    assert cfg.is_consumer and not cfg.is_producer
    assert cfg.kv_connector_extra_config == {"shared_storage_path": "/x"}
    assert KVTransferConfig.from_value(None) is None
    with pytest.raises(ValueError, match="kv_role='sender'.*kv_producer, kv_consumer, kv_both"):
        KVTransferConfig.from_value({"kv_connector": "X", "kv_role": "sender"})
    with pytest.raises(ValueError, match="unknown key.*kv_conector"):
        KVTransferConfig.from_value({"kv_conector": "X", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_value("{kv_connector")


def _config(**kw: object) -> SimpleNamespace:
    base = dict(kv_offload_config=None, kv_transfer_config=None, speculative_config=None,
                parallel=ParallelConfig())
    base.update(kw)
    return SimpleNamespace(**base)


def test_refused_without_kv_export_by_name(tmp_path) -> None:
    plain = SimpleNamespace(name="toy", capabilities=Capabilities())
    offload = KVOffloadConfig(disk_path=str(tmp_path))
    check_kv_transfer(_config(), plain)  # nothing asked: nothing refused
    with pytest.raises(ValueError, match=r"kv_offload_size/kv_offload_disk: the toy backend .*"
                                         r"Capabilities.kv_export.*backends that do: .*cpu"):
        check_kv_transfer(_config(kv_offload_config=offload), plain)
    transfer = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match="kv_transfer_config: the toy backend"):
        check_kv_transfer(_config(kv_transfer_config=transfer), plain)
    able = SimpleNamespace(name="able", capabilities=Capabilities(kv_export=True))
    check_kv_transfer(_config(kv_offload_config=offload), able)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported yet"):
        check_kv_transfer(_config(kv_offload_config=offload,
                                  parallel=ParallelConfig(tensor_parallel_size=2)), able)
    with pytest.raises(ValueError, match="speculative_config is not supported yet"):
        check_kv_transfer(_config(kv_offload_config=offload, speculative_config=object()), able)
