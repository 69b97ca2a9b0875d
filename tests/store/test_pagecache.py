"""Page-cache residency (cachestat and mincore agree), warm, evict, remembered throughput."""

from __future__ import annotations

import os

import pytest

from store import pagecache

PAGE = pagecache.PAGE_SIZE
# Readahead may pull a few pages back in after an evict; these bounds tolerate it.
READAHEAD_SLACK = 0.25


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_STATE_DIR", str(tmp_path / "state"))


def _file(tmp_path, pages: int = 256):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(pages * PAGE))
    return path


def _methods() -> list[str]:
    return ["cachestat", "mincore"] if pagecache.cachestat_available() else ["mincore"]


def _evicted_or_skip(path) -> pagecache.Residency:
    after = pagecache.evict(path)
    if after.fraction > READAHEAD_SLACK:
        pytest.skip(f"this filesystem keeps pages after POSIX_FADV_DONTNEED ({after})")
    return after


def test_residency_methods_agree_after_warm_and_after_evict(tmp_path):
    path = _file(tmp_path)
    pagecache.warm(path, remember=False)
    hot = {m: pagecache.residency_path(path, method=m) for m in _methods()}
    assert all(r.fraction == 1.0 and r.total_pages == 256 for r in hot.values()), hot
    assert {r.method for r in hot.values()} == set(_methods())

    _evicted_or_skip(path)
    cold = {m: pagecache.residency_path(path, method=m) for m in _methods()}
    assert all(r.fraction <= READAHEAD_SLACK for r in cold.values()), cold
    assert len({r.cached_pages for r in cold.values()}) == 1, cold


def test_mincore_over_small_windows_counts_a_partly_cached_file_exactly(tmp_path, monkeypatch):
    path = _file(tmp_path, pages=64)
    _evicted_or_skip(path)
    with open(path, "rb") as f:  # pull in a middle stretch only
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        f.seek(20 * PAGE)
        f.read(10 * PAGE)
    monkeypatch.setattr(pagecache, "MINCORE_WINDOW", 3 * PAGE)  # windows end mid-stretch
    windowed = pagecache.residency_path(path, method="mincore")
    monkeypatch.setattr(pagecache, "MINCORE_WINDOW", 1 << 30)
    whole = pagecache.residency_path(path, method="mincore")
    assert windowed.cached_pages == whole.cached_pages
    assert 10 <= windowed.cached_pages < 64
    if pagecache.cachestat_available():
        assert pagecache.residency_path(path, method="cachestat").cached_pages == whole.cached_pages


def test_default_probe_prefers_cachestat_and_falls_back_to_mincore(tmp_path, monkeypatch):
    path = _file(tmp_path, pages=4)
    expected = "cachestat" if pagecache.cachestat_available() else "mincore"
    assert pagecache.residency_path(path).method == expected

    def refused(fd):
        raise OSError(38, "cachestat: Function not implemented")  # ENOSYS, as seccomp may say

    monkeypatch.setattr(pagecache, "_cachestat", refused)
    monkeypatch.setattr(pagecache, "_cachestat_works", None)
    assert pagecache.residency_path(path).method == "mincore"
    with pytest.raises(OSError):
        pagecache.residency_path(path, method="cachestat")


def test_empty_file_is_fully_resident_and_unknown_method_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.touch()
    for m in _methods():
        r = pagecache.residency_path(empty, method=m)
        assert (r.fraction, r.total_pages, r.cached_pages) == (1.0, 0, 0)
    with pytest.raises(ValueError, match="unknown residency method"):
        pagecache.residency_path(empty, method="fincore")


def test_warm_reads_everything_with_progress_and_records_cold_throughput(tmp_path, monkeypatch):
    path = _file(tmp_path)
    _evicted_or_skip(path)
    monkeypatch.setattr(pagecache, "MIN_MEASURED_BYTES", PAGE)
    calls = []
    result = pagecache.warm(
        path, lambda done, total, bps: calls.append((done, total)), chunk=PAGE * 16
    )
    size = path.stat().st_size
    assert result.bytes_read == size
    assert calls[-1] == (size, size) and len(calls) == 16
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert result.after.fraction == 1.0
    assert result.cold_bytes >= size * (1 - READAHEAD_SLACK)
    remembered = pagecache.read_throughput()
    assert remembered.measured and remembered.bytes_per_s == pytest.approx(result.cold_bytes_per_s)


def test_warm_of_a_hot_file_does_not_record_cache_speed_as_disk_speed(tmp_path):
    path = _file(tmp_path)
    pagecache.warm(path, remember=False)
    result = pagecache.warm(path)
    assert result.cold_bytes == 0 and result.cold_bytes_per_s is None
    assert not pagecache.read_throughput().measured


def test_read_throughput_defaults_when_unknown_or_unreadable(tmp_path):
    t = pagecache.read_throughput()
    assert (t.bytes_per_s, t.measured) == (pagecache.DEFAULT_READ_BYTES_PER_S, False)
    target = tmp_path / "state" / pagecache.THROUGHPUT_FILE
    target.parent.mkdir(parents=True)
    target.write_text("{not json")
    assert not pagecache.read_throughput().measured
    pagecache.remember_read_throughput(1.5e9, 1 << 30)
    assert pagecache.read_throughput().bytes_per_s == 1.5e9
    assert target.stat().st_mode & 0o777 != 0o600


def test_scheduled_mincore_reuses_a_sample_until_its_cost_share_has_passed(tmp_path):
    path = _file(tmp_path)
    now = [1000.0]
    pagecache.schedule(0.02, clock=lambda: now[0])
    try:
        first = pagecache.residency_path(path, method="mincore")
        assert pagecache.residency_path(path, method="mincore") is first  # within cost / 2 %
        now[0] += 3600  # far beyond cost / share
        assert pagecache.residency_path(path, method="mincore") is not first
    finally:
        pagecache.schedule(None)
    assert pagecache.residency_path(path, method="mincore") is not pagecache.residency_path(path, method="mincore")
