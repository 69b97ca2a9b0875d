"""Services: every `dsv4 serve` of this user on this host, running or ended (the registry in
`store.services`), each as a `ServiceView`: its record, its `/health` (the contract's `Health`,
ranks included) and what it serves (`Serving`: the service's own last 10 s from /health's `recent`,
its counts and gauges from `/metrics`; an older service's rates from two scrapes up to a minute apart).
Plain Python, no torch, off the UI thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from runtime import contract as c
from runtime.serve.access import NO_ACCESS, Access
from store import services as registry
from store.services import Service

HTTP_TIMEOUT = 0.5  # loopback answers in milliseconds; a wedged service must not stall a refresh
WINDOW_S = 60.0  # rates and latency quantiles over the last minute; each figure's history too
FIGURES = ("tokens_s", "requests_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "running", "queued",
           "kv_fraction", "errors_4xx", "errors_5xx", "busy_503")  # every figure keeps its last minute
MAX_BODY = 1 << 20


def fetch(url: str, path: str, timeout: float = HTTP_TIMEOUT, access: Access = NO_ACCESS) -> tuple[int | None, bytes]:
    """(status, body) of GET url+path with `access` (its key, its CA); (None, b"") when nothing answered."""
    reply = access.get(url, path, timeout, MAX_BODY)
    return reply.status, reply.body


def health(url: str, access: Access = NO_ACCESS) -> tuple[str, c.Health | None, str]:
    """(`ok` | `HTTP 503` | `no answer`, the parsed Health, a problem in words: the contract's,
    or a 401 or an unverifiable certificate as `Access` says them)."""
    import json

    reply = access.get(url, "/health", HTTP_TIMEOUT, MAX_BODY)
    status, raw = reply.status, reply.body
    if status is None:
        return "no answer", None, reply.problem
    if reply.problem:  # 401: the service needs a key this console does not have
        return f"HTTP {status}", None, reply.problem
    word = "ok" if status == 200 else f"HTTP {status}"
    try:
        return word, c.Health.from_json(json.loads(raw)), ""
    except ValueError as e:  # ContractError is one, and so is a body that is not JSON
        return word, None, str(e)


# ---- /metrics → the serving figures ----

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of an exposition, by (name, sorted labels): prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _sum(samples: Samples, name: str, **match: Any) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and all(
        pred(dict(labels).get(k, "")) for k, pred in match.items()))


def quantile(q: float, now: Samples, then: Samples | None, name: str) -> c.Quantile:
    """The q-quantile of histogram `name` over the observations between two scrapes, by the
    contract's rule (`bucket_quantile`): past the top bucket, `above` its bound, never the bound."""
    bucket = f"{name}_bucket"

    def cumulative(samples: Samples) -> dict[float, float]:
        return {float(dict(labels)["le"]): v for (n, labels), v in samples.items() if n == bucket}

    cur, old = cumulative(now), cumulative(then or {})
    bounds, counts, below = [], [], 0.0
    for le in sorted(cur):
        seen = max(0.0, cur[le] - old.get(le, 0.0))
        counts.append(max(0.0, seen - below))
        below = max(below, seen)
        if le != float("inf"):
            bounds.append(le)
    return c.bucket_quantile(q, tuple(bounds), counts) if bounds else c.Quantile()


# each latency the console shows: its key, the histogram of /metrics, and the quantiles kept
LATENCY_METRICS = {"ttft": c.TTFT, "itl": c.ITL, "e2e": c.REQUEST_SECONDS, "queue": c.QUEUE_WAIT}
SHOWN_QUANTILES = ("p50", "p99")


@dataclass(frozen=True)
class Serving:
    """What a service serves. Rates, latency quantiles and finish reasons: the service's own last
    10 s (`source` "10s", /health's `recent`), or for an older service without it the console's
    two scrapes of /metrics up to a minute apart (`source` "metrics"). Counts since it started
    and gauges: its /metrics. A quantile past its histogram's top bucket is None here and its
    bound in `above` (`ttft_p99` → 5.12), as the contract says it: `latency("ttft_p99")`."""

    window_s: float
    requests_s: float | None
    tokens_s: float | None  # generation tokens/s
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    running: int
    queued: int
    kv_used: int
    kv_slots: int
    errors_4xx: int  # since the service started (499, a client that left, is not an error)
    errors_5xx: int  # every 5xx but 503
    busy_503: int
    generated: int  # tokens generated since the service started
    history: dict[str, tuple[float, ...]] = field(default_factory=dict)  # each of FIGURES: its last minute
    prompt_tokens_s: float | None = None  # prefill tokens/s
    e2e_p50: float | None = None  # end to end (arrival to the last byte)
    e2e_p99: float | None = None
    queue_p50: float | None = None  # waiting for a slot
    queue_p99: float | None = None
    above: dict[str, float] = field(default_factory=dict)  # a quantile past its top bucket → that bound
    finished: dict[str, int] = field(default_factory=dict)  # generations over the window, by finish reason
    source: str = "metrics"  # "10s": the service's own recent window; "metrics": the console's two scrapes

    @property
    def kv_fraction(self) -> float | None:
        return self.kv_used / self.kv_slots if self.kv_slots else None

    def latency(self, key: str) -> c.Quantile:
        """`ttft_p99` as the contract's Quantile: its value, or the bound it lies past."""
        return c.Quantile(getattr(self, key), self.above.get(key))


def _latencies(of) -> dict[str, Any]:
    """Serving's latency fields and `above` from `of(kind, quantile) -> Quantile`."""
    out: dict[str, Any] = {"above": {}}
    for kind in LATENCY_METRICS:
        for q in SHOWN_QUANTILES:
            value = of(kind, q)
            out[f"{kind}_{q}"] = value.value
            if value.above is not None:
                out["above"][f"{kind}_{q}"] = value.above
    return out


def serving(now: Samples, then: Samples | None, seconds: float,
            history: dict[str, tuple[float, ...]] | None = None, recent: c.Recent | None = None) -> Serving:
    """The figures of a scrape: its counts and gauges; rates, latency quantiles and finish reasons
    from the service's own `recent` window where it has one, else between the two scrapes `seconds`
    apart (`then` None: rates unknown)."""
    if recent is not None:  # the service said them: nothing of the scrapes' deltas is worked out
        then, seconds = None, recent.window_s

    def rate(name: str, **match: Any) -> float | None:
        if then is None or seconds <= 0:
            return None
        return max(0.0, _sum(now, name, **match) - _sum(then, name, **match)) / seconds

    generation = {"endpoint": lambda e: e in c.GENERATION_ENDPOINTS}
    requests = f"{c.REQUESTS.name}_total"

    def status_count(pred) -> int:
        return int(_sum(now, requests, status=lambda s: s.isdigit() and pred(int(s))))

    finished: dict[str, int] = {}
    if then is not None:
        for (name, labels), v in now.items():
            if name == f"{c.GENERATIONS.name}_total" and (n := int(v - then.get((name, labels), 0.0))) > 0:
                finished[dict(labels).get("reason", "")] = n
    if recent is not None:
        lat = _latencies(lambda kind, q: getattr(recent, kind).quantile(q))
    else:
        lat = _latencies(lambda kind, q: quantile(dict(c.QUANTILES)[q], now, then, LATENCY_METRICS[kind].name))
    figures = Serving(
        seconds, rate(requests, **generation), rate(f"{c.GENERATED.name}_total"), lat.pop("ttft_p50"),
        lat.pop("ttft_p99"), lat.pop("itl_p50"), lat.pop("itl_p99"),
        int(_sum(now, c.RUNNING.name)), int(_sum(now, c.QUEUE_DEPTH.name)), int(_sum(now, c.KV_SLOTS_USED.name)),
        int(_sum(now, c.KV_SLOTS.name)), status_count(lambda s: 400 <= s < 500 and s != 499),
        status_count(lambda s: 500 <= s < 600 and s != 503), status_count(lambda s: s == 503),
        int(_sum(now, f"{c.GENERATED.name}_total")), history or {},
        prompt_tokens_s=rate(f"{c.PREFILLED.name}_total"), finished=finished, **lat)
    if recent is None:
        return figures
    return replace(figures, requests_s=recent.requests_s, tokens_s=recent.generation_tokens_s,
                   prompt_tokens_s=recent.prompt_tokens_s, finished=dict(recent.finished), source=RECENT)


RECENT = "10s"  # the service's window the console reads: as its summary line; the sparklines keep the minute


class MetricsWindow:
    """One service's scrapes of the last minute, and each figure's values over it (FIGURES)."""

    def __init__(self) -> None:
        self.scrapes: deque[tuple[float, Samples]] = deque()
        self.history: dict[str, deque[tuple[float, float]]] = {k: deque() for k in FIGURES}

    def add(self, t: float, samples: Samples, recent: c.Recent | None = None) -> Serving:
        """The figures at `t`: the service's own `recent` window where it has one (a v4 /health),
        else the rates and quantiles between this scrape and the oldest of the last minute."""
        self.scrapes.append((t, samples))
        while len(self.scrapes) > 2 and self.scrapes[1][0] <= t - WINDOW_S:
            self.scrapes.popleft()  # keep one scrape at or before the window's start
        then_t, then = self.scrapes[0] if len(self.scrapes) > 1 else (t, None)
        figures = serving(samples, then, t - then_t, recent=recent)
        for key, values in self.history.items():
            if (value := getattr(figures, key)) is not None:
                values.append((t, float(value)))
            while values and values[0][0] < t - WINDOW_S:
                values.popleft()
        return replace(figures, history={k: tuple(v for _, v in values) for k, values in self.history.items()})


# ---- one service, as the console shows it ----

@dataclass(frozen=True)
class ServiceView:
    """A service of this host: its registry record (identity, settings, how it ended), its
    /health and what it serves. `state`: registering | serving | failed | unreachable | ended."""

    record: Service
    health: str  # ok | HTTP 503 | no answer | registering | ended
    detail: c.Health | None = None
    problem: str = ""  # the /health contract this console could not read, in words
    serving: Serving | None = None

    @property
    def pid(self) -> int:
        return self.record.pid

    @property
    def identity(self) -> registry.ServiceId:
        return self.record.identity

    @property
    def url(self) -> str:
        return self.record.url

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def ended(self) -> bool:
        return self.record.ended

    @property
    def from_console(self) -> bool:
        return self.record.from_console

    @property
    def state(self) -> str:
        if self.record.ended:
            return "ended"
        if self.detail is not None:
            return "serving" if self.detail.ok else "registering" if self.detail.registering else "failed"
        if self.record.state == registry.REGISTERING:
            return "registering"
        return "unreachable" if self.health == "no answer" else self.record.state

    @property
    def ranks(self) -> tuple[c.RankHealth, ...]:
        return self.detail.ranks if self.detail else ()

    @property
    def backend(self) -> str:
        return (self.detail.backend if self.detail else "") or self.record.backend

    @property
    def max_seq(self) -> int | None:
        return self.detail.max_seq if self.detail else self.record.max_seq

    @property
    def rank_count(self) -> int:
        return len(self.ranks) or self.record.ranks

    @property
    def in_flight(self) -> int | None:
        return self.detail.in_flight if self.detail else None

    def ending_line(self, now: float | None = None) -> str:
        return self.record.ending.line(now) if self.record.ending else ""

    def who(self, mine: bool = False) -> str:
        """Who started it: this console, a console, or a shell."""
        return "this console" if mine else "a console" if self.from_console else "a shell"

    def logs(self) -> list[tuple[str, str]]:
        """(label, path) of every log it has: the service's own (its capped log file; an older
        dsv4's: its output), then each rank's."""
        record = self.record
        own = record.log_file or record.log
        ranks = [f or (record.rank_logs[r] if r < len(record.rank_logs) else "")
                 for r, f in enumerate(record.rank_log_files)] or list(record.rank_logs)
        return ([("service", own)] if own else []) + [(f"rank {r}", p) for r, p in enumerate(ranks) if p]

    def to_json(self) -> dict[str, Any]:
        return {**self.record.to_json(), "identity": self.identity.key, "state": self.state, "health": self.health,
                "from_console": self.from_console, "problem": self.problem,
                "detail": self.detail.to_json() if self.detail else None,
                "serving": asdict(self.serving) if self.serving else None, "in_flight": self.in_flight}


    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ServiceView:
        """`to_json`'s inverse: the record, /health and the serving figures."""
        detail = c.Health.from_json(raw["detail"]) if raw.get("detail") else None
        figures = raw.get("serving")
        if figures:
            known = {k: figures[k] for k in Serving.__dataclass_fields__ if k in figures}
            known["history"] = {str(k): tuple(v) for k, v in (figures.get("history") or {}).items()}
            known["above"] = {str(k): float(v) for k, v in (figures.get("above") or {}).items()}
            known["finished"] = {str(k): int(v) for k, v in (figures.get("finished") or {}).items()}
            figures = Serving(**known)
        return cls(Service.from_json(raw), str(raw.get("health") or ""), detail, str(raw.get("problem") or ""),
                   figures or None)


@dataclass(frozen=True)
class ServicesSnapshot:
    services: tuple[ServiceView, ...] = ()
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"services": [s.to_json() for s in self.services], "error": self.error}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ServicesSnapshot:
        return cls(tuple(ServiceView.from_json(v) for v in raw.get("services") or ()), str(raw.get("error") or ""))


class ServicesCollector:
    """Every service of this host, each live one probed (/health, /metrics) at every call, with
    `access` (the API key and CA file the console was given)."""

    def __init__(self, access: Access = NO_ACCESS) -> None:
        self.windows: dict[str, MetricsWindow] = {}
        self.access = access

    def view(self, record: Service, now: float) -> ServiceView:
        if record.ended or not record.url:
            return ServiceView(record, "ended" if record.ended else record.state)
        word, detail, problem = health(record.url, self.access)
        figures = None
        status, raw = fetch(record.url, "/metrics", access=self.access) if detail is not None else (None, b"")
        if status == 200:
            try:
                samples = parse_metrics(raw.decode(errors="replace"))
            except ValueError as e:  # not an exposition this parser reads: say so, keep the rest
                problem = problem or f"/metrics: {e}"
            else:
                window = self.windows.setdefault(record.identity.key, MetricsWindow())
                figures = window.add(now, samples, detail.window(RECENT) if detail is not None else None)
        return ServiceView(record, word, detail, problem, figures)

    def __call__(self) -> ServicesSnapshot:
        try:
            now = time.monotonic()
            views = tuple(self.view(s, now) for s in registry.services())
            live = {v.identity.key for v in views if not v.ended}
            for key in set(self.windows) - live:  # a service gone: its scrapes go with it
                del self.windows[key]
            return ServicesSnapshot(views)
        except Exception as e:  # a collector never takes the console down
            return ServicesSnapshot(error=f"{type(e).__name__}: {e}")
