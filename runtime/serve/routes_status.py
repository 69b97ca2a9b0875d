"""The service's word on itself: GET /health (the contract's `Health`), /metrics and /v1/models.

Routes of a FastAPI router over the `Service` the app holds (`app.state.service`), not closures:
what they read is that value's, and the value is what tests build around a fake engine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from runtime.contract import FAILED, OK, DeviceUse, Health, RankHealth
from runtime.log import current
from runtime.serve import schema
from runtime.serve.api import ApiError
from runtime.serve.http import SafeJSONResponse, access_of
from runtime.serve.metrics import Metrics
from runtime.serve.scheduler import Scheduler
from runtime.usage import Usage
from store.services import ServiceId

router = APIRouter()


@dataclass
class Service:
    """What the routes serve: the launch, its scheduler and metrics, and the service's identity."""

    launched: Any  # runtime.launch.launched.Launched
    scheduler: Scheduler
    metrics: Metrics
    limits: Any  # runtime.serve.app.Limits
    identity: ServiceId = field(default_factory=ServiceId.of_this_process)
    created: int = field(default_factory=lambda: int(time.time()))
    usage: Usage | None = None  # one rank alone: this process's CPU, RSS and device, read when asked

    @property
    def model_dir(self):
        return self.launched.spec.model

    @property
    def model_id(self) -> str:
        return self.model_dir.name

    @property
    def max_seq(self) -> int:
        return self.launched.programs.dims.max_seq

    def failure(self) -> str | None:
        """Why the service must not generate (set on `launched.failure` by whatever watches its
        weights, e.g. a mapped sidecar that changed, or its ranks, one of which is gone; or its
        scheduler's, whose engine thread died): it then fails closed, 503 with the reason."""
        return getattr(self.launched, "failure", None) or self.scheduler.failure

    def ranks(self) -> tuple[RankHealth, ...]:
        """Each rank's own slots (it holds their sequences' KV), where it runs and beats, what it
        uses (CPU, RSS, device: each rank posts its own with its heartbeat) and its log."""
        group = getattr(self.launched, "group", None)
        members = group.members() if group is not None else [
            {"rank": 0, "host": self.identity.host, "pid": self.identity.pid, "device": self._device(),
             "phase": "serve", "heartbeat_age": None, "error": self.failure() or "", "log": str(current().path or ""),
             **self._usage().read()}]
        slots = {r["rank"]: r for r in self.scheduler.per_rank()}
        known = set(RankHealth.__dataclass_fields__)
        return tuple(RankHealth(**{**slots.get(m["rank"], {"slots": 0, "free_slots": 0, "running": 0}),
                                   **{k: v for k, v in m.items() if k in known},
                                   "device_use": DeviceUse.from_json(m.get("device_use"))})
                     for m in members)

    def _usage(self) -> Usage:
        if self.usage is None:
            self.usage = Usage(str(getattr(getattr(self.launched, "device", None), "torch_device", "cpu")))
        return self.usage

    def _device(self) -> str:
        device = getattr(self.launched, "device", None)
        return device.describe() if hasattr(device, "describe") else ""

    def health(self) -> Health:
        s, plan = self.scheduler, getattr(self.launched, "plan", None)
        tiers = getattr(self.launched, "tiers", None)
        reason = self.failure() or ""
        return Health(
            status=FAILED if reason else OK, model=str(self.model_dir), id=self.model_id, slots=s.slots,
            free_slots=s.free_slots, queued=s.queued, running=s.running, max_seq=self.max_seq,
            backend=str(getattr(plan, "backend", "") or ""), device=str(getattr(plan, "device", "") or ""),
            host=self.identity.host, pid=self.identity.pid, started=self.identity.started,
            tokenizer=getattr(self.launched.tokenizer, "kind", "bytes"),
            programs=tiers.status() if hasattr(tiers, "status") else "compiled",
            engine={**s.stats, "speculative": "mtp" if self.limits.speculative else "off"},
            ranks=self.ranks(), reason=reason, open_fds=open_fds(), recent=self.metrics.recent.windows())

    def model_card(self) -> dict[str, Any]:
        """OpenAI's model object. `root` is the model's id, not its directory: an API client is
        not told the server's paths (/health, the operators', says the directory)."""
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "dsv4",
                "root": self.model_id, "max_model_len": self.max_seq}

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_id, str(self.model_dir)):
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


def open_fds() -> int | None:
    """This process's open file descriptors (Linux), for /health: what a leak would show."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:
        return None


def service_of(request: Request) -> Service:
    return request.app.state.service


@router.get("/health", **schema.HEALTH)
async def health(request: Request) -> Any:
    value = service_of(request).health()
    return SafeJSONResponse(value.to_json(), status_code=200 if value.ok else 503)


@router.get("/metrics", response_class=PlainTextResponse, **schema.METRICS)
async def metrics(request: Request) -> PlainTextResponse:
    registry = service_of(request).metrics.registry
    return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", **schema.MODELS)
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [service_of(request).model_card()]}


@router.get("/v1/models/{model}", **schema.MODEL)
async def model(request: Request, model: str) -> dict[str, Any]:
    access_of(request).model = model
    service = service_of(request)
    service.check_model(model)
    return service.model_card()
