"""A node's record keeps why it ended (the failing rank's line), its ranks' own logs and the node
before it on this host."""

from __future__ import annotations

import signal

from store import nodes


def test_an_ending_keeps_its_reason_and_a_stop_asked_for_none(tmp_path):
    log = tmp_path / "node.log"
    log.write_text("torchrun: rank 1 on b (pid 9) killed by SIGKILL\n")
    node = nodes.Node(123, 1.0, 0, 2, "a:29500", "/m", str(log), "", service_logs=("/s/serve-8000.rank0.log",),
                      previous_log="/s/node-old.log")
    failed = nodes.ended(node, 1, reason="rank 1 on b (pid 9) killed by SIGKILL")
    assert failed.ending.how == "exited 1" and failed.ending.reason == "rank 1 on b (pid 9) killed by SIGKILL"
    again = nodes.Node.from_json(failed.to_json())
    assert again.service_logs == ("/s/serve-8000.rank0.log",) and again.previous_log == "/s/node-old.log"
    assert again.ending.reason == failed.ending.reason
    stopped = nodes.ended(node, -signal.SIGTERM, asked=True, reason="whatever the log said last")
    assert stopped.ending.how == "stopped by SIGTERM" and stopped.ending.reason == ""
