"""`dsv4 plan`: what the next launch will do, and why (runtime.launch.plan, torch-free)."""

from __future__ import annotations

import argparse

from console.cli.output import confirm, print_json, print_table
from runtime.launch.spec import PLAN, SIDECAR_PURGE, add_flags, from_args
from store.units import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="what the next launch will do: each program's cache state, the "
                       "sidecar verdict, the KV budget, predicted seconds per phase",
                       description="What `dsv4 serve` with the same flags would do, torch-free: each program "
                       "HIT / MISS / STALE (naming the changed component) / CORRUPT, the sidecar MAP or REPACK "
                       "and why, every rank's KV budget, how --ready auto resolves, and the predicted seconds "
                       "per phase from the launch history. Exit 1 when the plan has a problem.")
    add_flags(p, PLAN, model_help="checkpoint dir (default: the embedded default)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)


def spec_of(args: argparse.Namespace, command: str):
    """The command's launch spec, its model the given dir or the embedded default's (not made here)."""
    from store.paths import default_model_dir

    spec = from_args(args, command)
    return spec.with_(model=spec.model or default_model_dir())


def cmd_plan(args: argparse.Namespace) -> int:
    from runtime.launch.history import basis_line
    from runtime.launch.plan import make_plan

    plan = make_plan(spec_of(args, PLAN), digests="compute")
    if args.json:
        print_json(plan.to_json())
        return 1 if plan.problems else 0
    print_table(f"programs ({plan.backend} on {plan.device})", ("program", "state", "fingerprint", "why"),
                [(p.program, p.state, (p.fingerprint or "")[:12], p.reason) for p in plan.programs])
    if plan.content_id is not None:
        print(f"checkpoint content {plan.content_id.summary()}")
    if plan.across_hosts:
        print(plan.across_hosts)
    s = plan.sidecar
    if s is not None:
        print(f"weights: {s.verdict}{' (' + s.reason + ')' if s.reason else ''}: {s.detail}  [{s.path}]")
    kv = plan.kv
    if kv is not None and kv.slots is not None:
        capped = f" (fits {kv.fits}; --max-slots {kv.max_slots} per rank)" if (kv.fits or 0) > kv.slots else ""
        ranks = kv.per_rank
        budgets = sorted({format_size(max(0, b.budget)) for b in ranks})
        each = (f" = {' + '.join(str(b.slots) for b in ranks)} over {len(ranks)} ranks, each within a budget of "
                f"{' / '.join(budgets)}") if len(ranks) > 1 \
            else f" within a budget of {format_size(max(0, kv.budget or 0))}"
        print(f"kv: {kv.slots} slots of {format_size(kv.slot_bytes or 0)}{capped}{each}")
    elif kv is not None and kv.detail:
        print(f"kv: {kv.detail}")
    print(f"ready: {plan.ready}" + (" (--ready auto)" if plan.spec.ready == "auto" else ""))
    predicted = ", ".join(f"{k} {v:.2f} s" for k, v in plan.predicted.items() if v is not None)
    print(f"predicted: {predicted or '-'} ({basis_line(plan.basis, plan.compared)})")
    for problem in plan.problems:
        print(f"problem: {problem.line()}")
    return 1 if plan.problems else 0


def add_purge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, and why")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def register_sidecar_purge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("purge", help="delete the sidecar if the plan calls it stale or corrupt",
                       description="Delete the checkpoint's sidecar only when the plan of the next launch "
                       "calls it stale, corrupt or of another tensor set; a sidecar that would MAP, is "
                       "only cold, or whose checkpoint cannot be read is never deleted.")
    add_flags(p, SIDECAR_PURGE, model_help="checkpoint dir (default: the embedded default)")
    p.add_argument("--json", action="store_true", help="print what was (or would be) deleted as JSON")
    add_purge_arguments(p)
    p.set_defaults(func=lambda args: run_purge(args, "sidecar", SIDECAR_PURGE))


def run_purge(args: argparse.Namespace, kind: str, command: str) -> int:
    """Delete the `kind` targets (program | sidecar) the plan of the command's spec calls stale
    or corrupt."""
    from runtime.launch import purge
    from runtime.launch.plan import make_plan

    plan = make_plan(spec_of(args, command))
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
