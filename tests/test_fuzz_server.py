"""Hostile-client fuzzing in CI, against a real ``openinfer serve`` (bounded: a few dozen examples per route; the
longer run is ``scripts/fuzz_server.py``, or OPENINFER_FUZZ_EXAMPLES here): hypothesis bodies for the completion,
chat, tokenize and detokenize routes and schemathesis against /openapi.json never get a 5xx or hang, and the
server still answers a known greedy request with the same text afterwards."""

from __future__ import annotations

import os

import httpx
import pytest
from helpers import load_script
from server_utils import ServerProcess, shared_checkpoint

pytestmark = pytest.mark.slow  # schemathesis fuzzing a server process

EXAMPLES = int(os.environ.get("OPENINFER_FUZZ_EXAMPLES", "40"))
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "256", "--served-model-name", "tiny",
        "--max-num-seqs", "4", "--max-queue", "8"]
fuzz = load_script("fuzz_server")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(shared_checkpoint(tmp_path_factory), *ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_before(client):
    return fuzz.greedy_text(client)


@pytest.mark.parametrize("route", fuzz.ROUTES)
def test_fuzzed_bodies_never_get_a_5xx(client, greedy_before, route):
    statuses = fuzz.fuzz_bodies(client, route, EXAMPLES, seed=0)
    assert sum(statuses.values()) >= EXAMPLES // 2
    # the fuzzer reaches both the validation and the engine
    assert any(400 <= s < 500 for s in statuses) and statuses.get(200), statuses


def test_schemathesis_finds_no_server_error(server, greedy_before):
    assert fuzz.schemathesis_run(server.url, max(EXAMPLES // 4, 5), 30.0) == 0


def test_the_server_answers_the_same_greedy_text_afterwards(client, greedy_before, server):
    assert fuzz.greedy_text(client) == greedy_before
    assert server.alive
