"""The NIXL connector between two in-process engines (real NIXL over UCX): pull and push, token-identical to one
engine, DeepSeek's KV groups, fallbacks, and every block back in its pool afterwards. The scheduler side of the
seam, driven by hand, is tests/test_kv_connector.py."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from openinfer.config import KVTransferConfig
from openinfer.sampling_params import SamplingParams

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
        t.join(60)
        # Still stepping: going on would drive the producer from two threads at once (its executor's socket is
        # not thread-safe), which hangs instead of failing.
        assert not t.is_alive(), "the producer's step did not return within 60 s"


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


@pytest.mark.slow  # three DeepSeek engines per case; the dense pull stays fast
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


@pytest.mark.slow  # three DeepSeek engines; the dense pull stays fast
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


@pytest.mark.parametrize("send_type", ["GET", "PUT"])
def test_a_copy_the_decoder_refuses_for_its_layout_is_freed_at_the_producer_at_once(engines, send_type):
    """A decoder with another block_size cannot take the producer's blocks. A 20-token prompt: the block tables'
    lengths differ, so its scheduler refuses and tells the producer over the side channel; a 5-token one (one block
    each side): the handshake's layout check (pull) or the producer's (push) refuses. Either way the decoder computes
    the prompt itself - the same tokens - and the producer's pool is whole within a few steps, not at its abort
    timeout (480 s here: nothing expired)."""
    from helpers import random_prompts

    from openinfer.entrypoints.llm import LLM

    prod, _, ref, _ = engines
    extra = {"kv_connector_extra_config": {"send_type": "PUT"}} if send_type == "PUT" else {}
    other = LLM(prod.engine.config.model.path, kv_transfer_config=json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "load_timeout_s": 2.0, **extra}),
        dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=8)
    try:
        expired = prod.engine.stats().kv_transfer.sends_expired
        for prompt in random_prompts(11 if send_type == "GET" else 12, [20, 5]):
            want = greedy(ref, prompt, 4).outputs[0].token_ids
            held = greedy(prod, prompt, 1, {"do_remote_decode": True}).kv_transfer_params
            assert not prod.engine.core.kv.all_free()
            with stepping(prod):
                d = greedy(other, prompt, 4, held)
            assert d.outputs[0].token_ids == want and d.num_cached_tokens == 0
            deadline = time.monotonic() + 10  # bounded; a release the producer missed would take 480 s
            while not prod.engine.core.kv.all_free() and time.monotonic() < deadline:
                prod.engine.step()
                time.sleep(0.01)
            assert prod.engine.core.kv.all_free() and other.engine.core.kv.all_free()
        assert prod.engine.stats().kv_transfer.sends_expired == expired
        assert other.engine.stats().kv_transfer.fallbacks == 2
    finally:
        other.engine.shutdown()


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
        w._loads["r"] = _Load(spec, time.monotonic() - 1, handles={0: object()}, started=True)
        assert not w.get_finished().failed_recving and "r" in w._loads  # refused: still the request's
        out = w.get_finished()
        assert out.failed_recving == {"r": "transfer not done within 0.0 s"} and not w._loads
        assert w.agent.releases == 2
    finally:
        w.shutdown()
