"""The endpoints load balancers query (/get_server_info, /server_info, /get_model_info, /get_load) and
``--metrics-prefix vllm``: vLLM's metric names, fed by the same counters as openinfer's."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_utils import InProcessServer, shared_checkpoint

from openinfer.server.metrics import ServerMetrics
from openinfer.server.messages import StatsSnapshot


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = shared_checkpoint(tmp_path_factory)
    with InProcessServer(ckpt, server_kw={"metrics_prefix": "vllm"}, dtype="float32", max_model_len=512,
                         num_kv_blocks=64, block_size=16, max_num_seqs=4) as s:
        yield s


def test_server_and_model_info(server):
    info = httpx.get(server.url + "/get_server_info", timeout=10).json()
    assert info["served_model_name"] == "tiny"
    assert info["max_model_len"] == info["context_length"] == 512
    assert info["block_size"] == info["page_size"] == 16
    assert info["max_num_seqs"] == info["max_running_requests"] == 4
    assert info["kv_capacity_tokens"] == 64 * 16
    assert info["tp_size"] == info["dp_size"] == 1
    assert info["metrics_prefix"] == "vllm"
    assert info["internal_states"][0]["num_reqs"] == 0
    v = httpx.get(server.url + "/server_info?config_format=json", timeout=10).json()["vllm_config"]
    assert v["model_config"]["model"] == "tiny" and v["cache_config"]["block_size"] == 16
    m = httpx.get(server.url + "/get_model_info", timeout=10).json()
    assert m["is_generation"] is True and m["served_model_name"] == "tiny"
    assert m["model_path"] == info["model_path"]


def test_get_load_and_vllm_metrics_follow_a_running_request(server):
    idle = httpx.get(server.url + "/get_load", timeout=10).json()
    assert idle[0]["num_reqs"] == 0 and idle[0]["num_tokens"] == 0
    seen: list[dict] = []
    # as long as max_model_len allows: the server runs in this process, and on a loaded host the engine thread
    # once streamed 200 tokens before this thread's first poll
    body = {"model": "tiny", "prompt": "x" * 40, "max_tokens": 440, "ignore_eos": True, "stream": True}
    started = threading.Event()

    def run() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    while t.is_alive():  # while it streams, the load and the metrics show one running request holding KV
        load = httpx.get(server.url + "/get_load", timeout=10).json()[0]
        if load["num_requests_running"] == 1:
            metrics = server.metrics()
            # On a busy host the request can finish between the two reads: only a pair taken while it ran counts.
            if metrics["vllm:num_requests_running"] == 1:
                seen.append(load)
                break
    t.join(60)
    assert seen, "the running request never showed in /get_load"
    load = seen[0]
    assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0
    assert load["num_tokens"] >= 48 and load["kv_cache_usage_perc"] > 0  # >= 3 blocks of 16 for 40+ tokens
    assert metrics["vllm:num_requests_running"] == 1
    assert metrics["vllm:kv_cache_usage_perc"] == metrics["vllm:gpu_cache_usage_perc"] > 0
    after = server.metrics()
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] >= 440
    assert after["vllm:prompt_tokens_total"] >= 40
    assert after["vllm:time_to_first_token_seconds_count"] >= 1
    assert after['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert not any(k.startswith("openinfer:") for k in after)
    assert httpx.get(server.url + "/get_load", timeout=10).json()[0]["num_reqs"] == 0


def test_metrics_prefix_is_checked():
    with pytest.raises(ValueError, match="metrics prefix"):
        ServerMetrics("m", StatsSnapshot, "sglang")
    default = ServerMetrics("m", StatsSnapshot).render().decode()
    assert "openinfer:num_requests_running" in default and "vllm:" not in default


def test_get_load_has_one_entry_per_data_parallel_replica():
    """/get_load (and /get_server_info's internal_states) speak per dp_rank, from the core's per-replica figures."""
    from types import SimpleNamespace

    from openinfer.server.router_endpoints import load_info

    stats = StatsSnapshot(num_running=3, num_waiting=1, rank_loads=[(2, 1, 10, 16, 0.375), (1, 0, 14, 16, 0.125)])
    ctx = SimpleNamespace(async_engine=SimpleNamespace(stats=stats),
                          engine=SimpleNamespace(config=SimpleNamespace(cache=SimpleNamespace(block_size=8))))
    assert load_info(ctx) == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 48, "num_requests_running": 2,
         "num_requests_waiting": 1, "kv_cache_usage_perc": 0.375, "num_free_blocks": 10, "num_total_blocks": 16},
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 16, "num_requests_running": 1,
         "num_requests_waiting": 0, "kv_cache_usage_perc": 0.125, "num_free_blocks": 14, "num_total_blocks": 16}]
