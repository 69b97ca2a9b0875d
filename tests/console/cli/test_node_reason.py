"""A node's ending says why (issue 71, items 1 and 2): the failing rank's own line from the node's
log, or the line naming the rank that was killed first — never torchrun's footer."""

from __future__ import annotations

from console.cli.node import node_reason

FOOTER = """\
============================================================
dsv4 FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _log(tmp_path, text: str) -> str:
    path = tmp_path / "node.log"
    path.write_text(text)
    return str(path)


def test_the_ranks_own_error_line_is_the_reason_not_torchruns_footer(tmp_path):
    log = _log(tmp_path, "2026-01-05 14:02:30.000 INFO  access 200\n"
                         "2026-01-05 14:02:33.120 ERROR service failed: rank 1 on host-b (pid 77) stopped answering: "
                         "no heartbeat for 5.2 s (--rank-timeout 5) during phase serve\n"
                         "2026-01-05 14:02:34.500 ERROR service rank 1 on host-b (pid 77) stopped answering: no "
                         "heartbeat for 5.2 s (--rank-timeout 5) during phase serve; stopped serving (launch again)\n"
                         "E0105 14:02:35.000000 100 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                         "(exitcode: 1) local_rank: 0 (pid: 4242) of binary: dsv4\n"
                         "torchrun: rank 0 on host-a (pid 4242) exited 1\n" + FOOTER)
    assert node_reason(log) == ("rank 1 on host-b (pid 77) stopped answering: no heartbeat for 5.2 s "
                                "(--rank-timeout 5) during phase serve; stopped serving (launch again)")


def test_a_rank_killed_first_is_the_reason_whatever_the_others_said_after(tmp_path):
    log = _log(tmp_path, '[rank0]:{"ts":"x","level":"error","logger":"service","msg":"rank 0 stopping: rank 1 lost"}\n'
                         "torchrun: rank 1 on host-b (pid 78) killed by SIGKILL; 1 other rank here stopped after it\n")
    assert node_reason(log) == "rank 1 on host-b (pid 78) killed by SIGKILL; 1 other rank here stopped after it"


def test_a_log_with_neither_says_nothing_rather_than_its_last_line(tmp_path):
    assert node_reason(_log(tmp_path, FOOTER)) == ""
    assert node_reason(str(tmp_path / "missing.log")) == ""
