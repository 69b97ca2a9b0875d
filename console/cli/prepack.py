"""`dsv4 prepack MODEL_DIR`: pack a checkpoint once into a weight sidecar beside it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from console.cli.progress import byte_progress
from runtime.launch.spec import PREPACK, add_flags, from_args
from store.units import format_size

DESCRIPTION = """\
Pack MODEL_DIR into the serving layout once and write it as a sidecar (a safetensors file,
dsv4-packed.rRANKS.safetensors beside the checkpoint unless --out says otherwise), so launches
map it instead of repacking. Memory stays at about one layer whatever the model size; the file
is published in one rename (a crash leaves no partial sidecar) with the mode of a checkpoint
shard. The sidecar is the checkpoint's size (FP4 experts stay two codes a byte); its exact
size is known before packing (`dsv4 plan --json`: sidecar.expected_bytes), and a prepack whose
file would not fit in the free space is refused before it starts. Exits 1 when the checkpoint
changed while packing (the sidecar is then already stale).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepack",
        help="pack a checkpoint into a weight sidecar (mapped at launch instead of repacking)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, PREPACK, model_help="checkpoint directory", model_required=True)
    p.add_argument("--out", type=Path, metavar="PATH", help="sidecar file or directory to write to")
    p.add_argument("--force", action="store_true", help="replace an existing sidecar")
    p.set_defaults(func=cmd_prepack)


def cmd_prepack(args: argparse.Namespace) -> int:
    from runtime.weights.prepack import PrepackProgress, prepack

    spec = from_args(args, PREPACK)
    t0 = time.monotonic()
    emit = _event_sink(spec.events)
    emit("start", detail={"model": str(spec.model)})
    with byte_progress(f"prepack {spec.model.name}") as update:

        def progress(p: PrepackProgress) -> None:
            update(p.bytes_done, p.bytes_total, f"layer {p.layer}/{p.layers} {p.group}")
            emit("progress", done=p.bytes_done, total=p.bytes_total, unit="bytes",
                 detail={"group": f"layer {p.layer}/{p.layers} {p.group}"})

        info = prepack(spec.model, ranks=spec.ranks, out=args.out, force=args.force,
                       progress=progress)  # fmt: skip
    seconds = time.monotonic() - t0
    for leftover in info.swept:
        print(f"removed leftover staging file of a crashed writer: {leftover}", file=sys.stderr)
    rate = info.size_bytes / seconds if seconds > 0 else 0.0
    emit("end", seconds=seconds, detail={"path": str(info.path), "size_bytes": info.size_bytes,
                                         "stale": bool(info.stale_detail)})
    print(
        f"wrote {info.path}: {format_size(info.size_bytes)}, {info.tensors} tensors in "
        f"{seconds:.1f} s (packing {info.pack_seconds:.1f} s, {format_size(rate)}/s)"
    )
    if info.stale_detail:
        print(
            f"dsv4 prepack: the checkpoint changed while packing ({info.stale_detail}); the "
            "sidecar is stale: run again with --force once the checkpoint is settled",
            file=sys.stderr,
        )
        return 1
    return 0


def _event_sink(target: str | None):
    """`emit(kind, **fields)` writing phase-`prepack` events to FILE or stdout; a no-op without."""
    if not target:
        return lambda kind, **kw: None
    from runtime.events import Event, open_sink

    sink = open_sink(target)
    return lambda kind, **kw: sink(Event("prepack", kind, **kw))
