"""The server's Prometheus metrics (prometheus-client), in a registry of its own.

layerline's own (`layerline_*`) and, beside them, the names and meanings vLLM's dashboards read
(`vllm:*`, every one labelled `model_name`), so a Grafana board made for vLLM works unchanged:

  vllm:e2e_request_latency_seconds    histogram: arrival to the request's last token
  vllm:request_queue_time_seconds     histogram: arrival to admission (a KV slot)
  vllm:time_to_first_token_seconds    histogram: arrival to the first token
  vllm:inter_token_latency_seconds    histogram: between two tokens of a sequence
  vllm:time_per_output_token_seconds  the same (the name older vLLM dashboards read)
  vllm:num_requests_running / _waiting  gauges
  vllm:kv_cache_usage_perc            gauge: KV tokens the running sequences reserve, as a fraction (0..1)
                                      of what every stage holds
  vllm:request_success_total          counter by finished_reason: stop, length, abort (client gone), error
  vllm:prompt_tokens_total / vllm:generation_tokens_total  counters
  vllm:request_prompt_tokens / vllm:request_generation_tokens  histograms: tokens per finished request
  vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total  counters: prompt tokens looked up in
                                      the prefix cache, and those reused (their ratio: the token hit rate)

The prefix cache's own (layerline.prefix): layerline_prefix_lookups_total, _hits_total, _hit_ratio
(hits / lookups since the server started), _reused_tokens_total, _lost_total (hits whose entry a stage
no longer held: recomputed from 0), _entries and _tokens (the engine's index), and _bytes by host
(the KV bytes each stage's entries hold, from its health answers).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_REQUEST = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, model_name: str = "layerline"):
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "arrival to the request's last token", m,
                               buckets=_REQUEST, registry=r).labels(model_name)
        self.v_queue = Histogram("vllm:request_queue_time_seconds", "arrival to admission (a KV slot)", m,
                                 buckets=_REQUEST, registry=r).labels(model_name)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "arrival to the first token", m,
                                buckets=_LATENCY, registry=r).labels(model_name)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "time between two tokens of a sequence", m,
                               buckets=_LATENCY, registry=r).labels(model_name)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds", "time between two tokens of a sequence "
                                "(older vLLM dashboards' name)", m, buckets=_LATENCY, registry=r).labels(model_name)
        self.v_running = Gauge("vllm:num_requests_running", "requests being generated", m,
                               registry=r).labels(model_name)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "requests waiting for a KV slot", m,
                               registry=r).labels(model_name)
        self.v_kv = Gauge("vllm:kv_cache_usage_perc", "KV tokens reserved by running sequences, as a fraction of "
                          "the stages' KV budget (1 = full)", m, registry=r).labels(model_name)
        self.v_success = Counter("vllm:request_success", "finished requests by finished_reason",
                                 ["model_name", "finished_reason"], registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "prompt tokens of admitted requests", m,
                                registry=r).labels(model_name)
        self.v_generation = Counter("vllm:generation_tokens", "tokens generated", m, registry=r).labels(model_name)
        self.v_req_prompt = Histogram("vllm:request_prompt_tokens", "prompt tokens of each finished request", m,
                                      buckets=_TOKENS, registry=r).labels(model_name)
        self.v_req_generation = Histogram("vllm:request_generation_tokens", "tokens generated for each finished "
                                          "request", m, buckets=_TOKENS, registry=r).labels(model_name)
        self.v_prefix_queries = Counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                        m, registry=r).labels(model_name)
        self.v_prefix_hits = Counter("vllm:prefix_cache_hits", "prompt tokens the prefix cache answered (reused KV)",
                                     m, registry=r).labels(model_name)
        self.prefix_lookups = Counter("layerline_prefix_lookups", "prompts looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("layerline_prefix_hits", "prompts that started from a prefix entry's KV",
                                   registry=r)
        self.prefix_hit_ratio = Gauge("layerline_prefix_hit_ratio", "prefix cache hits / lookups since the "
                                      "server started", registry=r)
        self.prefix_reused = Counter("layerline_prefix_reused_tokens", "prompt tokens not computed: their KV came "
                                     "from a prefix entry", registry=r)
        self.prefix_lost = Counter("layerline_prefix_lost", "hits whose entry a stage no longer held (evicted, "
                                   "restarted, a new route): the sequence was computed from 0", registry=r)
        self.prefix_entries = Gauge("layerline_prefix_entries", "prefix entries the stages keep (the engine's "
                                    "index)", registry=r)
        self.prefix_tokens = Gauge("layerline_prefix_tokens", "tokens of the prefix entries the stages keep (the "
                                   "engine's index; each stage holds them for its layers)", registry=r)
        self.prefix_bytes = Gauge("layerline_prefix_bytes", "KV bytes the stage's prefix entries hold (its "
                                  "health answers)", ["host"], registry=r)
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
        self.step_hop = Histogram("layerline_step_hop_seconds", "each step's round trip beyond its stages' "
                                  "compute: the links, framing and copies, and waits at stages busy with "
                                  "another micro-batch", buckets=_LATENCY, registry=r)
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
