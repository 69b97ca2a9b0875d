"""The `dsv4 serve` process: register, then serve HTTP until SIGTERM or SIGINT, failing closed.

One process of one rank, or (with `--ranks N` outside torchrun) the launcher of N rank
processes (`runtime.serve.rank_launcher`). The port is taken before registration, SIGTERM
stops like Ctrl-C, a fault prints a traceback instead of a bare "Bus error", and the service
announces itself in the runtime registry (every console of this user sees it). Once serving,
anything that makes generation unsafe — the mapped sidecar changed, a rank was lost — fails
closed: 503 with the reason for a moment, the launch history records it, then a drained exit 1.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from runtime import log as service_log
from runtime.events import Emitter, Event, Phase, Sink, open_sink
from runtime.launch.spec import SERVE, LaunchSpec
from store import timeline
from store.errors import UserError
from store.services import ServiceId

FAIL_CLOSED_GRACE_S = 1.0  # 503s saying why, then drain and stop (well inside a lease-break time)
EXIT_BOUND_S = 10.0  # after failing closed, a drain that has not ended by then (an engine thread
# stuck in a collective no backend can abort) ends in a hard exit: the failure is recorded already


STOPPED_BY: list[int] = []  # the signals that asked this process to stop, first first


def interrupt(signum: object = None, *_: object) -> None:
    """A signal handler: SIGTERM stops like Ctrl-C (and the service's ending names it)."""
    if isinstance(signum, int):
        STOPPED_BY.append(signum)
    raise KeyboardInterrupt


def stopped_how() -> str:
    """"stopped by SIGTERM" (or SIGINT), as this process's ending says it."""
    return f"stopped by {signal.Signals(STOPPED_BY[0]).name}" if STOPPED_BY else "stopped"


def service_settings(spec: LaunchSpec) -> dict:
    """What the registry keeps of a launch's settings (the Services pane's columns)."""
    return {"backend": spec.backend, "device": spec.device, "max_seq": spec.max_seq, "ranks": spec.ranks}


def run(spec: LaunchSpec, rank_env=None, display: Callable[[], tuple[Sink, Callable[[], None]]] | None = None) -> int:
    """`dsv4 serve` of `spec` (its model resolved). `rank_env`: this process is one rank (under
    torchrun or our launcher). `display()`: a terminal sink for registration's progress, and its
    stop (only when events do not go to stdout)."""
    if spec.ranks > 1 and rank_env is None:
        return launch_ranks(spec)
    rank_env = rank_env if spec.ranks > 1 else None
    rank = rank_env.rank if rank_env is not None else 0
    sinks: list[Sink] = []
    if spec.events:
        try:
            sinks.append(open_sink(spec.events))
        except OSError as e:
            raise UserError(f"--events {spec.events}: cannot open ({e.strerror}); choose another path") from None
    if rank > 0:
        service_log.install(spec.log_format, service_log.log_path(spec, spec.port, rank))
        return _follow(spec, rank_env, Emitter(*sinks, service_log.PhaseLines(), rank=rank))
    from runtime.launch.registration import register
    from runtime.serve.auth import Door
    from runtime.serve.registering import Registering, answer_while_registering
    from runtime.serve.server import bind

    door = Door.of(spec)  # a bad key file or certificate is one line before anything starts
    # the port first: one in use is one line now, not after every registration phase; until it
    # serves, every request there is a 503 saying which phase (and, across hosts, who is behind)
    sock = bind(spec.host, spec.port)
    shown = display() if display is not None and spec.events != "-" else None
    if shown:
        sinks.append(shown[0])
    # one rank alone names its log by the port it holds; ranks of several by the port asked (rank 0's)
    port = spec.port if rank_env is not None else sock.getsockname()[1]
    files = service_log.install(spec.log_format, service_log.log_path(spec, port, rank if rank_env else None),
                                shown=bool(shown))
    emitter = Emitter(*sinks, service_log.PhaseLines(), rank=0 if rank_env is not None else None)
    signal.signal(signal.SIGTERM, interrupt)  # during registration, and re-raised by uvicorn after its drain
    never_silent()
    started = time.time()
    announced = announce(spec, rank_env, files, port)
    at = Registering(spec, ServiceId.of_this_process())  # the phase the launch is in: its ending names it
    emitter.sinks.append(at)
    try:
        stop_answering = answer_while_registering(sock, at, door)
        try:
            launched = register(spec, emitter, rank_env=rank_env, on_hosts=at.hosts)
        except BaseException:
            stop_answering()
            sock.close()
            raise
        finally:
            if shown:
                shown[1]()
        stop_answering()  # the service's own server takes the socket, listening all along
        code = _serve(launched, sock, emitter, announced, started, door)
    except KeyboardInterrupt:
        announced.end(stopped_how(), at.phase)
        ended(timeline.STOPPED, f"{stopped_how()} during {at.phase}")
        raise
    except UserError as e:
        announced.end(f"exited {e.exit_code}", at.phase, str(e))
        ended(timeline.FAILED, str(e))
        raise
    except BaseException as e:
        announced.end("exited 1", at.phase, f"{type(e).__name__}: {e}")
        ended(timeline.FAILED, f"{type(e).__name__}: {e}")
        raise
    announced.end(stopped_how(), Phase.SERVE, "drained")
    ended(timeline.STOPPED, f"{stopped_how()}, drained")
    return code


_ENDED: list[str] = []  # the timeline's word on this process's end, said once (the first cause holds)


def ended(kind: str, text: str, **fields) -> None:
    """This service's end in this host's timeline (store.timeline), once."""
    if not _ENDED:
        _ENDED.append(kind)
        timeline.record(kind, text=text, pid=ServiceId.of_this_process().pid, **fields)


def announce(spec: LaunchSpec, rank_env, files: service_log.LogFiles, port: int):
    """The service's record in the registry, with its log and the previous run's: rank 0 under the
    project's launcher fills in the launcher's (the service is the launcher's identity; its log is
    rank 0's); otherwise this process's own, and its start in the timeline."""
    from runtime.launch import history
    from store.services import Announcement

    identity = ServiceId.of_this_process()
    history.SERVICE_LAUNCH = identity.key  # this process serves one launch: its lines are one record
    if rank_env is not None and identity.pid != os.getpid():
        adopted = Announcement.adopt(identity)
        if adopted is not None:
            adopted.update(**files.to_json())
            return adopted
    events_file = "" if spec.events in (None, "-") else str(Path(spec.events).resolve())
    announced = Announcement(str(spec.model), events_file, **service_settings(spec), **files.to_json())
    started_in_timeline(spec, files, port)
    return announced


def started_in_timeline(spec: LaunchSpec, files: service_log.LogFiles, port: int) -> None:
    """`registering`, or `relaunched` when the log slot had a run before this one."""
    kind = timeline.RELAUNCHED if files.previous is not None else timeline.REGISTERING
    timeline.record(kind, pid=os.getpid(), text=f"{spec.model} on port {port}")


def _serve(launched, sock, emitter: Emitter, announced, started: float, door) -> int:
    from runtime.serve.app import Limits
    from runtime.serve.server import serve, url_of

    spec = launched.spec
    emitter.emit(Phase.SERVE, "start", detail={"host": spec.host, "port": sock.getsockname()[1]})
    if launched.group is not None:
        launched.group.set_phase(Phase.SERVE)
    t0 = time.perf_counter()

    def ready(url: str) -> None:
        seconds = time.perf_counter() - t0
        # the whole launch: from the service's first process (the launcher of several ranks) to serving
        whole = round(time.time() - ServiceId.of_this_process().started, 3)
        spans = {"launch_seconds": whole, "registration_seconds": launched.registration_seconds}
        # the event carries the figures the launch's record keeps: the console shows them, never its own
        emitter.emit(Phase.SERVE, "end", seconds=seconds,
                     detail={"url": url, **{k: v for k, v in spans.items() if v is not None}})
        with contextlib.suppress(Exception):  # a store gone meanwhile: rank 0's own seconds stand
            launched.slowest_phases()
        launched.phases[Phase.SERVE] = {"seconds": round(seconds, 4), "url": url}
        launched.record(started, "ok", url=url, seconds=whole)
        announced.serving(url)
        if launched.group is not None:  # each rank's own log, on its host, as it posted it when it joined
            with contextlib.suppress(Exception):
                announced.update(rank_log_files=tuple(m.get("log", "") for m in launched.group.members()))
        service_log.SERVICE.info("serving %s at %s (Ctrl-C or SIGTERM to stop)", spec.model, url)
        timeline.record(timeline.SERVING, url=url, pid=ServiceId.of_this_process().pid)

    failing = threading.Lock()

    def fail_closed(reason: str) -> None:
        """Stop generating (503 with the reason), record it, drain and exit non-zero. For a
        changed sidecar: the writer waiting on our lease proceeds only once nothing reads the
        mapping any more; for a lost rank: every rank of the service stops."""
        if not failing.acquire(blocking=False):
            return  # the first reason holds
        launched.fail(reason)  # 503 from now on; queued requests get theirs at once
        service_log.SERVICE.error("failed: %s", reason)
        if launched.group is None or not launched.group.said_by_launcher(reason):  # a death is one event
            emitter.emit(Phase.SERVE, "error", message=reason)
            rank = lost_rank(launched.group, reason)
            ended(timeline.FAILED, reason, rank=rank,
                  **({"host": launched.group.hosts[rank]} if rank is not None and rank < len(launched.group.hosts)
                     else {}))
        else:
            _ENDED.append(timeline.FAILED)  # the launcher said it, with the rank
        launched.record(started, "error", reason, failed_phase=Phase.SERVE, end="exited 1")
        announced.end("exited 1", Phase.SERVE, reason)  # before any hard exit could skip it
        threading.Timer(FAIL_CLOSED_GRACE_S, os.kill, (os.getpid(), signal.SIGTERM)).start()
        hard = threading.Timer(EXIT_BOUND_S, hard_exit, (reason,))
        hard.daemon = True
        hard.start()

    def sidecar_changed(reason: str) -> None:
        fail_closed(f"sidecar {launched.mapped.path} changed under the service: {reason}")

    stop_watching = launched.mapped.notify(sidecar_changed) if launched.mapped is not None else None
    if launched.group is not None:  # a rank that died, or a collective that failed: the service stops
        launched.group.on_lost = fail_closed
        launched.group.watch(fail_closed)
    limits = Limits.of(spec, launched.plan.speculative)  # --speculative as the plan resolved it

    def stats(engine: dict) -> None:
        rate = "" if engine["acceptance"] is None else f", MTP acceptance {engine['acceptance']:.0%}"
        emitter.log(Phase.SERVE, f"{engine['steps']} decode steps, mean batch {engine['mean_batch']}{rate}",
                    engine=engine)

    try:
        serve(launched, sock, limits, on_ready=ready, on_stats=stats, door=door,
              url=url_of(sock, door.tls is not None, spec.host), on_fatal=fail_closed)
    except KeyboardInterrupt:
        # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler it
        # found (KeyboardInterrupt for both): once serving, that is a clean, drained stop
        if Phase.SERVE not in launched.phases:
            raise
    finally:
        if stop_watching is not None:
            stop_watching()
    if launched.failure:
        launched.close()  # unmap, and release the lease: the waiting writer may go on now
        # the sidecar advice only where the sidecar was the cause (a lost rank has nothing to do with it)
        sidecar = launched.mapped is not None and launched.failure.startswith(f"sidecar {launched.mapped.path}")
        hint = "run `dsv4 sidecar status`, then launch again" if sidecar else "launch again"
        raise UserError(f"{launched.failure}; stopped serving ({hint})")
    emitter.emit(Phase.SERVE, "log", message="stopped: drained and released device memory")
    service_log.SERVICE.info("stopped: drained and released device memory")
    launched.record(started, "ok", end=stopped_how())  # the launch's true end, in its one record
    return 0


def lost_rank(group, reason: str) -> int | None:
    """The rank a failure's reason is about (the rank whose last error it is), if any."""
    if group is None:
        return None
    return next((r for r, line in sorted(group.errors.items()) if line == reason), None)


def hard_exit(reason: str) -> NoReturn:
    service_log.say_error(f"{reason}; the drain did not end within {EXIT_BOUND_S:g} s, exiting")
    os._exit(1)


def run_rank(run_it: Callable[[], int]) -> NoReturn:
    """One rank process of several, to its end: its result said the way `dsv4` says it (one line
    for a UserError), the atexit handlers run (the registry entry is withdrawn), then out with
    `os._exit`. The interpreter's own teardown is skipped on purpose: torch.distributed's C++
    threads abort it now and then ("terminate called without an active exception"), which
    turned a drained, clean stop into a crash."""
    try:
        code = run_it()
    except UserError as e:
        service_log.say_error(str(e))
        code = e.exit_code
    except KeyboardInterrupt:
        service_log.say_error("interrupted")
        code = 130
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def launch_ranks(spec: LaunchSpec) -> int:
    """`dsv4 serve --ranks N`: N rank processes of this same spec (runtime.serve.rank_launcher).
    The launcher is the service: it announces it (rank 0 fills in the URL), hands its identity to
    the ranks, keeps each rank's log apart beside its own, and records a rank's death as the
    service's ending."""
    from runtime.launch import history
    from runtime.launch.plan import resolve
    from runtime.serve.auth import Door
    from runtime.serve.rank_launcher import launch, rank_logs
    from runtime.serve.server import bind
    from store.services import Announcement, find, how

    resolution = resolve(spec)  # settings that cannot work (ranks, devices, MTP): one line before any rank starts
    resolution.check()
    Door.of(spec)  # a bad key file or certificate: one line now, not from rank 0 after N starts
    bind(spec.host, spec.port).close()  # the port in use is one line now, not after N registrations
    port = spec.master_port if spec.master_port is not None else int(os.environ.get("MASTER_PORT", 0) or 0)
    started = time.time()
    files = service_log.install(spec.log_format, service_log.log_path(spec, spec.port, None))
    events_file = "" if spec.events in (None, "-") else str(Path(spec.events).resolve())
    announced = Announcement(str(spec.model), events_file, **service_settings(spec), **files.to_json())
    started_in_timeline(spec, files, spec.port)
    history.SERVICE_LAUNCH = announced.service.identity.key
    logs = rank_logs(announced.service.log, spec.ranks)
    announced.update(rank_logs=tuple(map(str, logs)))

    def died(rank: int, phase: str, line: str, code: int) -> None:
        """The launcher's line, in the events too, with the rank and its phase (the console
        fails that rank's phase, whichever rank is gone), as the service's ending, and in the
        launch's one history record (rank 0 may be the one gone)."""
        if spec.events:
            with contextlib.suppress(OSError):
                open_sink(spec.events)(Event(Phase.SERVE, "error", message=line, detail={"rank": rank, "phase": phase},
                                             host=socket.gethostname()))
        timeline.record(timeline.FAILED, rank=rank, text=line, pid=os.getpid())
        announced.end(f"rank {rank} {how(code)}", phase, line, by="launcher")
        history.append(spec, {}, started, "error", line, device=resolution.device, backend=resolution.backend,
                       config=resolution.config,
                       extra={"failed_phase": phase, "rank": rank, "end": f"rank {rank} {how(code)}"})

    env = announced.service.identity.to_env()
    code = launch(["serve", *spec.argv(SERVE)], spec.ranks, "127.0.0.1", port, spec.rendezvous_timeout, died,
                  env=env, logs=logs)
    record = find(announced.service.pid)
    if record is None or record.ending is None:  # rank 0 (or `died`) said how already, or nobody did
        announced.end(how(code), "", by="launcher")
    return code


def _follow(spec: LaunchSpec, rank_env, emitter: Emitter) -> int:
    """A rank other than 0: register (every phase, as rank 0 leads), then run each engine call
    rank 0 sends until it stops the service. Killed at once by SIGTERM; an abort anywhere in the
    service (a rank died, rank 0 failed) ends this rank at once with the reason."""
    from runtime.launch.ranks import follow
    from runtime.launch.registration import register

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher or torchrun stops ranks, not the terminal
    signal.signal(signal.SIGTERM, interrupt)
    never_silent()
    launched = register(spec, emitter, rank_env=rank_env, record=False)

    def aborted(reason: str) -> None:
        service_log.say_error(f"rank {rank_env.rank} stopping: {reason}")
        os._exit(1)  # blocked in a collective: nothing else would return

    launched.group.on_lost = aborted  # a rank silent past --rank-timeout, or a collective that failed
    launched.group.watch(aborted)
    launched.group.set_phase(Phase.SERVE)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    follow(launched.engine, launched.group, until="stop")
    launched.close()
    return 0


def never_silent() -> None:
    """A fault (SIGBUS on a mapping changed behind our back) prints a traceback to stderr
    instead of a bare "Bus error"; SIGIO tells us a writer wants our sidecar (its read lease)."""
    import faulthandler

    from store.sidecar.watch import install_sigio_handler

    faulthandler.enable()
    install_sigio_handler()
