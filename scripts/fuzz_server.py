"""Fuzz a running ``openinfer serve`` as a hostile client would: hypothesis-built bodies for /v1/completions,
/v1/chat/completions, /tokenize and /detokenize (plausible fields mixed with out-of-range values, wrong types,
huge integers, junk JSON and bytes that are not JSON), then schemathesis against the server's /openapi.json.

Every answer must come within ``--timeout`` seconds with a status below 500 (a stream must not carry a server
error), and afterwards the server must still give a known greedy request the same text as before the run.
tests/test_fuzz_server.py runs a few dozen examples of each in CI; this script is the longer run:

    python -m openinfer serve --model <tiny model> --port 8000 &
    python scripts/fuzz_server.py --url http://127.0.0.1:8000 --examples 2000 --schemathesis
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

INTERESTING_INTS = [0, 1, -1, 2, 255, 256, 257, 1023, 1024, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64,
                    -(2**63) - 1, 10**30]
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
GREEDY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

_edges = st.sampled_from(INTERESTING_INTS)
_huge = st.sampled_from([2**63, 2**64, 10**30, -(2**63) - 1])  # past int64: what tensors and msgpack cannot hold
_ints = st.one_of(_huge, _edges, st.integers(-5, 300))
_leaf = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False, allow_infinity=False),
                  st.text(max_size=20))
_junk = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=10)
_small_floats = st.floats(-3, 3, allow_nan=False)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "robot"])},
    optional={"content": st.one_of(st.text(max_size=30), st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": st.text(max_size=10)}), max_size=2)),
              "name": st.text(max_size=5)})
_structured = st.one_of(
    st.fixed_dictionaries({"regex": st.sampled_from(["[a-z]{1,5}", "(", "a*", "[0-9]+"])}),
    st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=3)}),
    st.fixed_dictionaries({"json": st.sampled_from([{"type": "object"}, {"type": "integer"}, "not json", {}])}),
    st.fixed_dictionaries({"grammar": st.text(max_size=20)}),
    st.just({"json_object": True}),
    st.dictionaries(st.text(max_size=8), _leaf, max_size=2),
)
# Plausible values per field (valid or just past a limit); every field may also get junk of any type.
COMMON = {
    "model": st.sampled_from(["tiny", "other", ""]),
    "max_tokens": st.one_of(st.integers(-1, 8), _ints),
    "temperature": st.one_of(_small_floats, _ints), "top_p": _small_floats, "min_p": _small_floats,
    "top_k": _ints, "n": st.one_of(st.integers(-1, 3), _ints), "seed": _ints,
    "presence_penalty": _small_floats, "frequency_penalty": _small_floats,
    "repetition_penalty": st.one_of(_small_floats, st.sampled_from([1e9, 1e-9])),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5)),
    "stop_token_ids": st.lists(_ints, max_size=4), "min_tokens": st.one_of(st.integers(0, 10), _ints),
    "logit_bias": st.dictionaries(st.one_of(_ints.map(str), st.text(max_size=4)),
                                  st.floats(-200, 200, allow_nan=False), max_size=4),
    "allowed_token_ids": st.lists(_ints, max_size=4), "bad_words": st.lists(st.text(max_size=6), max_size=3),
    "prompt_logprobs": st.one_of(st.integers(-1, 25), _ints), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "ignore_eos": st.booleans(), "echo": st.booleans(), "return_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "structured_outputs": _structured, "best_of": _ints, "user": st.text(max_size=5),
}
FIELDS = {
    "/v1/completions": {**COMMON, "prompt": st.one_of(
        st.text(max_size=40), st.lists(_ints, max_size=20), st.lists(st.text(max_size=10), max_size=3),
        st.lists(st.lists(st.integers(-1, 260), max_size=5), max_size=3)),
        "logprobs": st.one_of(st.integers(-1, 25), _ints), "suffix": st.text(max_size=3),
        "add_special_tokens": st.booleans()},
    "/v1/chat/completions": {**COMMON, "messages": st.lists(_message, max_size=3),
                             "logprobs": st.booleans(), "top_logprobs": st.one_of(st.integers(-1, 25), _ints),
                             "max_completion_tokens": st.one_of(st.integers(-1, 8), _ints),
                             "response_format": st.one_of(st.fixed_dictionaries(
                                 {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}), _junk),
                             "tools": st.lists(_junk, max_size=2), "tool_choice": st.one_of(
                                 st.sampled_from(["auto", "none", "required"]), _junk),
                             "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
                             "chat_template_kwargs": st.dictionaries(st.text(max_size=5), _leaf, max_size=2)},
    "/tokenize": {"model": COMMON["model"], "prompt": st.text(max_size=40), "messages": st.lists(_message, max_size=3),
                  "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                  "return_token_strs": st.booleans()},
    "/detokenize": {"model": COMMON["model"], "tokens": st.lists(_ints, max_size=10)},
}


BASES = {
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/tokenize": {"model": "tiny", "prompt": "hello"},
    "/detokenize": {"model": "tiny", "tokens": [10, 11]},
}


def _mutated(route: str) -> st.SearchStrategy[dict]:
    """A valid body with a few fields set (plausible values, often at or past a limit, or junk of any type) and
    sometimes one of its required fields dropped."""
    fields = FIELDS[route]
    keys = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True)
    changes = keys.flatmap(lambda ks: st.fixed_dictionaries(
        {k: st.one_of(fields[k], fields[k], fields[k], _junk) for k in ks}))
    drop = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(sorted(BASES[route])))
    return st.builds(lambda c, d: {k: v for k, v in {**BASES[route], **c}.items() if k != d}, changes, drop)


def bodies(route: str) -> st.SearchStrategy[bytes]:
    """Raw request bodies for ``route``: mostly mutated valid bodies, sometimes JSON that is not one of them,
    sometimes bytes that are not JSON."""
    obj = _mutated(route).map(lambda d: json.dumps(d).encode())
    return st.one_of(obj, obj, obj, obj, _junk.map(lambda d: json.dumps(d).encode()), st.binary(max_size=40))


def check_answer(client: httpx.Client, route: str, body: bytes) -> int:
    """Send one body; fail on a 5xx, a stream that carries a server error, or an answer past the timeout."""
    headers = {"content-type": "application/json"}
    with client.stream("POST", route, content=body, headers=headers) as r:
        data = r.read()
    assert r.status_code < 500, f"{route} answered {r.status_code} to {body[:300]!r}: {data[:300]!r}"
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in data.decode().splitlines():
            if line.startswith("data: {") and '"error"' in line:
                err = json.loads(line[6:]).get("error", {})
                assert err.get("type") != "server_error", f"{route} streamed a server error to {body[:300]!r}: {line}"
    elif r.status_code == 200:
        json.loads(data)
    return r.status_code


def greedy_text(client: httpx.Client) -> str:
    r = client.post("/v1/completions", json=GREEDY)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def fuzz_bodies(client: httpx.Client, route: str, examples: int, seed: int | None = None) -> dict[int, int]:
    """Run ``examples`` hypothesis bodies against ``route``; returns how many answers had each status."""
    statuses: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(route))
    def run(body: bytes) -> None:
        status = check_answer(client, route, body)
        statuses[status] = statuses.get(status, 0) + 1

    run()
    return statuses


def schemathesis_run(url: str, examples: int, timeout_s: float) -> int:
    """schemathesis against /openapi.json (health routes left to their own tests); returns the failures."""
    import schemathesis
    from hypothesis import settings as hsettings
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(url + "/openapi.json").exclude(path_regex="^/health")
    failures = 0
    for result in schema.get_all_operations():
        op = result.ok()

        @hsettings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:
            response = case.call(base_url=url, timeout=timeout_s)
            case.validate_response(response, checks=[not_a_server_error])

        try:
            run()
            print(f"schemathesis {op.method.upper()} {op.path}: ok")
        except Exception as e:  # report every operation's failure, then fail the run
            failures += 1
            print(f"schemathesis {op.method.upper()} {op.path}: FAILED\n{e}")
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--examples", type=int, default=1000, help="bodies per route")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds an answer may take")
    p.add_argument("--schemathesis", action="store_true", help="also run schemathesis (same example count)")
    args = p.parse_args()
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        before = greedy_text(client)
        for route in ROUTES:
            t0 = time.monotonic()
            statuses = fuzz_bodies(client, route, args.examples)
            print(f"{route}: {sum(statuses.values())} bodies in {time.monotonic() - t0:.0f}s, statuses {statuses}")
        failures = schemathesis_run(args.url, args.examples, args.timeout) if args.schemathesis else 0
        after = greedy_text(client)
    print(f"greedy text before and after: {'same' if before == after else 'DIFFERENT'}")
    return 1 if failures or before != after else 0


if __name__ == "__main__":
    sys.exit(main())
