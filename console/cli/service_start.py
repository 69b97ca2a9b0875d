"""`dsv4 service start`: one host's service, as the console's `l` launches it on a fleet of one —
`dsv4 serve` with the launch flags, detached (its own session, its output and events in files
under the registry, so it outlives whoever started it: a console that quits, an ssh session that
closes), watched by a small supervisor that records how it ended when the service could not say
so itself: a signal (`killed by SIGKILL during serve`, the launch's one history record
`killed`), or an exit that left no ending (its own last error line as the cause). It prints the
service's registry record once the service has announced itself (`--json`: that record, one
line), so the one who started it attaches to it by its identity, as a later console re-attaches.

The supervisor is `dsv4 node start`'s for one process (`console.cli.node` supervises torchrun).
Torch-free: the service imports torch, this command does not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from store.errors import UserError

START_WAIT_S = 120.0  # the service announces itself once its interpreter and runtime are imported


def register(actions: argparse._SubParsersAction) -> None:
    from runtime.launch.spec import SERVE, add_flags

    start = actions.add_parser("start", help="start `dsv4 serve` detached, its ending recorded; print its record",
                               description="Start `dsv4 serve MODEL_DIR …` with these launch flags in a session of "
                               "its own (output and events under $DSV4_STATE_DIR/services/output, so it outlives this "
                               "command, a console, an ssh session), under a supervisor that records how it ended "
                               "when it could not (a signal); print its registry record once it announced itself.")
    start.add_argument("--json", action="store_true", help="print the service's record as one JSON line")
    add_flags(start, SERVE, model_help="checkpoint directory (default: the embedded default checkpoint)")
    start.set_defaults(func=cmd_start)
    supervise = actions.add_parser("supervise", help=argparse.SUPPRESS)
    supervise.add_argument("handoff", help=argparse.SUPPRESS)
    supervise.set_defaults(func=cmd_supervise)


def cmd_start(args: argparse.Namespace) -> int:
    from console.cli.model import resolve_model_dir
    from console.fleet.command import service_argv
    from runtime.launch.spec import SERVE, from_args
    from store import services

    spec = from_args(args, SERVE)
    spec = spec.with_(model=resolve_model_dir(spec.model))
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    log, events = services.output_paths(stamp)
    log.parent.mkdir(parents=True, exist_ok=True)
    if spec.events not in (None, "-"):  # the operator's own events file; else one beside the output
        events = Path(spec.events).resolve()
    argv = service_argv(*spec.with_(events=str(events)).argv(SERVE))
    handoff = log.with_name(f"serve-{stamp}.start.json")
    handoff.write_text(json.dumps({"argv": argv, "log": str(log), "events": str(events)}))
    with open(log, "ab") as out:
        sup = subprocess.Popen([sys.executable, "-m", "console.cli", "service", "supervise", str(handoff)],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    record = _announced(sup, _pid_file(handoff), log)
    if args.json:
        print(json.dumps(record.to_json()))
    else:
        print(f"pid {record.pid} {record.url or record.state}: log {record.log_file or record.log}")
    return 0


def _pid_file(handoff: Path) -> Path:
    return handoff.with_name(handoff.name.replace(".start.json", ".pid"))


def _announced(sup: subprocess.Popen, pid_file: Path, log: Path):
    """The service's record once it is in the registry; a UserError with its last lines when it
    ended first (a port in use, a bad flag, no checkpoint), or never announced itself."""
    from store import services

    deadline = time.monotonic() + START_WAIT_S
    pid = None
    while time.monotonic() < deadline:
        if pid is None and pid_file.is_file():  # written whole (a rename): a number
            pid = int(pid_file.read_text())
        found = services.find(pid) if pid is not None else None
        if found is not None:
            pid_file.unlink(missing_ok=True)
            return found
        if sup.poll() is not None:
            pid_file.unlink(missing_ok=True)
            lines = services.log_tail(str(log), 3)
            raise UserError(f"the service did not start: {' / '.join(lines) or 'no output'} (log {log})")
        time.sleep(0.1)
    raise UserError(f"the service did not announce itself within {START_WAIT_S:g} s; see {log}")


def cmd_supervise(args: argparse.Namespace) -> int:
    """The detached supervisor: start the service, wait, and record how it ended when the service
    itself could not — a signal, or an exit that wrote no ending — in its registry record, the
    launch history and this host's timeline."""
    handoff = Path(args.handoff)
    plan = json.loads(handoff.read_text())
    handoff.unlink(missing_ok=True)
    service = subprocess.Popen(plan["argv"], stdin=subprocess.DEVNULL)
    asked: list[int] = []

    def stop(signum: int, _frame) -> None:  # a stop asked of the supervisor goes to the service
        asked.append(signum)
        service.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    pid_file = _pid_file(handoff)  # said only now: whoever reads it may stop us at once
    staged = pid_file.with_name(pid_file.name + ".tmp")
    staged.write_text(str(service.pid))
    staged.replace(pid_file)
    code = service.wait()
    if code != 0:
        record_end(service.pid, code, plan.get("log", ""), plan.get("events", ""), asked=bool(asked))
    return 0


def record_end(pid: int, code: int, log: str, events: str, asked: bool = False) -> None:
    """How the service `pid` ended with exit status `code`, where it left no word of its own: its
    record's ending (by the supervisor: the service's own words, when it wrote them, stand), the
    launch's one history record for a signal (outcome `killed`: it may have served, and then
    still predicts like one), and its end in this host's timeline. `asked`: a stop was passed on
    to it (its SIGTERM is a stop, not a failure)."""
    from console.cli.node import node_reason
    from store import history, services, timeline

    record = services.find(pid)
    if record is None or (record.ending is not None and record.ending.by != "registry"):
        return  # it never announced itself (`start` says why), or it said how it ended
    phase = "serve" if record.state == services.SERVING else last_phase(events)
    if asked and code == -signal.SIGTERM:
        ended = services.end(record, "stopped by SIGTERM", phase, by="supervisor")
        timeline.record(timeline.STOPPED, pid=pid, text=ended.ending.cause() if ended.ending else "stopped")
        return
    how = services.how(code)
    error = "" if code < 0 else node_reason(log)  # a signal is its own cause; an exit, the service's last error
    ended = services.end(record, how, phase, error, by="supervisor")
    if code < 0:
        history.append({"v": 1, "launch": ended.identity.key, "outcome": "killed", "error": error or how, "end": how,
                        "ended": round(time.time(), 3), "failed_phase": phase})
    if ended.ending is not None:
        timeline.record(timeline.FAILED, pid=pid, text=ended.ending.cause())


def last_phase(events: str) -> str:
    """The phase a launch's events file last started ("" when it has none)."""
    from runtime.events import EventError, parse
    from store.safeio import tail_lines

    phase = ""
    for line in tail_lines(events, 64 << 10) if events else ():
        try:
            event = parse(line)
        except EventError:
            continue
        if event.kind == "start":
            phase = event.phase
    return phase
