"""`dsv4 snapshot`: this host's console snapshot as one JSON line — what `dsv4-console --once
--json` prints, for another host's console to read over SSH. Torch-free, never a device context.

`--stream` keeps the collectors (host rates, each service's /metrics window) between snapshots:
one line at start, then one line for every line read on stdin (`history`: with the launch
history's last records), until stdin ends (the console that asked has gone: so does this process)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from runtime.launch.spec import CONSOLE, add_flags


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("snapshot", help="this host's console snapshot as one JSON line (what a fleet reads)",
                       description="Collect what dsv4-console shows of this host for the launch the flags "
                       "describe (plan, kernel cache, sidecars, services and their serving figures, host, "
                       "device, toolchain, service nodes) and print it as one JSON line; the fleet console "
                       "runs this on every host over SSH.")
    add_flags(p, CONSOLE, model_help="checkpoint dir (default: the embedded synthetic checkpoint; not created here)")
    p.add_argument("--stream", action="store_true",
                   help="print one snapshot now and one more for every line read on stdin, until stdin ends")
    p.add_argument("--local-ranks", type=int, metavar="N",
                   help="the service's ranks that run on this host (a service across hosts; default --ranks): "
                   "the plan sizes the KV of these on this host's devices")
    p.set_defaults(func=cmd_snapshot)


def cmd_snapshot(args: argparse.Namespace) -> int:
    from console.data.collectors import Collectors, resolved
    from runtime.launch.spec import from_args

    model, args.model = args.model, None  # a host without the checkpoint still has a snapshot (its plan says so)
    spec = from_args(args, CONSOLE)
    if args.local_ranks is not None and not 1 <= args.local_ranks <= spec.ranks:
        from store.errors import UserError

        raise UserError(f"--local-ranks {args.local_ranks}: 1..--ranks ({spec.ranks})")
    collectors = Collectors(resolved(spec.with_(model=model) if model else spec), args.local_ranks)
    time.sleep(0.25)  # host rates need two samples
    _emit(collectors)
    if not args.stream:
        return 0
    for line in sys.stdin:
        _emit(collectors, with_history=line.strip() == "history")
    return 0


def _emit(collectors, with_history: bool = False) -> None:
    snap = collectors.snapshot(with_history=with_history)
    sys.stdout.write(json.dumps(snap.to_json(), default=str, separators=(",", ":")) + "\n")
    sys.stdout.flush()
