"""The KV connector seam in the scheduler (pure Python, the NixlConnector's scheduler side driven by hand as its
worker side would report), the side channel's wire, and the transfer config. The NIXL connector between two real
engines is tests/test_kv_nixl_engines.py."""
from __future__ import annotations

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


def test_a_remote_request_short_of_blocks_still_reads_its_prompt_once_blocks_free():
    """A decoder without blocks for a remote prompt admits nothing more that step; once a request ends and frees
    its blocks, the waiting one reads its prompt from the producer (it used to count as tried at the first ask and
    then computed its whole prompt here, while the producer held the blocks until its abort timeout)."""
    s, kv, conn = make("kv_consumer", num_blocks=4)  # 16 tokens of 4-token blocks
    s.add_request(Request("local", list(range(200, 209)), SamplingParams(max_tokens=3, ignore_eos=True), 128))
    step(s)  # its 9 prompt tokens: 3 blocks (another prompt than the remote one's: no prefix hit)
    add(s, "remote", 10, params=remote_params(10))  # 3 blocks: not there until "local" ends
    sched, rows, _ = step(s)
    assert "remote" not in s.waiting_remote and not sched.kv_connector_metadata.loads
    for _ in range(4):  # "local" decodes its last tokens and ends
        sched, rows, _ = step(s)
        if "remote" in s.waiting_remote:
            break
    assert "local" not in s.requests
    (load,) = sched.kv_connector_metadata.loads
    assert load.req_id == "remote" and load.remote_block_ids == [[100, 101, 102]]
    _, rows, _ = step(s, KVConnectorOutput(finished_recving=["remote"]))
    assert rows["remote"] == (9, 1) and conn.stats.fallbacks == 0


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


def test_a_replicas_ranks_reports_combine_once_every_rank_spoke():
    """distributed/kv_transfer/ranks.py: a read is over once every rank reported it (failed if one failed), a held
    prompt is read once every rank heard its reader; ranks may report in different steps."""
    from openinfer.distributed.kv_transfer.ranks import KVOutputAggregator
    from openinfer.step_io import KVConnectorOutput as Out

    agg = KVOutputAggregator(2)
    first = agg.merge([Out(finished_recving=["a", "b"], bytes_received=10), Out(failed_recving={"b": "gone"})])
    assert first.finished_recving == [] and first.failed_recving == {"b": "gone"} and first.bytes_received == 10
    later = agg.merge([None, Out(finished_recving=["a"], finished_sending=["h"], sending_started=["h"])])
    assert later.finished_recving == ["a"] and later.finished_sending == [] and later.sending_started == ["h"]
    assert agg.merge([Out(finished_sending=["h"]), None]).finished_sending == ["h"]
    assert agg.merge([None, None]) is None
    lone = Out(finished_recving=["x"])
    assert KVOutputAggregator(1).merge([lone]) is lone


@pytest.mark.parametrize("p, d, split, want", [
    (2, 2, False, [([0], [0], 1), ([1], [1], 1)]),  # the same size: rank i <-> rank i
    (2, 1, False, [([0], [0, 1], 1)]),  # whole stores, prefill TP 2 -> decode TP 1: read rank 0, tell rank 1
    (1, 2, False, [([0], [0], 2), ([0], [0], 2)]),  # TP 1 -> TP 2: both read rank 0, which waits for two notices
    (4, 2, False, [([0], [0, 2], 1), ([1], [1, 3], 1)]),
    (2, 1, True, [([0, 1], [0, 1], 1)]),  # split heads: the one decoder rank gathers both halves
    (1, 2, True, [([0], [0], 2), ([0], [0], 2)]),  # each takes its half of the one producer rank's rows
    (4, 2, True, [([0, 1], [0, 1], 1), ([2, 3], [2, 3], 1)]),
])
def test_which_producer_ranks_each_decoder_rank_reads_and_tells(p, d, split, want):
    from types import SimpleNamespace

    from openinfer.distributed.kv_transfer.nixl_worker import NixlConnectorWorker
    from openinfer.distributed.kv_transfer.side_channel import StoreLayout
    from openinfer.step_io import KVLoad

    spec = KVLoad("r", [[0]], [[0]], "prod", "p-1", "127.0.0.1", 1, remote_ports=list(range(p)) if p > 1 else [])
    layout = [[StoreLayout(0, 64, 8, 4 if split else 0)]]
    got = [NixlConnectorWorker._pairing(SimpleNamespace(tp_size=d, tp_rank=i, layout=layout), spec) for i in range(d)]
    assert got == want


def _heads_cache(ranks: int, rank: int, base: int, heads: int = 4, rows: int = 2, blocks: int = 3):
    """A split store's layout and its bytes: block b, row t, head h (of all heads) is the byte 100 b + 10 t + h."""
    from openinfer.distributed.kv_transfer.side_channel import StoreLayout

    mine = range(rank * heads // ranks, (rank + 1) * heads // ranks)
    data = bytes(100 * b + 10 * t + h for b in range(blocks) for t in range(rows) for h in mine)
    return StoreLayout(base, rows * len(mine), blocks, rows), data


@pytest.mark.parametrize("p, d", [(2, 1), (1, 2), (4, 2), (2, 4), (2, 2), (1, 1)])
def test_split_heads_move_to_whatever_tensor_parallel_size(p, d):
    """Every decoder rank ends up with exactly its heads of every row of the blocks it names, gathered from the
    producer ranks holding them (one byte a head here), whatever the two sizes."""
    from openinfer.distributed.kv_transfer.tp_slices import answers_for, sources, stores_fit, transfer_descs

    prod = [_heads_cache(p, r, 10_000 * (r + 1)) for r in range(p)]
    src_ids, dst_ids = [[2, 0, -1]], [[1, 2, 0]]  # producer block 2 -> decoder block 1, 0 -> 2, nothing into 0
    for i in range(d):
        layout, want_all = _heads_cache(d, i, 500_000)
        got = bytearray(len(want_all))
        assert stores_fit([[prod[0][0]]], p, [[layout]], d)
        for r in sources(p, d, i, True):
            s_layout, s_data = prod[r]
            for (sa, n, _), (da, m, _) in zip(*transfer_descs(src_ids, dst_ids, [[s_layout]], r, p, [[layout]], i, d)):
                assert n == m
                got[da - layout.base_addr:da - layout.base_addr + n] = s_data[sa - s_layout.base_addr:
                                                                              sa - s_layout.base_addr + n]
        assert set(answers_for(p, d, i, True)) == set(sources(p, d, i, True))
        bb = layout.block_bytes
        for sb, db in ((2, 1), (0, 2)):
            assert bytes(got[db * bb:(db + 1) * bb]) == want_all[sb * bb:(sb + 1) * bb]
        assert not any(got[:bb])  # block 0 was not named


def test_stores_that_do_not_split_over_both_sizes_do_not_fit():
    from openinfer.distributed.kv_transfer.nixl_push import layout_mismatch
    from openinfer.distributed.kv_transfer.side_channel import StoreLayout

    # Two KV heads of 8 bytes a row: TP 4 would replicate them (8 bytes a rank, not 4): not the same KV sharded.
    two_heads = [[StoreLayout(0, 16 * 2, 8, 2)]]
    assert layout_mismatch([[StoreLayout(0, 8 * 2, 8, 2)]], "prod settings", 2, two_heads, "mine", 1, "producer") == ""
    why = layout_mismatch([[StoreLayout(0, 8 * 2, 8, 2)]], "prod settings", 4, two_heads, "mine", 1, "producer")
    assert "tensor_parallel_size=4" in why and "tensor_parallel_size=1" in why and "prod settings" in why
    assert "one must divide" in layout_mismatch(two_heads, "a", 3, two_heads, "b", 2, "producer")


def test_another_tp_size_is_moved_where_one_size_divides_the_other():
    params = {**remote_params(20), "tp_size": 2, "remote_ports": [1, 2]}
    _, _, conn = make("kv_consumer")
    conn.validate_params(params, 20, BS)  # TP 2 -> TP 1: each rank's heads gathered (tp_slices.py)
    with pytest.raises(ValueError, match="remote_ports"):
        conn.validate_params({**params, "remote_ports": [1]}, 20, BS)
    two = NixlConnectorScheduler(KVTransferConfig("NixlConnector", "kv_consumer"), [BS], tp_size=2)
    two.set_side_channel({"host": "127.0.0.1", "port": 5555, "ports": [7, 8]})
    with pytest.raises(ValueError, match=r"tp_size=3 .*tensor_parallel_size=2: one must divide the other"):
        two.validate_params({**params, "tp_size": 3, "remote_ports": [1, 2, 3]}, 20, BS)
    push = NixlConnectorScheduler(KVTransferConfig("NixlConnector", "kv_consumer",
                                                   kv_connector_extra_config={"send_type": "PUT"}), [BS], tp_size=1)
    push.validate_params(params, 20, BS)  # push too: each producer rank writes its slice


def test_a_prompt_refused_for_its_layout_is_released_at_every_producer_rank():
    """A decoder that cannot take a producer's copy (sizes that do not divide) tells each producer rank holding it
    to free it now, over the side channel (msgpack); a rank that is no producer says so."""
    import time

    from openinfer.distributed.kv_transfer.side_channel import ReleaseRequest, SideChannelServer, release_held

    got = []
    servers = [SideChannelServer("127.0.0.1", 0, "prod", b"", [], on_release=lambda r: got.append(r) or "")
               for _ in range(3)]
    try:
        params = {**remote_params(20), "tp_size": 3, "remote_ports": [s.port for s in servers]}
        two = NixlConnectorScheduler(KVTransferConfig("NixlConnector", "kv_consumer"), [BS], tp_size=2)
        with pytest.raises(ValueError, match="one must divide the other"):
            two.validate_params(params, 20, BS)
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [ReleaseRequest(two.engine_id, "prod", "p-1")] * 3
    finally:
        for s in servers:
            s.close()
    no_producer = SideChannelServer("127.0.0.1", 0, "prod", b"", [])
    try:
        with pytest.raises(RuntimeError, match="not a kv_producer"):
            release_held("127.0.0.1", no_producer.port, ReleaseRequest("me", "prod", "p-1"), 5.0)
    finally:
        no_producer.close()


def test_kv_transfer_under_external_launcher_is_refused_naming_it():
    """Each torchrun rank is an engine of its own there: nobody would combine the ranks' transfer reports."""
    import torch

    from openinfer.config import EngineConfig, ModelConfig, ParallelConfig

    model = ModelConfig("m", {"architectures": ["LlamaForCausalLM"]}, torch.float32, torch.device("cpu"), 64, "m")
    with pytest.raises(ValueError, match="external_launcher"):
        EngineConfig(model=model, parallel=ParallelConfig(2, distributed_executor_backend="external_launcher"),
                     kv_transfer=KVTransferConfig("NixlConnector", "kv_both"))
    EngineConfig(model=model, parallel=ParallelConfig(2, distributed_executor_backend="mp"),
                 kv_transfer=KVTransferConfig("NixlConnector", "kv_both"))  # several ranks under mp: allowed
