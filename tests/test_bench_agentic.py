"""``openinfer bench serve --workload agentic``: trace schema and validation, the theoretical cache-hit
rate, exact filler, the synthetic generator, the report, and replays against a real ``openinfer serve``
whose accounting must add up."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import numpy as np
import pytest
from server_utils import ServerProcess, shared_checkpoint

from openinfer.bench.agentic.client import AgenticResult, stream_completion
from openinfer.bench.agentic.filler import Filler
from openinfer.bench.agentic.report import build_report
from openinfer.bench.agentic.runner import RequestRecord
from openinfer.bench.agentic.synth import SynthConfig, synthesize
from openinfer.bench.agentic.trace import (
    TraceError,
    TraceRecord,
    load_trace,
    theoretical_cache_hit_rate,
    write_trace,
)
from openinfer.bench.serve_client import open_session
from openinfer.entrypoints.cli import build_parser

SERVER_BLOCK = 16  # openinfer serve's default KV block size


def _write(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rec(sid, turn, n_in, hashes, out=4, agent="main", **kw):
    return {"session_id": sid, "agent": agent, "turn": turn, "in": n_in, "out": out, "hash_ids": hashes, **kw}


# -- trace -----------------------------------------------------------------------------------------


def test_trace_loads_agentx_and_mooncake_spellings(tmp_path):
    path = _write(
        tmp_path,
        [
            {"session": 7, "turn": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, 2]},
            _rec("7", 1, 9, [1, 3, 4], delay_ms=12.5),
            _rec("7", 0, 6, [1, 5], agent="sub", spawned_after=0),
        ],
    )
    recs = load_trace(path, block_size=4)
    assert [(r.session_id, r.agent, r.turn, r.input_len, r.output_len) for r in recs] == [
        ("7", "main", 0, 5, 3),
        ("7", "main", 1, 9, 4),
        ("7", "sub", 0, 6, 4),
    ]
    assert recs[1].think_ms == 12.5 and recs[2].spawned_after == 0
    write_trace(recs, tmp_path / "back.jsonl")
    assert load_trace(tmp_path / "back.jsonl", block_size=4) == recs


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", r"t.jsonl:2: not valid JSON"),
        ({"turn": 0, "in": 4, "out": 1, "hash_ids": [1]}, r"t.jsonl:2: missing field 'session_id'"),
        (_rec("a", 1, 9, [1, 2]), r"t.jsonl:2: 'hash_ids' has 2 ids but in=9 needs ceil\(9/4\) = 3"),
        (_rec("a", 1, 0, []), r"t.jsonl:2: 'in' must be an integer >= 1, got 0"),
        (_rec("a", 1, 4, [1], out=0), r"'out' must be an integer >= 1"),
        (_rec("a", 1, 4, [-1]), r"'hash_ids\[\]' must be an integer >= 0"),
        (_rec("a", 1, 4, [1], think_ms=-3), r"'think_ms' must be a finite number >= 0"),
        (_rec("a", 1, 4, [1], spawned_after=0), r"'spawned_after' is only for sub-agents"),
        (_rec("a", 0, 4, [1], agent="sub"), r"'spawned_after' must be an integer >= 0, got None"),
        (_rec("a", 0, 4, [1], agent="sub", spawned_after=5), r"spawned_after=5 is not a main-agent turn"),
        (_rec("a", 0, 4, [1]), r"session 'a' agent 'main': turn 0 appears twice"),
        ({**_rec("a", 1, 4, [1]), "in": 4, "input_length": 4}, r"give only one of \['in', 'input_length'\]"),
    ],
)
def test_trace_errors_name_line_and_field(tmp_path, row, message):
    path = _write(tmp_path, [_rec("a", 0, 4, [1]), row])
    with pytest.raises(TraceError, match=message):
        load_trace(path, block_size=4)


def test_missing_trace_file_fails_before_any_request(tmp_path, capsys):
    """A bad --trace is reported at once, without waiting for a server (port 1 has none)."""
    from openinfer.entrypoints.cli import main as cli_main

    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "serve", "--workload", "agentic", "--trace", str(tmp_path / "absent.jsonl"),
                  "--port", "1", "--ready-check-timeout-sec", "30"])
    assert exit_info.value.code == 2 and "no such file" in capsys.readouterr().err


def test_theoretical_hit_rate_on_a_hand_made_trace():
    def r(n_in, hashes):
        return TraceRecord("s", "main", 0, n_in, 1, tuple(hashes))

    trace = [
        r(10, [1, 2, 3]),  # first sight: 0 hits; caches the chains (1), (1,2); block 3 is partial
        r(12, [1, 2, 4]),  # (1), (1,2) hit, (1,2,4) new: 8
        r(8, [5, 2]),  # (5) misses, and (5,2) is not (1,2): chained keys, 0
        r(6, [1, 4]),  # (1) hits; 4 is a partial last block and never hits: 4
        r(12, [1, 2, 4]),  # all three full blocks seen in the second request: 12
        r(11, [1, 2, 3]),  # (1,2) hit; 3 was only ever a partial block, never cached: 8
        r(8, [1, 5]),  # (1) hits; block 5 was seen, but after 5 (root), not after 1: 4
    ]
    assert theoretical_cache_hit_rate(trace, block_size=4) == pytest.approx((0 + 8 + 0 + 4 + 12 + 8 + 4) / 67)
    # The total does not depend on which of several requests sharing a prefix comes first.
    assert theoretical_cache_hit_rate(trace[::-1], block_size=4) == pytest.approx(
        theoretical_cache_hit_rate([trace[i] for i in (1, 4, 6, 0, 5, 2, 3)], block_size=4)
    )


# -- filler ----------------------------------------------------------------------------------------


def test_filler_is_exact_and_deterministic():
    allowed = list(range(3, 200))
    f = Filler(allowed, block_size=8, salt="run1")
    a = f.prompt([10, 11, 12], 20)
    assert len(a) == 20 and set(a) <= set(allowed)
    assert a == Filler(allowed, block_size=8, salt="run1").prompt([10, 11, 12], 20)  # a fresh process agrees
    assert a[:16] == f.prompt([10, 11, 99], 24)[:16]  # equal ids -> equal blocks
    assert a[16:] == f.prompt([10, 11, 12], 24)[16:20]  # a partial block is the head of the full one
    assert f.prompt([12], 8) != f.prompt([13], 8)  # different ids -> different blocks
    assert f.prompt([10], 8, salt="run2") != f.prompt([10], 8)  # another salt shares nothing
    with pytest.raises(ValueError, match="2 hash ids cannot make 20 tokens"):
        f.prompt([1, 2], 20)


# -- synthetic traces -------------------------------------------------------------------------------


def test_synthetic_traces_are_seeded_and_well_formed(tmp_path):
    cfg = SynthConfig(sessions=6, turns=4, block_size=16, subagent_prob=0.5, max_context=900, seed=3)
    recs = synthesize(cfg)
    assert recs == synthesize(cfg) and recs != synthesize(SynthConfig(**{**vars(cfg), "seed": 4}))
    write_trace(recs, tmp_path / "s.jsonl")
    assert load_trace(tmp_path / "s.jsonl", block_size=16) == recs  # the loader accepts its own output
    by_agent = defaultdict(list)
    for r in recs:
        by_agent[(r.session_id, r.agent)].append(r)
        assert r.input_len + r.output_len <= cfg.max_context
        assert list(r.hash_ids[: cfg.system_blocks]) == list(range(cfg.system_blocks))  # shared prefix
    subs = {k: v for k, v in by_agent.items() if k[1] != "main"}
    assert subs, "seed 3 should produce at least one fan-out"
    for (sid, _), turns in by_agent.items():
        for prev, cur in zip(turns, turns[1:]):  # each turn resends the previous prompt's full blocks
            full = prev.input_len // cfg.block_size
            assert cur.input_len > prev.input_len + prev.output_len - 1
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            assert cur.hash_ids[full] not in prev.hash_ids  # the old partial block changed
    for (sid, agent), turns in subs.items():
        parent = next(r for r in by_agent[(sid, "main")] if r.turn == turns[0].spawned_after)
        full = parent.input_len // cfg.block_size
        assert turns[0].hash_ids[:full] == parent.hash_ids[:full]  # starts from the parent's prefix
    assert 0 < theoretical_cache_hit_rate(recs, 16) < 1


# -- report ----------------------------------------------------------------------------------------


def _done(n_in, cached, out, ttft, itl, start, warmup=False, hit=0):
    res = AgenticResult(True, "", "", n_in, cached, out, ttft, list(itl), ttft + sum(itl), start)
    res.end = start + res.latency
    return RequestRecord(TraceRecord("s", "main", 0, n_in, out, (0,) * n_in), 0, 0, warmup, hit, res)


def test_report_accounting_and_definitions():
    reqs = [
        _done(100, 0, 3, 0.5, [0.1, 0.1], start=0.0, warmup=True),
        _done(100, 64, 3, 0.2, [0.05, 0.15], start=1.0, hit=64),
        _done(50, 32, 2, 0.1, [0.02], start=1.5, hit=48),
    ]
    bad = AgenticResult(False, "context_overflow", "HTTP 400: maximum context length", start=2.0)
    bad.end = 4.0
    reqs.append(RequestRecord(TraceRecord("s", "main", 1, 5000, 4, (0,) * 5000), 1, 0, False, 0, bad))
    r = build_report(reqs, num_devices=2, metrics_before=(10, 5), metrics_after=(260, 101))
    assert (r["sent"], r["completed"], r["failed"]) == (3, 2, 1)
    acc = r["request_accounting"]
    assert acc == {
        "requests_sent_total": 4,
        "records_warmup_dropped": 1,
        "records_error_dropped": 1,
        "error_categories": {"context_overflow": 1},
    }
    assert r["duration"] == pytest.approx(3.0)  # first measured start 1.0 -> last end 4.0
    assert (r["total_input_tokens"], r["cached_input_tokens"], r["uncached_input_tokens"]) == (150, 96, 54)
    assert r["total_token_throughput"] == pytest.approx(155 / 3)
    assert r["total_token_throughput_per_device"] == pytest.approx(155 / 6)
    assert r["input_throughput_per_device"] == pytest.approx(150 / 6)
    itl_p90 = np.percentile([0.05, 0.15, 0.02], 90) * 1000
    assert r["itl_ms"]["p90"] == pytest.approx(itl_p90)
    assert r["p90_interactivity"] == pytest.approx(1000 / itl_p90)
    assert r["tpot_ms"]["mean"] == pytest.approx(np.mean([0.2 / 2, 0.02 / 1]) * 1000)
    assert r["theoretical_cache_hit_rate"] == pytest.approx(112 / 150)
    assert r["measured_cache_hit_rate_usage"] == pytest.approx(96 / 150)
    assert r["measured_cache_hit_rate_usage_all"] == pytest.approx(96 / 250)
    assert r["measured_cache_hit_rate_metrics"] == pytest.approx(96 / 250)
    v = r["validity"]
    assert v["context_overflow_rate"] == pytest.approx(1 / 3) and not v["submission_valid"]
    assert any("context-overflow rate" in reason for reason in v["reasons"])


def test_a_silent_stream_is_counted_as_stalled():
    async def hang(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)  # headers, then nothing
        writer.close()

    async def go():
        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        async with server, open_session() as http:
            return await stream_completion(http, url, {"prompt": [1]}, {}, stall_timeout_s=0.3)

    res = asyncio.run(go())
    assert not res.success and res.category == "stalled", res


# -- against a real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(shared_checkpoint(tmp_path_factory), "--block-size", str(SERVER_BLOCK)) as s:
        yield s


def _bench(server, tmp_path, *extra) -> tuple[int, dict]:
    args = build_parser().parse_args(
        ["bench", "serve", "--workload", "agentic", "--base-url", server.url, "--save-result",
         "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json", *extra]
    )
    rc = args.func(args)
    return rc, json.loads((tmp_path / "r.json").read_text())


@pytest.mark.slow  # a bench run against a server
def test_replay_accounting_and_cache_hits_match_the_trace(server, tmp_path):
    cfg = SynthConfig(
        sessions=3,
        turns=3,
        system_blocks=2,
        first_message=(32, 128),
        turn_message=(16, 96),
        output=(8, 8),
        think_ms_median=20.0,
        subagent_prob=0.4,
        subagent_fanout=2,
        subagent_turns=2,
        max_context=700,
        seed=1,
    )
    trace = synthesize(cfg)
    agents = {(r.session_id, r.agent) for r in trace}
    assert any(a != "main" for _, a in agents), "seed 1 should fan out at least once"
    write_trace(trace, tmp_path / "trace.jsonl")
    rc, r = _bench(server, tmp_path, "--trace", str(tmp_path / "trace.jsonl"), "--concurrency", "2")
    assert rc == 0, r["validity"]
    reqs = r["requests"]
    measured = [q for q in reqs if not q["warmup"]]
    done = [q for q in measured if q["success"]]

    # Request accounting: every trace record sent once; warm-up (first turn per lane) dropped.
    acc = r["request_accounting"]
    assert acc["requests_sent_total"] == len(reqs) == len(trace)
    assert acc["records_warmup_dropped"] == 2 == len(reqs) - len(measured)
    assert r["sent"] == len(measured) == r["completed"] + r["failed"] and r["failed"] == 0
    # Per request: the server saw exactly the trace's prompt and generated exactly `out` tokens.
    for q in done:
        assert q["cached_tokens"] + q["uncached_tokens"] == q["prompt_tokens"] == q["in"], q
        assert q["output_tokens"] == q["out"]
    # Totals are the sums of the per-request values.
    assert r["total_input_tokens"] == sum(q["prompt_tokens"] for q in done)
    assert r["cached_input_tokens"] == sum(q["cached_tokens"] for q in done)
    assert r["uncached_input_tokens"] == sum(q["uncached_tokens"] for q in done)
    assert r["total_output_tokens"] == sum(q["output_tokens"] for q in done)
    assert r["cached_input_tokens"] + r["uncached_input_tokens"] == r["total_input_tokens"]
    assert r["validity"]["submission_valid"]

    # Cache hits. The trace model counts whole 64-token blocks whose chained prefix was seen before. The
    # server caches 16-token blocks but the filler makes every 64-block four distinct 16-blocks, and new
    # blocks are fresh random ids, so it hits exactly the same tokens, except that it never serves a
    # prompt's last token from cache: a fully seen prompt of 64*k tokens gets 64*k - 16.
    cap = [(q["in"] - 1) // SERVER_BLOCK * SERVER_BLOCK for q in done]
    expected = sum(min(q["theoretical_hit_tokens"], c) for q, c in zip(done, cap))
    assert r["cached_input_tokens"] == expected
    theory = r["theoretical_cache_hit_rate"]
    assert theory > 0.3 and abs(r["measured_cache_hit_rate_usage"] - theory) <= 0.05
    # The server's own counters tell the same story over the whole run (warm-up included).
    metrics_rate = r["measured_cache_hit_rate_metrics"]
    assert metrics_rate == pytest.approx(r["measured_cache_hit_rate_usage_all"], abs=1e-3)

    # Fan-out and join: sub-agents start after their spawning turn ends; the next main turn waits for them.
    ends = {(q["session_id"], q["agent"], q["turn"]): q for q in reqs}
    for q in reqs:
        if q["agent"] == "main":
            continue
        key = (q["session_id"], q["agent"], q["turn"])
        rec = next(t for t in trace if (t.session_id, t.agent, t.turn) == key)
        spawn = ends[(q["session_id"], "main", rec.spawned_after)]
        assert q["start"] >= spawn["end"]
        nxt = ends.get((q["session_id"], "main", rec.spawned_after + 1))
        if nxt is not None:
            assert nxt["start"] >= q["end"]


def test_context_overflow_is_counted_and_invalidates(server, tmp_path):
    rows = [_rec("ok", 0, 100, [0, 1], out=4), _rec("ok", 1, 140, [0, 2, 3], out=4)]
    rows += [_rec("big", 0, 1100, list(range(10, 28)), out=4)]  # past the server's 1024-token context
    path = _write(tmp_path, rows)
    rc, r = _bench(
        server, tmp_path, "--trace", str(path), "--concurrency", "2", "--agentic-warmup-turns", "0"
    )
    assert rc == 0  # the run itself ends normally
    assert (r["sent"], r["completed"], r["failed"]) == (3, 2, 1)
    assert r["request_accounting"]["error_categories"] == {"context_overflow": 1}
    v = r["validity"]
    assert v["context_overflow_rate"] == pytest.approx(1 / 3) and not v["submission_valid"]
    assert r["total_input_tokens"] == 240  # the rejected request adds nothing
