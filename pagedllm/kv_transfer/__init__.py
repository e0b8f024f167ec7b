"""KV connectors (issue 45): moving KV blocks between an engine's device cache and somewhere
else, by the prefix cache's content keys. vLLM's shape:

    LLM(model, kv_transfer_config={"kv_connector": "SharedStorageConnector",
                                   "kv_role": "kv_producer", ...})
    pagedllm serve MODEL --kv-transfer-config '{"kv_connector": NAME, "kv_role": ...}'

  config.py          KVTransferConfig (vLLM's field names; plain data)
  keys.py            stable content keys (the prefix cache's; no torch)
  base.py            the connector interface, scheduler side (no torch) and worker side
  scheduler_side.py  KVConnectorManager: what the scheduler and block manager call (no torch)
  worker_side.py     the worker's half: runs a step's block moves through the cache ops
  shared_storage.py  the built-in transfer connector between engine processes on one host
  p2p.py             the built-in transfer connector over torch.distributed (one host or two)
  registry.py        connectors by name: built-ins + entry-point group "pagedllm.kv_connectors"
  engine.py          the engine's hooks: start-up, after each step, stats

The KV offload tiers (pagedllm/kv_offload) are the built-in connector "OffloadingConnector".
This package's own __init__ imports nothing.
"""
