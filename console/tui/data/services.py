"""Services: every `dsv4 serve` of this user on this host (from the registry in
`store.services`), with a health probe of each URL. Plain Python, no torch, off the UI thread."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from store import services

HEALTH_TIMEOUT = 0.5  # loopback answers in milliseconds; a wedged service must not stall a refresh


@dataclass(frozen=True)
class ServicesSnapshot:
    services: tuple[dict[str, Any], ...] = ()  # Service.to_json() + health + from_console
    error: str = ""


def health(url: str, timeout: float = HEALTH_TIMEOUT) -> tuple[str, dict[str, Any]]:
    """`ok`, `HTTP <status>` or `no answer` from GET <url>/health, and the body it answered
    ({} when none): engine figures, slots, free slots, queued."""
    import http.client  # lazily: not on the first paint's path
    import json
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        return "-", {}
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        raw = response.read(1 << 16)
        body: dict[str, Any] = {}
        with contextlib.suppress(ValueError, TypeError):
            body = dict(json.loads(raw))
        return ("ok" if response.status == 200 else f"HTTP {response.status}"), body
    except (OSError, http.client.HTTPException):
        return "no answer", {}
    finally:
        conn.close()


def in_flight(body: dict[str, Any]) -> int | None:
    """Requests holding a slot or waiting for one, from a /health body (None: it did not say)."""
    try:
        return int(body["slots"]) - int(body["free_slots"]) + int(body["queued"])
    except (KeyError, TypeError, ValueError):
        return None


def collect_services() -> ServicesSnapshot:
    try:
        rows = []
        for s in services.running():
            status, body = health(s.url) if s.url else (s.state, {})
            rows.append({**s.to_json(), "from_console": s.from_console, "health": status,
                         "engine": body.get("engine") if isinstance(body.get("engine"), dict) else {},
                         "in_flight": in_flight(body)})
        return ServicesSnapshot(tuple(rows))
    except Exception as e:  # a collector never takes the console down
        return ServicesSnapshot(error=f"{type(e).__name__}: {e}")
