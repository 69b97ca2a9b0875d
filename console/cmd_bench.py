"""`dsv4 bench …`: benchmarks printing side-by-side tables (one subcommand per bench)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "bench", help="benchmarks: side-by-side tables with ratios", description=__doc__
    )
    sub = group.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    cache = sub.add_parser(
        "cache",
        help="program cache: aoti cold compile vs cache HIT vs torch.compile; ls of 1,000 entries",
        description="Compile one sample program (a tiny MoE layer) with AOTInductor, load it "
        "from the cache, compare with torch.compile cold and warm, and time `cache ls` over "
        "1,000 synthetic entries. Runs compiles one at a time, each in its own process.",
    )
    cache.add_argument("--json", action="store_true", help="print one JSON object")
    cache.set_defaults(func=_cache)


def _cache(args: argparse.Namespace) -> int:
    from bench.cache_bench import main

    return main(json_output=args.json)
