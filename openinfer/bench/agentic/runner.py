"""Replay an agentic trace against a server: ``concurrency`` live sessions (lanes), each session's agents
turn by turn with think time, sub-agent fan-out and join.

A lane takes the next session, plays it to the end, then takes another. Within a session the main
agent's turn k+1 starts ``think_ms`` after the later of its turn k and every sub-agent spawned after
turn k (join); a sub-agent's first turn starts ``think_ms`` after its parent's turn k ends. So the live
request count can exceed ``concurrency`` while sub-agents run, as in AgentX.

Every request sends the whole prompt as token ids (see filler.py) with ``max_tokens = out`` and
``ignore_eos``. The first ``warmup_turns`` requests of each lane prime the cache and are kept out of the
metrics. With ``duration_s`` the lanes cycle through the trace until the deadline (no request starts
after it); each pass uses its own filler salt, so a pass never reuses another's blocks. Without it the
trace is played once.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from openinfer.bench.agentic.client import AgenticResult, stream_completion
from openinfer.bench.agentic.filler import Filler
from openinfer.bench.agentic.trace import MAIN, PrefixCacheModel, TraceRecord


@dataclass
class Session:
    session_id: str
    main: list[TraceRecord]
    # main turn -> sub-agents spawned after it, each a list of turns in order
    subagents: dict[int, list[list[TraceRecord]]] = field(default_factory=dict)


def build_sessions(records: list[TraceRecord]) -> list[Session]:
    """Sessions in order of first appearance in the trace."""
    main: dict[str, list[TraceRecord]] = defaultdict(list)
    subs: dict[str, dict[str, list[TraceRecord]]] = defaultdict(lambda: defaultdict(list))
    order: list[str] = []
    for r in records:
        if r.session_id not in main and r.session_id not in subs:
            order.append(r.session_id)
        (main[r.session_id] if r.agent == MAIN else subs[r.session_id][r.agent]).append(r)
    out = []
    for sid in order:
        s = Session(sid, sorted(main.get(sid, []), key=lambda r: r.turn))
        for turns in subs.get(sid, {}).values():
            turns.sort(key=lambda r: r.turn)
            s.subagents.setdefault(turns[0].spawned_after, []).append(turns)
        out.append(s)
    return out


@dataclass
class RequestRecord:
    record: TraceRecord
    lane: int
    pass_index: int
    warmup: bool
    theoretical_hit_tokens: int
    result: AgenticResult


@dataclass
class RunConfig:
    url: str  # the completions endpoint
    model: str
    concurrency: int
    warmup_turns: int = 1
    duration_s: float | None = None
    stall_timeout_s: float = 300.0
    salt: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    honor_think_time: bool = True


class AgenticRunner:
    def __init__(self, records: list[TraceRecord], filler: Filler, cfg: RunConfig) -> None:
        if cfg.concurrency < 1:
            raise ValueError(f"--concurrency (live sessions) must be >= 1, got {cfg.concurrency}")
        if cfg.warmup_turns < 0:
            raise ValueError(f"--agentic-warmup-turns must be >= 0, got {cfg.warmup_turns}")
        if cfg.duration_s is not None and cfg.duration_s <= 0:
            raise ValueError(f"--duration must be > 0 seconds, got {cfg.duration_s}")
        if cfg.stall_timeout_s <= 0:
            raise ValueError(f"--stall-timeout must be > 0 seconds, got {cfg.stall_timeout_s}")
        self.sessions = build_sessions(records)
        self.filler = filler
        self.cfg = cfg
        self.cache_model = PrefixCacheModel(filler.block_size)
        self.requests: list[RequestRecord] = []
        self._next = 0
        self._deadline = float("inf")

    def _take_session(self) -> tuple[Session, int] | None:
        n = len(self.sessions)
        if self.cfg.duration_s is None and self._next >= n:
            return None
        if time.perf_counter() >= self._deadline:
            return None
        i = self._next
        self._next += 1
        return self.sessions[i % n], i // n

    async def _think(self, rec: TraceRecord) -> None:
        if self.cfg.honor_think_time and rec.think_ms > 0:
            await asyncio.sleep(rec.think_ms / 1000.0)

    async def _send(self, http: aiohttp.ClientSession, rec: TraceRecord, lane: list[int], p: int) -> bool:
        """One request; False when the deadline has passed and nothing was sent."""
        await self._think(rec)
        if time.perf_counter() >= self._deadline:
            return False
        salt = f"{self.cfg.salt}/{p}"
        prompt = self.filler.prompt(rec.hash_ids, rec.input_len, salt)
        warmup = lane[1] < self.cfg.warmup_turns
        lane[1] += 1
        hit = self.cache_model.add(rec.hash_ids, rec.input_len, salt)
        payload = {
            "model": self.cfg.model,
            "prompt": prompt,
            "max_tokens": rec.output_len,
            "ignore_eos": True,
            **self.cfg.sampling,
            **self.cfg.extra_body,
        }
        entry = RequestRecord(rec, lane[0], p, warmup, hit, AgenticResult())
        self.requests.append(entry)  # in send order
        entry.result = await stream_completion(
            http, self.cfg.url, payload, self.cfg.headers, self.cfg.stall_timeout_s
        )
        return True

    async def _agent(self, http, turns: list[TraceRecord], lane: list[int], p: int) -> None:
        for rec in turns:
            if not await self._send(http, rec, lane, p):
                return

    async def _session(self, http, s: Session, lane: list[int], p: int) -> None:
        for rec in s.main:
            if not await self._send(http, rec, lane, p):
                return
            subs = s.subagents.get(rec.turn, [])
            if subs:  # fan out, then join before the main agent goes on
                await asyncio.gather(*(self._agent(http, turns, lane, p) for turns in subs))

    async def _lane(self, http, index: int) -> None:
        lane = [index, 0]  # lane id, requests sent so far (for warm-up)
        while (item := self._take_session()) is not None:
            session, pass_index = item
            await self._session(http, session, lane, pass_index)

    async def run(self, http: aiohttp.ClientSession) -> list[RequestRecord]:
        if self.cfg.duration_s is not None:
            self._deadline = time.perf_counter() + self.cfg.duration_s
        await asyncio.gather(*(self._lane(http, i) for i in range(self.cfg.concurrency)))
        return self.requests


async def scrape_prefix_cache(
    http: aiohttp.ClientSession, base: str, headers: dict[str, str]
) -> tuple[float, float] | None:
    """``(queries, hits)`` in tokens from the server's /metrics (``openinfer:`` or ``vllm:`` names, summed
    over label sets), or None when the server exposes neither."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with http.get(
            f"{base}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    sums = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}
    found = False
    for fam in text_string_to_metric_families(text):
        prefix, _, name = fam.name.partition(":")
        if prefix in ("openinfer", "vllm") and name in sums:
            for s in fam.samples:
                if s.name.endswith("_total") or s.name == fam.name:
                    sums[name] += s.value
                    found = True
    return (sums["prefix_cache_queries"], sums["prefix_cache_hits"]) if found else None
