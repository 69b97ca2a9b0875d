"""`dsv4-console`'s command line: the launch spec's flags (`runtime.launch.spec`: every setting
`dsv4 serve` takes, so `l`, `w`, `p` and `x` carry them), its own few, the environment it reads,
`--once [--json]`, and the run that prints where a service left running can be reached."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from console.about import VersionAction, with_environment
from console.data.collectors import Collectors, resolved
from runtime.launch.spec import CONSOLE, LaunchSpec, add_flags, from_args

ONCE_SCRAPE_GAP_S = 1.0  # --once: between the two /metrics scrapes of a live service


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
        spec = spec_from(args)
    except UserError as e:  # as `dsv4` says a bad setting: one line, exit 1
        return _bad(str(e), 1)
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
