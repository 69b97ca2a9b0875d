"""`dsv4 plan`: what the next launch will do, and why (runtime.plan, torch-free)."""

from __future__ import annotations

import argparse
from pathlib import Path

from console.output import print_json, print_table
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
