"""KVTransferConfig: which KV connector an engine runs and in which role (vLLM's field names and
JSON shape, ``--kv-transfer-config``). Plain data; no torch here."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """``kv_connector``: a registered connector's name (``pagedllm.kv_transfer.registry``);
    ``kv_role``: a producer saves the blocks of the prompts it computes, a consumer loads blocks
    before it computes a prompt, both does both; ``kv_connector_extra_config``: the
    connector's own settings. The rest is accepted for vLLM compatibility."""

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9
    kv_buffer_device: str = "cpu"
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} is invalid: "
                             "name a connector (`pagedllm.kv_transfer.registry` lists them)")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r} is invalid: allowed "
                             f"values are {', '.join(ROLES)}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config="
                             f"{self.kv_connector_extra_config!r} is invalid: must be an object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_value(cls, value: Any) -> KVTransferConfig | None:
        """None, a KVTransferConfig, a dict or its JSON text (the CLI's form)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config={value!r} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config={value!r} is invalid: give a JSON object such "
                             'as {"kv_connector": "SharedStorageConnector", "kv_role": '
                             '"kv_both"}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown key(s) {', '.join(unknown)}; "
                             f"known keys: {', '.join(sorted(known))}")
        return cls(**value)
