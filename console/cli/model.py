"""`dsv4 synth` and `dsv4 check`: make a synthetic checkpoint, check one against the contract."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from console.cli.output import print_json, print_table
from console.cli.progress import byte_progress
from store.units import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write a synthetic DeepSeek V4 checkpoint",
                       description="Write a structurally faithful synthetic DeepSeek V4 checkpoint "
                       "(real names, dtypes and FP8/FP4 formats at shrunk dimensions).")
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="directory to write the checkpoint into")
    p.add_argument("--preset", choices=("tiny", "small", "medium"), default="tiny",
                   help="tiny (6 MB, what tests use), small (0.5 GB), medium (~4 GB); default %(default)s")
    p.add_argument("--seed", type=int, default=0, help="the weights' random seed (default %(default)s)")
    p.add_argument("--shards", type=int, default=None, help="shard count (default per preset)")
    p.add_argument("--force", action="store_true", help="overwrite a checkpoint in a non-empty OUT_DIR")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("check", help="check a checkpoint against the DeepSeek V4 tensor contract",
                       description="Check names, dtypes and shapes against what config.json implies. "
                       "Without MODEL_DIR, checks the embedded default (created on first run). "
                       "Exits 0 only when the contract holds.")
    p.add_argument("model_dir", metavar="MODEL_DIR", type=Path, nargs="?",
                   help="checkpoint directory (default: the embedded synthetic checkpoint, made on first run)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--events", metavar="FILE|-", default=None,
                   help="while the embedded default is created, write its progress (bytes done/total, the "
                   "tensor now) as events (JSON lines) to FILE or stdout: what the console shows")
    p.set_defaults(func=cmd_check)


def cmd_synth(args: argparse.Namespace) -> int:
    from runtime.synth.checkpoint import synthesize

    if args.shards is not None and args.shards < 1:
        from store.errors import UserError

        raise UserError("--shards must be at least 1")
    t0 = time.perf_counter()
    with byte_progress(f"synth {args.preset}", enabled=args.preset != "tiny") as progress:
        out = synthesize(args.preset, args.out_dir, seed=args.seed, shards=args.shards,
                         force=args.force, progress=progress)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {args.preset} checkpoint to {out} ({format_size(size)}) in {time.perf_counter() - t0:.1f} s")
    return 0


def resolve_model_dir(model_dir: Path | None, events: str | None = None) -> Path:
    """An explicit MODEL_DIR, or the embedded default synthetic checkpoint (made on first run;
    its progress to `events`, FILE or `-`, as well as to the terminal's bar)."""
    if model_dir is not None:
        return model_dir
    from runtime.synth.checkpoint import default_model_dir, ensure_default_model

    with byte_progress(f"creating default model at {default_model_dir()}") as progress:
        path, created = ensure_default_model(progress=_with_events(progress, events))
    if created:
        print(f"created the default synthetic checkpoint at {path}", file=sys.stderr)
    return path


CREATE = "create"  # the phase of the creation's events
EVENTS_EVERY_S = 0.2  # at most this often a progress event (a tensor is written in microseconds)


def _with_events(progress, target: str | None):
    """`progress` that also writes phase-`create` events (start with the total, progress with
    bytes done/total and the tensor now, throttled, end) to `target`; `progress` alone without."""
    if not target:
        return progress
    from runtime.events import Event, open_sink

    sink = open_sink(target)
    state = {"last": 0.0, "started": None}

    def update(done: int, total: int, label: str) -> None:
        progress(done, total, label)
        now = time.monotonic()
        if state["started"] is None:
            state["started"] = now
            sink(Event(CREATE, "start", total=total, unit="bytes", detail={"total": total}))
        if done >= total or now - state["last"] >= EVENTS_EVERY_S:
            state["last"] = now
            sink(Event(CREATE, "progress", done=done, total=total, unit="bytes", detail={"file": label}))
        if done >= total:
            sink(Event(CREATE, "end", seconds=now - state["started"], detail={"bytes": total}))

    return update


def cmd_check(args: argparse.Namespace) -> int:
    from runtime.model.config import load_config
    from runtime.model.tensors import expected_tensors
    from runtime.model.tokenizer import load_tokenizer
    from store.checkpoint import Checkpoint, check_contract

    root = resolve_model_dir(args.model_dir, args.events)
    config = load_config(root)  # first: out-of-range values stop here, before anything loops on them
    ckpt = Checkpoint.open(root)
    report = check_contract(ckpt, expected_tensors(config))
    tokenizer, warning = load_tokenizer(root, config.vocab_size)
    summary = {**config.summary(), "tensors": len(ckpt.tensors),
               "bytes_by_dtype": ckpt.bytes_by_dtype(),
               "total_bytes": sum(ckpt.bytes_by_dtype().values()), "tokenizer": tokenizer.kind}
    if args.json:
        print_json({"path": str(root), **report.to_json(), "summary": summary})
        return 0 if report.ok else 1
    rows = []
    for fam, problems in report.by_family().items():
        for what, names in problems.items():
            rows.append((fam, what, len(names), ", ".join(names[:3]) + (" …" if len(names) > 3 else "")))
    if rows:
        print_table("contract problems", ("family", "problem", "count", "examples"), rows)
        for m in report.mismatched[:20]:
            print(f"  {m.name}: expected {m.expected}, found {m.found}")
    print(f"{root}: {len(ckpt.tensors)} tensors, {format_size(summary['total_bytes'])}; "
          f"{config.num_hidden_layers} layers ({len(config.sliding_layers)} sliding, "
          f"{len(config.csa_layers)} CSA, {len(config.hca_layers)} HCA; "
          f"{len(config.hash_layers)} hash-routed) + {config.num_nextn_predict_layers} MTP; "
          f"{config.n_routed_experts} experts, top-{config.num_experts_per_tok}")
    print("  " + ", ".join(f"{k} {format_size(v)}" for k, v in summary["bytes_by_dtype"].items()))
    print(f"  tokenizer: {warning or tokenizer.kind}")
    if report.ok:
        print(f"contract OK: {report.checked} tensors match")
        return 0
    print(f"contract FAILED: {len(report.missing)} missing, {len(report.extra)} extra, "
          f"{len(report.mismatched)} mismatched")
    return 1
