"""Issue 11 item 3 against a running `dsv4 serve`: its mapped sidecar is truncated, or another
same-size sidecar is copied over it. The service must know first (its read lease), answer 503
with the reason, record it in the launch history, stop, and let the writer go only once nothing
reads the mapping; never die of SIGBUS, never serve tokens from bytes it did not validate."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_server

from runtime.weights.prepack import prepack
from store import sidecar

pytestmark = pytest.mark.slow


def _write_in_background(action) -> tuple[threading.Thread, dict]:
    done: dict = {}

    def run():
        try:
            action()
            done["at"] = time.monotonic()
        except OSError as e:
            done["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


@pytest.mark.parametrize("how", ["truncate", "copy-over"])
def test_a_sidecar_changed_under_a_running_service_fails_closed(how, tiny_ckpt, tmp_path):
    prepack(tiny_ckpt)
    path = sidecar.default_sidecar_path(tiny_ckpt, 1)
    proc, url, events = start_server(tiny_ckpt, tmp_path, "--backend", "eager", "--cold-policy", "read")
    try:
        before = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
        assert before.status_code == 200
        weights = [json.loads(line) for line in events.read_text().splitlines()]
        assert any(e["phase"] == "weights" and e["kind"] == "end" and e["detail"]["path"] == "MAP" for e in weights)

        if how == "truncate":
            writer = lambda: os.truncate(path, 0)  # noqa: E731
        else:
            other = tmp_path / "ckp2"  # as long a name as "ckpt": the recorded source dir pads the header alike
            shutil.copytree(tiny_ckpt, other, ignore=shutil.ignore_patterns("dsv4-packed*"))
            config = json.loads((other / "config.json").read_text())
            (other / "config.json").write_text(json.dumps({**config, "note": "another checkpoint"}))
            replacement = prepack(other).path
            assert replacement.stat().st_size == path.stat().st_size
            writer = lambda: shutil.copyfile(replacement, path)  # noqa: E731
        thread, done = _write_in_background(writer)

        said = None
        deadline = time.monotonic() + 40  # the kernel's lease-break time is 45 s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"{url}/health", timeout=5)
            except httpx.TransportError:
                break  # the service has stopped listening
            if r.status_code == 503:
                said = r.text
                refused = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4},
                                     timeout=30)
                assert refused.status_code == 503
                break
            assert "at" not in done, "the writer went ahead while the service still answered ok"
            time.sleep(0.05)
        code = proc.wait(60)
        thread.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1 and code != -signal.SIGBUS  # a clean, non-zero exit: not a bare "Bus error"
    assert "at" in done  # the writer went on once the service let go
    stderr = (tmp_path / "stderr.log").read_text()
    assert "changed under the service" in stderr and "Bus error" not in stderr
    assert said is not None and "changed under the service" in said  # the 503 said why
    history = Path(os.environ["DSV4_STATE_DIR"]) / "launches.jsonl"
    record = json.loads(history.read_text().splitlines()[-1])
    assert record["outcome"] == "error" and "changed under the service" in record["error"]
    assert record["failed_phase"] == "serve"
