"""`dsv4 node start|stop|ls`: this host's part of a service across hosts — `torchrun` with this
host's node rank, the first host's address as the master, and `dsv4 serve` as every rank's
program — detached, watched by a supervisor that records how it ended (`store.nodes`). torchrun
runs as `runtime.launch.torchrun`: its rendezvous store listens on --master-addr alone.

The fleet console starts a service across hosts by running `dsv4 node start` on each over SSH
(node 0 first, `--master-port 0`: it picks a free port and says it), and stops it with
`dsv4 node stop`. Torch-free: torchrun and the ranks import torch, this command does not.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from console.cli.output import print_json, print_table
from runtime.launch.spec import SERVE, add_flags
from store.errors import UserError

START_WAIT_S = 20.0  # the supervisor records the agent within a second; this bounds a wedged start


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("node", help="this host's node of a service across hosts: start, stop, ls",
                           description="A service across hosts runs one torchrun agent per host; `dsv4 node` "
                           "starts this host's (detached, its ending recorded), stops it, and lists them. "
                           "dsv4-console --hosts/--fleet runs these over SSH.")
    actions = group.add_subparsers(dest="action", metavar="ACTION", required=True)

    start = actions.add_parser("start", help="start this host's node: torchrun with `dsv4 serve` as its ranks",
                               description="Start `torchrun --nnodes H --node-rank K --master-addr A "
                               "--master-port P --nproc-per-node N` with `dsv4 serve MODEL_DIR …` as every "
                               "rank, detached; print the node's record. --ranks (the service's ranks on all "
                               "hosts) defaults to H × N.")
    start.add_argument("--nnodes", type=int, required=True, metavar="H", help="hosts in the service")
    start.add_argument("--node-rank", type=int, required=True, metavar="K", help="this host's node rank (0..H-1)")
    start.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="ranks on this host (default 1)")
    start.add_argument("--master-addr", required=True, metavar="ADDR",
                       help="node 0's address as every host reaches it (`auto` on node 0: the address this "
                       "ssh session reached it at, $SSH_CONNECTION's; else its hostname's)")
    start.add_argument("--json", action="store_true", help="print the record as one JSON line")
    add_flags(start, SERVE, model_required=True, model_help="checkpoint directory (its path on this host)")
    for act in start._actions:  # two of serve's flags mean more here
        if act.dest == "master_port":
            act.help, act.required = "the rendezvous port on node 0 (0 on node 0: a free one there, printed)", True
        elif act.dest == "events":
            act.help = "progress events of this host's ranks (default: a file beside the node's log)"
    start.set_defaults(func=cmd_start)

    run = actions.add_parser("supervise", help=argparse.SUPPRESS)
    run.add_argument("record", help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_supervise)

    stop = actions.add_parser("stop", help="stop this host's running nodes (SIGTERM: rank 0 drains)",
                              description="Stop the nodes `dsv4 node start` runs here (all, or the agents "
                              "named): SIGTERM to each torchrun agent, which stops its ranks; SIGKILL to "
                              "what is left after --timeout.")
    stop.add_argument("pids", nargs="*", type=int, metavar="PID", help="agent pids (default: every running node)")
    stop.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="before SIGKILL (default 60)")
    stop.add_argument("--json", action="store_true", help="print what each stop did as JSON")
    stop.set_defaults(func=cmd_stop)

    ls = actions.add_parser("ls", help="this host's nodes, running or ended")
    ls.add_argument("--json", action="store_true", help="print them as JSON")
    ls.set_defaults(func=cmd_ls)


def _free_port(addr: str) -> int:
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
            return s.getsockname()[1]
    except OSError as e:
        raise UserError(f"--master-addr {addr}: cannot bind a port there ({e.strerror}); node 0 must be "
                        f"started with its own address") from None


def _own_address() -> str:
    """This host's address as the one who started us over ssh reached it ($SSH_CONNECTION: client
    address and port, server address and port); without ssh, its hostname's."""
    import os

    parts = os.environ.get("SSH_CONNECTION", "").split()
    if len(parts) == 4:
        return parts[2]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise UserError(f"--master-addr auto: no ssh connection to read it from, and {socket.gethostname()} does not "
                        f"resolve ({e}); give node 0's address") from None


def _dsv4_program() -> list[str]:
    """How torchrun runs `dsv4` for each rank: the installed script beside this interpreter (its
    command line says `dsv4 serve`), else this interpreter's `-m console.cli`."""
    script = Path(sys.executable).parent / "dsv4"
    return ["--no-python", str(script)] if script.is_file() else ["-m", "console.cli"]


def cmd_start(args: argparse.Namespace) -> int:
    from runtime.launch.spec import from_args
    from store import nodes

    hosts, rank, per = args.nnodes, args.node_rank, args.nproc_per_node
    if not 1 <= hosts <= 4096 or not 0 <= rank < hosts:
        raise UserError(f"--node-rank {rank} of --nnodes {hosts}: the node rank must be 0..{hosts - 1}")
    if not 1 <= per <= 1024:
        raise UserError(f"--nproc-per-node {per} is out of range; allowed 1..1024")
    port, addr = args.master_port, args.master_addr
    if port is None or not 0 <= port <= 65535:
        raise UserError("--master-port P is required: node 0's rendezvous port (0 on node 0: a free one)")
    if (port == 0 or addr == "auto") and rank != 0:
        raise UserError("--master-port 0 and --master-addr auto are node 0's to resolve; pass node 0's here")
    if addr == "auto":
        addr = _own_address()
    if port == 0:
        port = _free_port(addr)
    nodes.nodes_dir().mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{rank}"
    log, events = nodes.nodes_dir() / f"node-{stamp}.log", nodes.nodes_dir() / f"node-{stamp}.events.jsonl"
    args.master_port = None  # torchrun's (below), not the --ranks launcher's
    spec = from_args(args, SERVE, world=hosts * per)
    spec = spec.with_(events=spec.events or str(events))
    from console.cli.model import resolve_model_dir

    spec = spec.with_(model=resolve_model_dir(spec.model))
    argv = [sys.executable, "-m", "runtime.launch.torchrun", "--nnodes", str(hosts), "--nproc-per-node", str(per),
            "--node-rank", str(rank), "--master-addr", addr, "--master-port", str(port),
            *_dsv4_program(), "serve", *spec.argv(SERVE)]
    from runtime.log import log_path

    earlier = nodes.nodes()  # newest first: the node before this one keeps its log for `p`
    plan = {"argv": argv, "node_rank": rank, "nnodes": hosts, "master": f"{addr}:{port}",
            "model": str(spec.model), "log": str(log), "events": spec.events, "started": time.time(),
            # each of this host's ranks keeps its own log (runtime.log), named by the service's port
            "service_logs": [str(log_path(spec, spec.port, r)) for r in range(rank * per, (rank + 1) * per)],
            "previous_log": earlier[0].log if earlier else ""}
    handoff = nodes.nodes_dir() / f"node-{stamp}.start.json"
    handoff.write_text(json.dumps(plan))
    with open(log, "ab") as out:
        sup = subprocess.Popen([sys.executable, "-m", "console.cli", "node", "supervise", str(handoff)],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        found = next((n for n in nodes.nodes() if n.supervisor == sup.pid), None)
        if found is not None:
            if args.json:
                print(json.dumps(found.to_json()))
            else:
                print(f"node {rank} of {hosts}: torchrun pid {found.pid}, master {found.master}, log {found.log}")
            return 0
        if sup.poll() is not None:
            from store.services import log_tail

            lines = log_tail(str(log), 3)
            raise UserError(f"the node did not start (exit {sup.returncode}): {' / '.join(lines) or 'no output'}")
        time.sleep(0.1)
    raise UserError(f"the node did not start within {START_WAIT_S:g} s; see {log}")


def cmd_supervise(args: argparse.Namespace) -> int:
    """The detached supervisor: start torchrun, record it, wait, record how it ended and why (the
    failing rank's own line: `node_reason`), in the node's record and this host's timeline."""
    import os
    import signal

    from store import nodes, timeline

    handoff = Path(args.record)
    plan = json.loads(handoff.read_text())
    handoff.unlink(missing_ok=True)
    agent = subprocess.Popen(plan["argv"], stdin=subprocess.DEVNULL)
    import psutil

    node = nodes.Node(agent.pid, psutil.Process(agent.pid).create_time(), plan["node_rank"], plan["nnodes"],
                      plan["master"], plan["model"], plan["log"], plan["events"], os.getpid(), plan["started"],
                      argv=tuple(plan["argv"]), service_logs=tuple(plan.get("service_logs") or ()),
                      previous_log=plan.get("previous_log") or "")
    nodes.write(node)
    asked: list[int] = []

    def stop(signum: int, _frame) -> None:  # a stop asked of the supervisor is passed on to the agent
        asked.append(signum)
        agent.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = agent.wait()
    done = nodes.ended(node, code, asked=bool(asked), reason=node_reason(node.log) if code else "")
    how, reason = done.ending.how, done.ending.reason
    if code and not asked:
        timeline.record(timeline.FAILED, pid=node.pid, text=f"node {node.node_rank} of {node.nnodes} {how}"
                        + (f": {reason}" if reason else ""), rank=_rank_of(reason))
    else:
        timeline.record(timeline.STOPPED, pid=node.pid, text=f"node {node.node_rank} of {node.nnodes} {how}")
    return 0


NODE_LOG_TAIL = 64 << 10  # bytes of a node's log read for its ending's reason
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")  # torchrun's --tee/--log-dir line prefixes


def node_reason(log: str) -> str:
    """Why a node ended, from its log: the failing rank's own last error line (runtime.log),
    or, when the rank that failed first was killed and could say nothing, torchrun's line naming
    it (runtime.launch.torchrun); never torchrun's footer. "" when neither is there."""
    from runtime.launch.torchrun import SAID
    from runtime.log import error_of
    from store.safeio import tail_lines

    first = own = ""
    for raw in tail_lines(log, NODE_LOG_TAIL):
        line = _RANK_PREFIX.sub("", raw)
        if line.startswith(SAID):
            first = line.removeprefix(SAID)
        elif said := error_of(line):
            own = said
    if first and " killed by " in first:  # the first to fail died without a word: that death is the cause
        return first
    return own or first


def _rank_of(reason: str) -> int | None:
    m = re.search(r"\brank (\d+)\b", reason)
    return int(m.group(1)) if m else None


def cmd_stop(args: argparse.Namespace) -> int:
    from store import nodes

    every = nodes.nodes()
    chosen = [n for n in every if n.pid in args.pids] if args.pids else [n for n in every if n.alive]
    unknown = sorted(set(args.pids) - {n.pid for n in every})
    if unknown:
        raise UserError(f"no node of this host has agent pid {', '.join(map(str, unknown))} (`dsv4 node ls`)")
    done = [{"pid": n.pid, "node_rank": n.node_rank, "was": n.state(), "now": nodes.stop(n, args.timeout)}
            for n in chosen]
    if args.json:
        print(json.dumps(done))  # one line: a fleet reads it as one record
    elif not done:
        print("no node is running here", file=sys.stderr)
    else:
        for d in done:
            print(f"node {d['node_rank']} (torchrun pid {d['pid']}): {d['now']}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from store import nodes

    found = nodes.nodes()
    if args.json:
        print_json([n.to_json() for n in found])
        return 0
    print_table(None, ("pid", "node", "master", "state", "model", "log"),
                [(n.pid, f"{n.node_rank}/{n.nnodes}", n.master, n.state(), n.model, n.log) for n in found])
    return 0
