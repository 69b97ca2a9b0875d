"""/metrics: the exporter of the contract's metrics (`runtime.serve.contract.METRICS`): every
response by endpoint and status, generations, tokens, time to first token and between tokens,
queue, KV slots in use, launch facts, what compiled after ready."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.serve import contract as c
from runtime.serve.responses import usage


def _make(metric: c.Metric, registry: CollectorRegistry):
    if metric.kind == "counter":
        return Counter(metric.name, metric.doc, list(metric.labels), registry=registry)
    if metric.kind == "histogram":
        return Histogram(metric.name, metric.doc, list(metric.labels), registry=registry, buckets=metric.buckets)
    return Gauge(metric.name, metric.doc, list(metric.labels), registry=registry)


class Metrics:
    def __init__(self, launched, scheduler) -> None:
        self.registry = r = CollectorRegistry()
        m = {metric.name: _make(metric, r) for metric in c.METRICS}
        self.responses, self.tokens, self.keys = m[c.REQUESTS.name], m[c.TOKENS.name], m[c.API_KEYS.name]
        self.generated, self.finished = m[c.GENERATED.name], m[c.GENERATIONS.name]
        self.latency, self.queue_wait = m[c.REQUEST_SECONDS.name], m[c.QUEUE_WAIT.name]
        self.ttft, self.itl = m[c.TTFT.name], m[c.ITL.name]
        m[c.QUEUE_DEPTH.name].set_function(lambda: scheduler.queued)
        m[c.RUNNING.name].set_function(lambda: scheduler.running)
        m[c.KV_SLOTS.name].set(scheduler.slots)
        m[c.KV_SLOTS_USED.name].set_function(lambda: scheduler.slots - scheduler.free_slots)
        for name, rec in (launched.phases or {}).items():
            m[c.PHASE_SECONDS.name].labels(name).set(rec.get("seconds", 0.0))
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

    def on_token(self, job) -> None:
        """The engine thread handed `job` a token: counted, and timed against the job's last one
        (or its submission, for the first)."""
        now = time.perf_counter()
        self.generated.inc()
        last = getattr(job, "last_token_at", None)
        if last is None:
            self.ttft.observe(now - job.queued_at)
        else:
            self.itl.observe(now - last)
        job.last_token_at = now

    def count_response(self, endpoint: str, status: int) -> None:
        self.responses.labels(endpoint, str(status)).inc()

    def count_key(self, name: str, result: str) -> None:
        """A request let in by the key named `name`, or refused (401: missing | wrong)."""
        self.keys.labels(name, result).inc()

    def account(self, runs, seconds: float) -> None:
        """One finished generation request (runs: its responses.TextRun, one per choice): each
        prompt's tokens once, however many choices share it; a choice its client left before it
        ended (a closed stream) is `cancelled`."""
        for run in runs:
            self.finished.labels(run.finish or "cancelled").inc()
        counts = usage(runs)
        self.tokens.labels("prompt").inc(counts["prompt_tokens"])
        self.tokens.labels("completion").inc(counts["completion_tokens"])
        self.latency.observe(seconds)
