"""`dsv4 plan`: what the next launch will do, and why (runtime.plan, torch-free)."""

from __future__ import annotations

import argparse
from pathlib import Path

from console.output import confirm, print_json, print_table
from store.units import format_size


def add_launch_settings(p: argparse.ArgumentParser) -> None:
    """The settings a plan depends on; `dsv4 serve` takes the same ones."""
    p.add_argument("--backend", default="auto", choices=("auto", "aoti", "export", "eager"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "npu"))
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--kernel-cache-dir", type=Path, default=None,
                   help="kernel cache root (default $DSV4_KERNEL_CACHE_DIR, else the user cache dir)")
    p.add_argument("--no-sidecar", dest="use_sidecar", action="store_false")
    p.add_argument("--cold-policy", default="auto", choices=("reject", "read", "auto"))
    p.add_argument("--memory-utilization", type=float, default=0.9)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="what the next launch will do: each program's cache state, the "
                       "sidecar verdict, the KV budget, predicted seconds per phase")
    p.add_argument("model", nargs="?", type=Path, help="checkpoint dir (default: the embedded default)")
    add_launch_settings(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def settings_from(args: argparse.Namespace):
    from runtime.plan import Settings

    return Settings(backend=args.backend, device=args.device, ranks=args.ranks, max_seq=args.max_seq,
                    kernel_cache_dir=args.kernel_cache_dir, use_sidecar=args.use_sidecar,
                    cold_policy=args.cold_policy, memory_utilization=args.memory_utilization)


def cmd_plan(args: argparse.Namespace) -> int:
    from runtime.plan import make_plan
    from store.paths import default_model_dir

    plan = make_plan(args.model or default_model_dir(), settings_from(args))
    if args.json:
        print_json(plan.to_json())
        return 1 if plan.problems else 0
    print_table(f"programs ({plan.backend} on {plan.device})", ("program", "state", "fingerprint", "why"),
                [(p.program, p.state, (p.fingerprint or "")[:12], p.reason) for p in plan.programs])
    s = plan.sidecar
    print(f"weights: {s.get('verdict')}{' (' + s['reason'] + ')' if s.get('reason') else ''}: "
          f"{s.get('detail', '')}  [{s.get('path')}]")
    kv = plan.kv
    if kv.get("slots") is not None:
        print(f"kv: {kv['slots']} slots of {format_size(kv['slot_bytes'])} within a budget of "
              f"{format_size(max(0, kv['budget']))}")
    predicted = ", ".join(f"{k} {v:.2f} s" for k, v in plan.predicted.items() if v is not None)
    print(f"predicted: {predicted or 'no comparable launch in the history'}")
    for problem in plan.problems:
        print(f"problem: {problem}")
    return 1 if plan.problems else 0


def add_purge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, and why")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def register_sidecar_purge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("purge", help="delete the sidecar if the plan calls it stale or corrupt",
                       description="Delete the checkpoint's sidecar only when the plan of the next launch "
                       "calls it stale, corrupt or of another tensor set; a sidecar that would MAP, is "
                       "only cold, or whose checkpoint cannot be read is never deleted.")
    p.add_argument("model", nargs="?", type=Path, help="checkpoint dir (default: the embedded default)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print what was (or would be) deleted as JSON")
    add_purge_arguments(p)
    p.set_defaults(func=lambda args: run_purge(args, "sidecar"))


def run_purge(args: argparse.Namespace, kind: str) -> int:
    """Delete the `kind` targets (program | sidecar) the plan of args.model calls stale or corrupt."""
    from runtime import purge
    from runtime.plan import Settings, make_plan
    from store.paths import default_model_dir

    settings = Settings(ranks=getattr(args, "ranks", None) or 1, max_seq=getattr(args, "max_seq", 1024),
                        backend=getattr(args, "backend", "auto"), device=getattr(args, "device", "auto"),
                        kernel_cache_dir=getattr(args, "cache_dir", None) or getattr(args, "kernel_cache_dir", None))
    plan = make_plan(args.model or default_model_dir(), settings)
    chosen = [t for t in purge.targets(plan) if t.kind == kind]
    if getattr(args, "json", False) and (args.dry_run or not chosen):
        print_json([t.to_json() for t in chosen])
        return 0
    for t in chosen:
        print(f"{'would delete' if args.dry_run else 'delete'} {t.line()} ({format_size(t.size_bytes)})")
    if args.dry_run or not chosen:
        print(f"{len(chosen)} the plan calls stale or corrupt ({format_size(sum(t.size_bytes for t in chosen))})"
              + (" (dry run)" if args.dry_run else ""))
        return 0
    confirm(args.yes, f"delete {len(chosen)} files the plan calls stale or corrupt?")
    done = purge.purge(plan, chosen)
    print(f"deleted {len(done)} ({format_size(sum(t.size_bytes for t in done))})")
    return 0
