"""`dsv4 serve` (registration + HTTP service) and `dsv4 compile` (programs only)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from console.output import print_json, print_table
from runtime.plan import DEFAULT_MAX_SLOTS, MAX_SLOTS
from store.errors import UserError
from store.units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR", type=Path, nargs="?",
                   help="checkpoint directory (default: the embedded synthetic checkpoint)")
    p.add_argument("--kernel-cache-dir", type=Path, default=None,
                   help="kernel cache root (default: $DSV4_KERNEL_CACHE_DIR or the user cache dir)")
    p.add_argument("--backend", choices=("auto", "aoti", "export", "eager"), default="auto",
                   help="aoti (AOTInductor, default on cpu/cuda), export (torch.export; npu), eager (no cache)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    p.add_argument("--max-seq", type=int, default=1024, help="context length per KV slot (default 1024)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="compile missing programs in N worker processes (default: the CPUs this process "
                   "may use, capped by memory)")
    p.add_argument("--events", metavar="FILE|-", default=None, help="write progress events as JSON lines")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="register the model (programs, weights, KV) and serve HTTP",
                       description="Register the model phase by phase (check → programs ∥ weights → upload → "
                       "kv → validate → serve) and serve /health, /metrics and the OpenAI API (/v1/models, "
                       "/v1/completions, /v1/chat/completions) until SIGTERM or SIGINT, which drain.")
    _common(p)
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="fraction of device memory the service may use (KV budget = total × this − used)")
    p.add_argument("--device-memory", type=_size, default=None, help="cap device memory (e.g. 8G; on cpu: host memory)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="listen port (0: any free port)")
    p.add_argument("--ready", choices=("compiled", "early"), default="compiled",
                   help="compiled: serve once every program is compiled; early: serve on the eager tier "
                   "at once and swap each program in as its compile publishes")
    p.add_argument("--no-sidecar", action="store_true", help="always pack from the checkpoint")
    p.add_argument("--cold-policy", choices=("reject", "read", "auto"), default="auto",
                   help="a valid sidecar that is not in the page cache: repack, read it, or pick the faster")
    p.add_argument("--ranks", type=int, default=None,
                   help="expert-parallel rank processes, one per device (default 1, or WORLD_SIZE under torchrun)")
    p.add_argument("--master-port", type=int, default=None,
                   help="--ranks N: port of the ranks' rendezvous on 127.0.0.1 (default $MASTER_PORT, else any free port)")
    p.add_argument("--rendezvous-timeout", type=float, default=60.0,
                   help="seconds every rank has to join, and to reach each registration sync point (default 60)")
    p.add_argument("--max-slots", type=int, default=DEFAULT_MAX_SLOTS,
                   help="KV slots: at most this many sequences decode together (fewer if memory is short)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences that decode together in one step (default: every KV slot; 1: one at a time)")
    p.add_argument("--speculative", choices=("auto", "mtp", "off"), default="auto",
                   help="mtp: the MTP layer drafts a token, the main model verifies it in the same step "
                   "(greedy requests; tokens unchanged); auto: mtp on a real checkpoint with an MTP layer, "
                   "off on synthetic ones (their random MTP weights draft badly)")
    p.add_argument("--validate-tokens", type=int, default=8, help="greedy decode steps in the validate phase")
    p.add_argument("--max-body", type=_size, default=None,
                   help="largest request body accepted, larger is 413 (default 4M)")
    p.add_argument("--queue-timeout", type=float, default=None,
                   help="seconds a request waits for a free slot before 503 + Retry-After (default 30)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("compile", help="prepare every program through the cache without launching",
                       description="Compile (or HIT) every program of the model into the kernel cache, "
                       "so the next launch starts warm.")
    _common(p)
    p.add_argument("--ranks", type=int, default=None, help="the programs of N expert-parallel ranks (default 1)")
    p.add_argument("--json", action="store_true", help="print a list of {program, outcome, seconds}")
    p.set_defaults(func=cmd_compile)


def _in_range(flag: str, value: float | None, lo: float, hi: float, what: str = "") -> None:
    """One line for a flag outside lo..hi (NaN and inf included), before anything starts."""
    if value is not None and not (lo <= value <= hi):  # NaN fails both comparisons
        raise UserError(f"{flag} {value} is out of range; allowed {what or f'{lo}..{hi}'}")


def _check_serve_args(args: argparse.Namespace) -> None:
    _in_range("--port", args.port, 0, 65535, "0..65535 (0: any free port)")
    _in_range("--memory-utilization", args.memory_utilization, 1e-3, 1.0, "above 0 up to 1")
    _in_range("--max-slots", args.max_slots, 1, MAX_SLOTS)
    _in_range("--max-batch", args.max_batch, 1, MAX_SLOTS)
    _in_range("--ranks", args.ranks, 1, 4096)
    _in_range("--master-port", args.master_port, 1, 65535)
    _in_range("--rendezvous-timeout", args.rendezvous_timeout, 0.1, 86400, "above 0 up to 86400 seconds")
    _in_range("--validate-tokens", args.validate_tokens, 1, 4096)
    _in_range("--queue-timeout", args.queue_timeout, 0.001, 86400, "above 0 up to 86400 seconds")
    _in_range("--max-body", args.max_body, 1024, 1 << 40, "1K..1T")
    _in_range("--device-memory", args.device_memory, 1, 1 << 60, "at least 1 byte")
    if args.events not in (None, "-"):
        events = Path(args.events)
        if not events.parent.is_dir():
            raise UserError(f"--events {args.events}: directory {events.parent} does not exist; create it or "
                            f"choose another path")
        if events.exists() and not events.is_file():  # appending to a FIFO would block until a reader came
            raise UserError(f"--events {args.events}: not a regular file; choose another path")


def _options(args: argparse.Namespace):
    from console.cmd_model import resolve_model_dir
    from runtime.registration import LaunchOptions

    _in_range("--max-seq", args.max_seq, 16, 1 << 24)
    _in_range("--jobs", args.jobs, 1, 1024)
    return LaunchOptions(
        model_dir=resolve_model_dir(args.model_dir), kernel_cache_dir=args.kernel_cache_dir,
        backend=args.backend, device=args.device, max_seq=args.max_seq,
        memory_utilization=getattr(args, "memory_utilization", 0.9),
        device_memory=getattr(args, "device_memory", None),
        use_sidecar=not getattr(args, "no_sidecar", False), cold_policy=getattr(args, "cold_policy", "auto"),
        ranks=getattr(args, "ranks", None) or 1, max_slots=getattr(args, "max_slots", DEFAULT_MAX_SLOTS),
        validate_tokens=getattr(args, "validate_tokens", 8), jobs=args.jobs,
        ready=getattr(args, "ready", "compiled"), rendezvous_timeout=getattr(args, "rendezvous_timeout", 60.0),
    )


def speculation(choice: str, model_dir: Path) -> bool:
    """--speculative → whether MTP drafts; `mtp` on a checkpoint without an MTP layer: one line."""
    from runtime.config import load_config, synthetic_preset

    if choice == "off":
        return False
    has_mtp = load_config(model_dir).num_nextn_predict_layers > 0
    if choice == "mtp" and not has_mtp:
        raise UserError(f"--speculative mtp: {model_dir} has no MTP layer (num_nextn_predict_layers 0); use off")
    if choice == "mtp":
        return True
    return has_mtp and synthetic_preset(model_dir) is None


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    from console.live import PhaseDisplay
    from runtime.events import Emitter, open_sink
    from runtime.ranks import RankEnv
    from runtime.registration import append_history, register
    from runtime.service import DEFAULT_MAX_BODY, DEFAULT_QUEUE_TIMEOUT, Limits, bind, serve

    _check_serve_args(args)
    env = RankEnv.from_env()
    if env is not None and args.ranks not in (None, env.world):
        raise UserError(f"--ranks {args.ranks} but WORLD_SIZE={env.world} (torchrun's ranks); drop --ranks or "
                        f"make them agree")
    args.ranks = env.world if env is not None else (args.ranks or 1)
    options = _options(args)
    speculative = speculation(args.speculative, options.model_dir)
    if args.ranks > 1:
        _check_ranks(args, options)
    if env is None and args.ranks > 1:
        return _launch_ranks(args, options)
    options.rank_env = env if args.ranks > 1 else None
    leader = options.rank == 0
    options.history = leader  # one launch, one record: rank 0's
    sinks = []
    if args.events:
        try:
            sinks.append(open_sink(args.events))
        except OSError as e:
            raise UserError(f"--events {args.events}: cannot open ({e.strerror}); choose another path") from None
    if not leader:
        return _follow(options, Emitter(*sinks, rank=options.rank))
    # the port first: one in use is one line now, not after every registration phase
    sock = bind(args.host, args.port)
    display = PhaseDisplay() if args.events != "-" and sys.stderr.isatty() else None
    if display:
        sinks.append(display.sink)
    emitter = Emitter(*sinks, rank=0 if options.rank_env is not None else None)
    # SIGTERM stops like Ctrl-C: during registration, and re-raised by uvicorn after its drain
    signal.signal(signal.SIGTERM, _interrupt)
    _never_silent()
    started = time.time()
    # the runtime registry: every console of this user sees this service, whoever started it
    import atexit

    from store.services import Announcement

    announced = Announcement(str(options.model_dir), "" if args.events in (None, "-") else str(Path(args.events).resolve()))
    atexit.register(announced.withdraw)
    try:
        launched = register(options, emitter)
    except BaseException:
        sock.close()
        raise
    finally:
        if display:
            display.stop()
    emitter.emit("serve", "start", detail={"host": args.host, "port": sock.getsockname()[1]})
    t0 = time.perf_counter()

    def ready(url: str) -> None:
        seconds = time.perf_counter() - t0
        launched.phases["serve"] = {"seconds": round(seconds, 4), "url": url}
        emitter.emit("serve", "end", seconds=seconds, detail={"url": url})
        append_history(options, launched.phases, started, "ok", extra={"url": url})
        announced.serving(url)
        if args.events != "-":
            print(f"serving {options.model_dir} at {url} (Ctrl-C or SIGTERM to stop)", file=sys.stderr)

    failing = threading.Lock()

    def fail_closed(reason: str) -> None:
        """Stop generating (503 with the reason), record it, drain and exit non-zero. For a
        changed sidecar: the writer waiting on our lease proceeds only once nothing reads the
        mapping any more; for a lost rank: every rank of the service stops."""
        if not failing.acquire(blocking=False):
            return  # the first reason holds
        launched.failure = reason
        emitter.emit("serve", "error", message=reason)
        append_history(options, launched.phases, started, "error", reason, extra={"failed_phase": "serve"})
        # a moment of 503s saying why (clients and probes see the reason), then drain and stop;
        # well inside the kernel's lease-break time, so the writer never forces the mapping away
        threading.Timer(FAIL_CLOSED_GRACE_S, os.kill, (os.getpid(), signal.SIGTERM)).start()

    def sidecar_changed(reason: str) -> None:
        fail_closed(f"sidecar {launched.mapped.path} changed under the service: {reason}")

    stop_watching = launched.mapped.notify(sidecar_changed) if launched.mapped is not None else None
    if launched.group is not None:  # a rank that died, or a collective that failed: the service stops
        launched.group.on_lost = fail_closed
        launched.group.watch(fail_closed)
    limits = Limits(max_body_bytes=args.max_body or DEFAULT_MAX_BODY,
                    queue_timeout=args.queue_timeout or DEFAULT_QUEUE_TIMEOUT, max_batch=args.max_batch,
                    speculative=speculative)

    def stats(engine: dict) -> None:
        rate = "" if engine["acceptance"] is None else f", MTP acceptance {engine['acceptance']:.0%}"
        emitter.log("serve", f"{engine['steps']} decode steps, mean batch {engine['mean_batch']}{rate}", engine=engine)

    try:
        serve(launched, sock, limits, on_ready=ready, on_stats=stats)
    except KeyboardInterrupt:
        # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler it
        # found (KeyboardInterrupt for both): once serving, that is a clean, drained stop
        if "serve" not in launched.phases:
            raise
    finally:
        if stop_watching is not None:
            stop_watching()
    if launched.failure:
        launched.close()  # unmap, and release the lease: the waiting writer may go on now
        hint = "launch again" if launched.mapped is None else "run `dsv4 sidecar status`, then launch again"
        raise UserError(f"{launched.failure}; stopped serving ({hint})")
    emitter.emit("serve", "log", message="stopped: drained and released device memory")
    return 0


FAIL_CLOSED_GRACE_S = 1.0


def _check_ranks(args: argparse.Namespace, options) -> None:
    """One line for rank settings that cannot work, before any rank starts."""
    from runtime.config import load_config
    from runtime.plan import resolve_device

    load_config(options.model_dir).check_ranks(args.ranks)
    if args.ready == "early":
        raise UserError("--ready early serves one rank only (each rank would compile the same programs); "
                        "use --ready compiled with --ranks")
    device = resolve_device(args.device)
    if device != "cpu" and "RANK" not in os.environ:  # under torchrun each rank checks its LOCAL_RANK's device
        count = accelerator_count(device)
        if args.ranks > count:
            raise UserError(f"--ranks {args.ranks} but this host has {count} {device} device(s); one rank per "
                            f"device: run at most {count} ranks here (torchrun --nnodes for more hosts)")


def accelerator_count(device: str) -> int:
    """Accelerators of this host by their device nodes (no device context, no torch)."""
    import re

    pattern = re.compile(r"nvidia\d+" if device == "cuda" else r"davinci\d+")
    try:
        return sum(bool(pattern.fullmatch(n)) for n in os.listdir("/dev"))
    except OSError:
        return 0


def _launch_ranks(args: argparse.Namespace, options) -> int:
    """`dsv4 serve --ranks N`: N rank processes of this same command (runtime.rank_launcher)."""
    from runtime.events import Event, open_sink
    from runtime.rank_launcher import launch
    from runtime.registration import append_history
    from runtime.service import bind

    bind(args.host, args.port).close()  # the port in use is one line now, not after N registrations
    port = args.master_port if args.master_port is not None else int(os.environ.get("MASTER_PORT", 0) or 0)
    started = time.time()

    def died(rank: int, phase: str, line: str) -> None:
        """The launcher's line, in the events too, with the rank and its phase (the console
        fails that rank's phase, whichever rank is gone); rank 0 records the launch in the
        history, unless it is the one gone."""
        if args.events:
            with contextlib.suppress(OSError):
                open_sink(args.events)(Event("serve", "error", message=line, detail={"rank": rank, "phase": phase}))
        if rank == 0:
            append_history(options, {}, started, "error", line, extra={"failed_phase": "serve", "rank": rank})

    return launch(args.argv, args.ranks, "127.0.0.1", port, args.rendezvous_timeout, died)


def _follow(options, emitter) -> int:
    """A rank other than 0: register (every phase, as rank 0 leads), then run each engine call
    rank 0 sends until it stops the service. Killed at once by SIGTERM; an abort anywhere in the
    service (a rank died, rank 0 failed) ends this rank at once with the reason."""
    from runtime.ranks import follow
    from runtime.registration import register

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher or torchrun stops ranks, not the terminal
    signal.signal(signal.SIGTERM, _interrupt)
    _never_silent()
    launched = register(options, emitter)

    def aborted(reason: str) -> None:
        print(f"dsv4 serve: rank {options.rank} stopping: {reason}", file=sys.stderr, flush=True)
        os._exit(1)  # blocked in a collective: nothing else would return

    launched.group.watch(aborted)
    launched.group.set_phase("serve")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    follow(launched.engine, launched.group, until="stop")
    launched.close()
    return 0


def _never_silent() -> None:
    """A fault (SIGBUS on a mapping changed behind our back) prints a traceback to stderr
    instead of a bare "Bus error"; SIGIO tells us a writer wants our sidecar (its read lease)."""
    import faulthandler

    from store.sidecar.watch import install_sigio_handler

    faulthandler.enable()
    install_sigio_handler()


def cmd_compile(args: argparse.Namespace) -> int:
    """Every program published in the kernel cache, as the next launch's plan needs them; the
    events are the ones `dsv4 serve` emits for its programs phase. The parent never loads a
    program (no torch here): the compile workers do the work."""
    from runtime.events import Emitter, open_sink
    from runtime.plan import plan_for_launch
    from runtime.program_prep import prepare_programs
    from runtime.registration import _Phases

    options = _options(args)
    if args.events not in (None, "-") and not Path(args.events).parent.is_dir():
        raise UserError(f"--events {args.events}: directory {Path(args.events).parent} does not exist")
    plan = plan_for_launch(options)
    for problem in plan.problems:
        if problem.startswith("check:"):
            raise UserError(problem)
    options.backend = plan.backend

    def show(event) -> None:
        if not args.json and args.events != "-" and event.kind == "progress":
            d = event.detail
            print(f"[{event.done}/{event.total}] {d['program']}: {d['outcome']} ({d['seconds']:.2f} s)",
                  file=sys.stderr, flush=True)

    sinks = [show] + ([open_sink(args.events)] if args.events else [])
    phases = _Phases(Emitter(*sinks))
    from runtime.config import load_config
    from runtime.model_programs import build_programs
    from runtime.pack_plan import PackPlan

    config = load_config(options.model_dir)
    programs = build_programs(config, PackPlan(config, options.ranks), options.max_seq)
    signal.signal(signal.SIGTERM, _interrupt)
    with phases.run("programs", total=len(programs.specs), backend=options.backend) as d:
        _, results = prepare_programs(programs, options, plan.device, phases.emitter, load=False)
        d.update(programs={r["program"]: r["outcome"] for r in results})
    if args.events == "-":
        return 0
    if args.json:
        print_json(results)
    else:
        print_table(None, ("program", "outcome", "seconds", "reason"),
                    [(r["program"], r["outcome"], f"{r['seconds']:.2f}", r["reason"]) for r in results])
    return 0
