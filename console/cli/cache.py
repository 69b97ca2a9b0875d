"""`dsv4 cache ls|verify|purge|gc|why`: the kernel cache as an operator sees it.

States are judged against this environment: `runtime.programs.build.reference()` computes the
toolchain without importing torch, plus the live keys of the registered programs.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from console.cli import cache_ship
from console.cli.cache_args import action as _action
from console.cli.cache_args import open_cache as _cache
from console.cli.cache_args import reference as _reference
from console.cli.output import confirm, print_json, print_table
from runtime.launch.spec import CACHE
from store import kernel_cache as kc
from store.errors import UserError
from store.kernel_cache import inventory as inv
from store.paths import DEFAULT_KERNEL_CACHE_MAX_SIZE, kernel_cache_dir, kernel_cache_limit
from store.units import format_age, format_size, parse_size

PURGE_SELECTIONS = {  # --NAME: (which entries, what --help says of them)
    "stale": (lambda e: e.state == kc.STALE, "entries built by another toolchain or from other source: never "
              "usable again (with --model: what that checkpoint's plan calls stale or corrupt)"),
    "corrupt": (lambda e: e.state in (kc.CORRUPT, kc.QUARANTINED),
                "entries that fail to read or verify, and quarantined ones"),
    "partial": (lambda e: e.state == kc.PARTIAL, "staging dirs of writers that are gone"),
    "all": (lambda e: True, "every entry"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "cache",
        help="kernel cache (compiled programs): ls, verify, purge, gc, why, adopt, export, import, push, pull",
        description="The kernel cache of compiled programs: inventory, verification, cleanup, diagnosis.",
    )
    sub = group.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    ls = _action(sub, "ls", _ls, "every entry with its state against this environment")
    ls.add_argument("--json", action="store_true", help="print a JSON list of entries")

    verify = _action(sub, "verify", _verify, "hash every entry; quarantine those that fail (exit 1)")
    verify.add_argument("--json", action="store_true", help="print the quarantined entries as JSON")

    purge = _action(sub, "purge", _purge, "delete entries (safe while other processes read)")
    which = purge.add_mutually_exclusive_group(required=True)
    for name, (_, what) in PURGE_SELECTIONS.items():
        which.add_argument(f"--{name}", action="store_const", const=name, dest="selection", help=what)
    which.add_argument("--program", metavar="P", help="every entry of one program")
    purge.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    gc = _action(sub, "gc", _gc, "evict least recently used entries down to a size")
    gc.add_argument("--max-size", metavar="SIZE", help="e.g. 10G, 512M (default $DSV4_KERNEL_CACHE_MAX_SIZE, "
                    f"else {DEFAULT_KERNEL_CACHE_MAX_SIZE})")

    _action(sub, "adopt", _adopt, "mark a kernel cache made by an older dsv4 (no marker yet) as one")

    why = _action(sub, "why", _why, "would PROGRAM hit now; if not, what differs")
    why.add_argument("program", metavar="PROGRAM", help="a program name, as `dsv4 cache ls` lists them")

    cache_ship.register(sub)


def _rows(entries: list[kc.Entry], now: float) -> list[list[str]]:
    return [
        [
            e.program,
            e.fingerprint[:12],
            e.state,
            "; ".join(filter(None, [e.reason, e.origin.short(now) if e.origin else ""])),
            format_size(e.size_bytes),
            f"{format_age(now - e.last_used)} ago" if e.hits else "never",
            str(e.hits),
        ]
        for e in entries
    ]


def _totals(entries: list[kc.Entry]) -> str:
    counts = Counter(e.state for e in entries)
    by_state = ", ".join(f"{counts[s]} {s}" for s in kc.STATES if counts[s])
    size = format_size(sum(e.size_bytes for e in entries))
    return f"{len(entries)} entries, {size}" + (f" ({by_state})" if by_state else "")


def render_ls(entries: list[kc.Entry], root: Path) -> None:
    """The `ls` table and totals (shared with the benchmark, which times it)."""
    columns = ("program", "fingerprint", "state", "reason", "size", "last used", "hits")
    print_table(f"kernel cache {root}", columns, _rows(entries, time.time()))
    print(_totals(entries))


def _ls(args: argparse.Namespace) -> int:
    cache = _cache(args)
    entries = inv.inventory(cache.layout, _reference(args))
    if args.json:
        print_json([e.to_json() for e in entries])
        return 0
    render_ls(entries, cache.root)
    return 0


def _adopt(args: argparse.Namespace) -> int:
    from store.kernel_cache.trust import adopt

    root = kernel_cache_dir(args.kernel_cache_dir)
    adopt(root)
    print(f"{root}: a kernel cache ({kc.MARKER} written)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    cache = _cache(args)
    result = cache.verify()
    if args.json:
        print_json([e.to_json() for e in result.quarantined])
    else:
        for e in result.quarantined:
            print(f"quarantined {e.program}/{e.fingerprint[:12]}: {e.reason}")
        print(f"{result.checked} entries checked, {len(result.quarantined)} quarantined")
    return 1 if result.quarantined else 0


def _purge(args: argparse.Namespace) -> int:
    if args.model is not None and args.selection in ("stale", "corrupt") and not args.program:
        # delete only what the plan of this checkpoint calls stale or corrupt
        from console.cli.plan import run_purge

        return run_purge(args, "program", CACHE)
    cache = _cache(args)
    needs_reference = args.selection == "stale"
    entries = inv.inventory(cache.layout, _reference(args) if needs_reference else None)
    if args.program:
        chosen = [e for e in entries if e.program == args.program]
    else:
        chosen = [e for e in entries if PURGE_SELECTIONS[args.selection][0](e)]
    busy = [e for e in chosen if e.busy]
    chosen = [e for e in chosen if not e.busy]
    for e in chosen:
        print(f"{'would delete' if args.dry_run else 'delete'} {e.program}/{e.fingerprint[:12]} "
              f"({e.state}, {format_size(e.size_bytes)}) {e.reason}".rstrip())
    for e in busy:
        print(f"skip {e.program}/{e.fingerprint[:12]}: {e.reason}")
    if args.dry_run or not chosen:
        print(f"{len(chosen)} entries, {format_size(sum(e.size_bytes for e in chosen))}"
              + (" (dry run)" if args.dry_run else ""))
        return 0
    confirm(args.yes, f"delete {len(chosen)} entries from {cache.root}?")
    removed = inv.remove(cache.layout, chosen)
    print(f"deleted {len(removed)} entries, {format_size(sum(e.size_bytes for e in removed))}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    if args.max_size is None:
        max_size = kernel_cache_limit()
    else:
        try:
            max_size = parse_size(args.max_size)
        except ValueError as e:
            raise UserError(f"--max-size {args.max_size}: {e}") from None
    cache = _cache(args)
    removed = inv.gc(cache.layout, max_size)
    for e in removed:
        print(f"delete {e.program}/{e.fingerprint[:12]} ({e.state}, {format_size(e.size_bytes)})")
    left = sum(e.size_bytes for e in inv.inventory(cache.layout))
    print(f"deleted {len(removed)} entries; cache now {format_size(left)} (limit {format_size(max_size)})")
    return 0


def _why(args: argparse.Namespace) -> int:
    cache = _cache(args)
    reference = _reference(args)
    live = reference.keys.get(args.program)
    entries = [e for e in inv.inventory(cache.layout, reference) if e.program == args.program]
    if live is not None:
        result = cache.probe(args.program, live)
        verdict = "HIT" if result.hit else f"MISS: {result.reason}"
        print(f"{args.program}: {verdict}")
    else:
        print(f"{args.program}: no live key (not defined by a registered program module); "
              "entries judged by toolchain only")
    for e in entries:
        print(f"  {e.fingerprint[:12]} {e.state}" + (f": {e.reason}" if e.reason else "")
              + (f" ({e.origin}, {e.origin.reference})" if e.origin else ""))
    if not entries:
        print("  no entries cached for this program")
    return 0 if live is not None and result.hit else 1
