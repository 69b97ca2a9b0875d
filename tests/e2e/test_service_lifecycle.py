"""The live service as a value: its /health contract, its ending kept as a state (one row, one
history record, the right words), what it serves read from its /metrics, and its log in the
console — each against a real `dsv4 serve`."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import (
    MAX_SEQ,
    REPO,
    start_server,
)
from console_fakes import SPEC, FakeCollectors, snapshot
from test_console_actions import console, until

from console import fmt
from console.data import services as services_data
from console.data.services import ServicesCollector, ServicesSnapshot, parse_metrics
from console.tui.app import Dsv4Console
from console.tui.panes.services import cells, rank_line
from console.tui.screens.detail import DetailScreen
from console.tui.screens.logview import LogScreen
from runtime import contract
from runtime.contract import ContractError, Health
from runtime.launch.history import (
    SETTINGS,
    Likeness,
    comparable,
    recompiled,
    registered,
    weights_path,
)
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
    ({"v": 5, "status": "ok"}, "v5 (a newer dsv4)"),
    ({"v": 2, "status": "ok"}, "v2 (another dsv4)"),  # before /health answered while registering
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
        # a registry sweep may see the dead pid first ("gone"); its supervisor's words replace it
        await until(pilot, lambda: any(v.ended and v.record.ending.by == "supervisor"
                                       for v in app.snapshot.services.services), "the supervisor's ended row")
        [view] = app.snapshot.services.services
        assert (view.pid, view.state, view.record.ending.how, view.record.ending.phase) == (
            pid, "ended", "killed by SIGKILL", "serve")
        app.query_one("#services-table").focus()
        await pilot.press("d")  # dismissed: the row goes
        await until(pilot, lambda: not app.snapshot.services.services, "dismissed")
    [record] = read_history()  # one record of the launch, its true end; it registered: it predicts the next
    assert (record["outcome"], record["end"], record["pid"]) == ("killed", "killed by SIGKILL", pid)
    assert registered(record)
    # the pane said the record's figures: the whole launch, and the registration span (issue 71 item 5)
    assert f"this launch {record['seconds']:.2f} s" in summary
    assert f"actual {record['registration_seconds']:.2f} s" in summary or (
        f"registration {record['registration_seconds']:.2f} s" in summary)
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
    app = Dsv4Console(SPEC, host=FakeCollectors(snap), watch=False, create_default=False, interval=0)
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


# ---- services started from a shell, their output in a file, in a console with live collectors ----


def _serve_from_shell(model: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, services.Service, Path]:
    """`dsv4 serve` (eager: nothing compiles) as an operator starts it in a shell with its output
    in a file: (the process, its registry record once it serves, the log)."""
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "console.cli", "serve", str(model), "--device", "cpu",
                                 "--backend", "eager", "--port", "0", "--max-seq", str(MAX_SEQ), *extra],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300  # a hang guard on a loaded machine, not a timing assertion
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        found = [s for s in services.running() if s.pid == proc.pid and s.url]
        if found:
            return proc, found[0], log
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the service never served")


def _lines(path: str | Path) -> list[str]:
    """A log's complete lines, as the log view reads them."""
    text = Path(path).read_text(errors="replace")
    return text[:text.rfind("\n") + 1].splitlines()


class LiveServices(FakeCollectors):
    """The fakes' panes, but the Services pane from this host's real registry and services."""

    def __init__(self) -> None:
        super().__init__()
        self.services = ServicesCollector()

    def snapshot(self):
        return dataclasses.replace(super().snapshot(), services=self.services())


@pytest.fixture(scope="module")
def two_ranks(tiny_ckpt_ro, tmp_path_factory):
    """One `dsv4 serve --ranks 2` from a shell (eager, its events on stdout: the launcher's log
    and each rank's own beside it), two slots per rank so a load queues; under user dirs of its
    own (a test reads its registry with `monkeypatch.setenv(*two_ranks.state)`)."""
    base = tmp_path_factory.mktemp("two-ranks")
    dirs = {"DSV4_STATE_DIR": str(base / "state"), "DSV4_DATA_DIR": str(base / "data"),
            "DSV4_KERNEL_CACHE_DIR": str(base / "programs")}
    with pytest.MonkeyPatch.context() as env:
        for name, value in dirs.items():
            env.setenv(name, value)
        proc, record, log = _serve_from_shell(tiny_ckpt_ro, base, "--ranks", "2", "--events", "-", "--max-slots", "2")
        yield TwoRanks(proc, record, log, ("DSV4_STATE_DIR", dirs["DSV4_STATE_DIR"]))
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=60)


@dataclasses.dataclass(frozen=True)
class TwoRanks:
    proc: subprocess.Popen
    record: services.Service
    log: Path
    state: tuple[str, str]  # the registry it announced itself in


def _said(text: str) -> dict[str, float]:
    """What an exposition says, each sample name summed over its labels (the prometheus parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_the_figures_shown_while_a_load_runs_are_what_its_metrics_say(two_ranks, monkeypatch):
    """While requests decode and queue, the Services row shows exactly what that scrape of
    /metrics said: running/queued, KV in use; and tokens/s as the service measured it over its
    last 10 s (/health's recent window), nonzero while it generates."""
    record = two_ranks.record
    bodies: list[str] = []
    real = services_data.fetch

    def fetch(url: str, path: str, timeout: float = services_data.HTTP_TIMEOUT, access=services_data.NO_ACCESS):
        status, body = real(url, path, timeout=30, access=access)  # a loaded machine answers late, never wrongly
        if path == "/metrics":
            bodies.append(body.decode())
        return status, body

    monkeypatch.setattr(services_data, "fetch", fetch)
    monkeypatch.setattr(services_data, "HTTP_TIMEOUT", 30)  # /health's too
    collector = ServicesCollector()
    t0 = time.monotonic()
    collector.view(record, t0)  # the window's first scrape

    def load(i: int) -> int:
        body = {"prompt": f"load {i}", "max_tokens": MAX_SEQ - 16, "ignore_eos": True, "temperature": 0}
        return httpx.post(f"{record.url}/v1/completions", json=body, timeout=300).status_code

    seen = None
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load, i) for i in range(8)]
        deadline = time.monotonic() + 120  # a hang guard only
        while seen is None and time.monotonic() < deadline and not all(f.done() for f in futures):
            t = time.monotonic()
            view = collector.view(record, t)
            if view.serving is not None and view.serving.running > 0 and view.serving.tokens_s:
                seen = (view, t, _said(bodies[-1]))
        assert [f.result() for f in futures] == [200] * 8
    assert seen is not None, "no scrape while the load ran"
    view, t, said = seen
    generated = f"{contract.GENERATED.name}_total"
    s, shown = view.serving, cells(view, time.time())
    assert (s.running, s.queued) == (said[contract.RUNNING.name], said[contract.QUEUE_DEPTH.name])
    assert (s.kv_used, s.kv_slots) == (said[contract.KV_SLOTS_USED.name], said[contract.KV_SLOTS.name])
    recent = view.detail.window("10s")
    assert s.source == "10s" and s.tokens_s == recent.generation_tokens_s > 0 and s.generated == said[generated]
    assert shown["load"] == f"{s.running}/{s.queued}" and shown["tokens_s"] == fmt.per_second(s.tokens_s)
    assert shown["kv"] == f"{said[contract.KV_SLOTS_USED.name] / said[contract.KV_SLOTS.name]:.0%}"
    assert s.history["tokens_s"][-1] == s.tokens_s and set(s.history) == set(services_data.FIGURES)


@pytest.mark.asyncio
async def test_L_on_a_real_service_shows_its_last_lines_follows_them_and_opens_each_ranks_log(two_ranks,
                                                                                               monkeypatch):
    """`L` on a running two-rank service: its log's last lines, a rank's own log by its number,
    the tail followed as the service writes it (rank 1 killed: the launcher's line); that rank's
    last error in its rank line, and the ended row keeps the last log lines in its details."""
    proc, record, log = two_ranks.proc, two_ranks.record, two_ranks.log
    monkeypatch.setenv(*two_ranks.state)
    health = Health.from_json(httpx.get(f"{record.url}/health", timeout=30).json())
    rank1 = next(r.pid for r in health.ranks if r.rank == 1)
    app = Dsv4Console(SPEC, host=LiveServices(), watch=False, create_default=False, interval=0)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        app.query_one("#services-table").focus()
        await pilot.press("L")
        await until(pilot, lambda: isinstance(app.screen, LogScreen) and app.screen.lines, "the log view")
        view = app.screen
        assert [f.label for f in view.feeds] == ["service", "rank 0", "rank 1"]
        # the file's last line (the service may write one more meanwhile: the view follows it)
        await until(pilot, lambda: view.lines[-1] == _lines(log)[-1], "the service log's last line")
        await pilot.press("2")  # rank 1's own log
        assert view.feeds[view.which].label == "rank 1"
        await until(pilot, lambda: view.lines[-1] == _lines(record.rank_logs[1])[-1], "rank 1's last line")
        await pilot.press("tab")  # tab goes round: back to the service's
        assert view.which == 0
        await until(pilot, lambda: view.lines[-1] == _lines(log)[-1], "the service log again")

        failed: list = []

        def watch_health() -> None:  # the 503 the service answers while it fails closed
            while proc.poll() is None and not failed:
                try:
                    answer = httpx.get(f"{record.url}/health", timeout=30)
                except httpx.HTTPError:
                    continue  # it stopped listening
                if answer.status_code == 503:
                    failed.append(services_data.ServiceView(record, "HTTP 503", Health.from_json(answer.json())))

        watcher = threading.Thread(target=watch_health, daemon=True)
        watcher.start()
        os.kill(rank1, signal.SIGKILL)
        await until(pilot, lambda: any("killed by SIGKILL" in line for line in view.lines), "the tail followed")
        assert proc.wait(timeout=60) != 0
        watcher.join(timeout=30)
        assert failed, "no 503 seen while the service failed closed"
        rank = failed[0].ranks[1]
        assert "rank 1" in rank.error and "SIGKILL" in rank.error and not failed[0].ranks[0].error
        assert rank.error in fmt_plain(rank_line(failed[0]))
        await pilot.press("escape")
        app.refresh_now()
        await pilot.pause()
        [ended] = app.snapshot.services.services
        assert ended.ended and ended.record.ending.by == "launcher"
        tail = ended.record.ending.log  # the log's last lines when the launcher recorded the end
        written = [line for line in _lines(log) if line.strip()]
        assert len(tail) == 5 and any(written[i:i + 5] == list(tail) for i in range(len(written)))
        assert any("rank 1" in line and "killed by SIGKILL" in line for line in tail)  # the launcher's words
        summary = str(app.query_one("#services-summary").render())
        assert f"last log: {tail[-1]}" in summary
        app.query_one("#services-table").focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, DetailScreen), "the details")
        assert all(line in fmt_plain(app.screen.text) for line in tail)


def fmt_plain(markup: str) -> str:
    from rich.text import Text

    return Text.from_markup(markup).plain


def test_a_service_started_from_a_shell_and_sigkilled_ends_once_and_still_predicts_like_it_served(tiny_ckpt_ro,
                                                                                                  tmp_path):
    """Nobody waits for a service started from a shell: SIGKILLed, it becomes "gone" at the
    registry's sweep with its last log lines, and the launch's one history record — "ok" when
    it served — gets that true end (outcome unknown); it registered, so it still predicts the
    next launch like one (issue 71: a kill after serving no longer erases the prediction).
    `--once` (two scrapes a second apart) carries its rates as the screen does."""
    proc, record, log = _serve_from_shell(tiny_ckpt_ro, tmp_path)
    try:
        out = subprocess.run([sys.executable, "-m", "console.tui.app", "--once", "--json", "--model",
                              str(tiny_ckpt_ro), "--kernel-cache-dir", str(tmp_path / "programs"), "--device", "cpu"],
                             cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
        [shown] = json.loads(out.stdout)["services"]["services"]
        assert shown["pid"] == proc.pid and shown["serving"]["tokens_s"] == 0.0 == shown["serving"]["requests_s"]
        [ok] = [r for r in read_history() if r.get("model") == str(tiny_ckpt_ro)]
        assert ok["outcome"] == "ok"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    [ended] = services.services()
    services.services()  # a second sweep adds nothing
    assert (ended.pid, ended.ending.how, ended.ending.by) == (proc.pid, "gone", "registry")
    assert ended.ending.log[-1] == _lines(log)[-1] and " service serving " in ended.ending.log[-1]
    [record] = [r for r in read_history() if r.get("model") == str(tiny_ckpt_ro)]  # one record of the launch
    assert (record["outcome"], record["end"], record["pid"]) == ("unknown", "gone", proc.pid)
    like = Likeness({k: record[k] for k in SETTINGS}, recompiled(record), weights_path(record))
    assert comparable(read_history(), like) == [record] and comparable([ok], like) == [ok]
