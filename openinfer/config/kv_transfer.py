"""Prefill/decode disaggregation (vLLM's ``kv_transfer_config``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openinfer.config.json_option import parse_json_config


KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# kv_connector_extra_config.send_type, spelled as vLLM's P2pNcclConnector spells its push/pull switch: "GET" - the
# decoder reads the producer's blocks (pull, vLLM NixlConnector's only mode); "PUT" - the decoder hands its own
# blocks to the producer, which writes into them (push).
KV_SEND_TYPES = ("GET", "PUT")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (vLLM's ``kv_transfer_config``): a KV connector moves finished prompts' KV
    between instances. A producer runs prompts for others (``do_remote_decode``) and holds their blocks until the
    reader says it is done or ``abort_request_timeout_s`` passes (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT); a consumer
    reads them (``do_remote_prefill``), and falls back to computing the prompt itself when a read fails or takes
    longer than ``load_timeout_s``. The side channel (handshake and block layout, ZeroMQ + msgspec) listens on
    ``side_channel_host:side_channel_port``; port 0 picks a free port, advertised in ``kv_transfer_params``, so
    instances on one host never collide. ``kv_connector_extra_config.send_type`` picks pull (``"GET"``, the
    default) or push (``"PUT"``) for the requests this instance decodes; a producer serves both."""

    kv_connector: str
    kv_role: str
    engine_id: str | None = None  # None: a fresh uuid per start
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    abort_request_timeout_s: float = 480.0
    load_timeout_s: float = 30.0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config must be a JSON object, got {extra!r}")
        unknown = sorted(set(extra) - {"send_type"})
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown}; known: "
                             f"['send_type']")
        if extra.get("send_type", "GET") not in KV_SEND_TYPES:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.send_type={extra['send_type']!r}; choose "
                             f"one of {', '.join(KV_SEND_TYPES)}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r}; choose one of "
                             f"{', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r}; choose one of {', '.join(KV_ROLES)}")
        if not isinstance(self.side_channel_port, int) or not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"kv_transfer_config.side_channel_port must be in [0, 65535], got "
                             f"{self.side_channel_port!r}")
        for name in ("abort_request_timeout_s", "load_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"kv_transfer_config.{name} must be a number > 0, got {v!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def push(self) -> bool:
        """This instance, decoding, has the producer write into its blocks (send_type PUT) rather than read."""
        return self.kv_connector_extra_config.get("send_type", "GET") == "PUT"

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
        """JSON text, a dict or None -> the config; unknown keys are an error naming them."""
        return parse_json_config(cls, value, "kv_transfer_config", ("kv_connector", "kv_role"))
