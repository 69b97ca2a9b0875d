"""`dsv4 serve` (registration + HTTP service: `runtime.serve.main`) and `dsv4 compile`
(programs only). Both take the launch spec's flags (`runtime.launch.spec`)."""

from __future__ import annotations

import argparse
import signal
import sys

from console.cli.output import print_json, print_table
from runtime.launch.spec import COMPILE, SERVE, add_flags, from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="register the model (programs, weights, KV) and serve HTTP",
                       description="Register the model phase by phase (check → programs ∥ weights → upload → "
                       "kv → validate → serve) and serve /health, /metrics and the OpenAI API (/v1/models, "
                       "/v1/completions, /v1/chat/completions) until SIGTERM or SIGINT, which drain. Under "
                       "torchrun each process is one rank (--ranks defaults to WORLD_SIZE).")
    add_flags(p, SERVE)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("compile", help="prepare every program through the kernel cache without launching",
                       description="Compile (or HIT) every program of the model into the kernel cache, "
                       "so the next launch with the same settings starts warm.")
    add_flags(p, COMPILE)
    p.add_argument("--json", action="store_true", help="print a list of {program, outcome, seconds}")
    p.set_defaults(func=cmd_compile)


def launch_spec(args: argparse.Namespace, command: str, world: int | None = None):
    """The command's spec, its model resolved (the embedded default made on first use)."""
    from console.cli.model import resolve_model_dir

    spec = from_args(args, command, world=world)
    return spec.with_(model=resolve_model_dir(spec.model))


def cmd_serve(args: argparse.Namespace) -> int:
    from runtime.launch.rank_store import RankEnv
    from runtime.serve.main import run, run_rank

    env = RankEnv.from_env()
    spec = launch_spec(args, SERVE, world=env.world if env is not None else None)
    display = _display if sys.stderr.isatty() else None
    if env is not None and env.world > 1:  # one rank of several (our launcher's, or torchrun's)
        run_rank(lambda: run(spec, env, display))
    return run(spec, env, display)


def _display():
    from console.cli.live import PhaseDisplay

    display = PhaseDisplay()
    return display.sink, display.stop


def cmd_compile(args: argparse.Namespace) -> int:
    """Every program published in the kernel cache, as the next launch's plan needs them; the
    events are the ones `dsv4 serve` emits for its programs phase. The parent never loads a
    program (no torch here): the compile workers do the work."""
    from runtime.events import Emitter, Phase, open_sink
    from runtime.launch.phases import PhaseRecorder
    from runtime.launch.plan import make_plan
    from runtime.programs.phase import prepare_programs
    from runtime.serve.main import interrupt
    from store.errors import UserError

    spec = launch_spec(args, COMPILE)
    from runtime.launch.plan_report import CHECK

    plan = make_plan(spec)
    if (problem := plan.report().problem(CHECK)) is not None:
        raise UserError(problem.line())

    def show(event) -> None:
        if not args.json and spec.events != "-" and event.kind == "progress":
            d = event.detail
            print(f"[{event.done}/{event.total}] {d['program']}: {d['outcome']} ({d['seconds']:.2f} s)",
                  file=sys.stderr, flush=True)

    phases = PhaseRecorder(Emitter(show, *([open_sink(spec.events)] if spec.events else [])))
    signal.signal(signal.SIGTERM, interrupt)
    with phases.run(Phase.PROGRAMS, total=len(plan.catalog.specs), backend=plan.backend) as d:
        results = prepare_programs(plan, phases.emitter, load=False).results
        d.update(programs={r["program"]: r["outcome"] for r in results})
    if spec.events == "-":
        return 0
    if args.json:
        print_json(results)
    else:
        print_table(None, ("program", "outcome", "seconds", "reason"),
                    [(r["program"], r["outcome"], f"{r['seconds']:.2f}", r["reason"]) for r in results])
    return 0
