"""Disaggregated prefill/decode with real processes on 127.0.0.1: two ``openinfer serve`` instances started with
the same ``--kv-transfer-config`` and nothing but different ports, paired by the unmodified ``vllm-router`` in PD
mode. The KV moves over NIXL (pull; push in one test); output is token-identical to one instance; faults end each
request once."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import ServerProcess, free_port, shared_checkpoint

from openinfer.server.metrics import PREFIX as P

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # server processes and the router per test
pytest.importorskip("nixl")

ROUTER = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
KV = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "load_timeout_s": 3.0, "abort_request_timeout_s": 4.0}
COMMON = ("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "96", "--max-num-seqs", "8")


def _start_router(prefill, decode):
    """vllm-router in PD mode over the two instances; returns (process, url) once it answers /health."""
    port = free_port()
    log = open(f"/tmp/openinfer-test-router-{port}.log", "w")
    router = subprocess.Popen([ROUTER, "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode",
                               decode.url, "--host", "127.0.0.1", "--port", str(port),
                               "--worker-startup-check-interval", "1", "--request-timeout-secs", "60",
                               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:
        while True:
            assert router.poll() is None, open(log.name).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return router, url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router not up in 30 s"
            time.sleep(0.2)
    except BaseException:
        router.kill()
        router.wait(10)
        raise


def _stop_router(router):
    if router is not None:
        router.terminate()
        router.wait(10)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    if not os.path.exists(ROUTER):
        pytest.skip("vllm-router is not installed (pip install 'openinfer[pd]')")
    model = shared_checkpoint(tmp_path_factory)
    cfg = ("--kv-transfer-config", json.dumps(KV))
    # The prefill instance also decodes by push (send_type only matters on the decoding side): the push test runs
    # a second router with the two roles swapped, rather than paying for a third server.
    push_cfg = ("--kv-transfer-config", json.dumps({**KV, "kv_connector_extra_config": {"send_type": "PUT"}}))
    prefill = ServerProcess(model, *COMMON, *push_cfg, wait=False)
    decode = ServerProcess(model, *COMMON, *cfg, wait=False)
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router, url = _start_router(prefill, decode)
        yield prefill, decode, url
    finally:
        _stop_router(router)
        prefill.stop()
        decode.stop()


def _wait_free(server, timeout_s=10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m[P + "kv_cache_usage_perc"] == 0 and m[P + "kv_transfer_held_requests"] == 0:
            return m
        assert time.monotonic() < deadline, f"blocks still held: {m[P + 'kv_cache_usage_perc']}"
        time.sleep(0.1)


def _complete(url, prompt, max_tokens, stream=False, **extra):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}
    return _post(url + "/v1/completions", body, stream)


def _chat(url, text, max_tokens, stream=False, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    return _post(url + "/v1/chat/completions", body, stream)


def _post(url, body, stream):
    if "model" in body:
        body = {k: v for k, v in body.items() if k != "model"}
    if not stream:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    text = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(text)


def _text(resp):
    c = resp["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def test_router_pd_is_token_identical_and_the_decoder_generates(pd):
    prefill, decode, url = pd
    p0, d0 = prefill.metrics(), decode.metrics()
    prompts = ["the quick brown fox jumps over the lazy dog, again and again", "Disaggregated serving: hi",
               "0123456789" * 7]
    n_tokens = 0
    for i, prompt in enumerate(prompts):
        # The reference: the same request served whole by one instance (the prefill one, no kv_transfer_params).
        want = _complete(prefill.url, prompt, 12, return_token_ids=True)
        got = _complete(url, prompt, 12, return_token_ids=True)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert "kv_transfer_params" not in got  # the decoder's answer; only a producer returns them
        assert _complete(url, prompt, 12, stream=True) == _text(want)
        chat_want = _chat(prefill.url, f"chat {i}: {prompt}", 10)
        assert _text(_chat(url, f"chat {i}: {prompt}", 10)) == _text(chat_want)
        assert _chat(url, f"chat {i}: {prompt}!", 10, stream=True) == _text(_chat(prefill.url,
                                                                                   f"chat {i}: {prompt}!", 10))
        n_tokens += 12 + 12 + 10 + 10
    p1, d1 = _wait_free(prefill), _wait_free(decode)
    n_pd = 4 * len(prompts)  # requests that went through the router
    # The decoder generated every output token of the routed requests; the prefill instance one per request
    # (max_tokens=1) plus the reference requests it served whole.
    assert d1[P + "engine_generation_tokens_total"] - d0[P + "engine_generation_tokens_total"] == n_tokens
    ref_tokens = (12 + 10 + 10) * len(prompts)
    assert p1[P + "engine_generation_tokens_total"] - p0[P + "engine_generation_tokens_total"] == n_pd + ref_tokens
    assert d1[P + "kv_transfer_loads_total"] - d0[P + "kv_transfer_loads_total"] == n_pd
    assert d1[P + "kv_transfer_bytes_total"] > d0[P + "kv_transfer_bytes_total"]
    assert d1[P + "kv_transfer_fallbacks_total"] == d0[P + "kv_transfer_fallbacks_total"]
    src = P + 'prompt_tokens_by_source_total{source="%s"}'
    assert d1[src % "local_compute"] - d0[src % "local_compute"] == n_pd  # one (the last) per request
    assert d1[src % "external_kv_transfer"] > d0[src % "external_kv_transfer"]
    assert p1[P + "kv_transfer_sends_total"] - p0[P + "kv_transfer_sends_total"] == n_pd


def test_decoder_usage_counts_the_received_prompt_as_cached(pd):
    """The two legs the router runs, by hand: the decoder's own usage says every prompt token but the last (which
    it computes for its logits) came cached. (vllm-router rewrites usage.prompt_tokens_details in PD mode.)"""
    prefill, decode, _ = pd
    prompt = "usage on the decode side, measured directly"
    first = _complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    got = _complete(decode.url, prompt, 6, kv_transfer_params=first["kv_transfer_params"])
    n = got["usage"]["prompt_tokens"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert _text(got) == _text(_complete(prefill.url, prompt, 6))
    _wait_free(prefill), _wait_free(decode)


def test_bad_kv_transfer_params_are_a_400(pd):
    _, decode, _ = pd
    r = httpx.post(decode.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
        "remote_port": "not a port", "remote_block_ids": [0]}}, timeout=30)
    assert r.status_code == 400 and "remote_port" in r.text
    r = httpx.post(decode.url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2,
                                                         "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert r.status_code == 400 and "kv_transfer_params" in r.text


def test_a_reader_that_never_comes_frees_the_producer_after_its_timeout(pd):
    """The decode side dies after the prefill ran (or never asks): the producer's held blocks go back to the pool
    after abort_request_timeout_s, and /metrics says so."""
    prefill, _, _ = pd
    before = prefill.metrics()
    first = _complete(prefill.url, "nobody will read this prompt's blocks", 1,
                      kv_transfer_params={"do_remote_decode": True})
    assert first["kv_transfer_params"]["remote_block_ids"]
    m = prefill.metrics()
    assert m[P + "kv_transfer_held_requests"] == 1 and m[P + "kv_cache_usage_perc"] > 0
    after = _wait_free(prefill, timeout_s=15)
    assert after[P + "kv_transfer_sends_expired_total"] == before[P + "kv_transfer_sends_expired_total"] + 1


def test_a_transfer_that_never_completes_falls_back(pd):
    """A producer that accepts the connection and never answers: the read times out, the decoder computes the
    prompt itself, the answer is the same and nothing stays allocated."""
    import zmq

    _, decode, _ = pd
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        prompt = "a prompt whose producer never answers"
        want = _complete(decode.url, prompt, 8)
        _wait_free(decode)
        before = decode.metrics()[P + "kv_transfer_fallbacks_total"]
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "mute",
                  "remote_block_ids": [0, 1, 2], "remote_request_id": "x", "remote_host": "127.0.0.1",
                  "remote_port": port, "tp_size": 1}
        got = _complete(decode.url, prompt, 8, kv_transfer_params=params)
        assert _text(got) == _text(want)
        m = _wait_free(decode)
        assert m[P + "kv_transfer_fallbacks_total"] == before + 1
    finally:
        mute.close(0)
        ctx.term()


def test_router_pd_push_is_token_identical(pd):
    """Push (send_type PUT) through the same unmodified vllm-router, roles swapped (the module's prefill instance
    decodes, by push): the router runs the prefill leg first, so the decoder learns of the request from the prefill
    answer, registers its blocks with the producer over the side channel, and the producer NIXL-WRITEs them. Same
    tokens as one instance; the decoder computed only each prompt's last token; both sides free everything."""
    decoder, producer, _ = pd  # swapped: the module's decode instance produces, its prefill one decodes
    router, url = _start_router(producer, decoder)
    try:
        p0, d0 = producer.metrics(), decoder.metrics()
        prompts = ["pushed: the quick brown fox jumps over the lazy dog"]
        for prompt in prompts:
            want = _complete(producer.url, prompt, 8, return_token_ids=True)
            got = _complete(url, prompt, 8, return_token_ids=True)
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert _chat(url, "pushed chat", 8, stream=True) == _text(_chat(producer.url, "pushed chat", 8))
        p1, d1 = _wait_free(producer), _wait_free(decoder)
        n = len(prompts) + 1
        assert d1[P + "kv_transfer_loads_total"] - d0[P + "kv_transfer_loads_total"] == n
        assert d1[P + "kv_transfer_fallbacks_total"] == d0[P + "kv_transfer_fallbacks_total"]
        assert d1[P + "kv_transfer_bytes_total"] > d0[P + "kv_transfer_bytes_total"]
        src = P + 'prompt_tokens_by_source_total{source="%s"}'
        assert d1[src % "local_compute"] - d0[src % "local_compute"] == n
        assert p1[P + "kv_transfer_sends_total"] - p0[P + "kv_transfer_sends_total"] == n
    finally:
        _stop_router(router)


def test_prefill_killed_after_prefill_decoder_still_answers_once(pd):
    """Last in the module: it kills the prefill instance. Its prompt ran and its blocks were held; the decode
    request then finds nobody to read from, falls back, answers once, and frees everything."""
    prefill, decode, url = pd
    prompt = "kill the producer after this prompt ran"
    want = _complete(decode.url, prompt, 8)
    _wait_free(decode)
    first = _complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] > 0 and params["remote_block_ids"]
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait(10)
    t0 = time.monotonic()
    got = _complete(decode.url, prompt, 8, kv_transfer_params=params)
    assert time.monotonic() - t0 < 30
    assert _text(got) == _text(want)
    m = _wait_free(decode)
    assert m[P + "kv_transfer_fallbacks_total"] >= 1
    # Through the router, with its prefill instance gone: one clean error, no hang, nothing held on the decoder.
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60)
    assert r.status_code >= 500 and time.monotonic() - t0 < 30
    assert _wait_free(decode)[P + "num_requests_running"] == 0


def _deepseek_with_mtp(arch, tmp_path_factory) -> tuple[str, tuple[str, ...]]:
    """A tiny checkpoint of ``arch`` with its MTP block and the serve arguments it needs: V3 with one MTP layer
    (one latent group, 16-token blocks); V4 in DeepSeek's release layout with an mtp.0 block (full, 16-token
    sliding window, coarse compressed entries and the MTP block's groups: 8-token blocks), its tokenizer from the
    HF folder; V4.1 with its DSpark block (full, 8-token window with Engram ids, and the ``dspark.window`` context
    keys)."""
    from helpers import load_script

    tmp = tmp_path_factory.mktemp(f"pd-{arch}")
    if arch == "deepseek_v3":
        model = load_script("make_deepseek_checkpoint").make_v3(tmp / "v3", "tiny", seed=0,
                                                                overrides={"num_nextn_predict_layers": 1})
        return str(model), ("--block-size", "16")
    if arch == "deepseek_v4":
        from test_deepseek_v4 import write_release_with_mtp

        hf = load_script("make_deepseek_v4_checkpoint").make_checkpoint(tmp / "hf", "tiny", seed=0)
        write_release_with_mtp(hf, tmp / "release")
        return str(tmp / "release"), ("--block-size", "8", "--tokenizer", str(hf))
    model = load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp / "v41", "tiny", seed=0, quantize=False)
    return str(model), ("--block-size", "8")


# V3's servers run every rank as a Ray actor (both join one local Ray instance through RAY_ADDRESS, as servers join
# a cluster), V4's and V4.1's as processes (mp): both executors behind the router without a fourth server pair.
@pytest.mark.parametrize("arch,backend", [("deepseek_v3", "ray"), ("deepseek_v4", "mp"), ("deepseek_v41", "mp")])
def test_router_pd_full_deepseek_shape(arch, backend, tmp_path_factory):
    """The production DeepSeek shape at toy scale, as processes behind the unmodified router: a prefill instance and
    a decode instance, each DP 2 + EP with MTP k = 2 (V4.1: DSpark, its MTP; the prefill's prompt pass fills the
    drafter's KV, which moves with the target's groups). Two requests at once (the least-loaded pick spreads them
    over each side's replicas when they overlap; not asserted here - tests/test_pd_parallel.py checks that both
    producer replicas served); pull, then push (a second router, roles swapped: the first prefill instance
    decodes with send_type PUT); tokens as the instance answers alone; every prompt token but the last came over
    NIXL; the decoder drafted; both sides free everything. Prompts are prefilled in chunks; the producer of the
    pull round serves them from its prefix cache (it computed them as the reference); the decoders preempt. The documented commands are docs/composition.md's. Per model the two servers start once and serve the
    reference, the pull and the push rounds; four 40-token prompts, 12 tokens each."""
    if not os.path.exists(ROUTER):
        pytest.skip("vllm-router is not installed (pip install 'openinfer[pd]')")
    from concurrent.futures import ThreadPoolExecutor

    ray, env = None, {}
    if backend == "ray":
        from helpers import RAY_ENV, start_local_ray

        ray = start_local_ray(tmp_path_factory.mktemp("ray"))  # 4 CPUs: two servers' placement groups of 2
        env = {**RAY_ENV, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    model, model_args = _deepseek_with_mtp(arch, tmp_path_factory)
    # Chunked prefill (8-token chunks) and pools small enough that a replica holding two of the four requests runs
    # out of blocks while they decode, though both are admitted (with the k = 2 lookahead, 3 of 16-token blocks each
    # to admit, 4 at the end; 6 and 7 of 8-token blocks): the decoder preempts requests whose prompts came over NIXL
    # (they recompute there, never read again), and so does the reference. These pools found a producer sending
    # blocks cached through the drafter's lookahead slots (docs/composition.md).
    pool = {"deepseek_v3": "7", "deepseek_v4": "12", "deepseek_v41": "12"}[arch]
    args = (*COMMON, *model_args, "--data-parallel-size", "2", "--enable-expert-parallel",
            "--num-kv-blocks", pool,  # after COMMON's: the last one counts
            "--max-num-batched-tokens", "8",
            "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}),
            "--distributed-executor-backend", backend)
    push_kv = {**KV, "kv_connector_extra_config": {"send_type": "PUT"}}
    a = ServerProcess(model, *args, "--kv-transfer-config", json.dumps(push_kv), wait=False, env=env)
    b = ServerProcess(model, *args, "--kv-transfer-config", json.dumps(KV), wait=False, env=env)
    router = None
    # Both past V4's 16-token window (and V4.1's 8): the window groups send released (-1) blocks too.
    prompts = ["the full shape: prefill and decode, too.", "MTP drafts on the decoder, four requests",
               "chunked prefill, prefix hits, preemption", "behind the unmodified router, both ways."]
    n_out = 12
    try:
        a.wait_ready()
        b.wait_ready()
        with ThreadPoolExecutor(len(prompts)) as pool:
            want = list(pool.map(lambda p: _complete(a.url, p, n_out, return_token_ids=True), prompts))
        n_prompt = [w["usage"]["prompt_tokens"] for w in want]
        preempted = 0  # by the decoders, over the rounds
        _wait_free(a)
        # Which round preempts depends on arrival timing: on a starved host the four requests can reach the decoder
        # staggered enough that no replica holds two at once (seen once in 2 rounds under load). Pull and push
        # always run; up to two more pull rounds only while no decoder has preempted yet.
        rounds = [(a, b, "pull"), (b, a, "push"), (a, b, "pull again"), (a, b, "pull a third time")]
        for i, (prefill, decode, mode) in enumerate(rounds):
            if i >= 2 and preempted:
                break
            # The decoder must not hold the prompts already (it computed them as the reference, or produced them
            # last round): every prompt token but the last has to come over NIXL.
            assert httpx.post(decode.url + "/reset_prefix_cache", timeout=30).status_code == 200
            router, url = _start_router(prefill, decode)
            d0 = decode.metrics()
            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: _complete(url, p, n_out, return_token_ids=True), prompts))
            assert [g["choices"][0]["token_ids"] for g in got] == [w["choices"][0]["token_ids"] for w in want], mode
            assert [g["usage"]["prompt_tokens"] for g in got] == n_prompt, mode
            _wait_free(prefill), _wait_free(decode)
            d1 = decode.metrics()
            gen = P + "engine_generation_tokens_total"
            assert d1[gen] - d0[gen] == n_out * len(prompts), mode
            drafts = P + "spec_decode_num_draft_tokens_total"
            assert d1[drafts] > d0[drafts], mode  # the decoder drafted (its drafter's prompt KV came too)
            assert d1[P + "kv_transfer_loads_total"] - d0[P + "kv_transfer_loads_total"] == len(prompts), mode
            assert d1[P + "kv_transfer_fallbacks_total"] == d0[P + "kv_transfer_fallbacks_total"], mode
            src = P + 'prompt_tokens_by_source_total{source="%s"}'
            # the last prompt token of each, and what the preempted requests recomputed from their own cache
            assert d1[src % "local_compute"] - d0[src % "local_compute"] >= len(prompts), mode
            preempted += d1[P + "num_preemptions_total"] - d0[P + "num_preemptions_total"]
            assert d1[src % "external_kv_transfer"] - d0[src % "external_kv_transfer"] == sum(n_prompt) - len(
                prompts), mode
            _stop_router(router)
            router = None
        assert preempted > 0
        if ray is not None:  # each server's two ranks are actors of the one Ray instance, whose four CPUs the two
            # placement groups hold. Counted in Ray's actor table: the ranks' output also reaches the server's log
            # tagged with the actor's pid, but Ray forwards it asynchronously (one rank's lines were still missing
            # at this point in a CI run), so the log only has to show each server's ranks logging through Ray.
            from ray._private import state as ray_state

            alive = [x for x in ray_state.actors(actor_state_name="ALIVE").values()
                     if x["ActorClassName"] == "RayWorkerHost"]
            assert len({x["Pid"] for x in alive}) == len(alive) == 4, alive
            for s in (a, b):
                assert re.search(r"\(RayWorkerHost pid=\d+\)", s.log_path.read_text()), s.log()
            assert ray.available_resources().get("CPU", 0) == 0, ray.available_resources()
    finally:
        _stop_router(router)
        a.stop()
        b.stop()
        if ray is not None:
            ray.shutdown()
