"""The serving figures the console shows never understate: a one-shot read of a generating
service says what the service measured itself (/health's recent window), and a quantile past
its histogram's top bucket says `>bound`, never the bound."""

from __future__ import annotations

import os

import httpx
from conftest import get_json

from console.data.services import (
    MetricsWindow,
    ServicesCollector,
    ServicesSnapshot,
    ServiceView,
    parse_metrics,
    quantile,
    serving,
)
from console.tui.panes.device import use_lines
from runtime import contract as c
from store.services import Announcement, Service


def _exposition(le_counts: dict[str, int], name: str = c.TTFT.name) -> str:
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{le}"}} {n}' for le, n in le_counts.items()]
    total = max(le_counts.values())
    return "\n".join([*lines, f"{name}_count {total}", f"{name}_sum 1.0", ""])


def test_a_quantile_past_the_top_bucket_is_above_its_bound_never_the_bound():
    top = c.TTFT.buckets[-1]
    counts = {**{f"{b}": 1 for b in c.TTFT.buckets}, "+Inf": 10}  # 9 of 10 past the last bound
    q = quantile(0.99, parse_metrics(_exposition(counts)), None, c.TTFT.name)
    assert q.value is None and q.above == top and q.text() == f">{top:g} s"
    inside = quantile(0.5, parse_metrics(_exposition({"0.5": 2, "1.0": 4, "+Inf": 4})), None, c.TTFT.name)
    assert inside.above is None and inside.value == 0.5


def test_the_consoles_two_scrapes_use_the_contracts_rule_and_say_above_in_the_figures():
    before = parse_metrics(_exposition({"0.5": 0, "60.0": 0, "+Inf": 0}))
    after = parse_metrics(_exposition({"0.5": 5, "60.0": 5, "+Inf": 7}))
    figures = serving(after, before, 10.0)
    assert figures.ttft_p50 is not None and figures.ttft_p50 <= 0.5
    assert figures.ttft_p99 is None and figures.above == {"ttft_p99": 60.0}
    assert figures.latency("ttft_p99").text() == ">60 s"


def test_the_services_recent_window_is_the_source_and_survives_the_snapshots_json():
    figures = serving({}, None, 0.0)  # one scrape: the console alone knows no rate
    assert figures.tokens_s is None
    recent = c.Recent(10.0, requests_s=0.4, prompt_tokens_s=12.0, generation_tokens_s=2.5, finished={"length": 4},
                      ttft=c.Latency.of(4, p50=c.Quantile(0.64), p99=c.Quantile(above=5.12)),
                      e2e=c.Latency.of(4, p50=c.Quantile(3.2), p99=c.Quantile(4.1)))
    shown = serving({}, None, 0.0, recent=recent)
    assert (shown.tokens_s, shown.prompt_tokens_s, shown.requests_s, shown.source) == (2.5, 12.0, 0.4, "10s")
    assert shown.ttft_p50 == 0.64 and shown.ttft_p99 is None and shown.latency("ttft_p99").text() == ">5.12 s"
    assert (shown.e2e_p50, shown.e2e_p99, shown.finished) == (3.2, 4.1, {"length": 4})
    view = ServiceView(Service(1, 2.0, ("dsv4",), "/m", "serving", "http://127.0.0.1:9"), "ok", serving=shown)
    assert ServiceView.from_json(view.to_json()).serving == shown


def test_a_generating_service_read_once_shows_its_own_nonzero_rates(tiny_app):
    url, _ = tiny_app
    _, models, _ = get_json(f"{url}/v1/models")
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": models["data"][0]["id"], "prompt": "hello", "max_tokens": 8})
    assert r.status_code == 200, r.text
    Announcement("/m").serving(url)  # this process serves it: the registry every reader lists
    snap = ServicesCollector()()  # one read (--once, --once --json, a fleet host's): one scrape of /metrics
    [view] = [v for v in snap.services if v.pid == os.getpid()]
    assert ServicesSnapshot.from_json(snap.to_json()) == snap  # what --once --json and the fleet carry
    s = view.serving
    assert s is not None and s.source == "10s" and s.window_s > 0
    assert s.tokens_s > 0 and s.prompt_tokens_s > 0 and s.requests_s > 0
    assert s.ttft_p50 is not None or "ttft_p50" in s.above
    assert sum(s.finished.values()) >= 1
    # this host has no accelerator: its rank's device reads n/a, its process's CPU and RSS are the service's
    [rank] = view.ranks
    assert rank.device_use is None and rank.rss_bytes and rank.rss_bytes > 0
    assert use_lines(ServicesSnapshot((view,)))[0].endswith("util, temp, power n/a (no accelerator)")
    # the console's own window would have said nothing yet: its first scrape has no rate
    raw = httpx.get(f"{url}/metrics", timeout=10).text
    assert MetricsWindow().add(0.0, parse_metrics(raw)).tokens_s is None
