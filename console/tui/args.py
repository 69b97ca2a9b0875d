"""`dsv4-console`'s command line: the launch spec's flags (`runtime.launch.spec`: every setting
`dsv4 serve` takes, so `l`, `w`, `p` and `x` carry them), its own few, the environment it reads,
`--once [--json]`, and the run that prints where a service left running can be reached."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from console.about import VersionAction, with_environment
from console.data.collectors import Collectors, resolved
from runtime.launch.spec import CONSOLE, LaunchSpec, add_flags, from_args

ONCE_SCRAPE_GAP_S = 1.0  # --once: between the two /metrics scrapes of a live service

FIRST_ANSWER_S = 60.0  # --once waits this long for every host's first snapshot (ssh, then dsv4 starting)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-console", description="Operations console for DeepSeek V4 serving "
                                "hosts: kernel cache, weight sidecars, services, host, device, registration. "
                                "The launch flags are `dsv4 serve`'s: what the console shows is planned with "
                                "them, and `l` launches with them (its --ready defaults to auto).",
)
    p.add_argument("--version", action=VersionAction)
    add_flags(p, CONSOLE, model_help="checkpoint dir (default: the embedded synthetic checkpoint, made on first run)")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period (default 2)")
    p.add_argument("--readonly", action="store_true", help="refuse every mutating action")
    p.add_argument("--once", action="store_true", help="collect once, print every pane's data as text, exit "
                   "(exit 1 when there is no checkpoint to look at)")
    p.add_argument("--json", action="store_true", help="with --once: print it as one JSON object")
    fleet = p.add_argument_group("fleet", "every host of a service, reached with the system ssh (batch mode, "
                                 "your ssh config and agent, shared connections), each running `dsv4 snapshot`")
    fleet.add_argument("--hosts", metavar="HOST,…", help="the service's hosts ([user@]host[:port]), node ranks "
                       "in order")
    fleet.add_argument("--fleet", type=Path, metavar="FILE", help="a fleet file (TOML: hosts with node rank, ssh "
                       "user, port and options, dsv4's path; the launch flags every host shares; see docs/fleet.md)")
    fleet.add_argument("--ssh-config", metavar="FILE", help="passed to ssh as -F FILE")
    fleet.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                       help="passed to ssh as -o KEY=VALUE (repeatable)")
    fleet.add_argument("--registry", default="", metavar="HOST/REPO",
                       help="where the fleet's pull takes kernel-cache entries from (`dsv4 cache pull`)")
    fleet.add_argument("--insecure", action="store_true", help="the registry speaks plain HTTP")
    with_environment(p)
    return p


def spec_from(args: argparse.Namespace) -> LaunchSpec:
    return resolved(from_args(args, CONSOLE))


def once(spec: LaunchSpec, as_json: bool = False) -> dict[str, Any]:
    """Every pane's data once, printed as text (or JSON); returns the JSON form."""
    from console.tui.once import render

    collectors = Collectors(spec)
    # rates need two samples: the host's, and each live service's /metrics (tokens/s, requests/s:
    # the figures the screen shows), scraped about a second apart
    first = collectors.services()
    time.sleep(ONCE_SCRAPE_GAP_S if any(not v.ended for v in first.services) else 0.25)
    snap = collectors.snapshot()
    data = snap.to_json()
    if as_json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(render(snap))
    return data


def fleet_setup(args: argparse.Namespace):
    """--hosts/--fleet → the running FleetSetup (None: one host, this one)."""
    from console.fleet import spec as F
    from console.fleet.collector import FleetSetup
    from console.fleet.ssh import Ssh, control_dir
    from store.errors import UserError

    if not args.hosts and not args.fleet:
        if args.ssh_config or args.ssh_option or args.registry:
            raise UserError("--ssh-config, --ssh-option and --registry go with --hosts or --fleet")
        return None
    if args.hosts and args.fleet:
        raise UserError("--hosts or --fleet, not both")
    fleet = F.load(args.fleet) if args.fleet else F.from_hosts(args.hosts)
    config = args.ssh_config or fleet.ssh_config
    if config and not Path(config).expanduser().is_file():
        raise UserError(f"--ssh-config {config}: no such file")
    options = (*fleet.ssh_options, *F.check_options(args.ssh_option))
    model, args.model = args.model, None  # the hosts' paths: never looked for on this one
    spec = fleet.spec(from_args(args, CONSOLE).with_(model=model))
    ssh = Ssh(str(Path(config).expanduser()) if config else None, options, control_dir())
    return FleetSetup.start(fleet, spec, ssh, registry=args.registry or fleet.registry,
                            insecure=args.insecure or fleet.insecure)


def fleet_once(setup, as_json: bool, timeout: float) -> int:
    """Every host once (or why not): text per host, or `{"hosts": [...]}`; exit 1 when one is unreachable."""
    from console.fleet.rows import drift
    from console.tui.once import render

    try:
        snap = setup.collector.first(timeout)
    finally:
        setup.close()
    if as_json:
        json.dump(snap.to_json(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        drifts = drift(snap.hosts)
        for r in snap.hosts:
            print(f"=== {r.host} (node {r.node_rank}): " + ("reachable" if r.reachable else "unreachable")
                  + (f" — {r.error}" if r.error else ""))
            if r.snapshot is not None:
                tool = r.snapshot.toolchain
                print(f"toolchain: dsv4 {tool.get('dsv4', '?')}, torch {tool.get('torch', '?')}, python "
                      f"{tool.get('python', '?')}" + "".join(f"\n  differs: {d}" for d in drifts.get(r.host, ())))
                print(render(r.snapshot))
            print()
    return 0 if all(r.reachable and r.snapshot is not None for r in snap.hosts) else 1


def _bad(message: str, code: int = 2) -> int:
    print(f"dsv4-console: {message}", file=sys.stderr)
    return code


def run(argv: list[str] | None, app_class) -> int:
    args = build_parser().parse_args(argv)
    if args.interval < 0.1:
        return _bad("--interval must be at least 0.1 s")
    from store.errors import UserError
    from store.paths import data_dir, state_dir

    try:  # a dir env var pointing at a file is one line here, not a traceback from a refresh
        state_dir(), data_dir()
        setup = fleet_setup(args)
        spec = setup.spec if setup is not None else spec_from(args)
        from runtime.serve.access import Access

        Access.of(spec.api_key_file, spec.ca_file)  # a key or CA file that cannot serve: one line now
    except UserError as e:  # as `dsv4` says a bad setting: one line, exit 1
        return _bad(str(e), 1)
    if setup is not None:
        if args.once:
            return fleet_once(setup, args.json, FIRST_ANSWER_S)
        app = app_class(spec, readonly=args.readonly, interval=args.interval, fleet=setup)
        try:
            app.run()
        finally:
            setup.close()
        return 0
    if args.once:
        from store.checkpoint import INDEX_NAME

        if not (spec.model / INDEX_NAME).is_file():  # nothing to report on: say so, and fail the script
            hint = "" if args.model else " (the embedded default is made by `dsv4 check` or the first interactive run)"
            return _bad(f"{spec.model}: no checkpoint there{hint}", 1)
        once(spec, args.json)
        return 0
    from store import pagecache

    pagecache.schedule(pagecache.REFRESH_SHARE)  # this process refreshes forever: bound the mincore fallback
    app = app_class(spec, readonly=args.readonly, interval=args.interval)
    app.run()
    message = app.exit_message()
    if message:
        print(message, file=sys.stderr)
    return 0
