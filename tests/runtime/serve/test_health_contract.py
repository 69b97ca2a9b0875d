"""/health v4 (issue 71, item 4): the service's recent figures and each rank's use travel as the
contract's values; a v3 body still reads; a newer body that says it reads as this version reads."""

from __future__ import annotations

import json

import pytest

from runtime import contract as c

V3 = {"v": 3, "status": "ok", "model": "/m", "id": "m", "slots": 4, "free_slots": 4, "queued": 0, "running": 0,
      "max_seq": 64, "ranks": [{"rank": 0, "slots": 4, "free_slots": 4, "running": 0, "host": "a"}]}


def _v4() -> c.Health:
    recent = c.Recent(10.0, 0.5, 12.0, 2.5, {"length": 3}, {"200": 3, "503": 1},
                      ttft=c.Latency.of(3, p50=c.Quantile(0.64), p90=c.Quantile(0.9), p99=c.Quantile(above=30.0)))
    rank = c.RankHealth(0, 4, 2, 2, host="a", cpu_percent=180.5, rss_bytes=1 << 30, log="/s/serve-8000.rank0.log",
                        device_use=c.DeviceUse("cuda:0 H100", "nvml", 97.0, 70 << 30, 80 << 30, 61.0, 402.5))
    return c.Health("ok", "/m", "m", 4, 2, 1, 2, 64, ranks=(rank,), recent={"10s": recent, "60s": recent})


def test_a_v4_health_round_trips_through_json():
    health = _v4()
    body = json.loads(json.dumps(health.to_json()))
    assert c.Health.from_json(body) == health and body["v"] == 4 and body["compat"] == 3
    assert body["recent"]["10s"]["ttft"] == {"count": 3, "p50": 0.64, "p90": 0.9, "p99": None, "p99_above": 30.0}
    assert health.window("10s").errors == 1 and health.ranks[0].device_use.power == 402.5


def test_a_v3_body_still_reads_with_the_new_figures_empty():
    health = c.Health.from_json(V3)
    assert health.v == 3 and health.recent == {} and health.window() is None and health.ranks[0].cpu_percent is None


def test_a_newer_body_reads_when_it_says_it_reads_as_one_this_reader_takes():
    assert c.Health.from_json({**V3, "v": 9, "compat": 3, "added_later": {"x": 1}}).status == "ok"
    with pytest.raises(c.ContractError, match=r"v9 \(a newer dsv4\); this reader takes v3..v4"):
        c.Health.from_json({**V3, "v": 9, "compat": 8})
