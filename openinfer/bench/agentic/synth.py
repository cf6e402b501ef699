"""Seeded synthetic agentic traces: growing conversations with a shared system prompt, think time between
turns, and sub-agent fan-out/join.

Shape of one session (block size B):
- turn 0 prompt = the system prompt (``system_blocks`` full blocks, the same ids in every session) + the
  first user message;
- turn t > 0 prompt = turn t-1's prompt + its answer (``out`` tokens) + a new user/tool message. Its
  hash ids keep turn t-1's *full* blocks and take fresh ids from there on: turn t-1's partial last block
  now also holds the answer, so it is a different block;
- with probability ``subagent_prob`` a main turn (not the last) fans out ``subagent_fanout`` sub-agents.
  Each starts from that turn's prompt (its full blocks) plus its own task message and runs
  ``subagent_turns`` growing turns; the main agent's next turn waits for all of them (join) and its new
  message also carries their results;
- a session ends early rather than let a prompt plus its answer pass ``max_context``.

Think time is log-normal around ``think_ms_median``. The output is a list of trace records with fresh,
unique hash ids per new block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from openinfer.bench.agentic.trace import MAIN, TraceRecord, check_structure


@dataclass(frozen=True)
class SynthConfig:
    sessions: int = 8
    turns: int = 4
    block_size: int = 64
    system_blocks: int = 2
    first_message: tuple[int, int] = (64, 256)  # tokens, uniform [lo, hi]
    turn_message: tuple[int, int] = (32, 192)  # new user/tool tokens per later turn
    output: tuple[int, int] = (16, 64)
    think_ms_median: float = 500.0
    think_sigma: float = 1.0
    subagent_prob: float = 0.3
    subagent_fanout: int = 2
    subagent_turns: int = 2
    max_context: int = 32768
    seed: int = 0

    def check(self) -> None:
        def rng_ok(name: str, lo_hi: tuple[int, int], minimum: int) -> None:
            lo, hi = lo_hi
            if not minimum <= lo <= hi:
                raise ValueError(f"synthetic {name} range must satisfy {minimum} <= lo <= hi, got {lo_hi}")

        for name, v, m in (
            ("sessions", self.sessions, 1),
            ("turns", self.turns, 1),
            ("block_size", self.block_size, 1),
            ("system_blocks", self.system_blocks, 0),
            ("subagent_fanout", self.subagent_fanout, 1),
            ("subagent_turns", self.subagent_turns, 1),
        ):
            if v < m:
                raise ValueError(f"synthetic {name} must be >= {m}, got {v}")
        rng_ok("first_message", self.first_message, 1)
        rng_ok("turn_message", self.turn_message, 1)
        rng_ok("output", self.output, 1)
        if not 0 <= self.subagent_prob <= 1:
            raise ValueError(f"synthetic subagent_prob must be in [0, 1], got {self.subagent_prob}")
        if self.think_ms_median < 0 or self.think_sigma < 0:
            raise ValueError("synthetic think time median and sigma must be >= 0")
        smallest = self.system_blocks * self.block_size + self.first_message[0] + self.output[0]
        if self.max_context < smallest:
            raise ValueError(
                f"synthetic max_context={self.max_context} cannot fit even one first turn ({smallest} tokens)"
            )


class _Ids:
    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _grow(prev_ids: list[int], prev_len: int, new_len: int, bs: int, ids: _Ids) -> list[int]:
    """Hash ids of a prompt that extends a ``prev_len``-token prompt to ``new_len`` tokens."""
    keep = prev_ids[: prev_len // bs]
    return keep + ids.take(-(-new_len // bs) - len(keep))


def synthesize(cfg: SynthConfig) -> list[TraceRecord]:
    cfg.check()
    rng = np.random.default_rng(cfg.seed)
    bs = cfg.block_size
    system = list(range(cfg.system_blocks))
    ids = _Ids(cfg.system_blocks)
    out: list[TraceRecord] = []

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    def think() -> float:
        if cfg.think_ms_median == 0:
            return 0.0
        return round(float(rng.lognormal(np.log(cfg.think_ms_median), cfg.think_sigma)), 3)

    def fits(n_in: int, n_out: int) -> bool:
        return n_in + n_out <= cfg.max_context

    for s in range(cfg.sessions):
        sid = f"s{s}"
        n_in = cfg.system_blocks * bs + draw(cfg.first_message)
        n_out = draw(cfg.output)
        if not fits(n_in, n_out):
            continue
        hashes = system + ids.take(-(-n_in // bs) - cfg.system_blocks)
        extra = 0  # tokens the sub-agents' results add to the main agent's next message
        for t in range(cfg.turns):
            if t > 0:
                new_in = n_in + n_out + draw(cfg.turn_message) + extra
                new_out = draw(cfg.output)
                if not fits(new_in, new_out):
                    break
                hashes = _grow(hashes, n_in, new_in, bs, ids)
                n_in, n_out = new_in, new_out
            out.append(TraceRecord(sid, MAIN, t, n_in, n_out, tuple(hashes), 0.0 if t == 0 else think()))
            extra = 0
            if t + 1 < cfg.turns and rng.random() < cfg.subagent_prob:
                for k in range(cfg.subagent_fanout):
                    agent = f"sub{t}.{k}"
                    s_in = n_in + draw(cfg.turn_message)
                    s_out = draw(cfg.output)
                    if not fits(s_in, s_out):
                        continue
                    s_hashes = _grow(hashes, n_in, s_in, bs, ids)
                    for u in range(cfg.subagent_turns):
                        if u > 0:
                            nxt_in = s_in + s_out + draw(cfg.turn_message)
                            nxt_out = draw(cfg.output)
                            if not fits(nxt_in, nxt_out):
                                break
                            s_hashes = _grow(s_hashes, s_in, nxt_in, bs, ids)
                            s_in, s_out = nxt_in, nxt_out
                        out.append(
                            TraceRecord(sid, agent, u, s_in, s_out, tuple(s_hashes), think(), spawned_after=t)
                        )
                    extra += s_out  # the sub-agent's final answer joins the main conversation
    check_structure(out)
    return out
