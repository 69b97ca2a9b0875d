"""The live service as a value: its /health contract, its ending kept as a state (one row, one
history record, the right words), what it serves read from its /metrics, and its log in the
console — each against a real `dsv4 serve`."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest
from conftest import start_server
from console_fakes import SPEC, FakeCollectors, snapshot
from test_console_actions import console, until

from console.data.services import ServicesCollector, ServicesSnapshot, parse_metrics
from console.tui.app import Dsv4Console
from console.tui.screens.logview import LogScreen
from runtime.serve import contract
from runtime.serve.contract import ContractError, Health
from store import services
from store.history import read_history


def test_the_health_contract_round_trips_against_a_served_instance(tiny_server):
    url, _, _ = tiny_server
    body = httpx.get(f"{url}/health", timeout=30).json()
    health = Health.from_json(body)
    assert health.to_json() == body
    assert health.ok and health.v == contract.HEALTH_VERSION and health.backend == "export"
    assert [r.rank for r in health.ranks] == [0] and health.ranks[0].pid == health.pid
    assert health.in_flight == health.slots - health.free_slots + health.queued


@pytest.mark.parametrize(("body", "says"), [
    ({"status": "ok", "slots": 4}, "v1 (an older dsv4, unversioned)"),
    ({"v": 3, "status": "ok"}, "v3 (a newer dsv4)"),
    (["not", "an", "object"], "not a JSON object"),
    ({"v": contract.HEALTH_VERSION, "status": "ok"}, "malformed"),
])
def test_another_health_version_is_named_not_a_key_error(body, says):
    with pytest.raises(ContractError, match=r".*") as raised:
        Health.from_json(body)
    assert says in str(raised.value)


def _record(url: str, pid: int) -> services.Service:
    p = psutil.Process(pid)
    return services.Service(pid, p.create_time(), tuple(p.cmdline()), "tiny", services.SERVING, url)


def test_the_serving_figures_are_what_the_service_exports(tiny_server):
    url, _, _ = tiny_server
    pid = httpx.get(f"{url}/health", timeout=30).json()["pid"]
    collector, record = ServicesCollector(), _record(url, pid)
    collector.view(record, time.monotonic())  # the window's first scrape
    for prompt in ("the sea", "a cat", "DeepSeek"):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 6}, timeout=120)
        assert r.status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30).status_code == 400
    view = collector.view(record, time.monotonic())
    exported = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)  # nothing ran in between

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in exported.items() if n == name and all(dict(ls).get(k) == x
                                                                              for k, x in labels.items()))

    s = view.serving
    assert view.state == "serving" and view.detail is not None
    assert s.generated == total(f"{contract.GENERATED.name}_total") > 0
    assert s.errors_4xx == sum(v for (n, ls), v in exported.items()
                               if n == f"{contract.REQUESTS.name}_total" and dict(ls)["status"].startswith("4")
                               and dict(ls)["status"] != "499")
    assert s.errors_4xx >= 1 and s.errors_5xx == 0
    assert s.kv_slots == total(contract.KV_SLOTS.name) == view.detail.slots
    assert s.tokens_s is not None and s.tokens_s > 0 and s.requests_s > 0
    assert s.ttft_p50 is not None and s.itl_p50 is not None and s.ttft_p50 <= s.ttft_p99


def test_a_service_stopped_by_sigterm_stays_one_row_and_one_record(tiny_ckpt_ro, tmp_path):
    proc, url, _ = start_server(tiny_ckpt_ro, tmp_path, "--backend", "eager")
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=120).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    [ended] = services.services()
    assert (ended.pid, ended.ending.how, ended.ending.phase, ended.state) == (
        proc.pid, "stopped by SIGTERM", "serve", services.ENDED)
    [record] = [r for r in read_history() if r.get("model") == str(tiny_ckpt_ro)]
    assert (record["outcome"], record["end"], record["pid"]) == ("ok", "stopped by SIGTERM", proc.pid)



@pytest.mark.asyncio
async def test_a_killed_service_the_console_launched_is_one_row_one_record_never_serving(tiny_ckpt_ro, tmp_path):
    app = console(tiny_ckpt_ro, tmp_path / "programs")
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.press("l")
        await until(pilot, lambda: (app.launch and app.launch.url) or app.failures, "serving")
        pid = app.service.pid
        os.kill(pid, signal.SIGKILL)
        await until(pilot, lambda: app.launch.ended, "the end seen")
        summary = str(app.query_one("#registration-summary").render())
        assert "killed by SIGKILL" in summary and "during serve" in summary and "serving http" not in summary
        assert app.launch.phases["serve"].state == "error"
        # a registry sweep may see the dead pid first ("gone"); the console's words replace it
        await until(pilot, lambda: any(v.ended and v.record.ending.by == "console"
                                       for v in app.snapshot.services.services), "the console's ended row")
        [view] = app.snapshot.services.services
        assert (view.pid, view.state, view.record.ending.how, view.record.ending.phase) == (
            pid, "ended", "killed by SIGKILL", "serve")
        app.query_one("#services-table").focus()
        await pilot.press("d")  # dismissed: the row goes
        await until(pilot, lambda: not app.snapshot.services.services, "dismissed")
    [record] = read_history()  # one record of the launch, its true end, never a basis for predictions
    assert (record["outcome"], record["end"], record["pid"]) == ("killed", "killed by SIGKILL", pid)
    assert services.services() == []


@pytest.mark.asyncio
async def test_the_log_view_shows_the_services_last_lines_and_follows_its_tail(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("".join(f"line {i}\n" for i in range(500)))
    snap = snapshot()
    view = snap.services.services[0]
    import dataclasses

    view = dataclasses.replace(view, record=dataclasses.replace(view.record, log=str(log)))
    snap = dataclasses.replace(snap, services=ServicesSnapshot((view,)))
    app = Dsv4Console(SPEC, collectors=FakeCollectors(snap), watch=False, create_default=False, interval=0)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        app.query_one("#services-table").focus()
        await pilot.press("L")
        await pilot.pause()
        assert isinstance(app.screen, LogScreen)
        assert app.screen.lines[-1] == "line 499"
        with open(log, "a") as f:
            f.write("serving at http://127.0.0.1:8000\n")
        await pilot.pause(1.2)
        assert app.screen.lines[-1] == "serving at http://127.0.0.1:8000"
        await pilot.press("slash")
        await pilot.press(*"line 42")
        await pilot.press("enter")
        assert app.screen.match == app.screen.lines.index("line 42")
        await pilot.press("escape", "escape")
        assert not isinstance(app.screen, LogScreen)


def test_json_of_a_snapshot_carries_each_services_figures():
    data = snapshot().to_json()
    [svc] = data["services"]["services"]
    assert svc["serving"]["tokens_s"] == 182.4 and svc["detail"]["ranks"][0]["pid"] == 4242
    assert json.dumps(data, default=str)
