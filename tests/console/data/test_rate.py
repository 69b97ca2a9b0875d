"""An ETA that does not rise while work completes at the rate measured (issue 71 item 5): the
rate smoothed by time, counted down between progress samples, its basis shown; the Registration
pane's phase keeps it from its events."""

from __future__ import annotations

import random
from itertools import pairwise

from console.data.eta import Progress
from console.data.launch_state import LaunchState
from console.tui.panes.registration import phase_progress
from runtime.events import Event

STEP = 8 * (1 << 20)  # 8 MiB a sample
TOTAL = 40 * STEP


def _etas(arrivals: list[float], render_every: float = 0.05) -> list[tuple[float, float | None, str]]:
    """A weights phase of 40 samples arriving at `arrivals`, its ETA read every `render_every` s
    (as the pane redraws), on one clock."""
    p = Progress("weights", "bytes", started=0.0, clock=lambda: 0.0)
    p.update(0, TOTAL, t=0.0)
    out, i, t = [], 0, render_every
    while i < len(arrivals):
        while i < len(arrivals) and arrivals[i] <= t:
            p.update((i + 1) * STEP, t=arrivals[i])
            i += 1
        out.append((t, *p.eta(t)))
        t += render_every
    return out


def test_at_a_constant_rate_the_eta_never_rises_and_counts_down_between_samples():
    etas = _etas([0.7 * k for k in range(1, 41)])
    assert etas[0][1] is None  # before the first span: nothing to go by (no earlier run's rate here)
    etas = [e for e in etas if e[0] >= 0.7]
    values = [e for _, e, _ in etas]
    assert all(e is not None for e in values)
    assert all(b <= a + 1e-9 for a, b in pairwise(values))  # non-increasing, every redraw
    t, eta, basis = etas[len(etas) // 2]
    assert abs(t + eta - 28.0) < 0.01  # 40 samples of 0.7 s: it ends at 28 s, as the ETA said midway
    assert basis == "measured at 11.4 MiB/s"
    assert values[-1] < 0.1


def test_a_jittery_rate_moves_the_eta_up_by_less_than_the_jitter():
    """Samples up to 30 % early or late: an ETA made from the last span alone would jump by as
    much; the smoothed one by a fraction of it, and never while a late sample is awaited."""
    jitter = 0.3
    for seed in range(10):
        rnd, t, arrivals = random.Random(seed), 0.0, []
        for _ in range(40):
            t += 0.7 * (1 + rnd.uniform(-jitter, jitter))
            arrivals.append(t)
        values = [e for _, e, _ in _etas(arrivals)]
        rises = [(b - a) / a for a, b in pairwise(values) if a and b > a]
        assert max(rises, default=0.0) <= jitter / 2, seed


def test_a_stall_raises_the_eta_once_the_next_sample_is_later_than_jitter():
    p = Progress("weights", "bytes", started=0.0, clock=lambda: 0.0)
    p.update(0, TOTAL, t=0.0)
    for k in range(1, 11):
        p.update(k * STEP, t=float(k))  # 8 MiB/s for 10 s: 30 s left
    assert p.eta(10.0)[0] == 30.0
    assert p.eta(11.0)[0] == 29.0 and p.eta(12.0)[0] == 29.0  # one step done by the rate, then held
    assert p.eta(20.0)[0] > 29.0 * 4  # ten steps' time without one: slower than measured, it says so


def test_the_earlier_runs_rate_is_the_basis_until_one_is_measured_here():
    p = Progress("prepack", "bytes", rate=16 * (1 << 20), started=0.0, clock=lambda: 0.0)
    p.update(0, TOTAL, t=0.0)
    eta, basis = p.eta(1.0)  # no sample yet: the earlier runs' rate, counting down
    assert (eta, basis) == (TOTAL / (16 << 20) - 1.0, "history at 16.0 MiB/s")
    p.update(STEP, t=2.0)
    assert p.eta(2.0) == (39 * STEP / (STEP / 2.0), "measured at 4.0 MiB/s")


def test_the_registration_panes_eta_comes_from_the_phases_events():
    """The pane redraws from the launch's events: the rate is the phase's own (their times),
    kept between redraws, so the ETA holds its countdown instead of rising with each redraw."""
    import time

    now = time.time()
    state = LaunchState()
    state.apply(Event("weights", "start", ts=now - 10.0, detail={"total": TOTAL}))
    for k in range(1, 11):
        state.apply(Event("weights", "progress", ts=now - 10.0 + k, done=k * STEP, total=TOTAL, unit="bytes"))
    p = state.phases["weights"]
    line = phase_progress("weights", p, None, "")
    assert "ETA 30s (measured at 8.0 MiB/s)" in line
    assert p.rate.eta(now + 0.5, TOTAL) == 29.5


def _compile(seed: int, scale: float = 1.6, workers: int = 2) -> list[tuple[float, float, bool]]:
    """A pool of 16 programs compiling each `scale` times its expected seconds, in the pool's own
    order (not the longest first its ETA lays them in): (time, ETA, any finished yet) every 0.1 s."""
    import heapq

    from console.data.launch_state import ProgramStates

    rnd = random.Random(seed)
    expected = {f"p{i}": rnd.uniform(2, 12) for i in range(16)}
    pool, events, free = ProgramStates(), [], [0.0] * workers
    for name, e in expected.items():
        pool.feed({"program": name, "state": "queued", "expected_s": e, "workers": workers}, 0.0)
        start = heapq.heappop(free)
        events += [(start, 1, name, None), (start + e * scale, 0, name, e * scale)]
        heapq.heappush(free, start + e * scale)
    events.sort()
    out, i, t = [], 0, 0.0
    while i < len(events):
        while i < len(events) and events[i][0] <= t:
            at, compiling, name, took = events[i]
            pool.feed({"program": name, "state": "compiling"} if compiling else
                      {"program": name, "state": "published", "seconds": took}, at)
            i += 1
        out.append((t, pool.eta(t), bool(pool.took)))
        t += 0.1
    return out


def test_a_compile_pools_eta_never_rises_while_compiles_keep_the_measured_scale():
    for seed in range(5):
        measured = [eta for _, eta, took in _compile(seed) if took]  # after the first compile set the scale
        assert all(b <= a + 1e-9 for a, b in pairwise(measured)), seed
        assert measured[-1] < 0.2


def test_a_compile_slower_than_measured_raises_the_pools_eta():
    from console.data.launch_state import ProgramStates

    pool = ProgramStates()
    for name in "abc":
        pool.feed({"program": name, "state": "queued", "expected_s": 10.0, "workers": 1}, 0.0)
    pool.feed({"program": "a", "state": "compiling"}, 0.0)
    pool.feed({"program": "a", "state": "published", "seconds": 10.0}, 10.0)
    assert pool.eta(10.0) == 20.0
    pool.feed({"program": "b", "state": "compiling"}, 10.0)
    assert pool.eta(15.0) == 15.0  # on time: counting down
    assert pool.eta(30.0) == 10.0  # b past its 10 s: slower than measured, c's 10 s still ahead
    pool.feed({"program": "b", "state": "published", "seconds": 30.0}, 40.0)  # three times its expected
    assert pool.eta(40.0) == 20.0  # slower than measured: the scale is 2 now, c's 10 s take 20
