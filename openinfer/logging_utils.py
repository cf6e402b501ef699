"""openinfer's own logger: INFO lines (the KV-cache summary, model load) show without any setup, like vLLM.
Set OPENINFER_LOG_LEVEL=WARNING to silence them."""
from __future__ import annotations

import logging
from openinfer import envs

_configured = False


def init_logging() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    logger = logging.getLogger("openinfer")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel((envs.LOG_LEVEL or "INFO").upper())
    logger.propagate = False
