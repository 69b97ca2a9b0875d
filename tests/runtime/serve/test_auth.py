"""API keys at the door, against a real uvicorn serving the app over a fake engine: every path
needs the key, judged on the path the router serves — whatever the Host header, the root path,
or `//`, `%2F` and `..` say — and a 401 is one sentence with `WWW-Authenticate`, counted by key
name and never carrying the key."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
from door_fakes import Leaks, fake_launched, key_file, served

from runtime.serve.access import Access
from runtime.serve.auth import Door, RequireKey, open_paths
from store.api_keys import read_keys

KEY, OTHER = "gw-" + "a" * 29, "jobs-" + "b" * 27


def _door(tmp_path, open_status=False, root_path=""):
    keys = read_keys(key_file(tmp_path / "keys", gateway=KEY, jobs=OTHER))
    return Door(keys, open_paths(not open_status), None, root_path)


def raw(svc, target: str, headers: str = "", method: str = "GET") -> tuple[int, dict, bytes]:
    """One request with the exact target and headers given (no client normalises them)."""
    with socket.create_connection((svc.host, svc.port), timeout=30) as s:
        s.sendall(f"{method} {target} HTTP/1.1\r\nHost: svc\r\n{headers}Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}, body


ROUTES = ["/health", "/metrics", "/v1/models", "/v1/models/x", "/openapi.json", "/docs"]
# paths that are not /health or /metrics as the router reads them, however close they look
NEAR_MISSES = ["//health", "/health/", "/health/.", "/health/../v1/models", "/v1/../health", "/v1%2Fmodels",
               "/health%2F", "/%2Fhealth", "/./health", "http://svc/v1/models", "/health;x", "/HEALTH", "/metrics/x"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    with served(fake_launched(tmp), door=_door(tmp), access=Access(KEY, "gateway")) as svc:
        yield svc


def test_every_route_and_every_near_miss_is_401_without_a_key(keyed):
    leaks = Leaks(keyed)
    for target in ROUTES + NEAR_MISSES + ["/v1/completions"]:
        status, headers, body = raw(keyed, target, method="POST" if target == "/v1/completions" else "GET")
        assert status == 401, target
        assert headers["www-authenticate"] == 'Bearer realm="dsv4"'
        error = json.loads(body)["error"]
        assert error["message"] == "this service needs an API key: send `Authorization: Bearer KEY`"
        assert error["type"] == "authentication_error"
    leaks.check()


def test_the_host_header_never_opens_a_path_badhost(keyed):
    """CVE-2026-48710: `Host: x/health?` made Starlette's request.url.path read /health."""
    for host in ("example.com/health?x=", "svc/health#", "svc/health", "[::1]/health?"):
        with socket.create_connection((keyed.host, keyed.port), timeout=30) as s:
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            status_line = s.recv(4096).split(b"\r\n")[0]
        assert status_line.split()[1] in (b"400", b"401"), (host, status_line)


def test_the_key_opens_every_route_and_its_name_is_counted_never_the_key(keyed):
    for target in ROUTES:
        status, _, _ = raw(keyed, target, f"Authorization: Bearer {KEY}\r\n")
        assert status in (200, 404), target  # /v1/models/x: no such model, past the door
    assert raw(keyed, "/health", f"authorization: bearer {OTHER}\r\n")[0] == 200  # the scheme is case-blind
    status, headers, body = raw(keyed, "/health", f"Authorization: Bearer {KEY}x\r\n")
    assert status == 401 and headers["www-authenticate"] == 'Bearer realm="dsv4", error="invalid_token"'
    assert json.loads(body)["error"]["message"] == "the API key sent is not one this service accepts"
    for bad in (f"Basic {KEY}", "Bearer", f"Bearer {KEY[:-1]}", f"Token {KEY}"):
        assert raw(keyed, "/v1/models", f"Authorization: {bad}\r\n")[0] == 401, bad
    metrics = keyed.get("/metrics").text
    assert re.search(r'dsv4_api_key_requests_total\{key="gateway",result="accepted"\} \d', metrics)
    assert re.search(r'dsv4_api_key_requests_total\{key="jobs",result="accepted"\} 1\.0', metrics)
    assert re.search(r'dsv4_api_key_requests_total\{key="",result="wrong"\} [1-9]', metrics)
    assert re.search(r'dsv4_requests_total\{endpoint="/health",status="401"\} [1-9]', metrics)
    assert KEY not in metrics and OTHER not in metrics


def test_open_status_opens_exactly_health_and_metrics(tmp_path):
    with served(fake_launched(tmp_path), door=_door(tmp_path, open_status=True)) as svc:
        assert raw(svc, "/health")[0] == 200 and raw(svc, "/metrics")[0] == 200
        assert raw(svc, "/%68ealth")[0] == 200  # it is /health, as the router serves it
        for target in ["/v1/models", "/openapi.json", *NEAR_MISSES]:
            assert raw(svc, target)[0] == 401, target


def test_a_root_path_prefix_opens_nothing_more(tmp_path):
    """The router strips `root_path` from the scope's path; the door judges what remains, the
    same way (a prefix stripped differently once opened /v1/models again)."""
    with served(fake_launched(tmp_path), door=_door(tmp_path, open_status=True, root_path="/dsv4")) as svc:
        assert raw(svc, "/health")[0] == 200  # served as /dsv4/health → /health
        for target in ["/v1/models", "/dsv4/v1/models", "/dsv4", "/dsv4/", "//dsv4/health", "/dsv4health",
                       "/dsv4/health/../../v1/models"]:
            assert raw(svc, target)[0] == 401, target
        assert raw(svc, "/v1/models", f"Authorization: Bearer {KEY}\r\n")[0] == 200


def test_the_accepted_key_name_is_on_the_request_for_the_access_log(tmp_path):
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["state"].get("api_key"))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    counted = []
    app = RequireKey(inner, _door(tmp_path), lambda name, result: counted.append((name, result)))

    async def call(headers):
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/models", "root_path": "", "headers": headers, "method": "GET"}
        await app(scope, None, send)
        return sent[0]["status"]

    assert asyncio.run(call([(b"authorization", f"Bearer {OTHER}".encode())])) == 204
    assert asyncio.run(call([])) == 401
    assert seen == ["jobs"] and counted == [("jobs", "accepted"), ("", "missing")]
