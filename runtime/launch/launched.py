"""A launch that registered: everything its service needs (the plan it carried out, the weights,
the engine over every KV slot, the device, the tokenizer, the other ranks), what the launch cost
phase by phase, and how it ends — failing closed (`fail`), its line in the launch history
(`record`), its memory released (`close`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from runtime.launch import history
from runtime.launch.spec import LaunchSpec


@dataclass
class Launched:
    """Everything a running service needs, plus what the launch cost."""

    plan: Any  # runtime.launch.plan.Plan: what this launch was planned to do, and did
    weights: Any
    engine: Any  # runtime.engine.engine.Engine: every KV slot of the service
    device: Any
    tokenizer: Any
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    validation_tokens: list[int] = field(default_factory=list)
    tiers: Any = None  # runtime.programs.tiers.TieredRunners: each program's tier, "compiling 9/14" for /health
    mapped: Any = None  # the sidecar the weights are views of (cpu MAP): watch it for changes
    failure: str | None = None  # set when the service must stop generating (the service answers 503)
    _on_failure: list = field(default_factory=list)  # told the reason once `fail` sets it (the scheduler)
    group: Any = None  # runtime.launch.ranks.Group: the other ranks of this service (None: one rank)
    hosts: tuple[str, ...] = ()  # each rank's host, in rank order (a service of several ranks)
    registration_seconds: float | None = None  # check through validate, as this rank lived them
    _closers: list = field(default_factory=list)
    after_ready: Any = None  # runtime.programs.after_ready.AfterReady: what compiled after ready

    @property
    def spec(self) -> LaunchSpec:
        return self.plan.spec

    @property
    def config(self):
        return self.plan.config

    @property
    def programs(self):
        """The model's programs (runtime.programs.catalog.ModelPrograms), as the plan built them."""
        return self.plan.catalog

    def fail(self, reason: str) -> None:
        """The service must stop generating: from now on it answers 503 with `reason`, and
        whatever listens (`on_failure`: the scheduler, which fails its queued jobs) is told."""
        self.failure = reason
        for listener in list(self._on_failure):
            listener(reason)

    def on_failure(self, listener) -> None:
        self._on_failure.append(listener)

    def record(self, started: float, outcome: str, error: str = "", **extra: Any) -> None:
        """This launch's line in the launch history: its phases (of several ranks, each the slowest
        rank's, `slowest_phases`), its registration span and the plan's prediction of that span."""
        spans = {"registration_seconds": self.registration_seconds,
                 "predicted_registration_seconds": history.span(self.plan.predicted or {})}
        history.append(self.spec, self.phases, started, outcome, error, device=self.plan.device,
                       backend=self.plan.backend, predicted=self.plan.predicted, config=self.plan.config,
                       extra={**({"hosts": list(self.hosts)} if self.hosts else {}),
                              **{k: v for k, v in spans.items() if v is not None}, **extra})

    def slowest_phases(self) -> None:
        """Rank 0 of several: each phase's seconds become its slowest rank's, as every rank posted
        them once it registered (`RankStore.phase_seconds`)."""
        if self.group is not None:
            self.phases = history.slowest(self.phases, self.group.phase_seconds())

    def close(self) -> None:
        """Release device memory and the sidecar mapping; rank 0 of several tells the others to stop."""
        if self.group is not None:
            self.group.stop()
            self.group.close()
            self.group = None
        self.engine = None
        self.weights = None
        for close in self._closers:
            with contextlib.suppress(Exception):
                close()
        self._closers.clear()
        self.device.release()
