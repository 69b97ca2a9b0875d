"""Service: request fuzzing of /v1/completions (hypothesis) and 64 concurrent clients; loopback
bind; security invariants of the cache and the loaders."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from conftest import REPO, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relcounts import record

RSS_BOUND = 64 << 20  # growth allowed between the first and the last load round
FUZZ = {"n": 0, "4xx": 0, "2xx": 0, "5xx": 0}


@pytest.fixture(scope="module")
def server(tiny_ckpt_ro, tmp_path_factory):
    proc, url, _ = start_server(tiny_ckpt_ro, tmp_path_factory.mktemp("relsrv"), "--backend", "eager",
                                "--validate-tokens", "2")
    yield proc, url
    proc.terminate()
    assert proc.wait(timeout=60) == 0


json_scalar = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=20)
body = st.one_of(
    st.recursive(json_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                 max_leaves=8),
    st.fixed_dictionaries({}, optional={
        "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 300), max_size=40), json_scalar),
        "max_tokens": st.one_of(st.integers(-3, 5000), json_scalar),
        "temperature": st.one_of(st.floats(-1, 20), json_scalar),
        "stream": json_scalar, "seed": json_scalar, "model": json_scalar,
    }),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(payload=body, raw=st.booleans())
def test_fuzzed_requests_are_never_5xx(server, payload, raw):
    proc, url = server
    import json as _json

    if isinstance(payload, dict) and isinstance(payload.get("max_tokens"), int) and payload["max_tokens"] > 0:
        payload["max_tokens"] = min(payload["max_tokens"], 3)  # bounded work for valid requests
    data = _json.dumps(payload, allow_nan=True).encode()
    if raw:
        data = data[: len(data) // 2]  # truncated JSON
    r = httpx.post(f"{url}/v1/completions", content=data, headers={"content-type": "application/json"}, timeout=60)
    FUZZ["n"] += 1
    FUZZ[f"{r.status_code // 100}xx"] = FUZZ.get(f"{r.status_code // 100}xx", 0) + 1
    assert r.status_code < 500, r.text
    assert proc.poll() is None


def test_fuzz_counts(server, tmp_path_factory):
    proc, _ = server
    record(tmp_path_factory, "security: request fuzzing of /v1/completions",
           injection="hypothesis JSON bodies (150, derandomized), half truncated", trials=FUZZ["n"],
           recovered=FUZZ["2xx"], clean_error=FUZZ["4xx"], data_lost=FUZZ["5xx"],
           note="recovered = valid request answered 200; clean_error = 4xx JSON error; data_lost column = 5xx")
    assert FUZZ["5xx"] == 0 and proc.poll() is None


def test_64_concurrent_clients_all_answered_and_rss_stable(server, tmp_path_factory):
    proc, url = server
    prompts = [[1 + i % 7, 2, 3] for i in range(64)]
    with httpx.Client(timeout=120) as c:
        ref = {tuple(p): c.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 4}).json()
               for p in {tuple(p): p for p in prompts}.values()}
    expected = {k: v["choices"][0]["token_ids"] for k, v in ref.items()}
    rss = []
    answered = wrong = 0

    def client(p):
        with httpx.Client(timeout=300) as c:
            r = c.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 4})
        return r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected[tuple(p)]

    with ThreadPoolExecutor(64) as pool:
        for _round in range(4):
            results = list(pool.map(client, prompts))
            answered += len(results)
            wrong += results.count(False)
            rss.append(psutil.Process(proc.pid).memory_info().rss)
    growth = rss[-1] - rss[0]
    record(tmp_path_factory, "load: 64 concurrent clients", injection="64 threads x 4 rounds, max_tokens 4",
           trials=answered, recovered=answered - wrong, data_lost=wrong,
           note=f"server RSS {rss[0] >> 20} MiB after round 1 -> {rss[-1] >> 20} MiB after round 4 "
                f"(bound +{RSS_BOUND >> 20} MiB)")
    assert wrong == 0
    assert growth < RSS_BOUND, rss


def test_service_binds_loopback_by_default(server):
    _, url = server
    assert url.startswith("http://127.0.0.1:")


# --- security invariants of the stores ---------------------------------------------------------


def test_no_unsafe_deserialisation_in_the_code(tmp_path_factory):
    pattern = re.compile(r"\bpickle\.loads?\(|\bcPickle\b|torch\.load\((?![^)]*weights_only=True)")
    hits = []
    for d in ("store", "runtime", "console", "bench"):
        for p in (REPO / d).rglob("*.py"):
            hits += [f"{p}:{i}" for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    record(tmp_path_factory, "security: unsafe deserialisation",
           injection="source scan of store/ runtime/ console/ bench/",
           trials=1, clean_error=int(not hits), data_lost=len(hits))
    assert hits == []


def test_untrusted_roots_entries_and_symlinks_are_refused(tmp_path, tmp_path_factory):
    from store.fingerprint import Key
    from store.kernel_cache import Hit, KernelCache, UntrustedCacheError

    key = Key.of({"backend": "export", "source:p": "1", "torch": "2.13.0"})
    outside = tmp_path / "outside.pt2"
    outside.write_bytes(b"evil")
    cases = {
        "root world-writable": lambda c, e: os.chmod(c.root, 0o777),
        "root group-writable": lambda c, e: os.chmod(c.root, 0o775),
        "root owned by another user": lambda c, e: os.chown(c.root, 65534, 65534),
        "entry world-writable": lambda c, e: os.chmod(e, 0o777),
        "entry owned by another user": lambda c, e: os.chown(e, 65534, 65534),
        "artifact owned by another user": lambda c, e: os.chown(e / "program.pt2", 65534, 65534),
        "artifact symlink outside the root": lambda c, e: ((e / "program.pt2").unlink(),
                                                           (e / "program.pt2").symlink_to(outside)),
    }
    refused = 0
    for i, (name, damage) in enumerate(cases.items()):
        cache = KernelCache(tmp_path / f"c{i}")
        entry = cache.publish("prog", key, {"program.pt2": b"good"}).path
        damage(cache, entry)
        try:
            got = cache.lookup("prog", key)
            ok = not isinstance(got, Hit) and got.kind == "untrusted"
        except UntrustedCacheError:
            ok = True
        refused += ok
        assert ok, name
    record(tmp_path_factory, "security: untrusted cache roots/entries/symlinks",
           injection="chmod g+w/o+w, chown 65534, symlink outside the root (as root: the project's own checks)",
           trials=len(cases), clean_error=refused, data_lost=len(cases) - refused)
