"""`pagedllm proxy`: disaggregated prefill behind one OpenAI-compatible endpoint.

    pagedllm serve MODEL --port 8100 --kv-transfer-config \\
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer"}'
    pagedllm serve MODEL --port 8200 --kv-transfer-config \\
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer"}'
    pagedllm proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each completion or chat request goes first to a prefill instance as the same request with
``max_tokens=1`` (not streamed): the producer computes the prompt and saves its KV blocks
(kv_transfer/shared_storage.py) before it answers; then the original request goes to a decode
instance, which loads those blocks instead of computing them and generates (streamed as asked).
The decode instance's answer is the proxy's, so outputs are those of one instance. When the
prefill instance fails (gone, an error, a timeout), the decode instance computes the prompt
itself: the request is not lost; the failure is logged and counted
(``pagedllm:proxy_prefill_failures_total`` on the proxy's /metrics).
"""
from __future__ import annotations

import argparse
import asyncio
import logging

logger = logging.getLogger("pagedllm.proxy")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="route each request through a prefill and a decode "
                                     "instance (disaggregated prefill)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill (kv_producer) instance's base URL; repeat for several "
                        "(round robin) (required, no default)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode (kv_consumer) instance's base URL; repeat for several "
                        "(round robin) (required, no default)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                                                       "127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--prefill-timeout", type=float, default=300.0,
                   help="seconds a prefill may take before the decode instance computes the "
                        "prompt itself (default 300)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.entrypoints.proxy_app import Proxy

    proxy = Proxy(args.prefill, args.decode, args.prefill_timeout)
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port,
                ", ".join(proxy.prefill_urls), ", ".join(proxy.decode_urls))
    config = uvicorn.Config(proxy.app(), host=args.host, port=args.port, log_level="warning")
    asyncio.run(uvicorn.Server(config).serve())
    return 0
