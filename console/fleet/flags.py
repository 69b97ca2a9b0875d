"""The fleet's command-line flags, the same for `dsv4-console` and `dsv4 fleet`: which hosts
(`--hosts`, `--fleet FILE`), how ssh reaches them (`--ssh-config`, `--ssh-option`), where `pull`
takes entries from, and the hosts left out (`--exclude`); and the session they make. Torch-free."""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.launch.spec import CONSOLE, from_args
from store.errors import UserError


def add_fleet_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--hosts", metavar="HOST,…", help="the service's hosts ([user@]host[:port]), node ranks in order")
    p.add_argument("--fleet", type=Path, metavar="FILE", help="a fleet file (TOML: hosts with node rank, ssh user, "
                   "port and options, dsv4's path; the launch flags every host shares; see docs/fleet.md)")
    p.add_argument("--ssh-config", metavar="FILE", help="passed to ssh as -F FILE")
    p.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to ssh as -o KEY=VALUE (repeatable; yours come first, so they override the console's)")
    p.add_argument("--registry", default="", metavar="HOST/REPO",
                   help="where the fleet's pull takes kernel-cache entries from (`dsv4 cache pull`)")
    p.add_argument("--insecure", action="store_true", help="the registry speaks plain HTTP")
    p.add_argument("--exclude", action="append", default=[], metavar="HOST",
                   help="leave HOST out (repeatable): the ranks, the plans and a launch cover the other hosts")


def session_from(args: argparse.Namespace, *, required: bool = False):
    """--hosts/--fleet (and the launch flags) → the running FleetSession over ssh; None without
    them (one host, this one), unless `required`."""
    from console.fleet import spec as F
    from console.fleet.session import FleetSession
    from console.fleet.ssh import Ssh, control_dir

    if not args.hosts and not args.fleet:
        if required:
            raise UserError("which hosts? give --hosts HOST,… or --fleet FILE")
        if args.ssh_config or args.ssh_option or args.registry or args.exclude:
            raise UserError("--ssh-config, --ssh-option, --registry and --exclude go with --hosts or --fleet")
        return None
    if args.hosts and args.fleet:
        raise UserError("--hosts or --fleet, not both")
    fleet = F.load(args.fleet) if args.fleet else F.from_hosts(args.hosts)
    left_out = fleet.checked_out(args.exclude)
    config = args.ssh_config or fleet.ssh_config
    if config and not Path(config).expanduser().is_file():
        raise UserError(f"--ssh-config {config}: no such file")
    options = (*fleet.ssh_options, *F.check_options(args.ssh_option))
    model, args.model = args.model, None  # the hosts' paths: never looked for on this one
    spec = fleet.spec(from_args(args, CONSOLE).with_(model=model))
    ssh = Ssh(str(Path(config).expanduser()) if config else None, options, control_dir())
    return FleetSession.of_fleet(fleet, spec, ssh, registry=args.registry or fleet.registry,
                                 insecure=args.insecure or fleet.insecure, left_out=sorted(left_out))
