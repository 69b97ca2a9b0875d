"""The Services pane's figures, read the way the field reads a service: errors, saturation, tail
latency, throughput; every latency with its unit, `>5.1 s` past the top bucket, sparklines with
their scale, each rank's CPU and RSS."""

from __future__ import annotations

import re

from console_fakes import NOW, snapshot
from rich.text import Text

from console.tui.once import render
from console.tui.panes.services import COLUMNS, cells, summary

UNIT = re.compile(r"^(>?[\d.]+ (ms|s)|-)$")


def _service():
    [view] = snapshot().services.services
    return view


def test_the_columns_read_errors_then_saturation_then_tail_latency_then_throughput():
    keys = [c.key for c in COLUMNS]
    order = [keys.index(k) for k in ("errors", "load", "kv", "ttft", "e2e", "queue_wait", "prompt_s", "tokens_s",
                                     "requests_s")]
    assert order == sorted(order)


def test_every_latency_has_its_unit_and_a_p99_past_the_top_bucket_reads_above_it():
    shown = cells(_service(), NOW)
    for key in ("ttft", "itl", "e2e"):
        assert all(UNIT.match(part) for part in shown[key].split("/")), shown[key]
    assert shown["ttft"] == "31 ms/120 ms" and shown["itl"] == "19 ms/>5.1 s" and shown["e2e"] == "2.1 s/4.8 s"
    assert shown["queue_wait"] == "4 ms"
    assert shown["prompt_s"] == "96.0" and shown["tokens_s"] == "182"  # prefill and generation apart


def test_the_sparkline_shows_its_scale_beside_the_bars():
    bars, top = cells(_service(), NOW)["trend"].split()
    assert bars[-1] == "█" and float(top) == 182.0


def test_the_details_and_once_carry_finish_reasons_and_each_ranks_cpu_and_rss():
    text = "\n".join(Text.from_markup(line).plain for line in summary(_service(), NOW))
    once = render(snapshot())
    for said in (text, once):
        assert "last 10 s, its own" in said and "itl 19 ms/>5.1 s" in said and "finished length 30 · stop 5" in said
        assert "prefill 96.0 tok/s · gen 182 tok/s" in said and "queued 1 (wait p99 4 ms)" in said
        assert "rank 0 pid 4242 cpu serve 12/32 slots cpu 97% rss 1.3 GiB" in said
        assert "5120" not in said


def test_an_older_service_without_its_own_window_says_where_its_rates_come_from():
    from console.data.services import serving
    from console.tui.panes.services import serving_lines

    first, later = serving({}, None, 0.0), serving({}, {}, 12.0)
    assert "an older service: rates after a second scrape" in serving_lines(first)[2]
    assert "last 12 s, scraped" in serving_lines(later)[2] and "gen 0.0 tok/s" in serving_lines(later)[2]
