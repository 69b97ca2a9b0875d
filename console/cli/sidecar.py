"""`dsv4 sidecar status`: the prepacked weight sidecar as an operator sees it (warm, verify and
evict are console/cli/sidecar_read.py; purge acts on the plan: console/cli/plan.py).

Verdicts come from `store.sidecar.inspect`, which reads headers, never tensors. `status` of a
sidecar FILE stays torch-free (judged against the settings it records); `status` of a
checkpoint DIR asks the packer (`runtime.weights.prepack.judge`, which imports torch) for the live key
and tensor names, exactly as loading would. `dsv4 prepack` writes sidecars.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from console.cli import sidecar_read as read
from console.cli.sidecar_read import percent
from store import sidecar
from store.errors import UserError
from store.units import format_age, format_size

STATUS_HELP = """\
Judge a sidecar the way loading would: MAP it, or REPACK (missing, stale, cold, corrupt).

MODEL_DIR_OR_PATH is either a sidecar file, or a checkpoint directory whose sidecar is found
beside it by name (dsv4-packed.rRANKS.safetensors; pass --ranks when there are several).

Given a checkpoint dir, the sidecar is judged exactly as loading would judge it: against
this packer's format, version and layout, the ranks (--ranks, else the file name's), the
checkpoint's config.json, index and shards, and the tensor names the pack plan expects. So a
newer packer, other ranks or a different tensor set read as REPACK too.

Given a sidecar file, it is judged against the checkpoint it records (its source dir and the
settings it was packed with): a changed config.json, index or shard makes it stale; a newer
packer version, layout or tensor set is not seen this way. The same holds for a checkpoint
dir whose config.json this runtime cannot plan (the output says which way was used).
Leftover staging files of crashed writers beside the sidecar are listed, not removed.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "sidecar",
        help="prepacked weight sidecars: status, warm, verify, evict, purge",
        description="Prepacked weight sidecars: verdict and page-cache residency, warm, evict.",
    )
    sub = group.add_subparsers(dest="sidecar_command", metavar="ACTION", required=True)

    status = sub.add_parser(
        "status",
        help="verdict (MAP/REPACK and why), residency, size, age",
        description=STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _target(status)
    status.add_argument(
        "--cold-threshold",
        type=float,
        default=sidecar.DEFAULT_COLD_THRESHOLD,
        metavar="FRACTION",
        help="residency below which the sidecar counts as cold (default %(default)s)",
    )
    status.add_argument(
        "--cold-policy",
        choices=sidecar.COLD_POLICIES,
        default="auto",
        help="cold sidecar: reject (repack), read it, or auto: whichever is predicted faster "
        "(default %(default)s)",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_status)

    warm = sub.add_parser(
        "warm",
        help="read a sidecar into the page cache (and measure this host's read throughput)",
        description="Read the sidecar sequentially so it is hot for the next launch, checking "
        "every data chunk against its checksum as it goes (exit 1 on a bad chunk). A read of "
        "enough cold bytes records this host's read throughput, which the auto cold policy uses.",
    )
    _target(warm)
    warm.add_argument(
        "--no-willneed", action="store_true", help="do not send POSIX_FADV_WILLNEED first"
    )
    warm.add_argument("--no-verify", action="store_true",
                      help="do not check the data chunks' checksums while reading")
    warm.add_argument("--json", action="store_true", help="print one JSON object")
    warm.add_argument("--events", metavar="FILE|-", default=None,
                      help="also write progress as runtime.events JSON lines (phase warm)")
    warm.add_argument("--if-present", action="store_true",
                      help="with a checkpoint dir: no sidecar there is nothing to read (say so, exit 0)")
    warm.set_defaults(func=_warm)

    verify = sub.add_parser(
        "verify",
        help="check every data chunk against its recorded checksum; name the tensors of a bad one",
        description="Read the whole sidecar and check each data chunk's xxh3 checksum (recorded "
        "by prepack). Exit 0 when all match, 1 naming the tensors of every bad chunk.",
    )
    _target(verify)
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.set_defaults(func=lambda args: read.verify(args, _existing(args)))

    evict = sub.add_parser(
        "evict",
        help="drop a sidecar from the page cache (POSIX_FADV_DONTNEED)",
        description="Drop the sidecar's pages from the page cache, e.g. to measure a cold launch.",
    )
    _target(evict)
    evict.add_argument("--json", action="store_true", help="print one JSON object")
    evict.set_defaults(func=lambda args: read.evict(args, _existing(args)))

    from console.cli.plan import register_sidecar_purge  # the plan decides what is stale

    register_sidecar_purge(sub)


def _target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", metavar="MODEL_DIR_OR_PATH", help="sidecar file or checkpoint dir"
    )
    parser.add_argument("--ranks", type=int, help="with a checkpoint dir: the sidecar for RANKS")


def _resolve(target: str, ranks: int | None) -> Path | None:
    """The sidecar path a target names; None for a checkpoint dir without any sidecar."""
    path = Path(target).expanduser()
    if not path.is_dir():
        if not os.path.lexists(path):
            raise UserError(f"{path}: no sidecar there, nor a checkpoint directory; give one that exists "
                            f"(`dsv4 prepack` creates a sidecar)")
        return path
    if ranks is not None:
        return sidecar.default_sidecar_path(path, ranks)
    found = sidecar.find_sidecars(path)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise UserError(f"{path}: several sidecars ({names}); pass --ranks N to pick one")
    if found:
        return found[0]
    if not (path / sidecar.CONFIG_NAME).exists():
        raise UserError(f"{path}: neither a sidecar nor a checkpoint directory (no config.json)")
    return None


def _warm(args: argparse.Namespace) -> int:
    if args.if_present:
        path = _resolve(args.target, args.ranks)
        if path is None or not path.is_file():
            print(f"no sidecar at {path or args.target}: nothing to read (p packs one)", file=sys.stderr)
            return 0
    return read.warm(args, _existing(args))


def _existing(args: argparse.Namespace) -> Path:
    path = _resolve(args.target, args.ranks)
    if path is None or not path.is_file():
        where = path or Path(args.target)
        raise UserError(f"{where}: no sidecar there; run `dsv4 prepack` to create one")
    return path


def _status(args: argparse.Namespace) -> int:
    if not 0.0 <= args.cold_threshold <= 1.0:
        raise UserError(f"--cold-threshold {args.cold_threshold}: give a fraction within 0..1")
    path = _resolve(args.target, args.ranks)
    judged_against = RECORDED
    if path is None:
        pattern = sidecar.glob_pattern(args.target)
        verdict = sidecar.missing(pattern, "no sidecar beside this checkpoint; prepack to create it")
        directory = Path(args.target)
    else:
        verdict = None
        target = Path(args.target).expanduser()
        # a sidecar file inside a checkpoint dir is judged as the launch from that dir would judge it
        model_dir = target if target.is_dir() else path.parent
        if (model_dir / sidecar.CONFIG_NAME).is_file():
            verdict, judged_against = _judge_live(model_dir, path, args)
        if verdict is None:
            verdict = sidecar.inspect(
                path, cold_threshold=args.cold_threshold, cold_policy=args.cold_policy
            )
        directory = path.parent
    leftovers = sidecar.sweep_temp_files(directory, remove=False)
    data = {
        **verdict.to_json(),
        "judged_against": judged_against,
        "leftover_temp_files": [str(p) for p in leftovers],
    }
    if args.json:
        from console.cli.output import print_json

        print_json(data)
        return 0
    from console.cli.output import print_table

    rows = [
        ("verdict", verdict.action + (f" ({verdict.reason})" if verdict.reason else "")),
        ("detail", verdict.detail),
        ("residency", percent(verdict.residency, verdict.residency_method)),
        ("size", format_size(verdict.size_bytes) if verdict.size_bytes else "-"),
        ("tensors", verdict.tensors or "-"),
        ("age", format_age(data["age_seconds"])),
        ("pack seconds", "-" if verdict.pack_seconds is None else f"{verdict.pack_seconds:.1f}"),
        ("judged against", judged_against),
    ]
    rows += [("leftover", str(p)) for p in leftovers]
    print_table(verdict.path, ("field", "value"), rows)
    return 0


RECORDED = "settings recorded in the sidecar"
LIVE = "this packer's key and tensor names"


def _judge_live(
    model_dir: Path, path: Path, args: argparse.Namespace
) -> tuple[sidecar.Verdict | None, str]:
    """The loader's verdict (live key and plan names), or None with why it cannot be had."""
    ranks = args.ranks
    if ranks is None:
        ranks = sidecar.ranks_of(path)
        if ranks is None:
            return None, f"{RECORDED} (pass --ranks to judge it as loading would)"
    from runtime.model.config import ConfigError
    from runtime.weights.prepack import judge

    try:
        verdict = judge(
            model_dir, ranks, path, cold_policy=args.cold_policy, cold_threshold=args.cold_threshold
        )
    except ConfigError as e:
        return None, f"{RECORDED} (cannot plan this checkpoint: {e})"
    return verdict, f"{LIVE} (ranks {ranks})"
