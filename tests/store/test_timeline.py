"""store.timeline: typed events kept per host, merged by time, repeats counted."""

from __future__ import annotations

import json
import os

from store import timeline as tl


def test_an_event_round_trips_and_says_itself():
    e = tl.TimelineEvent(kind=tl.FAILED, host="b", rank=1, text="rank 1 on b (pid 42) was killed by SIGKILL", ts=5.0)
    assert tl.TimelineEvent.from_json(json.loads(json.dumps(e.to_json()))) == e
    assert e.sentence() == "service on b failed (rank 1): rank 1 on b (pid 42) was killed by SIGKILL"
    assert tl.TimelineEvent(kind=tl.BACK, host="c", seconds=185).sentence() == "c back after 3m05s"
    assert "done on a, b in 12s" in tl.TimelineEvent(kind=tl.ENDED, action="warm", hosts=("a", "b"), ok=True,
                                                       seconds=12).sentence()


def test_another_version_is_not_read_as_this_one():
    lines = [json.dumps({"v": 2, "kind": tl.SERVING, "host": "a", "ts": 1}),
             json.dumps({"v": 1, "kind": tl.SERVING, "host": "a", "ts": 2, "url": "http://a:1"}),
             '{"v": 1, "kind": "service.serv',  # torn by a crash mid-line
             "not json"]
    assert [e.ts for e in tl.parse(lines)] == [2]


def test_each_host_keeps_its_file_and_a_reader_merges_them_by_time(tmp_path):
    for host, ts in (("a", 3.0), ("b", 1.0), ("a", 2.0), ("b", 4.0)):
        assert tl.append(tl.TimelineEvent(kind=tl.STALE, host=host, ts=ts, text="no snapshot"),
                         tl.host_file(host, tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl"]
    assert [(e.host, e.ts) for e in tl.read_dir(tmp_path)] == [("b", 1.0), ("a", 2.0), ("a", 3.0), ("b", 4.0)]
    fetched = (tmp_path / "b.jsonl").read_text().splitlines()  # another host's file, fetched as text
    assert [e.ts for e in tl.merge(tl.read(tl.host_file("a", tmp_path)), tl.parse(fetched))] == [1.0, 2.0, 3.0, 4.0]


def test_repeats_are_counted_with_their_first_time():
    events = [tl.TimelineEvent(kind=tl.STALE, host="a", text="no snapshot", ts=t) for t in (1, 5, 9)]
    events += [tl.TimelineEvent(kind=tl.BACK, host="a", seconds=s, ts=t) for s, t in ((3, 4), (2, 10))]
    out = tl.counted(events)
    assert [(c.event.kind, c.count, c.first, c.event.ts) for c in out] == [(tl.STALE, 3, 1, 9), (tl.BACK, 2, 4, 10)]
    assert "(×3 since" in out[0].line()


def test_appending_never_raises_nor_blocks(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    assert tl.append(tl.TimelineEvent(kind=tl.SERVING, host="a"), fifo) is False
    (tmp_path / "file").write_text("")
    assert tl.append(tl.TimelineEvent(kind=tl.SERVING, host="a"), tmp_path / "file" / "x.jsonl") is False


def test_record_appends_to_this_hosts_file_under_the_state_dir():
    e = tl.record(tl.REGISTERING, pid=7, text="tiny")
    assert tl.read() == [e] and tl.host_file().parent == tl.timeline_dir()
