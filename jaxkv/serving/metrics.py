"""The server's Prometheus metrics (prometheus_client; `serve` extra), every name prefixed `jaxkv_`: gauges and
transport counters read from the serving loop at each scrape; the requests by how they ended, the tokens handed to
clients and vLLM's latency histograms (time to first token, inter-token latency, queue time, end to end) counted by
the HTTP layer (jaxkv.serving.api), once per request."""

from __future__ import annotations

import collections

import prometheus_client
from prometheus_client import core

from jaxkv.serving import loop as loop_lib

# Seconds: first tokens from ~10 ms (tiny model) to a long prompt's prefill on a large one.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# How a request ended: the loop's ends (jaxkv.serving.loop.ENDS) and "stop", a stop string.
REASONS = ("eos", "stop", "length", "cancelled", "error")


class Metrics:
  """A registry of its own (several servers can live in one test process)."""

  def __init__(self, loop: loop_lib.ServingLoop):
    self.registry = prometheus_client.CollectorRegistry()
    self.registry.register(_LoopCollector(loop))
    self.rejected = prometheus_client.Counter(
        "jaxkv_requests_rejected",
        "HTTP requests refused before serving, by status code.",
        ["code"],
        registry=self.registry,
    )
    self.finished = prometheus_client.Counter(
        "jaxkv_requests", "Requests served, by how they ended.", ["reason"], registry=self.registry
    )
    for reason in REASONS:
      self.finished.labels(reason)  # Every reason is exported, from 0.
    self.generated = prometheus_client.Counter(
        "jaxkv_generated_tokens",
        "Tokens generated and handed to clients (usage.completion_tokens).",
        registry=self.registry,
    )
    self.ttft = prometheus_client.Histogram(
        "jaxkv_time_to_first_token_seconds",
        "From a request's arrival to its first token read back.",
        buckets=_TTFT_BUCKETS,
        registry=self.registry,
    )
    self.itl = prometheus_client.Histogram(
        "jaxkv_inter_token_latency_seconds",
        "Between two tokens of a request.",
        buckets=_ITL_BUCKETS,
        registry=self.registry,
    )
    self.queue = prometheus_client.Histogram(
        "jaxkv_request_queue_time_seconds",
        "From a request's arrival to its entering a slot (or its end, if it never did).",
        buckets=_TTFT_BUCKETS,
        registry=self.registry,
    )
    self.e2e = prometheus_client.Histogram(
        "jaxkv_e2e_request_latency_seconds",
        "From a request's arrival to its end.",
        buckets=_TTFT_BUCKETS + (120.0, 300.0),
        registry=self.registry,
    )

  def text(self) -> bytes:
    return prometheus_client.generate_latest(self.registry)


class _LoopCollector:
  """The serving loop's counters, read when scraped."""

  def __init__(self, loop: loop_lib.ServingLoop):
    self.loop = loop

  def describe(self):
    return []

  def collect(self):
    stats, transport = self.loop.stats, self.loop.transport()
    yield core.CounterMetricFamily(
        "jaxkv_prompt_tokens", "Prompt tokens of the accepted requests.", stats.prompt_tokens
    )
    yield core.GaugeMetricFamily(
        "jaxkv_tokens_per_second", "Tokens generated per second over the last 10 s.", self.loop.tokens_per_second()
    )
    yield core.GaugeMetricFamily("jaxkv_queue_length", "Requests waiting for a slot.", stats.waiting)
    yield core.GaugeMetricFamily("jaxkv_slots_busy", "Slots serving a request.", stats.busy)
    yield core.GaugeMetricFamily("jaxkv_slots", "Slots (--parallel).", self.loop.parallel)
    yield core.GaugeMetricFamily(
        "jaxkv_epoch_running",
        "1 while an epoch (a cache and its slots) serves; a request then joins it.",
        stats.epoch_running,
    )
    yield core.CounterMetricFamily(
        "jaxkv_host_to_device_bytes", "KV bytes delivered from host to devices (all devices).", transport["h2d_bytes"]
    )
    yield core.GaugeMetricFamily(
        "jaxkv_ring_high_water_bytes",
        "Highest delivery ring occupancy on a device so far, bytes.",
        transport["ring_high_water_bytes_per_device"],
    )
    yield core.CounterMetricFamily(
        "jaxkv_slot_insertions", "Requests that entered a slot of a running batch.", transport["insertions"]
    )
    spec = self.loop.speculated()
    yield core.CounterMetricFamily(
        "jaxkv_spec_drafted_tokens", "Draft tokens proposed to verify passes (--speculate).", spec["drafted"]
    )
    yield core.CounterMetricFamily(
        "jaxkv_spec_accepted_tokens", "Draft tokens accepted and recorded as tokens (--speculate).", spec["accepted"]
    )
    cache = self.loop.server.prefix_cache
    prefix = collections.Counter() if cache is None else cache.summary()
    yield core.CounterMetricFamily(
        "jaxkv_prefix_cache_hits", "Requests whose prompt started with a cached prefix.", prefix["hits"]
    )
    yield core.CounterMetricFamily(
        "jaxkv_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache.", prefix["hit_tokens"]
    )
    yield core.GaugeMetricFamily("jaxkv_prefix_cache_bytes", "Bytes the prefix cache holds.", prefix["bytes"])
    yield core.CounterMetricFamily("jaxkv_prefix_cache_evictions", "Prefix cache blocks evicted.", prefix["evictions"])
