"""The calls an executor makes on worker processes, and their replies: msgspec structs sent as msgpack over
ZeroMQ (never pickle). Each call is a tagged struct; a reply carries the call's result encoded on its own
(``value``), which the executor decodes with the type that call returns."""
from __future__ import annotations

import msgspec

from openinfer.kv_cache_interface import KVBudget, KVGroupSpec
from openinfer.step_io import ModelRunnerOutput, SchedulerOutput


class GetKVCacheSpec(msgspec.Struct, tag=True):
    pass


class DetermineKVBudget(msgspec.Struct, tag=True):
    pass


class InitializeKVCache(msgspec.Struct, tag=True):
    num_blocks: dict[str, int]


class ExecuteModel(msgspec.Struct, tag=True):
    scheduler_output: SchedulerOutput
    # Another replica steps and the model's layers meet across replicas: run a forward even with nothing scheduled.
    lockstep: bool = False


class GetLoadTime(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


class InitKVOffload(msgspec.Struct, tag=True):
    """Start the offloading tier's worker side (``locations``: by data-parallel replica)."""

    backend: str
    locations: list[str]
    fingerprint: str


class InitKVConnector(msgspec.Struct, tag=True):
    engine_id: str  # the instance's; each rank derives its replica's (distributed/kv_transfer/ranks.py)


Call = (GetKVCacheSpec | DetermineKVBudget | InitializeKVCache | ExecuteModel | GetLoadTime | Shutdown | InitKVOffload
        | InitKVConnector)

# What each call returns (the type its reply's value decodes to) and the worker method that answers it.
RESULT_TYPES: dict[type, type] = {
    GetKVCacheSpec: list[KVGroupSpec], DetermineKVBudget: KVBudget, InitializeKVCache: type(None),
    ExecuteModel: ModelRunnerOutput | None, GetLoadTime: float, Shutdown: type(None),
    InitKVOffload: dict[str, list[int]], InitKVConnector: dict,
}
METHODS: dict[str, type] = {
    "get_kv_cache_spec": GetKVCacheSpec, "determine_kv_budget": DetermineKVBudget,
    "initialize_kv_cache": InitializeKVCache, "execute_model": ExecuteModel, "load_time_s": GetLoadTime,
    "init_kv_offload": InitKVOffload, "init_kv_connector": InitKVConnector,
}


class Request(msgspec.Struct):
    call_id: int
    call: Call


class Reply(msgspec.Struct):
    call_id: int
    rank: int
    ok: bool
    value: bytes = b""  # msgpack of the call's result
    error: str | None = None


class Ready(msgspec.Struct):
    """A worker's first message: it joined the process groups and loaded its shard of the model."""

    rank: int
    pid: int
    ok: bool = True
    error: str | None = None
