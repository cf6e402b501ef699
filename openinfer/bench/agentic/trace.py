"""Agentic trace records (one request each), the JSONL loader, and the trace's theoretical cache-hit rate.

JSONL schema, one object per line (AgentX / Mooncake spellings accepted where noted):

- ``session_id`` (str or int; also ``session``, ``conversation_id``): the session the request belongs to.
- ``agent`` (str, default ``"main"``): which agent of the session sends it; anything but ``"main"`` is a
  sub-agent.
- ``turn`` (int >= 0): order of the request within its agent (turns need not be contiguous, only unique).
- ``in`` (also ``input_length``): prompt tokens. ``out`` (also ``output_length``): tokens to generate
  (sent as ``max_tokens`` with ``ignore_eos``).
- ``hash_ids``: one non-negative int per ``block_size`` prompt tokens, the last block possibly partial, so
  ``len(hash_ids) == ceil(in / block_size)``. Equal ids mean equal token blocks.
- ``think_ms`` (also ``delay_ms``; default 0): gap between the end of what this request waits for (the
  agent's previous turn, the spawn point, or the join) and its start.
- ``spawned_after`` (int, sub-agents only): the main turn after which the sub-agent starts. The main
  agent's next turn waits for every sub-agent spawned after the turn before it (fan-out, then join).
  Sub-agents do not spawn sub-agents.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

MAIN = "main"
_ALIASES = {
    "session_id": ("session_id", "session", "conversation_id"),
    "in": ("in", "input_length"),
    "out": ("out", "output_length"),
    "think_ms": ("think_ms", "delay_ms"),
}


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class TraceRecord:
    session_id: str
    agent: str
    turn: int
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    think_ms: float = 0.0
    spawned_after: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        out = {
            "session_id": d["session_id"],
            "agent": d["agent"],
            "turn": d["turn"],
            "in": d["input_len"],
            "out": d["output_len"],
            "hash_ids": list(d["hash_ids"]),
            "think_ms": d["think_ms"],
        }
        if self.spawned_after is not None:
            out["spawned_after"] = self.spawned_after
        return out


def _pick(obj: dict[str, Any], key: str, where: str, default: Any = ...) -> Any:
    names = [n for n in _ALIASES.get(key, (key,)) if n in obj]
    if len(names) > 1:
        raise TraceError(f"{where}: give only one of {names}")
    if names:
        return obj[names[0]]
    if default is ...:
        raise TraceError(f"{where}: missing field {key!r}")
    return default


def _int(value: Any, where: str, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {field!r} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_record(obj: Any, block_size: int, where: str) -> TraceRecord:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    sid = _pick(obj, "session_id", where)
    if isinstance(sid, bool) or not isinstance(sid, (str, int)):
        raise TraceError(f"{where}: 'session_id' must be a string or an integer, got {sid!r}")
    agent = _pick(obj, "agent", where, MAIN)
    if not isinstance(agent, str) or not agent:
        raise TraceError(f"{where}: 'agent' must be a non-empty string, got {agent!r}")
    turn = _int(_pick(obj, "turn", where), where, "turn", 0)
    n_in = _int(_pick(obj, "in", where), where, "in", 1)
    n_out = _int(_pick(obj, "out", where), where, "out", 1)
    hashes = _pick(obj, "hash_ids", where)
    if not isinstance(hashes, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    for h in hashes:
        _int(h, where, "hash_ids[]", 0)
    want = -(-n_in // block_size)
    if len(hashes) != want:
        raise TraceError(
            f"{where}: 'hash_ids' has {len(hashes)} ids but in={n_in} needs ceil({n_in}/{block_size}) = "
            f"{want} (block size {block_size})"
        )
    think = _pick(obj, "think_ms", where, 0.0)
    if isinstance(think, bool) or not isinstance(think, (int, float)) or not 0 <= think < float("inf"):
        raise TraceError(f"{where}: 'think_ms' must be a finite number >= 0, got {think!r}")
    spawned = obj.get("spawned_after")
    if agent == MAIN and spawned is not None:
        raise TraceError(f"{where}: 'spawned_after' is only for sub-agents (agent != 'main')")
    if agent != MAIN:
        spawned = _int(spawned, where, "spawned_after", 0)
    return TraceRecord(str(sid), agent, turn, n_in, n_out, tuple(hashes), float(think), spawned)


def check_structure(records: Iterable[TraceRecord]) -> None:
    """Unique (session, agent, turn); every sub-agent spawned after one existing main turn."""
    seen: set[tuple[str, str, int]] = set()
    main_turns: dict[str, set[int]] = {}
    spawn: dict[tuple[str, str], int] = {}
    recs = list(records)
    for r in recs:
        key = (r.session_id, r.agent, r.turn)
        if key in seen:
            raise TraceError(f"session {r.session_id!r} agent {r.agent!r}: turn {r.turn} appears twice")
        seen.add(key)
        if r.agent == MAIN:
            main_turns.setdefault(r.session_id, set()).add(r.turn)
    for r in recs:
        if r.agent == MAIN:
            continue
        if r.spawned_after not in main_turns.get(r.session_id, ()):
            raise TraceError(
                f"session {r.session_id!r} sub-agent {r.agent!r}: spawned_after={r.spawned_after} is not a "
                "main-agent turn of that session"
            )
        first = spawn.setdefault((r.session_id, r.agent), r.spawned_after)
        if first != r.spawned_after:
            raise TraceError(
                f"session {r.session_id!r} sub-agent {r.agent!r}: turns disagree on spawned_after "
                f"({first} vs {r.spawned_after})"
            )


def load_trace(path: str | Path, block_size: int = 64) -> list[TraceRecord]:
    """Records in file order; errors name the line and the field."""
    if block_size < 1:
        raise TraceError(f"trace block size must be >= 1, got {block_size}")
    out = []
    if not Path(path).is_file():
        raise TraceError(f"--trace {path}: no such file")
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            out.append(parse_record(obj, block_size, where))
    if not out:
        raise TraceError(f"{path}: the trace has no records")
    check_structure(out)
    return out


def write_trace(records: Iterable[TraceRecord], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")


class PrefixCacheModel:
    """An unlimited prefix cache over trace blocks. Block keys chain over the ids before them (as servers
    hash blocks), so a block hits only when its whole prefix was seen in an earlier request. Only full
    blocks are cached and only full blocks hit: a request's last, partial block always misses."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[int] = set()

    def add(self, hash_ids: Iterable[int], input_len: int, salt: Any = None) -> int:
        """Hit tokens of one request, then remember its full blocks. ``salt`` separates replays that the
        runner makes distinct (a different salt means different filler, so nothing is shared)."""
        full = input_len // self.block_size
        key = hash(("root", salt))
        hits = 0
        missed = False
        for h in list(hash_ids)[:full]:
            key = hash((key, h))
            if not missed and key in self._seen:
                hits += 1
            else:
                missed = True
                self._seen.add(key)
        return hits * self.block_size


def theoretical_cache_hit_rate(records: Iterable[TraceRecord], block_size: int = 64) -> float:
    """Σ hit tokens / Σ prompt tokens over ``records`` in order, assuming an unlimited cache that keeps
    every full block of every earlier request. The order only matters within a chained prefix shared by
    several requests, and even then only which of them pays the miss: the total is order-independent."""
    model = PrefixCacheModel(block_size)
    hits = total = 0
    for r in records:
        hits += model.add(r.hash_ids, r.input_len)
        total += r.input_len
    return hits / total if total else 0.0
