"""Heartbeats in a real rendezvous store (issue 26): a rank whose beat stops (dead, stopped, cut
off) is lost and named with its host, pid and phase, whether or not traffic flows; a store
that stops answering loses the service too; a live, beating rank never is."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from runtime.launch.liveness import Heartbeat, describe, member
from runtime.launch.rank_store import PREFIX

TIMEOUT = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store():
    host = TCPStore("127.0.0.1", _free_port(), None, True, timedelta(seconds=5), wait_for_workers=False)
    yield host


def _client(store) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=TIMEOUT), wait_for_workers=False)


def _watch(store, rank: int, peers: list[int]) -> tuple[Heartbeat, list[str], threading.Event]:
    lost: list[str] = []
    said = threading.Event()

    def lose(reason: str) -> None:
        lost.append(reason)
        said.set()

    return Heartbeat(_client(store), PREFIX, rank, peers, TIMEOUT, lose).start(), lost, said


def test_a_rank_whose_beat_stops_is_lost_and_named_with_its_host_and_phase(store):
    store.set(f"{PREFIX}member/1", member(1))
    store.set(f"{PREFIX}phase/1", "serve")
    zero, lost, said = _watch(store, 0, [1])
    one, lost_one, _ = _watch(store, 1, [0])
    time.sleep(4 * TIMEOUT)
    assert lost == [] and lost_one == []  # both beat: nobody is lost, however long it runs
    one.stop()  # as SIGSTOP would: the process lives, nothing answers
    assert said.wait(20 * TIMEOUT)
    (reason,) = lost
    assert reason.startswith(f"rank 1 on {socket.gethostname()} (pid ")
    assert "stopped answering: no heartbeat for" in reason and reason.endswith("during phase serve")
    zero.stop()


def test_a_rank_that_never_beats_after_joining_is_lost_too(store):
    _, lost, said = _watch(store, 0, [1, 2])
    two, _, _ = _watch(store, 2, [0, 1])
    assert said.wait(20 * TIMEOUT)
    assert lost[0].startswith("rank 1 ") and lost[0].endswith("during phase start")
    two.stop()


def test_a_store_that_stops_answering_loses_the_service():
    import gc

    host = TCPStore("127.0.0.1", _free_port(), None, True, timedelta(seconds=5), wait_for_workers=False)
    _watch(host, 0, [1])
    _, lost, said = _watch(host, 1, [0])
    time.sleep(2 * TIMEOUT)
    del host  # the store's host is gone
    gc.collect()
    assert said.wait(40 * TIMEOUT)
    assert lost[0].startswith(f"rank 1 on {socket.gethostname()} lost the rendezvous store"), lost


def test_what_a_rank_posts_names_it():
    assert describe(3, member(3)).startswith(f"rank 3 on {socket.gethostname()} (pid ")
    assert describe(3, "not json") == "rank 3"


def test_the_silent_rank_is_blamed_by_name_and_its_line_is_its_error_in_the_roster(store):
    """What /health's ranks show: the line that named a rank (here: the heartbeat's on a silent
    one) as that rank's last error, posted for rank 0 to read; the others have none."""
    from runtime.launch.liveness import roster

    blamed: list[tuple[int, str, bool]] = []
    lost: list[str] = []
    said = threading.Event()
    watch = Heartbeat(_client(store), PREFIX, 0, [1], TIMEOUT, lambda reason: (lost.append(reason), said.set()),
                      lambda rank, line, post: blamed.append((rank, line, post))).start()
    assert said.wait(20 * TIMEOUT)  # rank 1 never beats
    watch.stop()
    assert blamed == [(1, lost[0], True)]
    ranks = roster(2, 0, "serve", {}, lambda r: None, {}, {r: line for r, line, _ in blamed})
    assert [r["error"] for r in ranks] == ["", lost[0]]
