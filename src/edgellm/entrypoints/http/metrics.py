"""Prometheus metrics of one server (its own registry, so tests can run several)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("edgellm_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.busy = Counter("edgellm_busy_rejections", "Requests refused because the queue was full", registry=r)
        self.timeouts = Counter("edgellm_timeouts", "Requests stopped at their deadline", registry=r)
        self.errors = Counter("edgellm_errors", "Requests answered with an error, by HTTP status", ["status"],
                              registry=r)
        self.ttft = Histogram("edgellm_ttft_seconds", "Time to first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
        self.decode = Histogram("edgellm_decode_tokens_per_second", "Decode speed per request", registry=r,
                                buckets=(5, 10, 25, 50, 75, 100, 150, 200, 300))
        self.prefill = Histogram("edgellm_prefill_tokens_per_second", "Prefill speed per request", registry=r,
                                 buckets=(50, 100, 250, 500, 1000, 2000, 4000))
        self.queue_wait = Histogram("edgellm_queue_wait_seconds", "Time spent waiting for the engine", registry=r)
        self.tokens = Counter("edgellm_tokens", "Tokens processed", ["kind"], registry=r)
        self.degrades = Counter("edgellm_degrades", "Requests run degraded, by reason", ["reason"], registry=r)
        self.temperature = Gauge("edgellm_temperature_celsius", "Device temperature as last read", registry=r)
        self.thermal_events = Gauge("edgellm_thermal_events", "Thermal throttle/restore transitions", ["kind"],
                                    registry=r)
        self.speculative = Counter("edgellm_speculative_tokens", "Speculative guesses checked, and kept",
                                   ["outcome"], registry=r)
        self.passes = Counter("edgellm_decode_passes", "Decode passes of speculative requests (a check of guesses is one)",
                              registry=r)
        self.warmups = Counter("edgellm_warmups", "Background warmup inferences", ["outcome"], registry=r)
        self.queue_depth = Gauge("edgellm_queue_depth", "Requests waiting", registry=r)
        self.kv_bytes = Gauge("edgellm_kv_bytes", "KV cache bytes held in the pool", registry=r)
        self.prefix_bytes = Gauge("edgellm_prefix_cache_bytes", "Of those, blocks kept for prefix reuse", registry=r)
        self.peak_rss = Gauge("edgellm_peak_rss_bytes", "Process resident memory high-water mark", registry=r)
        self.models_loaded = Gauge("edgellm_models_loaded", "Models loaded now", registry=r)
        self.model_events = Gauge("edgellm_model_events", "Model loads, evictions to make room and keep-alive unloads",
                                  ["event"], registry=r)
        self.fallbacks = Counter("edgellm_cloud_fallbacks", "Requests sent to the --fallback-url upstream, by reason "
                                 "and outcome", ["reason", "outcome"], registry=r)
        self.swaps = Counter("edgellm_swaps", "Hot swaps (and rollbacks) by outcome", ["outcome"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
