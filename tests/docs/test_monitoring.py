"""The monitoring files (issue 71, item 6): Prometheus rules that promtool accepts and whose unit
tests pass (promtool from Debian's `prometheus`, installed by the test when missing and root), a
/metrics promtool lints clean, and rules and a Grafana dashboard over the contract's metric names
only, the dashboard read in the field's order: errors, saturation, tail latency, throughput."""

from __future__ import annotations

import json
import re
import subprocess

import httpx
import pytest
from conftest import REPO
from door_fakes import fake_launched, served
from servers import ensure_binary

from runtime import contract as c

MONITORING = REPO / "docs" / "monitoring"
RULES, RULE_TESTS, DASHBOARD = (MONITORING / n for n in ("dsv4.rules.yml", "dsv4.rules.test.yml", "grafana-dsv4.json"))
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


@pytest.fixture(scope="module")
def promtool() -> str:
    return ensure_binary("promtool", "prometheus")


def test_promtool_accepts_the_rules(promtool):
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"SUCCESS: \d+ rules found", done.stdout)


def test_the_rules_unit_tests_pass(promtool):
    done = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, cwd=MONITORING)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_lints_what_a_service_exports_clean(promtool, tmp_path):
    with served(fake_launched(tmp_path)) as svc:
        assert svc.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}).status_code == 200
        text = httpx.get(f"{svc.url}/metrics", timeout=30).text
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dsv4_prefill_tokens_total 2.0" in text and 'dsv4_rank_up{host=' in text


def _exported() -> set[str]:
    names = {"up"}
    for m in (*c.METRICS, *c.RANK_METRICS):
        names |= {m.name + suffix for suffix in SUFFIXES[m.kind]}
    return names


def _series(expr: str) -> set[str]:
    """The metric names an expression reads (recording rules' names left out)."""
    words = set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*(?:\{|\[|\)|$|\s)", expr))
    return {w for w in words if w.startswith("dsv4_") or w == "up"}


def _rules() -> list[dict]:
    import yaml

    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_the_rules_and_the_dashboard_read_only_what_the_contract_exports():
    recorded = {r["record"] for r in _rules() if "record" in r}
    exprs = [r["expr"] for r in _rules()]
    dashboard = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    unknown = set().union(*map(_series, exprs)) - _exported()
    assert not unknown, f"not in runtime/contract.py: {sorted(unknown)}"
    used = set(re.findall(r"\b(dsv4:[a-z0-9_:]+)", " ".join(exprs)))
    assert used <= recorded, f"the dashboard reads rules that are not recorded: {sorted(used - recorded)}"


def test_the_share_past_a_histograms_range_is_taken_at_its_last_bound():
    """`le="60.0"` in the rules is the last finite bucket of the histograms they read."""
    found = [hit for rule in _rules() for hit in re.findall(r"(dsv4_[a-z_]+)_bucket\{le=\"([0-9.]+)\"\}", rule["expr"])]
    assert {name for name, _ in found} == {c.TTFT.name, c.ITL.name}
    for name, le in found:
        metric = next(m for m in c.METRICS if m.name == name)
        assert float(le) == metric.buckets[-1], (name, le)


def test_the_dashboard_reads_errors_then_saturation_then_tail_latency_then_throughput():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = [p["title"] for p in sorted(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
            if p["type"] == "row"]
    assert rows[:4] == ["Errors", "Saturation", "Tail latency", "Throughput"]
    for p in panels:
        if p["type"] == "timeseries" and any("seconds" in t["expr"] for t in p["targets"]):
            # every latency has its unit
            assert p["fieldConfig"]["defaults"]["unit"] in ("s", "percentunit"), p["title"]
