"""The server's Prometheus metrics (prometheus-client), in a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("layerline_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("layerline_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("layerline_generated_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("layerline_queue_depth", "requests waiting for a KV slot", registry=r)
        self.running = Gauge("layerline_running_sequences", "sequences being generated", registry=r)
        self.microbatches = Gauge("layerline_microbatches", "micro-batches the engine keeps in flight (one per "
                                  "core group of the route, or --microbatches)", registry=r)
        self.kv_tokens = Gauge("layerline_kv_tokens_reserved", "KV tokens the running sequences reserve", registry=r)
        self.ttft = Histogram("layerline_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("layerline_inter_token_seconds", "time between a sequence's tokens",
                             buckets=_LATENCY, registry=r)
        self.stage_step = Histogram("layerline_stage_step_seconds", "each stage's compute time per step",
                                    ["stage"], buckets=_LATENCY, registry=r)
        self.replays = Counter("layerline_replays", "sequences replayed after a stage lost their cache",
                               registry=r)
        self.stage_up = Gauge("layerline_stage_up", "1 while the stage answers health within the deadline",
                              ["host", "role"], registry=r)
        self.failovers = Counter("layerline_failovers", "active stages lost (down or restarted), by what the "
                                 "server did: promoted (a standby), waited (until it answered again), restarted (it came back "
                                 "between two checks), failed (the requests it held)",
                                 ["host", "action"], registry=r)
        self.route_epoch = Gauge("layerline_route_epoch", "route switches and standby promotions so far",
                                 registry=r)
        self.route_switches = Counter("layerline_route_switches", "planned route changes (drain, rejoin) by "
                                      "result", ["result"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
