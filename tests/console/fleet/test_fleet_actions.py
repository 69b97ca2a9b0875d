"""Each action, defined once: the `dsv4` command line it runs on a host, as a person would type it."""

from __future__ import annotations

from pathlib import Path

from console.fleet import actions as A
from runtime.launch.spec import LaunchSpec


def test_each_fleet_action_runs_the_dsv4_command_a_person_would():
    spec = LaunchSpec(Path("/models/v4"), backend="export", ranks=2, max_seq=64)
    said = {a: [" ".join(s.args) for s in A.steps(a, spec, registry="reg:5000/dsv4", insecure=True)]
            for a in ("compile", "prepack", "pull", "stop", "warm")}
    assert said["compile"] == ["compile /models/v4 --backend export --ranks 2 --max-seq 64 --events -"]
    assert said["prepack"] == ["prepack /models/v4 --ranks 2 --events - --force"]
    assert said["pull"] == ["cache pull reg:5000/dsv4 --model /models/v4 --backend export --ranks 2 --max-seq 64 "
                            "--insecure"]
    assert said["stop"] == ["node stop --json"]
    assert said["warm"] == ["sidecar warm /models/v4 --ranks 2 --if-present --events -", said["compile"][0]]
    assert " ".join(A.purge_args(spec)) == ("purge /models/v4 --backend export --ranks 2 --max-seq 64 --scope plan "
                                            "--json --dry-run")
    assert A.purge_args(spec, "cache", ["/x", "/y"])[-5:] == ("--yes", "--only", "/x", "--only", "/y")
    node = A.node_start(spec, 2, 1, "10.0.0.1", 29500).args
    assert node[:12] == ("node", "start", "--json", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
                         "--master-addr", "10.0.0.1", "--master-port")
    assert A.service_stop(42, 10) == ("service", "stop", "42", "--timeout", "10", "--json")
