"""/metrics: every response by endpoint and status, generations, tokens, queue, launch facts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self, launched, scheduler) -> None:
        self.registry = r = CollectorRegistry()
        self.responses = Counter("dsv4_requests", "HTTP responses by endpoint and status (499: client left first)",
                                 ["endpoint", "status"], registry=r)
        self.tokens = Counter("dsv4_tokens", "Tokens processed", ["kind"], registry=r)
        self.generated = Counter("dsv4_generated_tokens", "Tokens the engines generated, delivered or not",
                                 registry=r)
        self.finished = Counter("dsv4_generations", "Generations by finish reason", ["reason"], registry=r)
        self.latency = Histogram("dsv4_request_seconds", "Generation request latency", registry=r,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.queue_wait = Histogram("dsv4_queue_wait_seconds", "Time from submission to a slot", registry=r,
                                    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60))
        Gauge("dsv4_queue_depth", "Requests waiting for a slot", registry=r).set_function(lambda: scheduler.queued)
        Gauge("dsv4_running", "Requests holding a slot", registry=r).set_function(lambda: scheduler.running)
        phase = Gauge("dsv4_registration_phase_seconds", "Registration phase durations", ["phase"], registry=r)
        for name, rec in (launched.phases or {}).items():
            phase.labels(name).set(rec.get("seconds", 0.0))
        programs = Gauge("dsv4_kernel_cache_programs", "Programs by cache outcome at launch", ["outcome"], registry=r)
        for outcome, n in ((launched.phases.get("programs") or {}).get("counts") or {}).items():
            programs.labels(outcome).set(n)
        weights = launched.phases.get("weights") or {}
        Gauge("dsv4_sidecar_verdict", "1 for the weights path taken at launch", ["path", "reason"],
              registry=r).labels(weights.get("path", "unknown"), weights.get("reason", "")).set(1)
        Gauge("dsv4_kv_slots", "KV cache sequence slots", registry=r).set(scheduler.slots)
        engine = {  # read from the engine thread's counters at every scrape
            "dsv4_decode_steps": ("Decode steps the engine ran", "steps"),
            "dsv4_decode_batch_mean": ("Mean sequences per decode step", "mean_batch"),
            "dsv4_mtp_drafts": ("MTP drafts verified", "drafts"),
            "dsv4_mtp_accepted": ("MTP drafts accepted", "accepted"),
            "dsv4_mtp_acceptance": ("Accepted / verified MTP drafts", "acceptance"),
            "dsv4_tokens_per_step": ("Tokens handed over per sequence and decode step (MTP: up to 2)", "tokens_per_step"),
        }
        for name, (doc, key) in engine.items():
            Gauge(name, doc, registry=r).set_function(lambda key=key: scheduler.stats[key] or 0.0)
        tiers = getattr(launched, "tiers", None)
        tiers = tiers if hasattr(tiers, "steps") else None
        if tiers is not None:  # --ready early: how many steps ran with some program still eager
            steps = Gauge("dsv4_steps_by_tier", "Engine steps run while any program was eager, or all compiled",
                          ["tier"], registry=r)
            for tier in tiers.steps:
                steps.labels(tier).set_function(lambda tier=tier: tiers.steps[tier])

    def count_response(self, endpoint: str, status: int) -> None:
        self.responses.labels(endpoint, str(status)).inc()

    def account(self, run, seconds: float) -> None:
        """One finished generation request (run: responses.TextRun)."""
        self.finished.labels(run.finish or "unknown").inc()
        self.tokens.labels("prompt").inc(len(run.job.prompt))
        self.tokens.labels("completion").inc(len(run.ids))
        self.latency.observe(seconds)
