"""`dsv4 purge`: delete what the plan of a launch calls stale or corrupt — program entries and the
sidecar together (`--scope plan`) — or, `--scope cache`, every kernel-cache entry that can never
be used again (`runtime.launch.purge`). `--dry-run --json` lists each file and why (what the
console confirms, on any host); `--only PATH` deletes only those of them a fresh look still allows."""

from __future__ import annotations

import argparse

from console.cli.output import confirm, print_json
from console.cli.plan import spec_of
from runtime.launch.spec import PLAN, add_flags
from store.units import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("purge", help="delete the kernel-cache entries and the sidecar the plan calls stale or corrupt",
                       description="Delete what the plan of the next launch (the same flags as `dsv4 plan`) calls "
                       "stale or corrupt: program entries of this model and its sidecar; with --scope cache, every "
                       "entry under the kernel cache that can never be used again (stale, corrupt, quarantined, "
                       "abandoned staging). Current entries, entries of another layout and a sidecar that would "
                       "map or is only cold are never touched; each file is looked at again right before it goes.")
    add_flags(p, PLAN, model_help="checkpoint dir (default: the embedded default)")
    p.add_argument("--scope", choices=("plan", "cache"), default="plan",
                   help="plan: what this checkpoint's plan calls stale or corrupt (default); cache: every entry "
                   "that can never be used again")
    p.add_argument("--only", action="append", default=[], metavar="PATH",
                   help="delete only these of the files it would (repeatable; what a dry run listed)")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, and why")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--json", action="store_true", help="print the files (deleted, or with --dry-run listed) as JSON")
    p.set_defaults(func=cmd_purge)


def cmd_purge(args: argparse.Namespace) -> int:
    from runtime.launch import purge
    from runtime.launch.plan import make_plan

    plan = make_plan(spec_of(args, PLAN))
    chosen = purge.targets(plan, args.scope)
    if args.only:
        chosen = [t for t in chosen if t.path in set(args.only)]
    if args.dry_run or not chosen:
        if args.json:
            print_json([t.to_json() for t in chosen])
        else:
            for t in chosen:
                print(f"would delete {t.line()} ({format_size(t.size_bytes)})")
            print(f"{len(chosen)} files, {format_size(sum(t.size_bytes for t in chosen))}"
                  + (" (dry run)" if args.dry_run else ""))
        return 0
    confirm(args.yes, f"delete {len(chosen)} files ({format_size(sum(t.size_bytes for t in chosen))})?")
    done = purge.purge(plan, chosen, args.scope)
    if args.json:
        print_json([t.to_json() for t in done])
    else:
        for t in done:
            print(f"deleted {t.line()}")
        print(f"deleted {len(done)} of {len(chosen)} ({format_size(sum(t.size_bytes for t in done))})")
    return 0
