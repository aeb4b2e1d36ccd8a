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
        "resident_bytes": kv.elastic.resident_bytes, "asleep": int(kv.elastic.asleep),
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
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        # per model, what its loop last kept (at most state_every_s plus one step old), so a
        # scrape never waits on a long step; before the first, asked of the (idle) loop
        models = [(m.name, m.latest or snapshot_of(m.loop)) for m in self.metrics.models]
        p = PREFIX

        def family(kind, name, doc, value):
            f = kind(p + name, doc, labels=["model_name"])
            for model, s in models:
                f.add_metric([model], value(s))
            return f

        gauge = lambda name, doc, value: family(GaugeMetricFamily, name, doc, value)  # noqa: E731
        yield gauge("num_requests_running", "Sequences running in the engine",
                    lambda s: s["running"])  # fmt: skip
        yield gauge("num_requests_waiting", "Sequences waiting to be admitted",
                    lambda s: s["waiting"])  # fmt: skip
        yield gauge("num_requests_swapped", "Sequences swapped to the host", lambda s: s["swapped"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV pages in use, idle prefix-cache pages "
                    "(evictable) not counted (1 = full)", _usage)  # fmt: skip
        yield gauge("kv_pages_prefix_idle", "Pages only the prefix index holds (evictable)",
                    lambda s: s["reclaimable"])  # fmt: skip
        yield gauge("kv_pages_used", "Physical KV pages in use", lambda s: s["pages_used"])
        yield gauge(
            "kv_pages_total", "Physical KV pages the pool holds", lambda s: s["pages_total"]
        )
        yield gauge("kv_mapped_bytes", "Bytes the live sequences' page tables map",
                    lambda s: s["mapped_bytes"])  # fmt: skip
        yield gauge("kv_resident_bytes", "Physical KV memory the cache holds now",
                    lambda s: s["resident_bytes"])  # fmt: skip
        yield gauge("is_sleeping", "1 while the model sleeps (its KV memory given back)",
                    lambda s: s["asleep"])  # fmt: skip
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
            yield family(CounterMetricFamily, name, doc, lambda s, key=key: s[key])


def _usage(s: dict) -> float:
    busy = s["pages_used"] - s["reclaimable"]
    return busy / s["pages_total"] if s["pages_total"] else 0.0


def snapshot_of(loop: EngineLoop) -> dict:
    return loop.query(snapshot)


class ModelMetrics(Observer):
    """One model's observer: what its engine loop reports, labelled with its name."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.metrics, self.name = metrics, name
        self.latest: dict | None = None  # the engine's last snapshot (written by the loop)
        self.loop: EngineLoop | None = None

    def attach(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.metrics.config.labels(model_name=self.name).info(cache_config(loop.engine))

    def engine_state(self, engine) -> None:
        self.latest = snapshot(engine)  # one reference swapped: scrapes read it whole

    def request_finished(self, record: Finished) -> None:
        m, label = self.metrics, {"model_name": self.name}
        m.ttft.labels(**label).observe(record.ttft_s)
        if record.tpot_s is not None:
            m.tpot.labels(**label).observe(record.tpot_s)
        itl = m.itl.labels(**label)
        for gap in record.inter_token_s:
            itl.observe(gap)
        m.e2e.labels(**label).observe(record.e2e_s)
        m.queue.labels(**label).observe(record.queue_s)
        if record.phases_s is not None:
            for hist, value in zip((m.prefill, m.decode, m.inference), record.phases_s):
                hist.labels(**label).observe(value)
        m.prompt.labels(**label).inc(record.prompt_tokens)
        m.generation.labels(**label).inc(record.completion_tokens)
        m.prompt_hist.labels(**label).observe(record.prompt_tokens)
        m.generation_hist.labels(**label).observe(record.completion_tokens)
        m.max_generation.labels(**label).observe(record.max_tokens)
        m.params_n.labels(**label).observe(record.n)
        m.params_max_tokens.labels(**label).observe(record.max_tokens)
        m.success.labels(finished_reason=record.reason, **label).inc()

    def step_finished(self, tokens: int) -> None:
        self.metrics.iteration.labels(model_name=self.name).observe(tokens)


class Metrics:
    """The server's registry: every model's engine figures at scrape time and the observers
    (:meth:`model`) their engine loops report finished requests to; every series carries a
    ``model_name`` label, as vLLM's do."""

    def __init__(self) -> None:
        self.models: list[ModelMetrics] = []
        self.registry = CollectorRegistry(auto_describe=False)
        p, r, L = PREFIX, self.registry, ["model_name"]
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token", L,
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram(f"{p}time_per_output_token_seconds", "Time per output token "
                              "after the first", L, buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.prompt = Counter(f"{p}prompt_tokens", "Prompt tokens of finished requests", L,
                              registry=r)  # fmt: skip
        self.generation = Counter(f"{p}generation_tokens", "Tokens generated for finished "
                                  "requests", L, registry=r)  # fmt: skip
        self.success = Counter(f"{p}request_success", "Requests ended, by finish reason",
                               ["finished_reason", *L], registry=r)  # fmt: skip
        hist = lambda name, doc, buckets: Histogram(p + name, doc, L, buckets=buckets,  # noqa: E731
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
        self.config = Info(f"{p}cache_config", "The served cache's configuration", L,
                           registry=r)  # fmt: skip
        self.registry.register(_EngineCollector(self))

    def model(self, name: str) -> ModelMetrics:
        """The observer for model ``name``'s engine loop (then ``attach`` it to the loop)."""
        if any(m.name == name for m in self.models):
            raise ValueError(f"model {name!r} has metrics already")
        m = ModelMetrics(self, name)
        self.models.append(m)
        return m

    def render(self) -> bytes:
        return generate_latest(self.registry)
