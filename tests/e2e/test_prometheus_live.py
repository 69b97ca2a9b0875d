"""The rules and the dashboard against a real Prometheus (Debian's `prometheus`) scraping a service
while it generates (issue 71, item 6): every recording rule evaluates, the throughput and
saturation figures are the service's, and every dashboard query is one Prometheus accepts."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import httpx
import pytest
from conftest import REPO
from door_fakes import fake_launched, served
from servers import ensure_binary

RULES, DASHBOARD = REPO / "docs" / "monitoring" / "dsv4.rules.yml", REPO / "docs" / "monitoring" / "grafana-dsv4.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(api: str, expr: str) -> dict:
    r = httpx.get(f"{api}/api/v1/query", params={"query": expr}, timeout=10)
    return r.json()


def test_prometheus_scrapes_a_generating_service_and_the_rules_and_panels_read_it(tmp_path):
    binary = ensure_binary("prometheus", "prometheus")
    (tmp_path / "rules.yml").write_text(RULES.read_text().replace("interval: 30s", "interval: 1s"))
    stop = threading.Event()
    with served(fake_launched(tmp_path, slots=2)) as svc:
        (tmp_path / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["rules.yml"],
            "scrape_configs": [{"job_name": "dsv4", "static_configs": [{"targets": [f"127.0.0.1:{svc.port}"]}]}]}))
        port = _port()
        api = f"http://127.0.0.1:{port}"
        with open(tmp_path / "prometheus.log", "w") as log:
            prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)

        def load() -> None:
            while not stop.is_set():
                svc.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8})
                time.sleep(0.05)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        try:
            deadline = time.monotonic() + 90
            got = {}
            while time.monotonic() < deadline:
                time.sleep(1)
                if prom.poll() is not None:
                    pytest.fail(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
                try:
                    got = _query(api, "dsv4:generated_tokens:rate1m")
                except httpx.HTTPError:
                    continue
                if got.get("data", {}).get("result") and float(got["data"]["result"][0]["value"][1]) > 0:
                    break
            else:
                pytest.fail(f"no generation rate recorded: {got}")
            time.sleep(3)  # a few more evaluations: the 5 min windows have two samples or more
            for expr, want in (("dsv4:kv_slots_used:ratio", lambda v: 0 <= v <= 1), ("dsv4_rank_up", lambda v: v == 1),
                               ("dsv4:prefill_tokens:rate1m", lambda v: v > 0),
                               ("dsv4:errors:ratio_rate5m", lambda v: v == 0),
                               ("dsv4:time_to_first_token_seconds:p99_5m", lambda v: 0 < v <= 60)):
                result = _query(api, expr)["data"]["result"]
                assert result and want(float(result[0]["value"][1])), (expr, result)
            rules = httpx.get(f"{api}/api/v1/rules", timeout=10).json()["data"]["groups"]
            unhealthy = [r["name"] for g in rules for r in g["rules"] if r.get("health") != "ok"]
            assert not unhealthy, unhealthy
            for panel in json.loads(DASHBOARD.read_text())["panels"]:
                for target in panel.get("targets", ()):
                    expr = target["expr"].replace("$job", "dsv4").replace("$instance", ".*")
                    answer = _query(api, expr)
                    assert answer["status"] == "success", (panel["title"], expr, answer)
        finally:
            stop.set()
            loader.join(30)
            prom.terminate()
            prom.wait(30)
