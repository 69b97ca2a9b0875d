"""`dsv4 serve --ranks N` on one host: N rank processes, as torchrun would start them.

The launcher hosts the rendezvous store (as torchrun's agent does, so MASTER_PORT in use is one
line before any rank starts), starts each rank as `dsv4 serve …` with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT set, each in its own session (its compile workers go with it),
and watches them:

- SIGTERM/SIGINT here → SIGTERM to rank 0, which drains HTTP and then stops the other ranks;
- a rank that exits otherwise (killed, crashed) → one line naming the rank and its last phase,
  posted as the service's `abort` (rank 0 answers 503 with it, records it, exits non-zero; the
  others exit at once), and after STOP_TIMEOUT_S every rank still there is killed.

No rank outlives the launcher's return.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from runtime.launch.rank_store import (
    LAUNCHER_LINE,
    PREFIX,
    RankEnv,
    error_key,
    first_wins,
    open_store,
    phase_of,
    read,
)
from runtime.log import say_error

STOP_TIMEOUT_S = 10.0  # after a failure, or rank 0's end, the other ranks have this long to exit
POLL_S = 0.1


def how_it_ended(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def rank_logs(log: str, world: int) -> list[Path]:
    """Each rank's own log beside the launcher's (`serve-….log` → `serve-….rank1.log`), when
    the launcher's output goes to a file; [] otherwise (the ranks write to its output as it is)."""
    if not log:
        return []
    base = Path(log)
    return [base.with_name(f"{base.stem}.rank{r}{base.suffix or '.log'}") for r in range(world)]


def _tee(stream, rank: int, path: Path) -> None:
    """A rank's output, line by line, into its own log and the launcher's (named by its rank)."""
    prefix = b"" if rank == 0 else f"rank {rank}: ".encode()
    with contextlib.suppress(OSError), open(path, "ab") as own:
        for line in iter(stream.readline, b""):
            own.write(line)
            own.flush()
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()


def launch(argv: Sequence[str], world: int, addr: str = "127.0.0.1", port: int = 0,
           rendezvous_timeout: float = 60.0, on_failure: Callable[[int, str, str, int], None] | None = None,
           stop_timeout: float = STOP_TIMEOUT_S, env: dict[str, str] | None = None,
           logs: Sequence[Path] = ()) -> int:
    """Run `dsv4 <argv>` as ranks 0..world-1 until they end; rank 0's exit code, or 1 when a
    rank failed. `on_failure(rank, phase, line, exit code)` is told of a rank that ended the
    service by dying (for the events, the service's ending and the launch history). `env`: added
    to every rank's; `logs`: each rank's own log file (its output also reaches ours)."""
    store = open_store(RankEnv(0, world, 0, world, addr, port, True), rendezvous_timeout, host=True)
    port = store.port
    procs: list[subprocess.Popen] = []
    stopping = {"asked": 0.0}

    def stop(*_: object) -> None:
        if not stopping["asked"]:
            stopping["asked"] = time.monotonic()
            if procs and procs[0].poll() is None:
                procs[0].send_signal(signal.SIGTERM)  # rank 0 drains, then stops the others

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        for r in range(world):
            child = {**os.environ, **(env or {}), **RankEnv(r, world, r, world, addr, port, True).child_env()}
            piped = subprocess.PIPE if logs else None
            procs.append(subprocess.Popen([sys.executable, "-m", "console.cli", *argv], env=child,
                                          start_new_session=True, stdout=piped,
                                          stderr=subprocess.STDOUT if logs else None))
            if logs:
                threading.Thread(target=_tee, args=(procs[-1].stdout, r, logs[r]), daemon=True,
                                 name=f"rank-{r}-log").start()
        deadline = None
        while [p.poll() for p in procs].count(None):  # poll every rank (any() would stop at the first)
            ended = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode is not None]
            if not failed and not stopping["asked"]:
                for r, code in ended:
                    if code != 0 and not (r == 0 and read(store, "abort")):
                        phase = phase_of(store, r)
                        line = (f"rank {r} on {socket.gethostname()} (pid {procs[r].pid}) {how_it_ended(code)} "
                                f"during phase {phase}")
                        store.set(PREFIX + error_key(r), line)  # the dead rank's last error (/health's ranks)
                        store.set(PREFIX + LAUNCHER_LINE, line)  # before the abort: rank 0 then knows it is said
                        held = first_wins(store, "abort", line)
                        failed = True
                        if held == line:
                            say_error(f"{line}; stopping every rank")
                            if on_failure is not None:
                                on_failure(r, phase, line, code)
                        break
                    if code != 0:
                        failed = True
            if deadline is None and (failed or ended):
                deadline = time.monotonic() + stop_timeout
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
    finally:
        for p in procs:  # every rank's session: the rank and anything it started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for s, handler in old.items():
            signal.signal(s, handler)
    codes = [p.returncode for p in procs]
    if failed or any(c != 0 for c in codes[1:]):
        return codes[0] if codes[0] and codes[0] > 0 else 1
    return codes[0]
