"""The service's own recent figures (issue 71, item 4): rates over the last 10 s and minute (over
its age while younger), latency quantiles that never understate, and a quantile past a
histogram's range said as beyond it."""

from __future__ import annotations

import random

import pytest

from runtime.contract import Latency, Quantile, bucket_quantile
from runtime.serve import recent as r


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rates_cover_the_window_and_a_young_service_only_its_age():
    clock = Clock()
    tally = r.Tally(clock)
    clock.t += 4.0  # a service 4 s old that made 10 tokens: 2.5 tokens/s, not 10 over 10 s (1.0)
    tally.add("generation_tokens", 10)
    young = tally.figures(10)
    assert young.window_s == 4.0 and young.generation_tokens_s == 2.5
    clock.t += 30.0
    tally.add("generation_tokens", 5)
    tally.add("prompt_tokens", 20)
    tally.add("requests")
    tally.add("finish:length")
    tally.add("status:200")
    ten, minute = tally.figures(10), tally.figures(60)
    assert (ten.window_s, ten.generation_tokens_s, ten.prompt_tokens_s, ten.requests_s) == (10.0, 0.5, 2.0, 0.1)
    assert minute.window_s == 34.0 and minute.generation_tokens_s == round(15 / 34, 3)
    assert ten.finished == {"length": 1} and ten.statuses == {"200": 1} and ten.errors == 0
    clock.t += 61.0  # a minute later nothing of it is left
    assert tally.figures(60).generation_tokens_s == 0 and tally.figures(60).ttft.count == 0


def test_a_young_service_read_a_second_later_still_counts_its_first_second():
    clock = Clock(1000.7)  # started late in a second: its first request lands in that second's slot
    tally = r.Tally(clock)
    clock.t = 1000.8
    tally.add("prompt_tokens", 6)
    tally.observe("ttft", 0.05)
    clock.t = 1002.1  # 1.4 s old: three slots (1000, 1001, 1002), not the last ceil(1.4) = 2
    young = tally.figures(10)
    assert young.prompt_tokens_s == round(6 / 1.4, 3) and young.ttft.count == 1


def test_whole_seconds_read_in_turn_count_every_event_once():
    """The summary line's reading (`Tally.seconds`): consecutive readings of whole seconds hold
    every count and latency exactly once, wherever in a second it fell; the first reading's rate is
    over the part the tally lived."""
    clock = Clock(1000.7)
    tally = r.Tally(clock)
    for t in (1000.8, 1001.0, 1001.99, 1002.5, 1003.95, 1004.0):
        clock.t = t
        tally.add("generation_tokens", 2)
        tally.observe("ttft", 0.1)
    clock.t = 1004.2
    first, second = tally.seconds(1000, 1002), tally.seconds(1002, 1004)
    assert first.window_s == 1.3 and first.generation_tokens_s == round(6 / 1.3, 3) and first.ttft.count == 3
    assert second.window_s == 2.0 and second.generation_tokens_s == 2.0 and second.ttft.count == 2
    assert tally.seconds(1004, 1006).ttft.count == 1  # the second being counted: the next reading's


def test_quantiles_are_never_under_the_true_value_and_at_most_a_bucket_over():
    rng = random.Random(7)
    clock = Clock()
    tally = r.Tally(clock)
    values = [rng.lognormvariate(-1.0, 1.2) for _ in range(2000)]
    for v in values:
        tally.observe("itl", v)
    got = tally.figures(10).itl
    ordered = sorted(values)
    assert got.count == 2000
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        true = ordered[int(q * len(values)) - 1]
        value = got.quantile(name).value
        assert true <= value <= true * r.RATIO * 1.0001, (name, true, value)


def test_a_latency_past_the_largest_bucket_is_above_it_never_its_bound():
    tally = r.Tally(Clock())
    for _ in range(98):
        tally.observe("ttft", 0.5)
    for _ in range(2):
        tally.observe("ttft", 2 * r.LARGEST)
    got = tally.figures(10).ttft
    assert got.p50 == pytest.approx(0.5, rel=0.1) and got.quantile("p99") == Quantile(above=r.LARGEST)
    assert got.p99 is None and got.quantile("p99").text() == f">{r.LARGEST:g} s"
    assert got.to_json()["p99"] is None and got.to_json()["p99_above"] == r.LARGEST
    assert Latency.from_json(got.to_json()) == got


def test_a_quantile_from_prometheus_buckets_says_when_it_is_past_the_last():
    bounds = (0.64, 1.28, 2.56, 5.12)
    assert bucket_quantile(0.5, bounds, [10, 10, 0, 0, 0]).value == pytest.approx(0.64)
    past = bucket_quantile(0.99, bounds, [50, 0, 0, 40, 10])  # the ITL the client measured at 10.5 s
    assert past.value is None and past.above == 5.12 and past.text() == ">5.12 s"
    assert bucket_quantile(0.99, bounds, [0, 0, 0, 0, 0]) == Quantile()
