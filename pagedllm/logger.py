"""One log format for every pagedllm process: the CLI, the server, uvicorn and the engine process.

    2026-12-05 03:01:02 INFO pagedllm.engine.llm_engine: ...

The library itself only creates loggers (``logging.getLogger(__name__)``); the entry points call
``configure_logging()``, which leaves an application's own logging set-up alone.
"""
from __future__ import annotations

import logging
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def configure_logging(level: int = logging.INFO) -> None:
    """The root handler in LOG_FORMAT, unless the process already configured logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=DATE_FORMAT)


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's loggers without handlers of their own: their records reach the root handler
    (LOG_FORMAT) instead of uvicorn's ``INFO:     ...`` lines."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: {"handlers": [], "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def one_line(exc: BaseException) -> str:
    """An error's message on one log line (multi-line messages joined with "; ")."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__
