"""Shared fixtures: one tiny synthetic checkpoint per session, copied when a test mutates it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_user_dirs(tmp_path_factory, monkeypatch):
    """Never touch the real user cache/data/state dirs from a test."""
    base = tmp_path_factory.mktemp("userdirs")
    monkeypatch.setenv("DSV4_DATA_DIR", str(base / "data"))
    monkeypatch.setenv("DSV4_STATE_DIR", str(base / "state"))
    monkeypatch.setenv("DSV4_KERNEL_CACHE_DIR", str(base / "programs"))
    monkeypatch.setenv("DSV4_DEFAULT_PRESET", "tiny")  # an embedded default costs 6 MB, not 0.5 GB


@pytest.fixture(scope="session")
def tiny_ckpt_ro(tmp_path_factory) -> Path:
    """A tiny checkpoint shared by the whole session: never modify it (use `tiny_ckpt`)."""
    from runtime.synth import synthesize

    return synthesize("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture
def tiny_ckpt(tiny_ckpt_ro, tmp_path) -> Path:
    """A private copy of the tiny checkpoint, free to corrupt."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_ro, dst)
    return dst


MAX_SEQ = 64  # small fixed-size KV caches keep every test launch cheap


def launch(model_dir, *, backend="export", cache_dir=None, history=False, **kw):
    """Run registration in-process; returns (Launched, events)."""
    from runtime.events import Emitter
    from runtime.registration import LaunchOptions, register

    events = []
    options = LaunchOptions(Path(model_dir), kernel_cache_dir=cache_dir, backend=backend, device="cpu",
                            max_seq=kw.pop("max_seq", MAX_SEQ), history=history, **kw)
    launched = register(options, Emitter(events.append))
    return launched, events


@pytest.fixture(scope="session")
def cold_export_launch(tiny_ckpt_ro, tmp_path_factory):
    """One cold launch (empty program cache, no sidecar) with the export backend; its cache
    directory is warm afterwards and shared (read-mostly) by later tests."""
    cache_dir = tmp_path_factory.mktemp("programs")
    launched, events = launch(tiny_ckpt_ro, cache_dir=cache_dir)
    launched.close()
    return cache_dir, launched, events
