"""`dsv4-console`'s command line: flags, the environment it reads, `--once --json`, and the
run that prints where a service left running can be reached."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from console.about import ENVIRONMENT, VersionAction
from console.collectors import Collectors, Settings

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000  # the `dsv4 serve` defaults

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-console", description="Operations console for DeepSeek V4 serving "
                                "hosts: kernel cache, weight sidecars, services, host, device, registration.",
                                epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="checkpoint dir (default: the embedded synthetic checkpoint, made on first run)")
    p.add_argument("--kernel-cache-dir", type=Path, metavar="DIR", help="kernel cache root")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    p.add_argument("--memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of device memory a launch may use (KV budget)")
    p.add_argument("--backend", choices=("auto", "aoti", "export", "eager"), default="auto",
                   help="program backend for launch and warm")
    p.add_argument("--max-seq", type=int, default=1024, help="context length per KV slot for launch")
    p.add_argument("--ranks", type=int, default=1, help="expert-parallel ranks of the sidecar")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address `l` binds the service to (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port `l` binds the service to (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period (default 2)")
    p.add_argument("--readonly", action="store_true", help="refuse every mutating action")
    p.add_argument("--once", action="store_true", help="collect once, print, exit")
    p.add_argument("--json", action="store_true", help="with --once: print every pane's data as JSON")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings.make(args.model, args.kernel_cache_dir, device=args.device,
                         memory_utilization=args.memory_utilization, backend=args.backend,
                         ranks=args.ranks, max_seq=args.max_seq)


def once(settings: Settings, as_json: bool = True) -> dict[str, Any]:
    collectors = Collectors(settings)
    time.sleep(0.25)  # host rates need two samples
    data = collectors.snapshot().to_json()
    if as_json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return data


def _bad(message: str) -> int:
    print(f"dsv4-console: {message}", file=sys.stderr)
    return 2


def run(argv: list[str] | None, app_class) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.memory_utilization <= 1:
        return _bad("--memory-utilization must be within (0, 1]")
    if args.ranks < 1:
        return _bad("--ranks must be at least 1")
    if args.interval < 0.1:
        return _bad("--interval must be at least 0.1 s")
    if not 0 <= args.port <= 65535:
        return _bad("--port must be within 0..65535")
    from store.errors import UserError
    from store.paths import data_dir, state_dir

    try:  # a dir env var pointing at a file is one line here, not a traceback from a refresh
        state_dir(), data_dir()
        settings = settings_from(args)
    except UserError as e:
        print(f"dsv4-console: {e}", file=sys.stderr)
        return 1
    if args.once:
        once(settings)
        return 0
    from console.collectors import RESIDENCY_SHARE
    from store import pagecache

    pagecache.schedule(RESIDENCY_SHARE)  # this process refreshes forever: bound the mincore fallback
    app = app_class(settings, readonly=args.readonly, interval=args.interval, host=args.host, port=args.port)
    app.run()
    message = app.exit_message()
    if message:
        print(message, file=sys.stderr)
    return 0
