"""`dsv4 cache export|import|push|pull`: kernel-cache entries that travel between hosts.

Export and push sign each entry with the signing key; import and pull install an entry only when
its signer is trusted, the archive is safe, its artifacts match their sha256 and its key is this
host's live key for its program (store.kernel_cache.transfer). Live keys come from `--model`
and the launch flags, computed here (the store never computes keys).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from console.cli.cache_args import action, open_cache, reference
from store import kernel_cache as kc
from store.errors import UserError
from store.fingerprint import Key

SELECT_HELP = ("with --model (and the launch flags), the entries that launch uses; or --program P (every "
               "entry of one program); or --all-current (every current entry)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the four actions to `dsv4 cache`."""
    export = action(sub, "export", _export, "write entries, signed, to one bundle (a tar archive)")
    export.add_argument("-o", "--output", type=Path, metavar="FILE", required=True,
                        help="the bundle to write (never overwritten; - : standard output, never a terminal)")
    _selection(export)
    _signing(export)

    imp = action(sub, "import", _import, "install a bundle's entries (signed by a trusted key, for this host's "
                 "live keys)")
    imp.add_argument("bundle", type=Path, metavar="FILE", help="a bundle written by `dsv4 cache export` (- : standard "
                     "input, as `ssh host dsv4 cache export -o - … | dsv4 cache import - …` pipes one)")
    _trusting(imp)

    push = action(sub, "push", _push, "push entries, signed, to an OCI registry (one artifact per entry)")
    push.add_argument("target", metavar="REGISTRY/REPO", help="e.g. registry.example.com/dsv4/programs")
    _selection(push)
    _signing(push)
    _insecure(push)

    pull = action(sub, "pull", _pull, "pull from an OCI registry exactly the entries the --model launch misses")
    pull.add_argument("target", metavar="REGISTRY/REPO", help="e.g. registry.example.com/dsv4/programs")
    _trusting(pull, other_layout=False)  # pulled by the live key's digest: never another layout
    _insecure(pull)


def _selection(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--program", metavar="P", help="every verified entry of program P")
    which.add_argument("--all-current", action="store_true", help="every entry current in this environment")
    p.description = f"{p.description} Which entries: {SELECT_HELP}."


def _signing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--signing-key", type=Path, metavar="FILE",
                   help="the private key to sign with (default $DSV4_SIGNING_KEY, else <user config dir>/"
                   "dsv4-console/signing.key; `dsv4 keys generate` makes one)")


def _trusting(p: argparse.ArgumentParser, other_layout: bool = True) -> None:
    p.add_argument("--trusted-keys", type=Path, metavar="FILE",
                   help="public keys whose signatures are accepted (default $DSV4_TRUSTED_KEYS; none: "
                   "nothing is installed)")
    if other_layout:
        p.add_argument("--other-layout", action="store_true",
                       help="also install entries for another layout of this toolchain and source "
                       "(another --max-seq or rank count), as other-layout entries")


def _insecure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true", help="speak plain HTTP to the registry (never by default)")


# ---------------------------------------------------------------------------------------------


def selected(args: argparse.Namespace, cache: kc.KernelCache) -> list[kc.EntryBundle]:
    """The verified entries export and push ship, signed (one line when none)."""
    from store.paths import signing_key_path
    from store.signing import load_signing_key

    if args.program or args.all_current:
        which = {"program": args.program} if args.program else {"current": reference(args)}
        what = f"program {args.program}" if args.program else "current entries"
    elif args.model is not None:
        which, what = {"keys": _launch_keys(args)}, f"the launch of {args.model}"
    else:
        raise UserError("say which entries: --model DIR (and the launch flags), --program P or --all-current")
    signer = load_signing_key(signing_key_path(args.signing_key))
    exported = kc.export_entries(cache, signer=signer, **which)
    for line in exported.skipped:
        print(f"skip {line}", file=sys.stderr)
    if exported.missing:
        print(f"not cached here ({len(exported.missing)}): {', '.join(exported.missing)}", file=sys.stderr)
    if not exported.entries:
        raise UserError(f"nothing to ship: no verified entry of {what} in {cache.root}")
    return list(exported.entries)


def _launch_keys(args: argparse.Namespace) -> dict[str, Key]:
    from runtime.launch.plan import program_keys
    from runtime.launch.spec import CACHE, from_args

    return program_keys(from_args(args, CACHE))


def _policy(args: argparse.Namespace) -> kc.TrustPolicy:
    from store.signing import TRUSTED_KEYS_ENV, TrustedKeys, env_path

    path = env_path(args.trusted_keys, TRUSTED_KEYS_ENV)
    return kc.TrustPolicy(TrustedKeys.load(path)) if path else kc.TrustPolicy()


def _live(args: argparse.Namespace, what: str) -> kc.Reference:
    if args.model is None:
        raise UserError(f"{what} needs --model DIR (and the launch flags): entries are installed only for this "
                        "host's live keys of that launch's programs")
    return reference(args)


def _report(installed: list[kc.Installed], origin: str) -> None:
    for i in installed:
        done = f"installed ({i.state})" if i.placed else "already cached"
        print(f"{i.name}: {done} from {origin}")
    print(f"{sum(i.placed for i in installed)} installed, {sum(not i.placed for i in installed)} already cached")


def _export(args: argparse.Namespace) -> int:
    from store.atomic import staged_file

    cache = open_cache(args)
    bundle = kc.Bundle.of(selected(args, cache))
    out = args.output
    if str(out) == "-":
        return _export_to_stdout(bundle)
    if os.path.lexists(out):
        raise UserError(f"{out}: exists already; choose another -o (a bundle is never overwritten)")
    try:
        with staged_file(out, replace=False) as (_, f):
            size = kc.write_bundle(f, bundle)
    except FileExistsError:
        raise UserError(f"{out}: written by someone else meanwhile; choose another -o") from None
    except OSError as e:
        raise UserError(f"{out}: cannot write the bundle ({e.strerror})") from None
    from store.units import format_size

    print(f"{out}: {len(bundle.entries)} entries, {format_size(size)}, signed by {bundle.entries[0].signature.key_id}")
    return 0


def _export_to_stdout(bundle) -> int:
    """`-o -`: the bundle on standard output (for a pipe; a terminal would show a tar), its summary
    on standard error."""
    from store.units import format_size

    if sys.stdout.isatty():
        raise UserError("-o -: standard output is a terminal; pipe it (… | dsv4 cache import - …) or give a file")
    sys.stdout.flush()
    size = kc.write_bundle(sys.stdout.buffer, bundle)
    sys.stdout.buffer.flush()
    print(f"-: {len(bundle.entries)} entries, {format_size(size)}, signed by {bundle.entries[0].signature.key_id}",
          file=sys.stderr)
    return 0


def _import(args: argparse.Namespace) -> int:
    from store import safeio

    cache = open_cache(args)
    policy, reference = _policy(args), _live(args, "import")
    path = args.bundle
    if str(path) == "-":  # a pipe, read once front to back, as a file is
        bundle = kc.read_bundle(sys.stdin.buffer, "stdin")
    else:
        try:
            fd = safeio.open_regular(path)
        except FileNotFoundError:
            raise UserError(f"{path}: no such bundle") from None
        except OSError as e:
            raise UserError(f"{path}: cannot read the bundle ({e.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            bundle = kc.read_bundle(f, str(path.absolute()))
    try:
        installed = kc.import_bundle(cache.layout, bundle, policy, reference, other_layout=args.other_layout)
    except kc.BundleError as e:
        raise UserError(f"{path}: refused: {e}") from None
    _report(installed, f"{bundle.host} ({path})")
    return 0


def _push(args: argparse.Namespace) -> int:
    from store.kernel_cache import oci

    cache = open_cache(args)
    entries = selected(args, cache)
    repo = oci.Repository.parse(args.target, insecure=args.insecure)
    for e in entries:
        print(f"{e.name}: pushed {oci.push(repo, e)}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from store.kernel_cache import oci

    cache = open_cache(args)
    policy, reference = _policy(args), _live(args, "pull")
    repo = oci.Repository.parse(args.target, insecure=args.insecure)
    wanted = {}
    for program, key in _launch_keys(args).items():
        if not cache.probe(program, key, verify=False).hit:
            wanted[program] = key
    if not wanted:
        print("nothing to pull: the launch misses no program")
        return 0
    try:
        bundle = oci.pull(repo, wanted, policy)  # the signer checked before any blob is fetched
    except kc.BundleError as e:
        raise UserError(f"{args.target}: refused: {e}") from None
    absent = sorted(set(wanted) - {e.manifest.program for e in bundle.entries})
    if absent:  # they compile at launch, as without a registry
        print(f"not in {repo} ({len(absent)}): {', '.join(absent)}", file=sys.stderr)
    try:
        installed = kc.import_bundle(cache.layout, bundle, policy, reference)
    except kc.BundleError as e:
        raise UserError(f"{args.target}: refused: {e}") from None
    _report(installed, args.target)
    return 0
