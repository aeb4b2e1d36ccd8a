"""``GET /metrics``: the Prometheus text format through ``prometheus_client``, with the names
vLLM users already chart (``vllm:num_requests_running`` → ``vmcache:num_requests_running``)
and the cache's own figures. One registry per server (no process-global state).

Gauges and the engine's counters are read at scrape time on the engine thread
(:meth:`EngineLoop.query`: no lock, no copy per step); latency histograms and per-request
token counters are observed as requests finish.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vmcache.server.loop import EngineLoop
from vmcache.server.observe import Finished, Observer

PREFIX = "vmcache:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5, 10)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480,
                   960, 1920, 7680)  # vLLM's request-latency buckets  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
N_BUCKETS = (1, 2, 5, 10, 20)


def snapshot(engine) -> dict:
    """What a scrape reports of ``engine`` (run on its thread)."""
    kv, sched, st = engine.kv, engine.scheduler, engine.stats
    cache = kv.stats()
    return {
        "running": len(sched.running), "waiting": len(sched.waiting),
        "swapped": len(sched.swapped), "pages_used": cache.physical_pages,
        "pages_total": cache.total_pages, "mapped_bytes": cache.mapped_bytes,
        "prefix_queries": st.prefix_query_tokens, "prefix_hits": st.prefix_hit_tokens,
        "preemptions": st.preempt_swap + st.preempt_recompute, "swap_bytes": st.swap_bytes,
        "cow_bytes": cache.cow_bytes_copied, "cow_copies": cache.cow_copies,
        "prefill_tokens": st.prefill_tokens, "steps": st.steps,
        # pages only the prefix index holds: evicted on demand, so free as far as usage goes
        "reclaimable": kv.prefix.index.reclaimable() if kv.prefix.index is not None else 0,
    }  # fmt: skip


def cache_config(engine) -> dict[str, str]:
    """``cache_config_info``'s labels: what the served cache was built with."""
    kv = engine.kv
    cfg = kv.config
    return {"cache": type(kv).__name__, "page_bytes": str(cfg.page_bytes),
            "num_pages": str(kv.capacity.num_pages), "max_seqs": str(cfg.max_seqs),
            "max_seq_len": str(cfg.max_seq_len), "kv_dtype": str(kv.spec.storage_dtype),
            "prefix_caching": str(kv.prefix.enabled).lower(),
            "max_batch_tokens": str(engine.scheduler.max_batch_tokens)}  # fmt: skip


class _EngineCollector:
    def __init__(self, metrics: Metrics, loop: EngineLoop) -> None:
        self.metrics, self.loop = metrics, loop

    def collect(self):
        # what the loop last kept (at most state_every_s plus one step old), so a scrape
        # never waits on a long step; before the first, asked of the (idle) loop directly
        s = self.metrics.latest or snapshot_of(self.loop)
        p = PREFIX
        yield _gauge(f"{p}num_requests_running", "Sequences running in the engine", s["running"])
        yield _gauge(f"{p}num_requests_waiting", "Sequences waiting to be admitted", s["waiting"])
        yield _gauge(f"{p}num_requests_swapped", "Sequences swapped to the host", s["swapped"])
        busy = s["pages_used"] - s["reclaimable"]
        usage = busy / s["pages_total"] if s["pages_total"] else 0.0
        yield _gauge(f"{p}kv_cache_usage_perc", "Fraction of KV pages in use, idle prefix-"
                     "cache pages (evictable) not counted (1 = full)", usage)  # fmt: skip
        yield _gauge(f"{p}kv_pages_prefix_idle", "Pages only the prefix index holds "
                     "(evictable)", s["reclaimable"])  # fmt: skip
        yield _gauge(f"{p}kv_pages_used", "Physical KV pages in use", s["pages_used"])
        yield _gauge(f"{p}kv_pages_total", "Physical KV pages the pool holds", s["pages_total"])
        yield _gauge(f"{p}kv_mapped_bytes", "Bytes the live sequences' page tables map",
                     s["mapped_bytes"])  # fmt: skip
        for name, doc, key in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix", "prefix_queries"),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache", "prefix_hits"),
            ("num_preemptions", "Sequences preempted (swap or recompute)", "preemptions"),
            ("swap_bytes", "Bytes copied to the host tier by swap-outs", "swap_bytes"),
            ("cow_bytes_copied", "Bytes copied on write (forked pages written)", "cow_bytes"),
            ("prefill_computed_tokens", "Prompt tokens computed (cache hits excluded)",
             "prefill_tokens"),
            ("engine_steps", "Engine steps run", "steps"),
        ):  # fmt: skip
            c = CounterMetricFamily(p + name, doc)
            c.add_metric([], s[key])
            yield c


def snapshot_of(loop: EngineLoop) -> dict:
    return loop.query(snapshot)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


class Metrics(Observer):
    """The server's registry: the engine's figures at scrape time, and the observer the
    engine loop reports finished requests to."""

    def __init__(self) -> None:
        self.latest: dict | None = None  # the engine's last snapshot (written by the loop)
        self.registry = CollectorRegistry(auto_describe=False)
        p, r = PREFIX, self.registry
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram(f"{p}time_per_output_token_seconds", "Time per output token "
                              "after the first", buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.prompt = Counter(f"{p}prompt_tokens", "Prompt tokens of finished requests",
                              registry=r)  # fmt: skip
        self.generation = Counter(f"{p}generation_tokens", "Tokens generated for finished "
                                  "requests", registry=r)  # fmt: skip
        self.success = Counter(f"{p}request_success", "Requests ended, by finish reason",
                               ["finished_reason"], registry=r)  # fmt: skip
        hist = lambda name, doc, buckets: Histogram(p + name, doc, buckets=buckets,  # noqa: E731
                                                    registry=r)  # fmt: skip
        self.itl = hist("inter_token_latency_seconds", "Time between a request's tokens",
                        TPOT_BUCKETS)  # fmt: skip
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to end", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to the first step it ran in",
                          LATENCY_BUCKETS)  # fmt: skip
        self.prefill = hist("request_prefill_time_seconds", "First step to first token",
                            LATENCY_BUCKETS)  # fmt: skip
        self.decode = hist("request_decode_time_seconds", "First token to end", LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "First step to end",
                              LATENCY_BUCKETS)  # fmt: skip
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request",
                                TOKEN_BUCKETS)  # fmt: skip
        self.generation_hist = hist("request_generation_tokens", "Tokens generated per "
                                    "request (every sequence)", TOKEN_BUCKETS)  # fmt: skip
        self.max_generation = hist("request_max_num_generation_tokens", "Tokens its longest "
                                   "sequence could generate", TOKEN_BUCKETS)  # fmt: skip
        self.params_n = hist("request_params_n", "Sequences asked for (n)", N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "max_tokens asked for",
                                      TOKEN_BUCKETS)  # fmt: skip
        self.iteration = hist("iteration_tokens_total", "Tokens one engine step computed "
                              "(prompt) and generated", TOKEN_BUCKETS)  # fmt: skip
        self.config = Info(f"{p}cache_config", "The served cache's configuration", registry=r)

    def attach(self, loop: EngineLoop) -> None:
        self.registry.register(_EngineCollector(self, loop))
        self.config.info(cache_config(loop.engine))  # before the loop runs: read directly

    def engine_state(self, engine) -> None:
        self.latest = snapshot(engine)  # one reference swapped: scrapes read it whole

    def request_finished(self, record: Finished) -> None:
        self.ttft.observe(record.ttft_s)
        if record.tpot_s is not None:
            self.tpot.observe(record.tpot_s)
        for gap in record.inter_token_s:
            self.itl.observe(gap)
        self.e2e.observe(record.e2e_s)
        self.queue.observe(record.queue_s)
        if record.phases_s is not None:
            prefill, decode, inference = record.phases_s
            self.prefill.observe(prefill)
            self.decode.observe(decode)
            self.inference.observe(inference)
        self.prompt.inc(record.prompt_tokens)
        self.generation.inc(record.completion_tokens)
        self.prompt_hist.observe(record.prompt_tokens)
        self.generation_hist.observe(record.completion_tokens)
        self.max_generation.observe(record.max_tokens)
        self.params_n.observe(record.n)
        self.params_max_tokens.observe(record.max_tokens)
        self.success.labels(finished_reason=record.reason).inc()

    def step_finished(self, tokens: int) -> None:
        self.iteration.observe(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
