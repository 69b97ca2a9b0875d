"""`dsv4 keys generate|show`: the ed25519 keys that sign kernel-cache entries for other hosts
(formats: store.signing)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from store.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "keys", help="signing keys for kernel-cache entries that travel: generate, show",
        description="ed25519 keys that sign the kernel-cache entries `dsv4 cache export|push` ship; "
        "another host installs them (`cache import|pull`) only when the signer's public key is in "
        "its trusted keys file ($DSV4_TRUSTED_KEYS).")
    sub = group.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    gen = sub.add_parser(
        "generate", help="make a key pair: FILE (private, mode 0600) and FILE.pub (its trusted-keys line)",
        description="Make an ed25519 key pair: the private key in FILE (one line NAME:BASE64, mode "
        "0600; never overwritten) and its public line in FILE.pub; print the public line (add it to "
        "the other hosts' trusted keys file).")
    gen.add_argument("--out", type=Path, metavar="FILE",
                     help="the private key file (default $DSV4_SIGNING_KEY, else <user config dir>/"
                     "dsv4-console/signing.key)")
    gen.add_argument("--name", help="the key's name in trusted-keys lines (default: this host's name)")
    gen.set_defaults(func=_generate)
    show = sub.add_parser(
        "show", help="print a key's public line (NAME KEY ID) for a trusted keys file",
        description="Print the public key of FILE (a private key file or a .pub line) as one line of "
        "a trusted keys file: its name, the base64 public key, its short id.")
    show.add_argument("file", type=Path, metavar="FILE", help="a private key file or its .pub file")
    show.set_defaults(func=_show)


def _generate(args: argparse.Namespace) -> int:
    from store.atomic import staged_file
    from store.paths import signing_key_path
    from store.signing import SigningKey

    path = signing_key_path(args.out)
    key = SigningKey.generate(args.name or socket.gethostname())
    public = path.with_name(path.name + ".pub")
    for p in (path, public):
        if p.exists():
            raise UserError(f"{p}: exists already; keys are never overwritten (choose another --out)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # staged and linked into place: a crash never leaves half a key, and replace=False keeps
        # one that a concurrent generate wrote meanwhile
        with staged_file(path, 0o600, replace=False) as (_, f):
            f.write((key.line() + "\n").encode())
        with staged_file(public, replace=False) as (_, f):
            f.write((key.public.line() + "\n").encode())
    except FileExistsError:
        raise UserError(f"{path}: written by someone else meanwhile; keys are never overwritten") from None
    except OSError as e:
        raise UserError(f"{e.filename or path}: cannot write the key ({e.strerror})") from None
    print(key.public.line())
    return 0


def _show(args: argparse.Namespace) -> int:
    from store.signing import load_public_key

    print(load_public_key(args.file).line())
    return 0
