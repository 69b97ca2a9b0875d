"""What a service says about itself: the versioned `/health` value and the table of its metrics.

Torch-free and imported by both sides: the server builds a `Health` and exports the metrics of
`METRICS`; the console, the benches and the tests parse `/health` with `Health.from_json` and
read `/metrics` by the names here. A reader meeting another version says which one it got
(`ContractError`) instead of failing on a key (SGLang's `io_struct.py`, one step further: the
value carries its version).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

HEALTH_VERSION = 4  # 1: the unversioned dict of dsv4 before the contract; 2: the value; 3: it answers
# while registering too (503 `registering`: its phase, each host's phase and progress, the slowest host);
# 4: its own recent figures (`recent`: rates and latency quantiles over 10 s and a minute) and each
# rank's CPU, RSS, device use and log
HEALTH_READS = (3, 4)  # v3 reads with the figures it lacks empty
HEALTH_COMPAT = 3  # what a body says it reads as: every version since 3 only adds fields, so a reader of
# `compat` takes a newer body whose `compat` it reads (the fields it does not know are left aside)
OK, FAILED, REGISTERING = "ok", "failed", "registering"
WINDOWS = {"10s": 10.0, "60s": 60.0}  # the recent windows a service reports, as vLLM's logger keeps them


class ContractError(ValueError):
    """A `/health` or `/metrics` this reader cannot take: another version, or not ours."""


@dataclass(frozen=True)
class Quantile:
    """A latency quantile in seconds that never understates: `value`, or, when it lies past the
    largest bucket that measured it, no value and `above`: that bucket's bound (said `>5.12 s`).
    In JSON `p99` is then null and `p99_above` 5.12, so no reader takes the bound for the value."""

    value: float | None = None
    above: float | None = None

    def text(self) -> str:
        """`0.64 s`, `>5.12 s`, or `-` (nothing measured)."""
        if self.above is not None:
            return f">{self.above:g} s"
        return "-" if self.value is None else f"{self.value:.3g} s"


QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


@dataclass(frozen=True)
class Latency:
    """How many were measured and their quantiles in seconds (`quantile("p99")`: the value, or
    what it lies beyond). Flat as it travels: `p99` null and `p99_above` 5.12 for a p99 past 5.12 s."""

    count: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    p50_above: float | None = None
    p90_above: float | None = None
    p99_above: float | None = None

    @classmethod
    def of(cls, count: int, **quantiles: Quantile) -> Latency:
        """From QUANTILES' names → Quantile values."""
        flat: dict[str, float | None] = {}
        for name, q in quantiles.items():
            flat[name], flat[f"{name}_above"] = q.value, q.above
        return cls(count, **flat)

    def quantile(self, name: str) -> Quantile:
        return Quantile(getattr(self, name), getattr(self, f"{name}_above"))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not (k.endswith("_above") and v is None)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Latency:
        data = data or {}
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def bucket_quantile(q: float, bounds: tuple[float, ...], counts: list[float]) -> Quantile:
    """The q-quantile of a histogram: `counts[i]` observations up to `bounds[i]` (not cumulative),
    `counts[-1]` past the last bound (+Inf). Linear within a bucket, as Prometheus's
    histogram_quantile; past the last bound, `above` it: never the bound itself."""
    total = sum(counts)
    if total <= 0:
        return Quantile()
    rank, seen = q * total, 0.0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i >= len(bounds):
                return Quantile(above=bounds[-1])
            lo = bounds[i - 1] if i else 0.0
            return Quantile(round(lo + (bounds[i] - lo) * (rank - seen) / n, 6))
        seen += n
    return Quantile(above=bounds[-1])


@dataclass(frozen=True)
class Recent:
    """What the service did over its last `window_s` seconds (its age, when younger): rates,
    finish reasons, statuses of its generation requests, and latency quantiles: time to first
    token, between tokens, end to end, waiting for a slot."""

    window_s: float
    requests_s: float = 0.0  # generation requests answered
    prompt_tokens_s: float = 0.0  # prompt tokens prefilled
    generation_tokens_s: float = 0.0  # tokens generated
    finished: dict[str, int] = field(default_factory=dict)  # generations by finish reason
    statuses: dict[str, int] = field(default_factory=dict)  # generation responses by status
    ttft: Latency = Latency()
    itl: Latency = Latency()
    e2e: Latency = Latency()
    queue: Latency = Latency()

    @property
    def errors(self) -> int:
        """Responses of 500 and up (a 503 of a full queue or a failed service included)."""
        return sum(n for s, n in self.statuses.items() if s.isdigit() and int(s) >= 500)

    def to_json(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in ("window_s", "requests_s", "prompt_tokens_s", "generation_tokens_s",
                                                  "finished", "statuses")},
                **{k: getattr(self, k).to_json() for k in LATENCIES}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Recent:
        plain = {k: data[k] for k in ("window_s", "requests_s", "prompt_tokens_s", "generation_tokens_s") if k in data}
        return cls(**plain, finished=dict(data.get("finished") or {}), statuses=dict(data.get("statuses") or {}),
                   **{k: Latency.from_json(data.get(k)) for k in LATENCIES})


LATENCIES = ("ttft", "itl", "e2e", "queue")


@dataclass(frozen=True)
class DeviceUse:
    """A rank's accelerator as its tools read it (NVML, npu-smi): None where one says nothing."""

    name: str
    source: str  # nvml | npu-smi
    utilization: float | None = None  # percent of the time a kernel ran
    memory_used: int | None = None  # bytes
    memory_total: int | None = None
    temperature: float | None = None  # °C
    power: float | None = None  # W

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> DeviceUse | None:
        if not isinstance(data, dict) or "name" not in data:
            return None
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class RankHealth:
    """One rank of a service as rank 0 sees it: where it runs, what it holds, how it beats."""

    rank: int
    slots: int
    free_slots: int
    running: int
    host: str = ""
    pid: int | None = None
    device: str = ""
    phase: str = ""
    heartbeat_age: float | None = None  # seconds since its beat last moved (None: one rank, no beat)
    error: str = ""
    cpu_percent: float | None = None  # the rank process's CPU (100: one core), over its last second or so
    rss_bytes: int | None = None  # its resident memory
    device_use: DeviceUse | None = None  # its accelerator's (None: a CPU rank, or no tool could say)
    log: str = ""  # its log file on its host

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankHealth:
        fields_ = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**fields_, "device_use": DeviceUse.from_json(data.get("device_use"))})


@dataclass(frozen=True)
class HostProgress:
    """One host of a registering service as rank 0 sees it: the phase its least advanced rank is
    in, and that rank's last counted progress (`step`: the phase the count is of — programs and
    weights run at once)."""

    host: str
    ranks: tuple[int, ...]
    phase: str
    done: float | None = None
    total: float | None = None
    unit: str = ""
    step: str = ""

    @property
    def doing(self) -> str:
        """`programs 3/8 programs`, or the phase alone when nothing was counted."""
        if self.done is None or self.total is None:
            return self.phase
        return f"{self.step or self.phase} {self.done:g}/{self.total:g} {self.unit}".rstrip()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ranks": list(self.ranks)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostProgress:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**fields, "ranks": tuple(int(r) for r in data.get("ranks") or ())})


@dataclass(frozen=True)
class Health:
    """GET /health: 200 with status `ok` while the service generates, 503 with status `failed`
    and the reason once it must not, and 503 with status `registering` before it serves (its
    phase; of several ranks, each host's phase and progress and the slowest host, in the reason
    too). Every field is the server's own count, never a guess."""

    status: str
    model: str
    id: str
    slots: int
    free_slots: int
    queued: int
    running: int
    max_seq: int
    backend: str = ""
    device: str = ""
    host: str = ""
    pid: int | None = None  # the service's identity: its launcher's pid (one process: its own)
    started: float | None = None  # and that process's start time
    tokenizer: str = "bytes"
    programs: str = "compiled"  # or "compiling 9/14" while --ready early serves some programs eager
    engine: dict[str, Any] = field(default_factory=dict)  # steps, mean batch, MTP drafts and acceptance
    ranks: tuple[RankHealth, ...] = ()
    reason: str = ""
    phase: str = ""  # while registering: rank 0's phase ("" once it serves)
    hosts: tuple[HostProgress, ...] = ()  # while registering: each host's phase and progress
    slowest: str = ""  # while registering across hosts: the host furthest behind ("" : none behind)
    open_fds: int | None = None  # rank 0's open file descriptors: with free_slots and running, what a leak moves
    recent: dict[str, Recent] = field(default_factory=dict)  # WINDOWS' names → what it did over each
    v: int = HEALTH_VERSION
    compat: int = HEALTH_COMPAT

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def registering(self) -> bool:
        return self.status == REGISTERING

    @property
    def in_flight(self) -> int:
        """Requests holding a slot or waiting for one."""
        return self.slots - self.free_slots + self.queued

    def window(self, name: str = "10s") -> Recent | None:
        """What it did over a recent window (None: a v3 service, or registering)."""
        return self.recent.get(name)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ranks": [asdict(r) for r in self.ranks], "hosts": [h.to_json() for h in self.hosts],
                "recent": {k: r.to_json() for k, r in self.recent.items()}}

    @classmethod
    def from_json(cls, data: Any) -> Health:
        """The value of a /health body; `ContractError` naming the version for any other."""
        if not isinstance(data, dict):
            raise ContractError("/health: not a JSON object (is this a dsv4 service?)")
        version = data.get("v")
        if version is None:
            raise ContractError(f"/health v1 (an older dsv4, unversioned); this reader takes v{HEALTH_VERSION}")
        if version not in HEALTH_READS and data.get("compat") not in HEALTH_READS:
            newer = "a newer" if isinstance(version, int) and version > HEALTH_VERSION else "another"
            raise ContractError(f"/health v{version} ({newer} dsv4); this reader takes "
                                f"v{HEALTH_READS[0]}..v{HEALTH_VERSION}")
        try:
            fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            fields["ranks"] = tuple(RankHealth.from_json(r) for r in data.get("ranks") or ())
            fields["hosts"] = tuple(HostProgress.from_json(h) for h in data.get("hosts") or ())
            fields["engine"] = dict(data.get("engine") or {})
            fields["recent"] = {str(k): Recent.from_json(r) for k, r in (data.get("recent") or {}).items()}
            return cls(**fields)
        except (TypeError, KeyError, ValueError) as e:
            raise ContractError(f"/health v{version}: malformed ({e})") from None


# ---- /metrics: one table of names and labels, for the exporter and every reader ----

@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)

REQUESTS = Metric("dsv4_requests", "counter", "HTTP responses by endpoint and status (499: client left first)",
                  ("endpoint", "status"))
TOKENS = Metric("dsv4_tokens", "counter", "Tokens processed: each prompt once (however many choices), "
                "every completion token", ("kind",))
API_KEYS = Metric("dsv4_api_key_requests", "counter", "Requests by API key name (never the key) and result: "
                  "accepted, or 401 for a key missing or wrong (name empty)", ("key", "result"))
GENERATED = Metric("dsv4_generated_tokens", "counter", "Tokens the engines generated, delivered or not")
PREFILLED = Metric("dsv4_prefill_tokens", "counter", "Prompt tokens the engines prefilled (each prompt once, "
                   "counted when its first token comes)")
GENERATIONS = Metric("dsv4_generations", "counter", "Generations by finish reason", ("reason",))
REQUEST_SECONDS = Metric("dsv4_request_seconds", "histogram", "Generation request latency, end to end (arrival to "
                         "the last byte)", buckets=LATENCY_BUCKETS)
QUEUE_WAIT = Metric("dsv4_queue_wait_seconds", "histogram", "Time from submission to a slot",
                    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60))
TTFT = Metric("dsv4_time_to_first_token_seconds", "histogram",
              "Time from a request's arrival to its first generated token", buckets=(*TOKEN_BUCKETS, 10, 30, 60))
ITL = Metric("dsv4_inter_token_seconds", "histogram", "Time between two tokens handed to one sequence",
             buckets=(*TOKEN_BUCKETS, 10, 30, 60))
QUEUE_DEPTH = Metric("dsv4_queue_depth", "gauge", "Requests waiting for a slot")
RUNNING = Metric("dsv4_running", "gauge", "Requests holding a slot")
KV_SLOTS = Metric("dsv4_kv_slots", "gauge", "KV cache sequence slots")
KV_SLOTS_USED = Metric("dsv4_kv_slots_used", "gauge", "KV cache sequence slots holding a sequence")
FAILED_NOW = Metric("dsv4_failed", "gauge",
                    "1 once the service has failed (it answers 503 with the reason, then exits)")
RANK_UP = Metric("dsv4_rank_up", "gauge", "1 while a rank beats and has no error, 0 once it is lost", ("rank", "host"))
RANK_CPU = Metric("dsv4_rank_cpu_percent", "gauge", "A rank process's CPU (100: one core)", ("rank", "host"))
RANK_RSS = Metric("dsv4_rank_rss_bytes", "gauge", "A rank process's resident memory", ("rank", "host"))
DEVICE_UTIL = Metric("dsv4_device_utilization_percent", "gauge", "A rank's accelerator busy (NVML, npu-smi)",
                     ("rank", "device"))
DEVICE_MEMORY = Metric("dsv4_device_memory_used_bytes", "gauge", "A rank's accelerator memory in use",
                       ("rank", "device"))
DEVICE_TEMP = Metric("dsv4_device_temperature_celsius", "gauge", "A rank's accelerator temperature", ("rank", "device"))
DEVICE_POWER = Metric("dsv4_device_power_watts", "gauge", "A rank's accelerator power draw", ("rank", "device"))
PHASE_SECONDS = Metric("dsv4_registration_phase_seconds", "gauge", "Registration phase durations", ("phase",))
PROGRAM_OUTCOMES = Metric("dsv4_kernel_cache_programs", "gauge", "Programs by cache outcome at launch", ("outcome",))
SIDECAR_VERDICT = Metric("dsv4_sidecar_verdict", "gauge", "1 for the weights path taken at launch",
                         ("path", "reason"))
STEPS_BY_TIER = Metric("dsv4_steps_by_tier", "gauge", "Engine steps run while any program was eager, or all compiled",
                       ("tier",))
COMPILES_AFTER_READY = Metric(
    "dsv4_compiles_after_ready", "counter", "Programs compiled, loaded or specialised after the service turned "
    "ready, by program and kind (jit, load, compile; tier-swap: --ready early's compiled tier swapping in)",
    ("program", "kind"))
ENGINE = {  # gauges read from the engine thread's counters (Scheduler.stats) at every scrape
    Metric("dsv4_decode_steps", "gauge", "Decode steps the engine ran"): "steps",
    Metric("dsv4_decode_batch_mean", "gauge", "Mean sequences per decode step"): "mean_batch",
    Metric("dsv4_mtp_drafts", "gauge", "MTP drafts verified"): "drafts",
    Metric("dsv4_mtp_accepted", "gauge", "MTP drafts accepted"): "accepted",
    Metric("dsv4_mtp_acceptance", "gauge", "Accepted / verified MTP drafts"): "acceptance",
    Metric("dsv4_tokens_per_step", "gauge", "Tokens handed over per sequence and decode step (MTP: up to 2)"):
        "tokens_per_step",
}
# read from /health's ranks at each scrape (runtime.serve.metrics.RankCollector)
RANK_METRICS = (RANK_UP, RANK_CPU, RANK_RSS, DEVICE_UTIL, DEVICE_MEMORY, DEVICE_TEMP, DEVICE_POWER)
METRICS = (REQUESTS, API_KEYS, TOKENS, GENERATED, PREFILLED, GENERATIONS, REQUEST_SECONDS, QUEUE_WAIT, TTFT, ITL,
           QUEUE_DEPTH, RUNNING, KV_SLOTS, KV_SLOTS_USED, FAILED_NOW, PHASE_SECONDS, PROGRAM_OUTCOMES, SIDECAR_VERDICT,
           STEPS_BY_TIER, COMPILES_AFTER_READY, *ENGINE)
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
