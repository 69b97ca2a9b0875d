"""`dsv4-console`'s command line: the launch spec's flags (`runtime.launch.spec`: every setting
`dsv4 serve` takes, so `l`, `w`, `p` and `x` carry them), its own few, the fleet's
(`console.fleet.flags`), the environment it reads, `--once [--json]` (one host or a fleet: the
same collector, asked twice for rates), and the run that prints where a service left running
can be reached."""

from __future__ import annotations

import argparse
import json
import sys

from console.about import VersionAction, with_environment
from console.data.collectors import resolved
from console.fleet.flags import add_fleet_flags
from runtime.launch.spec import CONSOLE, LaunchSpec, add_flags, from_args

FIRST_ANSWER_S = 60.0  # --once waits this long for every host's first snapshot (ssh, then dsv4 starting)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-console", description="Operations console for DeepSeek V4 serving "
                                "hosts: kernel cache, weight sidecars, services, host, device, registration. "
                                "The launch flags are `dsv4 serve`'s: what the console shows is planned with "
                                "them, and `l` launches with them (its --ready defaults to auto).")
    p.add_argument("--version", action=VersionAction)
    add_flags(p, CONSOLE, model_help="checkpoint dir (default: the embedded synthetic checkpoint, made on first run)")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period (default 2)")
    p.add_argument("--readonly", action="store_true", help="refuse every mutating action")
    p.add_argument("--once", action="store_true", help="collect once, print every pane's data as text, exit "
                   "(exit 1 when there is no checkpoint to look at, or a host cannot be reached)")
    p.add_argument("--json", action="store_true", help="with --once: print it as one JSON object")
    fleet = p.add_argument_group("fleet", "every host of a service, reached with the system ssh (batch mode, "
                                 "your ssh config and agent, shared connections), each running `dsv4 snapshot`; "
                                 "`dsv4 fleet` runs the same without the screen")
    add_fleet_flags(fleet)
    with_environment(p)
    return p


def spec_from(args: argparse.Namespace) -> LaunchSpec:
    return resolved(from_args(args, CONSOLE))


def once(session, as_json: bool, timeout: float = FIRST_ANSWER_S) -> int:
    """Every host once — this one alone, or a fleet — asked twice about a second apart (a live
    service's rates need two scrapes), the second time with the launch history: its panes' data
    as text, or JSON (one host: its snapshot; a fleet: every host's). Exit 1 when a host cannot be
    reached."""
    from console.fleet.rows import kv_total, rows
    from console.tui.once import fleet_text, render

    try:
        snap = session.collector.once(timeout)
    finally:
        session.close()
    if session.alone:
        reading = snap.hosts[0]
        if reading.snapshot is None:
            return _bad(reading.error or "no snapshot", 1)
        data = reading.snapshot.to_json()
    else:
        data = snap.to_json()
    if as_json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    elif session.alone:
        print(render(snap.hosts[0].snapshot))
    else:
        print(fleet_text(snap, session.spec, kv_total(rows(snap))))
    return 0 if all(r.reachable and r.snapshot is not None for r in snap.hosts) else 1


def _bad(message: str, code: int = 2) -> int:
    print(f"dsv4-console: {message}", file=sys.stderr)
    return code


def run(argv: list[str] | None, app_class) -> int:
    args = build_parser().parse_args(argv)
    if args.interval < 0.1:
        return _bad("--interval must be at least 0.1 s")
    from console.fleet.flags import session_from
    from console.fleet.session import FleetSession
    from store.errors import UserError
    from store.paths import data_dir, state_dir

    try:  # a dir env var pointing at a file is one line here, not a traceback from a refresh
        state_dir(), data_dir()
        session = session_from(args)
        spec = session.spec if session is not None else spec_from(args)
        from runtime.serve.access import Access

        Access.of(spec.api_key_file, spec.ca_file)  # a key or CA file that cannot serve: one line now
    except UserError as e:  # as `dsv4` says a bad setting: one line, exit 1
        return _bad(str(e), 1)
    if session is None:
        if args.once:
            from store.checkpoint import INDEX_NAME

            if not (spec.model / INDEX_NAME).is_file():  # nothing to report on: say so, and fail the script
                hint = "" if args.model else (" (the embedded default is made by `dsv4 check` or the first "
                                              "interactive run)")
                return _bad(f"{spec.model}: no checkpoint there{hint}", 1)
            return once(FleetSession.this_host(spec), args.json)
        from store import pagecache

        pagecache.schedule(pagecache.REFRESH_SHARE)  # this process refreshes forever: bound the mincore fallback
        app = app_class(spec, readonly=args.readonly, interval=args.interval)
        app.run()
        message = app.exit_message()
        if message:
            print(message, file=sys.stderr)
        return 0
    if args.once:
        return once(session, args.json)
    app = app_class(spec, session=session, readonly=args.readonly, interval=args.interval)
    try:
        app.run()
    finally:
        session.close()
    return 0
