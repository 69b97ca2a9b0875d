"""Which log a console follows: the service's own capped log file (not its terminal output), each
rank's, a rank's own on its node's host, and the previous run's of each, kept beside it — only
files the registries name (real registry and node records of this process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from console.data.logs import log_args, which_log
from console.fleet.local import LocalHost
from store import nodes, services
from store.errors import UserError


def _service(tmp_path: Path, **fields) -> services.Service:
    me = psutil.Process()
    record = services.Service(os.getpid(), me.create_time(), tuple(me.cmdline()), "/models/tiny", services.SERVING,
                              "http://127.0.0.1:8000", log=str(tmp_path / "output.log"), **fields)
    services._write(record)
    return record


def _lines(path: Path, *lines: str) -> str:
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def test_the_services_own_log_each_ranks_and_the_previous_runs(tmp_path):
    own = _lines(tmp_path / "serve-8000.log", "serving")
    before = _lines(tmp_path / "serve-8000.prev.log", "the run before")
    rank1 = _lines(tmp_path / "serve-8000.rank1.log", "rank 1 serving")
    _lines(tmp_path / "serve-8000.rank1.prev.log", "rank 1 before")
    _service(tmp_path, log_file=own, previous_log=before, rank_log_files=("", rank1))
    assert which_log() == ("service", own)  # the capped log, not the terminal output beside it
    assert which_log(previous=True) == ("service (previous run)", before)
    assert which_log(rank=1) == ("rank 1", rank1)
    assert which_log(rank=1, previous=True) == ("rank 1 (previous run)", str(tmp_path / "serve-8000.rank1.prev.log"))
    with pytest.raises(UserError, match="keeps no log of rank 2"):
        which_log(rank=2)
    feed = LocalHost().log("service", previous=True)
    feed.start()
    assert feed.poll() == ["the run before"]
    assert log_args(pid=7, rank=1, previous=True) == ("--pid", "7", "--rank", "1", "--previous")


def test_a_first_run_says_it_has_no_previous_log(tmp_path):
    _service(tmp_path, log_file=_lines(tmp_path / "serve-9000.log", "first"))
    with pytest.raises(UserError, match="no previous run's log here"):
        which_log(previous=True)


def test_a_nodes_rank_has_its_own_log_and_the_node_its_previous_one(tmp_path):
    node = nodes.Node(os.getpid(), psutil.Process().create_time(), 1, 2, "10.0.0.1:29500", "/models/tiny",
                      _lines(tmp_path / "node-1.log", "torchrun"), "", service_logs=(
                          _lines(tmp_path / "serve-8000.rank2.log", "rank 2 here"),
                          _lines(tmp_path / "serve-8000.rank3.log", "rank 3 here")),
                      previous_log=_lines(tmp_path / "node-0.log", "the node before"))
    nodes.write(node)
    assert which_log(node=node.pid, rank=3) == ("rank 3", str(tmp_path / "serve-8000.rank3.log"))
    assert which_log(node=node.pid) == ("node 1", str(tmp_path / "node-1.log"))
    assert which_log(node=node.pid, previous=True) == ("node 1 (previous run)", str(tmp_path / "node-0.log"))
    with pytest.raises(UserError, match="keeps no log of rank 0 on this host"):
        which_log(node=node.pid, rank=0)
    assert json.loads(json.dumps(node.to_json()))["service_logs"][1].endswith("rank3.log")
