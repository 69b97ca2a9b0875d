"""A rate measured from progress samples, smoothed so that an ETA made from it never rises
while work completes at that rate (`console.data.eta` shows it; the Registration pane keeps one
per phase). Torch-free, no Textual."""

from __future__ import annotations

import math
from dataclasses import dataclass

TAU_S = 4.0  # the measured rate's memory: a span this long ago weighs 1/e of the newest
MIN_SPAN_S = 0.5  # a rate from less time than this says nothing (two events in one instant)
JITTER = 2.0  # a sample up to this many steps' time late is jitter: the ETA holds; later, the stall slows it


@dataclass
class Rate:
    """Work per second from progress samples (`sample(t, done)`): each span of at least
    MIN_SPAN_S since the last weighs by its length against the rate so far (1 - e^(-span/TAU_S)),
    so a jittery span moves it as much as its share of time, never more. `step` is the work one
    sample brings (smoothed alike): at most that can have been done since the last sample."""

    rate: float | None = None
    anchor: tuple[float, float] | None = None  # (t, done) the next span is measured from
    seen: tuple[float, float] | None = None  # the newest sample
    step: float = 0.0

    def sample(self, t: float, done: float) -> None:
        if self.seen is None or done < self.seen[1]:  # the first, or the work started again
            self.rate, self.step = None, 0.0
            self.anchor = self.seen = (t, done)
            return
        if done > self.seen[1]:
            grew = done - self.seen[1]
            self.step = grew if not self.step else self.step + 0.5 * (grew - self.step)
            self.seen = (t, done)
        span, work = t - self.anchor[0], done - self.anchor[1]
        if span < MIN_SPAN_S or work <= 0:
            return
        weight = 1.0 - math.exp(-span / TAU_S)
        self.rate = work / span if self.rate is None else self.rate + weight * (work / span - self.rate)
        self.anchor = (t, done)

    def blended(self, prior: float | None) -> float | None:
        """The rate measured here once a span measured it, else `prior` (an earlier run's): never
        a mix, whose share of each would move the ETA while work keeps the measured rate."""
        return self.rate if self.rate is not None else prior

    def eta(self, t: float, total: float, prior: float | None = None, done: float = 0.0) -> float | None:
        """Seconds until `total` at the rate (`blended`: the measured one, else `prior`):
        what was left at the newest sample less what the rate did since — at most one `step`,
        then it holds while the next sample is within JITTER steps' time; a sample later than
        that means a slower rate: the ETA grows with the wait (None with no rate to go by)."""
        rate = self.blended(prior)
        if not rate or rate <= 0:
            return None
        seen_t, seen_done = self.seen if self.seen is not None else (t, done)  # `done`: no sample yet
        left, age = max(0.0, total - seen_done), max(0.0, t - seen_t)
        most = self.step or left  # no step yet: the rate may have done all that is left
        if rate * age <= most:  # on time: count down at the rate
            return max(0.0, left - rate * age) / rate
        late = age * rate / most  # how many steps' time the next sample is taking
        return max(0.0, left - most) / rate * max(1.0, late / JITTER)
