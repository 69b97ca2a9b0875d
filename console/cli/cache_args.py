"""What every `dsv4 cache` action shares: its parser (the launch flags, --kernel-cache-dir),
the cache it acts on, and the reference its entries are judged against."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from runtime.launch.spec import CACHE, add_flags, from_args
from store import kernel_cache as kc
from store.kernel_cache.trust import check_trust
from store.paths import kernel_cache_dir


def action(sub: argparse._SubParsersAction, name: str, func: Callable, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ". Entries are judged "
                       "against this host's toolchain (--device); with --model also against the live keys of "
                       "that checkpoint's programs for the launch the other flags describe.")
    add_flags(p, CACHE, model_help="judge entries against the live keys of this checkpoint's programs, as a "
              "launch with the same --backend, --ranks and --max-seq would")
    # The old name, kept working for scripts; not advertised.
    p.add_argument("--cache-dir", type=Path, dest="kernel_cache_dir", help=argparse.SUPPRESS)
    p.set_defaults(func=func)
    return p


def open_cache(args: argparse.Namespace) -> kc.KernelCache:
    """The cache the command acts on; one line (exit 1) for a root that is not a kernel cache
    of ours: a file, unreadable, another user's, or an unmarked non-empty directory."""
    cache = kc.KernelCache(kernel_cache_dir(args.kernel_cache_dir))
    check_trust(cache.layout)
    return cache


def reference(args: argparse.Namespace) -> kc.Reference:
    """This host's toolchain and, with --model, the live keys of that launch's programs."""
    from runtime.launch.hardware import resolve_device
    from runtime.programs.build import reference as toolchain_reference

    spec = from_args(args, CACHE)
    ref = toolchain_reference(device=resolve_device(spec.device))
    if spec.model is None:
        return ref
    from runtime.launch.plan import program_keys

    return kc.Reference(components=ref.components, keys={**ref.keys, **program_keys(spec)})
