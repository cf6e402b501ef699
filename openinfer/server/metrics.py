"""Prometheus metrics under vLLM's names with the ``openinfer:`` prefix (see docs/design/metrics.md in vLLM).

``--metrics-prefix vllm`` renders the same series as ``vllm:...`` (``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:prompt_tokens_total``, ``vllm:time_to_first_token_seconds`` ...), plus the
older ``vllm:gpu_cache_usage_perc`` that some routers and dashboards still read, so tools written for vLLM
scrape openinfer unchanged. The names are the same either way; only the prefix changes.

Counters and histograms are fed by the engine-core thread as outputs appear (prometheus_client is
thread-safe); gauges and the engine's own cumulative counters (prefix cache, preemptions) are read from the
latest ``StatsSnapshot`` at scrape time, so the KV pool state in /metrics is never older than one core-loop
iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from openinfer.engine.spec_stats import SpecDecodeStats
from openinfer.server.messages import StatsSnapshot

PREFIX = "openinfer:"
METRICS_PREFIXES = ("openinfer", "vllm")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = tuple(float(b * 10**e) for e in range(0, 6) for b in (1, 2, 5))


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, source: Callable[[], StatsSnapshot], prefix: str = PREFIX) -> None:
        self.model_name = model_name
        self.source = source
        self.prefix = prefix

    def _offload_metrics(self, t) -> Iterator[Metric]:
        return _offload_families(self.prefix, self.model_name, t)

    def collect(self) -> Iterator[Metric]:
        s = self.source()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests in the model's running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge(
            "kv_cache_usage_perc", "KV-cache usage: 1 = all blocks in use (vLLM's name).", s.kv_cache_usage
        )
        if self.prefix == "vllm:":  # vLLM's name before 0.10 (same value); still read by some routers
            yield gauge("gpu_cache_usage_perc", "KV-cache usage (deprecated name of kv_cache_usage_perc).",
                        s.kv_cache_usage)
        yield gauge(
            "kv_cache_free_blocks",
            "KV blocks free (cached-but-unreferenced blocks count as free).",
            s.num_free_blocks,
        )
        yield gauge("kv_cache_total_blocks", "KV blocks in the pool.", s.num_blocks)
        yield gauge("engine_consecutive_failed_steps", "Engine steps in a row whose forward failed (0 after one "
                    "succeeds); /health/ready fails past --ready-max-step-failures.", s.consecutive_failed_steps)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield counter(
            "num_preemptions", "Requests preempted (recomputed) for lack of KV blocks.", s.num_preemptions
        )
        yield counter("engine_steps", "Engine steps executed.", s.num_steps)
        yield counter("eplb_rebalances", "Expert load-balancing rebalances (re-placements of the experts).",
                      s.eplb_rebalances)
        yield gauge("eplb_rank_imbalance", "Busiest expert-parallel rank's routed tokens over the mean, in the last "
                    "load-balancing window (1 = balanced).", s.eplb_imbalance_served)
        yield gauge("eplb_rank_imbalance_rebalanced", "The same window's loads under the placement the last "
                    "rebalance moved to.", s.eplb_imbalance_rebalanced)
        # Speculative decoding, under vLLM's names (all zero without it).
        yield counter("spec_decode_num_drafts", "Verifications of speculative drafts (requests x steps).",
                      s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative tokens proposed.", s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.", s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative tokens accepted at each draft position.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos
        by_source = CounterMetricFamily(self.prefix + "prompt_tokens_by_source",
                                        "Prompt tokens by where their KV came from (vLLM's sources): computed here, "
                                        "local prefix-cache hits, read from a remote prefill instance.",
                                        labels=["model_name", "source"])
        for source, n in (("local_compute", s.prompt_tokens_computed), ("local_cache_hit", s.prompt_tokens_cached),
                          ("external_kv_transfer", s.prompt_tokens_received)):
            by_source.add_metric([self.model_name, source], n)
        yield by_source
        yield counter("engine_generation_tokens", "Tokens sampled by this engine's model (a prefill instance of a "
                      "disaggregated pair samples one per request; its decoder the rest).", s.engine_generation_tokens)
        yield counter("kv_transfer_loads", "Prompts whose KV was read from a remote instance.", s.kv_loads)
        yield counter("kv_transfer_failures", "KV reads that failed or timed out.", s.kv_load_failures)
        yield counter("kv_transfer_fallbacks", "Requests with kv_transfer_params that computed their prompt here "
                      "after all (a failed read, or params that did not fit).", s.kv_fallbacks)
        yield counter("kv_transfer_bytes", "KV bytes read from remote instances.", s.kv_bytes_received)
        yield counter("kv_transfer_seconds", "Seconds spent in KV reads (sum over reads).", s.kv_seconds_receiving)
        yield counter("kv_transfer_sends", "Held prompts a remote reader finished with.", s.kv_sends)
        yield counter("kv_transfer_sends_expired", "Held prompts freed by the abort timeout (no reader came).",
                      s.kv_sends_expired)
        yield gauge("kv_transfer_held_requests", "Finished requests whose KV blocks wait for a remote reader.",
                    s.kv_held_requests)
        if s.kv_offload is not None:
            yield from self._offload_metrics(s.kv_offload)
        yield gauge("spec_decode_mean_accepted_length", "Tokens per verification: accepted drafts + 1 (1 without "
                    "speculation).", SpecDecodeStats(s.spec_num_drafts, s.spec_num_draft_tokens,
                                                 s.spec_num_accepted_tokens).mean_accepted_length)


def _offload_families(prefix: str, model_name: str, t) -> Iterator[Metric]:
    """The offloading tier's figures, labelled with vLLM's medium name for it ("DISK")."""
    labels = [model_name, "DISK"]
    for name, doc, value, kind in (
        ("kv_offload_queries", "Prompt tokens (full blocks past the pool's hit) looked up in the tier.", t.queries,
         CounterMetricFamily),
        ("kv_offload_hits", "Prompt tokens found in the tier (loaded instead of computed).", t.hits,
         CounterMetricFamily),
        ("kv_offload_misses", "Prompt tokens looked up in the tier and not found.", t.queries - t.hits,
         CounterMetricFamily),
        ("kv_offload_loads", "Requests whose prefix was read from the tier.", t.loads, CounterMetricFamily),
        ("kv_offload_load_failures", "Tier reads that found a stale, corrupt or missing file (recomputed).",
         t.load_failures, CounterMetricFamily),
        ("kv_offload_load_seconds", "Seconds spent reading from the tier (sum over reads; with "
         "kv_offload_loads, the mean load latency).", t.load_seconds, CounterMetricFamily),
        ("kv_offload_bytes_in", "KV bytes read from the tier into the pool.", t.bytes_loaded, CounterMetricFamily),
        ("kv_offload_bytes_out", "KV bytes written from the pool to the tier.", t.bytes_stored,
         CounterMetricFamily),
        ("kv_offload_blocks_stored", "Blocks written to the tier.", t.blocks_stored, CounterMetricFamily),
        ("kv_offload_blocks_evicted", "Blocks evicted from the tier (LRU, to stay within its size).",
         t.blocks_evicted, CounterMetricFamily),
        ("kv_offload_blocks_invalid", "Tier entries dropped as stale or corrupt.", t.blocks_invalid,
         CounterMetricFamily),
        ("kv_offload_blocks", "Blocks in the tier.", t.num_blocks, GaugeMetricFamily),
        ("kv_offload_bytes_used", "Bytes of the tier's files.", t.bytes_used, GaugeMetricFamily),
        ("kv_offload_enabled", "1 while the tier works, 0 once a failed write turned it off.", int(t.enabled),
         GaugeMetricFamily),
    ):
        m = kind(prefix + name, doc, labels=["model_name", "medium"])
        m.add_metric(labels, value)
        yield m


class ServerMetrics:
    def __init__(self, model_name: str, stats_source: Callable[[], StatsSnapshot], prefix: str = "openinfer") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        p = prefix + ":"
        disable_created_metrics()  # process-wide; the *_created series only add noise to each scrape
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        reg = self.registry
        m = ["model_name"]
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prefill tokens processed.", m, registry=reg)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", m, registry=reg)
        self.request_success = Counter(
            p + "request_success",
            "Finished requests by finish reason.",
            m + ["finished_reason"],
            registry=reg,
        )
        self.requests_rejected = Counter(
            p + "request_rejected", "Requests refused before admission.", m + ["reason"], registry=reg
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token (from arrival).",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between output steps of a request.",
            m,
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to finish.",
            m,
            buckets=_E2E_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Arrival to first scheduled.",
            m,
            buckets=_E2E_BUCKETS,
            registry=reg,
        )
        self.req_prompt_tokens = Histogram(
            p + "request_prompt_tokens",
            "Prompt tokens per request.",
            m,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        self.req_generation_tokens = Histogram(
            p + "request_generation_tokens",
            "Generated tokens per request.",
            m,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        reg.register(_EngineStatsCollector(model_name, stats_source, p))
        # process_resident_memory_bytes, process_open_fds, ... (Linux): what a soak or a dashboard watches for leaks.
        ProcessCollector(registry=reg)
        # Every label value exists from the start (at 0), so rates and dashboards work before the first event.
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        for reason in ("queue_full", "unavailable"):
            self.requests_rejected.labels(model_name, reason)
        # Bound children: labels() takes a lock and a dict lookup; the hot path calls these per step.
        self._prompt = self.prompt_tokens.labels(model_name)
        self._gen = self.generation_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._queue = self.queue_time.labels(model_name)
        self._req_prompt = self.req_prompt_tokens.labels(model_name)
        self._req_gen = self.req_generation_tokens.labels(model_name)

    # Called from the engine-core thread.
    def on_first_token(self, num_prompt_tokens: int, ttft_s: float | None, queue_s: float | None) -> None:
        self._prompt.inc(num_prompt_tokens)
        if ttft_s is not None:
            self._ttft.observe(max(ttft_s, 0.0))
        if queue_s is not None:
            self._queue.observe(max(queue_s, 0.0))

    def on_tokens(self, num_new_tokens: int, itl_s: float | None) -> None:
        self._gen.inc(num_new_tokens)
        if itl_s is not None:
            self._itl.observe(itl_s)

    def on_finished(
        self, finish_reason: str, e2e_s: float, num_prompt_tokens: int, num_generation_tokens: int
    ) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()
        self._e2e.observe(max(e2e_s, 0.0))
        self._req_prompt.observe(num_prompt_tokens)
        self._req_gen.observe(num_generation_tokens)

    # Called from the event loop.
    def on_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
