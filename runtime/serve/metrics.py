"""/metrics: the exporter of the contract's metrics (`runtime.contract.METRICS`): every
response by endpoint and status, generations, tokens prefilled and generated, time to first token,
between tokens, end to end and in the queue, queue, KV slots in use, whether it failed, each rank's
liveness, CPU, memory and device, launch facts, what compiled after ready. Every observation also
goes to the service's own recent window (`runtime.serve.recent.Tally`: what /health and the summary
line say), so the two never count differently."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from runtime import contract as c
from runtime.serve.recent import Tally
from runtime.serve.responses import usage


def _make(metric: c.Metric, registry: CollectorRegistry):
    if metric.kind == "counter":
        return Counter(metric.name, metric.doc, list(metric.labels), registry=registry)
    if metric.kind == "histogram":
        return Histogram(metric.name, metric.doc, list(metric.labels), registry=registry, buckets=metric.buckets)
    return Gauge(metric.name, metric.doc, list(metric.labels), registry=registry)


class RankCollector:
    """Each rank's liveness, CPU, memory and device, read from what /health says of its ranks at
    each scrape (the ranks of a service are known only once it serves, and a rank lost goes to 0)."""

    def __init__(self, ranks: Callable[[], Iterable[c.RankHealth]]):
        self.ranks = ranks

    def describe(self):
        return []  # the names are the contract's; nothing to check at registration

    def collect(self):
        fams = {m.name: GaugeMetricFamily(m.name, m.doc, labels=list(m.labels)) for m in c.RANK_METRICS}
        for r in self.ranks():
            rank, host = str(r.rank), r.host
            fams[c.RANK_UP.name].add_metric([rank, host], 0.0 if r.error else 1.0)
            if r.cpu_percent is not None:
                fams[c.RANK_CPU.name].add_metric([rank, host], r.cpu_percent)
            if r.rss_bytes is not None:
                fams[c.RANK_RSS.name].add_metric([rank, host], r.rss_bytes)
            d = r.device_use
            if d is None:
                continue
            for metric, value in ((c.DEVICE_UTIL, d.utilization), (c.DEVICE_MEMORY, d.memory_used),
                                  (c.DEVICE_TEMP, d.temperature), (c.DEVICE_POWER, d.power)):
                if value is not None:
                    fams[metric.name].add_metric([rank, d.name], value)
        yield from fams.values()


class Metrics:
    def __init__(self, launched, scheduler) -> None:
        self.registry = r = CollectorRegistry()
        self.recent = Tally()
        m = {metric.name: _make(metric, r) for metric in c.METRICS}
        self.responses, self.tokens, self.keys = m[c.REQUESTS.name], m[c.TOKENS.name], m[c.API_KEYS.name]
        self.generated, self.prefilled, self.finished = m[c.GENERATED.name], m[c.PREFILLED.name], m[c.GENERATIONS.name]
        self.latency, self.queue_wait = m[c.REQUEST_SECONDS.name], m[c.QUEUE_WAIT.name]
        self.ttft, self.itl = m[c.TTFT.name], m[c.ITL.name]
        m[c.QUEUE_DEPTH.name].set_function(lambda: scheduler.queued)
        m[c.RUNNING.name].set_function(lambda: scheduler.running)
        m[c.KV_SLOTS.name].set(scheduler.slots)
        m[c.KV_SLOTS_USED.name].set_function(lambda: scheduler.slots - scheduler.free_slots)
        m[c.FAILED_NOW.name].set_function(lambda: float(bool(getattr(launched, "failure", None) or scheduler.failure)))
        for name in (launched.phases or {}):  # read at each scrape: of several ranks, the slowest rank's once known
            m[c.PHASE_SECONDS.name].labels(name).set_function(
                lambda name=name: float((launched.phases.get(name) or {}).get("seconds") or 0.0))
        for outcome, n in ((launched.phases.get("programs") or {}).get("counts") or {}).items():
            m[c.PROGRAM_OUTCOMES.name].labels(outcome).set(n)
        weights = launched.phases.get("weights") or {}
        m[c.SIDECAR_VERDICT.name].labels(weights.get("path", "unknown"), weights.get("reason", "")).set(1)
        for metric, key in c.ENGINE.items():
            m[metric.name].set_function(lambda key=key: scheduler.stats[key] or 0.0)
        watch = getattr(launched, "after_ready", None)  # runtime.programs.after_ready.AfterReady
        if watch is not None:
            compiles = m[c.COMPILES_AFTER_READY.name]
            watch.listen(lambda program, kind, n: compiles.labels(program, kind).inc(n))
        tiers = getattr(launched, "tiers", None)
        if hasattr(tiers, "steps"):  # --ready early: how many steps ran with some program still eager
            for tier in tiers.steps:
                m[c.STEPS_BY_TIER.name].labels(tier).set_function(lambda tier=tier: tiers.steps[tier])

    def watch_ranks(self, ranks: Callable[[], Iterable[c.RankHealth]]) -> None:
        """Export each rank's figures as `ranks()` (the service's /health ranks) says them."""
        self.registry.register(RankCollector(ranks))

    def on_token(self, job) -> None:
        """The engine thread handed `job` a token: counted, and timed against the job's last one
        (or its submission, for the first: its prompt was prefilled then, counted once for the
        request's choices)."""
        now = time.perf_counter()
        self.generated.inc()
        self.recent.add("generation_tokens")
        last = getattr(job, "last_token_at", None)
        if last is None:
            job.first_token_at = now
            self.ttft.observe(now - job.queued_at)
            self.recent.observe("ttft", now - job.queued_at)
            if job._group[0] is job:
                self.prefilled.inc(len(job.prompt))
                self.recent.add("prompt_tokens", len(job.prompt))
        else:
            self.itl.observe(now - last)
            self.recent.observe("itl", now - last)
        job.last_token_at = now

    def waited(self, seconds: float) -> None:
        """A request's first job got a slot after `seconds` in the queue."""
        self.queue_wait.observe(seconds)
        self.recent.observe("queue", seconds)

    def count_response(self, endpoint: str, status: int) -> None:
        self.responses.labels(endpoint, str(status)).inc()
        if endpoint in c.GENERATION_ENDPOINTS:
            self.recent.add(f"status:{status}")
            self.recent.add("requests")

    def count_key(self, name: str, result: str) -> None:
        """A request let in by the key named `name`, or refused (401: missing | wrong)."""
        self.keys.labels(name, result).inc()

    def account(self, runs, seconds: float) -> dict[str, int]:
        """One finished generation request (runs: its responses.TextRun, one per choice): each
        prompt's tokens once, however many choices share it; a choice its client left before it
        ended (a closed stream) is `cancelled`. Its token counts (OpenAI's usage)."""
        for run in runs:
            reason = run.finish or "cancelled"
            self.finished.labels(reason).inc()
            self.recent.add(f"finish:{reason}")
        counts = usage(runs)
        self.tokens.labels("prompt").inc(counts["prompt_tokens"])
        self.tokens.labels("completion").inc(counts["completion_tokens"])
        self.latency.observe(seconds)
        self.recent.observe("e2e", seconds)
        return counts
