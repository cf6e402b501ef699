"""scripts/pd_agentic_bench.py without servers: the setups it compares have the same number of ranks, the commands it
launches carry the full shape's flags, bad arguments name the flag, and its time split adds up (the replay itself is
the committed result, docs/results/pd_agentic/)."""
from __future__ import annotations

import json

import pytest
from helpers import load_script

bench = load_script("pd_agentic_bench")


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_setups_compare_the_same_number_of_ranks():
    args = bench.parse_args([])
    assert args.setups == ["monolithic", "pd"]
    assert {s: bench.num_ranks(s) for s in bench.SETUPS} == {"monolithic": 4, "pd": 4, "pd-push": 4}


def test_commands_carry_the_full_shape():
    args = bench.parse_args(["--num-kv-blocks", "64"])
    mono = bench.server_cmd("/m", 1, 4, None, args)
    assert "--kv-transfer-config" not in mono and _flag(mono, "--data-parallel-size") == "4"
    pull = bench.server_cmd("/m", 2, 2, "GET", args)
    push = bench.server_cmd("/m", 3, 2, "PUT", args)
    for cmd in (mono, pull, push):
        assert "--enable-expert-parallel" in cmd and _flag(cmd, "--host") == "127.0.0.1"
        assert json.loads(_flag(cmd, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 2}
        assert _flag(cmd, "--num-kv-blocks") == "64"
    assert "kv_connector_extra_config" not in json.loads(_flag(pull, "--kv-transfer-config"))
    assert json.loads(_flag(push, "--kv-transfer-config"))["kv_connector_extra_config"] == {"send_type": "PUT"}
    router = bench.router_cmd("vllm-router", "http://p", "http://d", 5, 6)
    assert "--vllm-pd-disaggregation" in router and _flag(router, "--prefill") == "http://p"
    assert _flag(router, "--decode") == "http://d" and _flag(router, "--prometheus-port") == "6"
    warm = bench.bench_cmd("http://x", args, "/m", salt="w", sessions=2, turns=1, warmup=True)
    assert "--save-result" not in warm and _flag(warm, "--salt") == "w"
    run = bench.bench_cmd("http://x", args, "/m", salt="s", sessions=4, turns=3, warmup=False, out="/o", name="pd")
    assert _flag(run, "--result-filename") == "pd.json" and _flag(run, "--agentic-warmup-turns") == "0"


@pytest.mark.parametrize("argv, flag", [(["--setups", "pd", "tp8"], "--setups"), (["--sessions", "0"], "--sessions"),
                                        (["--num-kv-blocks", "0"], "--num-kv-blocks")])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert flag in capsys.readouterr().err


METRICS = """# TYPE openinfer:time_to_first_token_seconds histogram
openinfer:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} %(n)s
openinfer:time_to_first_token_seconds_count{model_name="m"} %(n)s
openinfer:time_to_first_token_seconds_sum{model_name="m"} %(ttft)s
# TYPE openinfer:e2e_request_latency_seconds histogram
openinfer:e2e_request_latency_seconds_count{model_name="m"} %(n)s
openinfer:e2e_request_latency_seconds_sum{model_name="m"} %(e2e)s
# TYPE openinfer:request_queue_time_seconds histogram
openinfer:request_queue_time_seconds_count{model_name="m"} %(n)s
openinfer:request_queue_time_seconds_sum{model_name="m"} %(queue)s
# TYPE openinfer:prompt_tokens_by_source counter
openinfer:prompt_tokens_by_source_total{model_name="m",source="local_compute"} %(computed)s
openinfer:prompt_tokens_by_source_total{model_name="m",source="local_cache_hit"} %(hit)s
openinfer:prompt_tokens_by_source_total{model_name="m",source="external_kv_transfer"} %(received)s
# TYPE openinfer:kv_transfer_loads counter
openinfer:kv_transfer_loads_total{model_name="m"} %(loads)s
# TYPE openinfer:kv_transfer_seconds counter
openinfer:kv_transfer_seconds_total{model_name="m"} %(kv_s)s
"""


def _server(**kw):
    base = dict(n=0, ttft=0, e2e=0, queue=0, computed=0, hit=0, received=0, loads=0, kv_s=0)
    return bench.parse_metrics(METRICS % {**base, **kw})


def test_time_split_adds_up_from_metrics_deltas():
    # Two requests over the replay: the prefill instance's answers take 0.3 s each (0.1 queued), the decoder's first
    # token 0.2 s after arrival (0.05 of it the KV read); the client saw 0.6 s TTFT: 0.1 s router + HTTP.
    before = {"prefill": _server(n=1, ttft=1.0, e2e=1.0, queue=0.5, computed=100),
              "decode": _server(n=1, ttft=1.0, e2e=2.0, queue=0.0, received=99, computed=1, loads=1, kv_s=0.5)}
    after = {"prefill": _server(n=3, ttft=1.5, e2e=1.6, queue=0.7, computed=160, hit=240),
             "decode": _server(n=3, ttft=1.4, e2e=3.4, queue=0.0, received=497, hit=2, computed=3, loads=3,
                               kv_s=0.6)}
    servers = {role: bench.server_figures(bench.delta(before[role], after[role])) for role in before}
    assert servers["prefill"]["cached_share"] == pytest.approx(240 / 300)
    assert servers["decode"]["prompt_tokens_received"] == 398 and servers["decode"]["kv_read_ms_mean"] == \
        pytest.approx(50)
    client = {"ttft_ms": {"mean": 600.0}, "e2el_ms": {"mean": 1300.0}}
    split = bench.time_split(client, servers)
    assert split["prefill_queue"] == pytest.approx(100) and split["prompt_pass"] == pytest.approx(150)
    assert split["prefill_answer_back"] == pytest.approx(50) and split["kv_read"] == pytest.approx(50)
    assert split["decoder_first_token"] == pytest.approx(150)
    assert split["router_and_http"] == pytest.approx(600 - 300 - 200) and split["decode"] == pytest.approx(700)
    mono = bench.time_split(client, {"mono": bench.server_figures(bench.delta(before["prefill"], after["prefill"]))})
    assert mono["http"] == pytest.approx(600 - 250) and mono["queue"] == pytest.approx(100)


def test_repeats_interleave_the_setups():
    args = bench.parse_args(["--setups", "monolithic", "pd", "--repeats", "2"])
    assert bench.run_names(args) == [("monolithic #1", "monolithic"), ("pd #1", "pd"), ("monolithic #2", "monolithic"),
                                     ("pd #2", "pd")]
    assert bench.run_names(bench.parse_args(["--setups", "pd"])) == [("pd", "pd")]
