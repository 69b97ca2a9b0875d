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

HEALTH_VERSION = 3  # 1: the unversioned dict of dsv4 before the contract; 2: the value; 3: it answers
# while registering too (503 `registering`: its phase, each host's phase and progress, the slowest host)
OK, FAILED, REGISTERING = "ok", "failed", "registering"


class ContractError(ValueError):
    """A `/health` or `/metrics` this reader cannot take: another version, or not ours."""


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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankHealth:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


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
    v: int = HEALTH_VERSION

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

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ranks": [asdict(r) for r in self.ranks], "hosts": [h.to_json() for h in self.hosts]}

    @classmethod
    def from_json(cls, data: Any) -> Health:
        """The value of a /health body; `ContractError` naming the version for any other."""
        if not isinstance(data, dict):
            raise ContractError("/health: not a JSON object (is this a dsv4 service?)")
        version = data.get("v")
        if version is None:
            raise ContractError(f"/health v1 (an older dsv4, unversioned); this reader takes v{HEALTH_VERSION}")
        if version != HEALTH_VERSION:
            newer = "a newer" if isinstance(version, int) and version > HEALTH_VERSION else "another"
            raise ContractError(f"/health v{version} ({newer} dsv4); this reader takes v{HEALTH_VERSION}")
        try:
            fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            fields["ranks"] = tuple(RankHealth.from_json(r) for r in data.get("ranks") or ())
            fields["hosts"] = tuple(HostProgress.from_json(h) for h in data.get("hosts") or ())
            fields["engine"] = dict(data.get("engine") or {})
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


LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)

REQUESTS = Metric("dsv4_requests", "counter", "HTTP responses by endpoint and status (499: client left first)",
                  ("endpoint", "status"))
TOKENS = Metric("dsv4_tokens", "counter", "Tokens processed: each prompt once (however many choices), "
                "every completion token", ("kind",))
API_KEYS = Metric("dsv4_api_key_requests", "counter", "Requests by API key name (never the key) and result: "
                  "accepted, or 401 for a key missing or wrong (name empty)", ("key", "result"))
GENERATED = Metric("dsv4_generated_tokens", "counter", "Tokens the engines generated, delivered or not")
GENERATIONS = Metric("dsv4_generations", "counter", "Generations by finish reason", ("reason",))
REQUEST_SECONDS = Metric("dsv4_request_seconds", "histogram", "Generation request latency",
                         buckets=LATENCY_BUCKETS)
QUEUE_WAIT = Metric("dsv4_queue_wait_seconds", "histogram", "Time from submission to a slot",
                    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60))
TTFT = Metric("dsv4_time_to_first_token_seconds", "histogram",
              "Time from a request's arrival to its first generated token", buckets=(*TOKEN_BUCKETS, 10, 30))
ITL = Metric("dsv4_inter_token_seconds", "histogram", "Time between two tokens handed to one sequence",
             buckets=TOKEN_BUCKETS)
QUEUE_DEPTH = Metric("dsv4_queue_depth", "gauge", "Requests waiting for a slot")
RUNNING = Metric("dsv4_running", "gauge", "Requests holding a slot")
KV_SLOTS = Metric("dsv4_kv_slots", "gauge", "KV cache sequence slots")
KV_SLOTS_USED = Metric("dsv4_kv_slots_used", "gauge", "KV cache sequence slots holding a sequence")
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
METRICS = (REQUESTS, API_KEYS, TOKENS, GENERATED, GENERATIONS, REQUEST_SECONDS, QUEUE_WAIT, TTFT, ITL, QUEUE_DEPTH,
           RUNNING, KV_SLOTS, KV_SLOTS_USED, PHASE_SECONDS, PROGRAM_OUTCOMES, SIDECAR_VERDICT, STEPS_BY_TIER,
           COMPILES_AFTER_READY, *ENGINE)
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
