"""The KV connector seam in the scheduler (pure Python, the NixlConnector's scheduler side driven by hand as its
worker side would report) and the NIXL connector between two in-process engines (real NIXL over UCX)."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from openinfer.config import KVTransferConfig, SchedulerConfig
from openinfer.distributed.kv_transfer.nixl_scheduler import NixlConnectorScheduler
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.sampling_params import SamplingParams
from openinfer.step_io import KVConnectorOutput, ModelRunnerOutput, SampledToken

BS = 4


def make(role="kv_both", specs=None, num_blocks=32, timeout=480.0):
    specs = specs or [KVGroupSpec("full", 64)]
    kv = KVCacheManager(specs, {s.name: num_blocks for s in specs}, BS)
    conn = NixlConnectorScheduler(KVTransferConfig("NixlConnector", role, engine_id="me",
                                                   abort_request_timeout_s=timeout),
                                  [s.tokens_per_block(BS) for s in specs])
    conn.set_side_channel({"host": "127.0.0.1", "port": 5555})
    return Scheduler(SchedulerConfig(8, 64), kv, conn), kv, conn


def remote_params(n_prompt, groups=1, tpb=(BS,)):
    ids = [list(range(100, 100 + -(-n_prompt // r))) for r in tpb]
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prod",
            "remote_block_ids": ids[0] if groups == 1 else ids, "remote_request_id": "p-1",
            "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}


def add(s, rid, n_prompt, max_tokens=3, params=None):
    r = Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                    kv_transfer_params=params), 128)
    s.add_request(r)
    return r


def step(s, out=None, token=7):
    """``out``: what the worker side reported after the previous step (the engine core applies it before the
    next schedule)."""
    s.update_kv_connector_output(out)
    sched = s.schedule()
    rows = {}
    for rid, n in sched.num_scheduled_tokens.items():
        req = s.requests[rid]
        rows[rid] = (req.num_computed_tokens, n)
    res = s.update_from_output(sched, ModelRunnerOutput({rid: [SampledToken(token)] for rid, (c, n) in rows.items()
                                                         if c + n == s.requests[rid].num_tokens}))
    return sched, rows, res


def test_remote_request_waits_without_blocking_others_then_computes_only_its_last_token():
    s, kv, conn = make("kv_consumer")
    add(s, "remote", 10, params=remote_params(10))
    add(s, "local", 5)
    sched, rows, _ = step(s)
    r = s.waiting_remote["remote"]
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(rows) == ["local"]  # the local one behind it ran
    (load,) = sched.kv_connector_metadata.loads
    assert load.remote_block_ids == [[100, 101, 102]] and load.local_block_ids == kv.block_ids("remote")
    assert not kv.groups[0].pool._cached or all(b.key is None for b in kv.groups[0].tables["remote"])  # not cached
    sched, rows, res = step(s, KVConnectorOutput(finished_recving=["remote"]))
    assert rows["remote"] == (9, 1)  # all but the last prompt token came from the producer
    assert s.prompt_tokens_received == 9 and s.requests["remote"].num_cached_tokens == 9
    assert conn.stats.loads_ok == 1


def test_failed_read_falls_back_to_computing_the_prompt():
    s, kv, conn = make("kv_consumer")
    add(s, "r", 10, params=remote_params(10))
    step(s)
    _, rows, _ = step(s, KVConnectorOutput(failed_recving={"r": "boom"}))
    assert rows["r"] == (0, 10)
    assert conn.stats.fallbacks == 1 and conn.stats.load_failures == 1
    while s.num_unfinished:
        step(s)
    assert kv.all_free() and not conn.has_pending_work()


def test_params_that_do_not_cover_the_prompt_fall_back_at_once():
    s, kv, conn = make("kv_consumer")
    add(s, "r", 10, params=remote_params(30))  # another tokenization: more blocks than this prompt has
    _, rows, _ = step(s)
    assert rows["r"] == (0, 10) and conn.stats.fallbacks == 1 and not s.waiting_remote


def test_abort_during_read_frees_blocks_only_when_the_read_is_over():
    s, kv, conn = make("kv_consumer")
    add(s, "r", 10, params=remote_params(10))
    step(s)
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert not kv.all_free() and s.has_connector_work()  # the worker may still be writing into them
    step(s, KVConnectorOutput(finished_recving=["r"]))
    assert kv.all_free() and not s.has_connector_work()


def test_producer_holds_blocks_until_the_reader_is_done_and_returns_vllm_params():
    s, kv, conn = make("kv_producer")
    add(s, "p", 10, max_tokens=1, params={"do_remote_decode": True})
    _, _, res = step(s)
    (o,) = res
    assert o.finish_reason == "length"
    p = o.kv_transfer_params
    assert p == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "me",
                 "remote_block_ids": kv.block_ids("p")[0], "remote_request_id": "p", "remote_host": "127.0.0.1",
                 "remote_port": 5555, "tp_size": 1}
    assert s.num_unfinished == 0 and s.has_connector_work() and not kv.all_free()
    step(s, KVConnectorOutput(finished_sending=["p"]))
    assert kv.all_free() and not s.has_connector_work() and conn.stats.sends_ok == 1


def test_producer_frees_held_blocks_after_the_abort_timeout():
    s, kv, conn = make("kv_producer", timeout=0.05)
    add(s, "p", 10, max_tokens=1, params={"do_remote_decode": True})
    step(s)
    assert not kv.all_free()
    time.sleep(0.06)
    sched, _, _ = step(s)
    assert kv.all_free() and conn.stats.sends_expired == 1 and sched.kv_connector_metadata.released == ["p"]
    # The step that freed it carried the release to the worker side (it stops serving pushes from those blocks),
    # and the engine runs it although nothing computes.
    assert s.has_connector_work()
    step(s, KVConnectorOutput(finished_sending=["p"]))  # a late reader changes nothing
    assert kv.all_free() and conn.stats.sends_ok == 0


def test_a_held_prompt_being_pushed_does_not_expire_until_the_write_is_over():
    s, kv, conn = make("kv_producer", timeout=0.05)
    add(s, "p", 10, max_tokens=1, params={"do_remote_decode": True})
    sched, _, _ = step(s)
    assert step(s)[0].kv_connector_metadata.held == {"p": kv.block_ids("p")}  # the worker side learns what it holds
    step(s, KVConnectorOutput(sending_started=["p"]))
    time.sleep(0.06)
    step(s)
    assert not kv.all_free() and conn.stats.sends_expired == 0  # past the timeout, but a write reads from it
    step(s, KVConnectorOutput(finished_sending=["p"]))
    assert kv.all_free() and conn.stats.sends_ok == 1 and not s.has_connector_work()


def test_an_errored_request_holds_nothing():
    s, kv, conn = make("kv_producer")
    add(s, "p", 10, max_tokens=1, params={"do_remote_decode": True})
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert kv.all_free() and not s.has_connector_work()


def test_every_kv_group_goes_through_the_seam_as_block_lists():
    """DeepSeek-V4's shape: whole-life entries, a sliding window and coarse 16-token blocks."""
    specs = [KVGroupSpec("full", 64), KVGroupSpec("window", 64, lookback_tokens=5),
             KVGroupSpec("coarse", 64, block_tokens=16)]
    prod, pkv, _ = make("kv_producer", specs)
    add(prod, "p", 18, max_tokens=1, params={"do_remote_decode": True})
    _, _, (o,) = step(prod)
    full, window, coarse = o.kv_transfer_params["remote_block_ids"]
    assert len(full) == 5 and len(coarse) == 2 and len(window) == 5
    # Released window blocks are -1; the last query (position 17, lookback 5) reads rows >= 12: blocks 3 and 4.
    assert window[:3] == [-1, -1, -1] and min(window[3:]) >= 0
    cons, ckv, _ = make("kv_consumer", specs)
    add(cons, "d", 18, params=o.kv_transfer_params)
    sched, _, _ = step(cons)
    (load,) = sched.kv_connector_metadata.loads
    assert load.remote_block_ids == [full, window, coarse]
    assert [len(g) for g in load.local_block_ids] == [5, 5, 2]
    # The decoder holds no window block where the producer sent none: nothing would ever fill it.
    assert load.local_block_ids[1][:3] == [-1, -1, -1] and min(load.local_block_ids[1][3:]) >= 0
    assert ckv.groups[1].num_held("d") == 2


@pytest.mark.parametrize("params, field", [
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ({"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "r", "remote_host": "h",
      "remote_port": "80", "remote_block_ids": [1]}, "remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "r", "remote_host": "h",
      "remote_port": 80, "remote_block_ids": "1"}, "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "r", "remote_host": "h",
      "remote_port": 80, "remote_block_ids": [1], "tp_size": 2}, "tp_size"),
])
def test_bad_params_are_a_clear_error(params, field):
    _, _, conn = make("kv_consumer")
    with pytest.raises(ValueError, match=field):
        conn.validate_params(params, 4, BS)


def test_role_mismatch_is_a_clear_error():
    _, _, conn = make("kv_consumer")
    with pytest.raises(ValueError, match="kv_producer"):
        conn.validate_params({"do_remote_decode": True}, 4, BS)


def test_kv_transfer_config_parsing():
    assert KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}').is_consumer
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "both"}')
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "x": 1}')
    base = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert not KVTransferConfig.parse(base).push
    assert KVTransferConfig.parse({**base, "kv_connector_extra_config": {"send_type": "PUT"}}).push
    with pytest.raises(ValueError, match="send_type"):
        KVTransferConfig.parse({**base, "kv_connector_extra_config": {"send_type": "push"}})
    with pytest.raises(ValueError, match="kv_connector_extra_config has unknown keys"):
        KVTransferConfig.parse({**base, "kv_connector_extra_config": {"backends": ["UCX"]}})


# -- two engines in one process, real NIXL ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    pytest.importorskip("nixl")
    from helpers import make_dense_checkpoint

    from openinfer.entrypoints.llm import LLM

    ck = make_dense_checkpoint(tmp_path_factory.mktemp("pd") / "llama")
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16)

    def pd(role, **extra):
        return LLM(str(ck), kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                             **extra}), **kw)

    prod, pull, ref = pd("kv_producer"), pd("kv_consumer", load_timeout_s=2.0), LLM(str(ck), **kw)
    push = pd("kv_consumer", load_timeout_s=2.0, kv_connector_extra_config={"send_type": "PUT"})
    yield prod, pull, ref, push


@contextlib.contextmanager
def stepping(prod):
    """The producer's engine loop, as its server runs it: push needs the producer to act (take the registration,
    write) while the decoder waits, which one thread driving both engines in turn would never let happen."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if prod.engine.has_unfinished_requests():
                prod.engine.step()
            else:
                time.sleep(0.002)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(30)


def drain_and_check_free(prod, cons):
    """Step the producer until it has freed what it held (once the transfers' notifications arrive); then every
    block of both engines is back in its pool."""
    for _ in range(200):
        if not prod.engine.has_unfinished_requests():
            break
        prod.engine.step()
    assert prod.engine.core.kv.all_free() and cons.engine.core.kv.all_free()


def greedy(llm, prompt, max_tokens, params=None):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, kv_transfer_params=params),
                        use_tqdm=False)[0]


@pytest.mark.parametrize("send_type", ["GET", "PUT"])
def test_nixl_pull_between_two_engines_is_token_identical(engines, send_type):
    """Pull (the decoder reads) and push (the decoder registers its blocks, the producer writes them)."""
    from helpers import random_prompts

    prod, cons, ref, push = engines
    if send_type == "PUT":
        cons = push
        assert cons.engine.config.kv_transfer.push
    before = cons.engine.stats()
    sends_before = prod.engine.stats().kv_transfer.sends_ok
    for prompt in random_prompts(0, [40, 17, 5, 33]):
        want = greedy(ref, prompt, 8).outputs[0].token_ids
        p = greedy(prod, prompt, 1, {"do_remote_decode": True})
        with stepping(prod):
            d = greedy(cons, prompt, 8, p.kv_transfer_params)
        assert d.outputs[0].token_ids == want
        assert d.num_cached_tokens == len(prompt) - 1
    after = cons.engine.stats()
    # The decoder computed one prompt token per request (the last); the rest arrived over NIXL.
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 4
    assert after.kv_transfer.loads_ok - before.kv_transfer.loads_ok == 4
    assert after.kv_transfer.bytes_received > before.kv_transfer.bytes_received
    drain_and_check_free(prod, cons)
    assert prod.engine.stats().kv_transfer.sends_ok - sends_before == 4


def test_unreachable_producer_falls_back_to_local_prefill(engines):
    from helpers import random_prompts

    _, cons, ref, _ = engines
    (prompt,) = random_prompts(1, [21])
    n = -(-len(prompt) // 16)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
              "remote_block_ids": list(range(n)), "remote_request_id": "x", "remote_host": "127.0.0.1",
              "remote_port": 9, "tp_size": 1}  # nothing listens there: the handshake times out
    before = cons.engine.stats().kv_transfer.fallbacks
    d = greedy(cons, prompt, 6, params)
    assert d.outputs[0].token_ids == greedy(ref, prompt, 6).outputs[0].token_ids
    assert cons.engine.stats().kv_transfer.fallbacks == before + 1
    assert cons.engine.core.kv.all_free()


@pytest.mark.parametrize("arch, send_type", [("deepseek_v3", "GET"), ("deepseek_v4", "GET"), ("deepseek_v3", "PUT"),
                                            ("deepseek_v4", "PUT")])
def test_nixl_pull_deepseek_groups_token_identical(arch, send_type, tmp_path):
    """DeepSeek-V3's latent group and DeepSeek-V4's full / window (sliding, released blocks sent as -1) / coarse
    groups all go through the connector: the decoder, reading them (or having them written, send_type PUT),
    answers token for token as one engine does."""
    pytest.importorskip("nixl")
    from helpers import load_script, random_prompts

    from openinfer.entrypoints.llm import LLM

    if arch == "deepseek_v3":
        ck = load_script("make_deepseek_checkpoint").make_v3(tmp_path / "v3", "tiny", seed=0)
    else:
        ck = load_script("make_deepseek_v4_checkpoint").make_checkpoint(tmp_path / "v4", "tiny", seed=0)
    # V4 with 8-token blocks: its 16-token compressed entries get the coarse group too (three groups in all).
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16 if arch == "deepseek_v3" else 8)

    def pd(role, **extra):
        return LLM(str(ck), kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                             **extra}), **kw)

    prod, ref = pd("kv_producer"), LLM(str(ck), **kw)
    cons = pd("kv_consumer", kv_connector_extra_config={"send_type": send_type})
    specs = cons.engine.core.kv_specs
    assert [s.name for s in specs] == (["full"] if arch == "deepseek_v3" else ["full", "window", "coarse"])
    for prompt in random_prompts(2, [70, 23]):
        want = greedy(ref, prompt, 6).outputs[0].token_ids
        p = greedy(prod, prompt, 1, {"do_remote_decode": True})
        if len(specs) > 1:
            ids = p.kv_transfer_params["remote_block_ids"]
            assert len(ids) == len(specs)
            assert any(-1 in g for g in ids) == (len(prompt) > 40)  # the window group released its old blocks
            assert all(len(g) > 0 for g in ids)
        with stepping(prod):
            d = greedy(cons, prompt, 6, p.kv_transfer_params)
        assert d.outputs[0].token_ids == want
    stats = cons.engine.stats()
    assert stats.kv_transfer.loads_ok == 2 and stats.kv_transfer.fallbacks == 0 and stats.prompt_tokens_computed == 2
    drain_and_check_free(prod, cons)
    for llm in (prod, cons):
        llm.engine.shutdown()


def test_nixl_pull_deepseek_v41_token_identical(tmp_path):
    """Every DeepSeek-V4.1 store goes through the connector: window rows (every layer's ``kv``, the C2 sources'
    ``comp``), the Engram token ids, and the full group's compressed entries and index keys, held only by the KV /
    index source layers (YOCO consumers and sharing layers read their sources'). The producer runs without prefix
    caching, where YOCO's shortened prefill would skip consumer-layer rows; it computes every row of a prompt it
    hands on, since the decoder (here with prefix caching) keeps the received blocks for later requests: one
    resuming inside them reads window rows older than the producer's last query did."""
    pytest.importorskip("nixl")
    from helpers import load_script, random_prompts

    from openinfer.entrypoints.llm import LLM

    ck = load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp_path / "v41", "tiny", seed=0,
                                                                      quantize=False)
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=8)

    def pd(role, **extra):
        return LLM(str(ck), kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role}),
                   **kw, **extra)

    # The producer (no prefix cache: every prompt computed whole) is the single-instance reference too.
    prod, cons = pd("kv_producer", enable_prefix_caching=False), pd("kv_consumer")
    ref = prod
    assert [s.name for s in cons.engine.core.kv_specs] == ["full", "window"]
    (prompt, tail) = random_prompts(4, [60, 9])
    want = greedy(ref, prompt, 6).outputs[0].token_ids
    p = greedy(prod, prompt, 1, {"do_remote_decode": True})
    full, window = p.kv_transfer_params["remote_block_ids"]
    assert len(full) == len(window) == 8 and -1 in window and min(full) >= 0
    d = greedy(cons, prompt, 6, p.kv_transfer_params)
    assert d.outputs[0].token_ids == want and d.num_cached_tokens == len(prompt) - 1
    # Later requests on the decoder sharing the prompt's head. Resuming at 56 reads window rows 50..57 of every
    # layer (rows YOCO's shortened prefill skips in the last layers); a resume at 48 would read window block 5,
    # which the producer released and never sent: the decoder holds nothing there, so that prefix is no hit.
    # Greedy tokens of a tiny random model barely move for a few wrong rows: compare the log-probabilities.
    lp = SamplingParams(temperature=0, max_tokens=3, logprobs=1)
    for cut, cached in ((56, 56), (48, 0)):
        again = prompt[:cut] + tail[:2]
        hit, exact = (llm.generate([again], lp, use_tqdm=False)[0] for llm in (cons, ref))
        assert hit.num_cached_tokens == cached and hit.outputs[0].token_ids == exact.outputs[0].token_ids
        for got_lp, want_lp in zip(hit.outputs[0].logprobs, exact.outputs[0].logprobs):
            assert got_lp == pytest.approx(want_lp, abs=1e-4)
    stats = cons.engine.stats()
    assert stats.kv_transfer.loads_ok == 1 and stats.kv_transfer.fallbacks == 0
    drain_and_check_free(prod, cons)
    for llm in (prod, cons):
        llm.engine.shutdown()


def test_local_prefix_hit_is_kept_and_only_the_rest_is_read():
    s, kv, conn = make("kv_consumer")
    add(s, "warm", 10)  # caches the first two 4-token blocks of the shared prompt
    while s.num_unfinished:
        step(s)
    add(s, "r", 10, params=remote_params(10))
    sched, _, _ = step(s)
    (load,) = sched.kv_connector_metadata.loads
    assert load.local_block_ids[0][:2] == [-1, -1] and min(load.local_block_ids[0][2:]) >= 0
    _, rows, _ = step(s, KVConnectorOutput(finished_recving=["r"]))
    assert rows["r"] == (9, 1)
    assert s.prompt_tokens_received == 9 - 8 and s.prompt_tokens_cached == 8


def test_side_channel_speaks_msgpack_not_pickle():
    """The handshake is msgspec msgpack both ways; a pickled request is refused, not unpickled."""
    import pickle

    import zmq

    from openinfer.distributed.kv_transfer.side_channel import (HandshakeRequest, PushRefused, PushRequest,
                                                                SideChannelServer, StoreLayout, handshake,
                                                                register_push)

    server = SideChannelServer("127.0.0.1", 0, "prod", b"\x00agent-bytes", [[StoreLayout(4096, 64, 8)]])
    try:
        reply = handshake("127.0.0.1", server.port, "me", "prod", 5.0)
        assert reply.agent_metadata == b"\x00agent-bytes" and reply.groups[0][0].block_bytes == 64
        with pytest.raises(RuntimeError, match="not other"):
            handshake("127.0.0.1", server.port, "me", "other", 5.0)
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        sock.send(pickle.dumps(HandshakeRequest("me", "prod")))
        assert sock.poll(5000)
        raw = sock.recv()
        sock.close(0)
        assert not raw.startswith(b"\x80")  # no pickle protocol header in the answer
        import msgspec

        from openinfer.distributed.kv_transfer.side_channel import HandshakeReply

        refused = msgspec.msgpack.decode(raw, type=HandshakeReply)
        assert refused.error.startswith("bad handshake") and refused.agent_metadata == b""
        # Push registrations: msgpack too; an instance that is no producer refuses them, a producer queues them.
        push = PushRequest("me", "prod", b"\x00me", [[StoreLayout(0, 64, 8)]], "r", "p-1", [[3, 4]])
        with pytest.raises(PushRefused, match="not a kv_producer"):
            register_push("127.0.0.1", server.port, push, 5.0)
    finally:
        server.close()
    got = []
    server = SideChannelServer("127.0.0.1", 0, "prod", b"", [], on_push=lambda r: got.append(r) or "")
    try:
        register_push("127.0.0.1", server.port, push, 5.0)
        assert got == [push]
    finally:
        server.close()


def test_a_request_waiting_for_remote_kv_counts_as_waiting(engines):
    """Load reports (/metrics, a router's) see a parked request as waiting, as vLLM counts WAITING_FOR_REMOTE_KVS."""
    from helpers import random_prompts

    _, cons, _, _ = engines
    (prompt,) = random_prompts(3, [20])
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone2",
              "remote_block_ids": [0, 1], "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 9,
              "tp_size": 1}
    cons.engine.add_request("parked", {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=2, kv_transfer_params=params))
    cons.engine.step()
    assert cons.engine.core.scheduler.waiting_remote and cons.engine.stats().num_waiting == 1
    while cons.engine.has_unfinished_requests():  # the handshake times out, the prompt is computed here
        cons.engine.step()
    assert cons.engine.core.kv.all_free()


def test_push_that_is_refused_or_never_comes_falls_back_and_frees_both_sides(engines):
    """Push failures: a producer that holds no such prompt refuses at once; one that never answers (nothing listens)
    leaves the decoder waiting 2 x load_timeout_s. Either way the decoder computes the prompt itself, token for
    token, and neither side keeps a block."""
    from helpers import random_prompts

    prod, _, ref, cons = engines
    (prompt,) = random_prompts(4, [21])
    p = greedy(prod, prompt, 1, {"do_remote_decode": True}).kv_transfer_params
    want = greedy(ref, prompt, 5).outputs[0].token_ids
    before = cons.engine.stats().kv_transfer
    t0 = time.monotonic()
    with stepping(prod):
        d = greedy(cons, prompt, 5, {**p, "remote_request_id": "not-held"})
    assert d.outputs[0].token_ids == want and time.monotonic() - t0 < 2.0  # refused: no wait for the deadline
    t0 = time.monotonic()
    d = greedy(cons, prompt, 5, {**p, "remote_port": 9, "remote_engine_id": "gone"})
    assert d.outputs[0].token_ids == want and time.monotonic() - t0 >= 4.0  # 2 x load_timeout_s=2
    after = cons.engine.stats().kv_transfer
    assert after.fallbacks - before.fallbacks == 2 and after.loads_ok == before.loads_ok
    with stepping(prod):
        d = greedy(cons, prompt, 5, p)  # the held prompt itself is still served
    assert d.outputs[0].token_ids == want and d.num_cached_tokens == len(prompt) - 1
    drain_and_check_free(prod, cons)


class _StuckRelease:
    """A NIXL agent whose transfer stays in progress and whose first release refuses (it could not abort)."""

    def __init__(self, agent):
        self._agent, self.releases = agent, 0

    def check_xfer_state(self, handle):
        return "PROC"

    def release_xfer_handle(self, handle):
        self.releases += 1
        if self.releases == 1:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")

    def __getattr__(self, name):
        return getattr(self._agent, name)


def test_a_timed_out_read_is_reported_only_once_nixl_released_its_transfer():
    """The read's blocks go back to the pool (failed_recving) only after release_xfer_handle succeeded: a release
    NIXL refuses means the transfer may still write into them."""
    pytest.importorskip("nixl")
    from openinfer.distributed.kv_transfer.nixl_worker import NixlConnectorWorker, _Load
    from openinfer.step_io import KVLoad

    w = NixlConnectorWorker(KVTransferConfig("NixlConnector", "kv_consumer", load_timeout_s=0.01), "stuck")
    try:
        w.agent = _StuckRelease(w.agent)
        spec = KVLoad("r", [[0]], [[0]], "prod", "p-1", "127.0.0.1", 1)
        w._loads["r"] = _Load(spec, time.monotonic() - 1, handle=object())
        assert not w.get_finished().failed_recving and "r" in w._loads  # refused: still the request's
        out = w.get_finished()
        assert out.failed_recving == {"r": "transfer not done within 0.0 s"} and not w._loads
        assert w.agent.releases == 2
    finally:
        w.shutdown()
