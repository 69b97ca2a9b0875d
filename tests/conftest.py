"""Shared fixtures: one tiny synthetic checkpoint per session, copied when a test mutates it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]  # the checkout: tests run its code and read its docs
TESTS = REPO / "tests"


@pytest.fixture(autouse=True)
def _isolated_user_dirs(tmp_path_factory, monkeypatch):
    """Never touch the real user cache/data/state dirs from a test."""
    base = tmp_path_factory.mktemp("userdirs")
    monkeypatch.setenv("DSV4_DATA_DIR", str(base / "data"))
    monkeypatch.setenv("DSV4_STATE_DIR", str(base / "state"))
    monkeypatch.setenv("DSV4_KERNEL_CACHE_DIR", str(base / "programs"))
    monkeypatch.setenv("DSV4_DEFAULT_PRESET", "tiny")  # an embedded default costs 6 MB, not 0.5 GB


@pytest.fixture(scope="session")
def native_library(tmp_path_factory) -> bytes:
    """The native products' library (`runtime.model.native`), built once a session: each build is
    several seconds of the C++ compiler, and every module that loads it loads these bytes."""
    from runtime.model.native import build

    out = tmp_path_factory.mktemp("native") / "native.so"
    build(out)
    return out.read_bytes()


@pytest.fixture
def serving():
    """`ops.use_native` for a test (a library's `dsv4::dense` kernel released while others serve),
    what the process served before restored after."""
    from runtime.model import ops

    with ops.native_restored():
        yield ops.use_native


@pytest.fixture(scope="session")
def tiny_ckpt_ro(tmp_path_factory) -> Path:
    """A tiny checkpoint shared by the whole session: never modify it (use `tiny_ckpt`)."""
    from runtime.synth.checkpoint import synthesize

    return synthesize("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def tiny_packed(tiny_ckpt_ro):
    """tiny's config, its one-rank packed layout, and the programs' weight views of it, in memory."""
    from runtime.model.config import load_config
    from runtime.weights.pack import PackedLayout, pack_in_memory
    from runtime.weights.views import packed_views
    from store.checkpoint import Checkpoint

    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config, ranks=1)
    ckpt = Checkpoint.open(tiny_ckpt_ro)
    try:
        weights = packed_views(layout, pack_in_memory(ckpt, layout))
    finally:
        ckpt.close()
    return config, layout, weights


@pytest.fixture
def tiny_ckpt(tiny_ckpt_ro, tmp_path) -> Path:
    """A private copy of the tiny checkpoint, free to corrupt."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_ro, dst)
    return dst


MAX_SEQ = 64  # small fixed-size KV caches keep every test launch cheap
E2E = TESTS / "e2e"


# `slow` whole: the end-to-end proofs (live services, sshd hosts, registries, torchrun) and the
# reliability suites (crash trials, concurrent processes, resource faults); and any test that needs a
# fixture which compiles every program of a checkpoint or starts a `dsv4 serve`
SLOW_DIRS = (E2E, TESTS / "reliability")
SLOW_FIXTURES = {"cold_export_launch", "tiny_server"}


def pytest_collection_modifyitems(items):
    """Mark what `pytest -m "not slow"` (the inner loop) leaves out; `heavy` is slow too."""
    for item in items:
        if (any(d in item.path.parents for d in SLOW_DIRS) or SLOW_FIXTURES & set(item.fixturenames)
                or item.get_closest_marker("heavy")):
            item.add_marker(pytest.mark.slow)


def launch(model_dir, *, backend="export", cache_dir=None, history=False, **kw):
    """Run registration in-process; returns (Launched, events)."""
    from runtime.events import Emitter
    from runtime.launch.registration import register
    from runtime.launch.spec import LaunchSpec

    events = []
    spec = LaunchSpec(Path(model_dir), kernel_cache_dir=cache_dir, backend=backend, device="cpu",
                      max_seq=kw.pop("max_seq", MAX_SEQ), **kw)
    launched = register(spec, Emitter(events.append), record=history)
    return launched, events


@pytest.fixture(scope="session")
def cold_export_launch(tiny_ckpt_ro, tmp_path_factory):
    """One cold launch (empty kernel cache, no sidecar) with the export backend; its cache
    directory is warm afterwards and shared (read-mostly) by later tests."""
    cache_dir = tmp_path_factory.mktemp("programs")
    launched, events = launch(tiny_ckpt_ro, cache_dir=cache_dir)
    launched.close()
    return cache_dir, launched, events


def start_server(model_dir, tmp_path, *extra, env=None):
    """A real `dsv4 serve` process on a free loopback port; (process, url, events file) once it
    serves. The caller stops it."""
    from runtime.events import parse

    events, log = tmp_path / "events.jsonl", tmp_path / "stderr.log"
    with open(log, "w") as err:  # a file, not a pipe: nobody reads a long-lived server's stderr
        proc = subprocess.Popen(
            [sys.executable, "-m", "console.cli", "serve", str(model_dir), "--device", "cpu", "--port", "0",
             "--max-seq", str(MAX_SEQ), "--events", str(events), *extra],
            stdout=subprocess.DEVNULL, stderr=err, text=True, env={**os.environ, **(env or {})})
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {log.read_text()}")
        if events.exists():
            # whole lines only: the server may be half-way through writing the last (a plan's
            # event is several KiB, more than one write)
            for line in events.read_text().splitlines(keepends=True):
                if not line.endswith("\n"):
                    break
                e = parse(line)
                if e.phase == "serve" and e.kind == "end":
                    return proc, e.detail["url"], events
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not become ready")


@contextlib.contextmanager
def app_server(launched, speculative: bool = False):
    """`launched`'s service app served by uvicorn from a thread on a loopback port: the API at a
    real URL (sockets, disconnects, streams) without a `dsv4 serve` process. Yields the URL; the
    caller closes `launched`."""
    import threading

    import uvicorn

    from runtime.serve.app import Limits, create_app
    from runtime.serve.server import bind, url_of

    app = create_app(launched, Limits(speculative=speculative))
    sock = bind("127.0.0.1", 0)
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="app-server")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process service did not start"
        time.sleep(0.01)
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
        app.state.scheduler.close()


@pytest.fixture(scope="session")
def tiny_app(tiny_ckpt_ro):
    """The tiny model registered in this process (eager: nothing compiles; tokens never depend on
    the tier) behind `app_server`, with MTP speculation as `tiny_server`: the API's semantics
    through the real model, in-process. (url, Launched)."""
    launched, _ = launch(tiny_ckpt_ro, backend="eager")
    try:
        with app_server(launched, speculative=True) as url:
            yield url, launched
    finally:
        launched.close()


@pytest.fixture(scope="session")
def tiny_server(cold_export_launch, tiny_ckpt_ro, tmp_path_factory):
    """One `dsv4 serve` of the tiny checkpoint (export programs, warm cache, MTP speculation:
    greedy requests verify drafts, and must still answer greedy's tokens) shared by the service
    and OpenAI-client tests: (url, events file, the cold in-process launch)."""
    proc, url, events = start_server(tiny_ckpt_ro, tmp_path_factory.mktemp("srv"), "--backend", "export",
                                      "--kernel-cache-dir", str(cold_export_launch[0]), "--speculative", "mtp")
    yield url, events, cold_export_launch[1]
    proc.terminate()
    proc.wait(timeout=60)


def get_json(url: str, body: bytes | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) whatever the status."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, body, {"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)
