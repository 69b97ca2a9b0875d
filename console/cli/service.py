"""`dsv4 service ls|stop|dismiss|log` and `dsv4 events`: this host's services (the registry in `store.services`) as
the console acts on them — on this host, or on another over ssh (the fleet console runs these
there): stop one (SIGTERM, it drains; SIGKILL after --timeout), forget an ended one, follow a log
(the service's, a rank's, or a node's), and say what happened here (its timeline). Torch-free."""

from __future__ import annotations

import argparse
import os
import sys
import time

from console.cli.output import print_json, print_table
from store.errors import UserError

FOLLOW_POLL_S = 0.25


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("service", help="this host's services: start, ls, stop, dismiss, log",
                           description="Every `dsv4 serve` of this user on this host, running or ended, and what "
                           "the console does to one: stop it, forget an ended one, follow its logs.")
    actions = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    from console.cli.service_start import register as register_start

    register_start(actions)
    ls = actions.add_parser("ls", help="every service of this host, running or ended")
    ls.add_argument("--json", action="store_true", help="print them as JSON")
    ls.set_defaults(func=cmd_ls)
    stop = actions.add_parser("stop", help="stop a service (SIGTERM: it drains; SIGKILL after --timeout)")
    stop.add_argument("pid", type=int, metavar="PID", help="the service's pid (`dsv4 service ls`)")
    stop.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="before SIGKILL (default 10)")
    stop.add_argument("--json", action="store_true", help="print what the stop did as JSON")
    stop.set_defaults(func=cmd_stop)
    dismiss = actions.add_parser("dismiss", help="forget an ended service (its record goes)")
    dismiss.add_argument("pid", type=int, metavar="PID", help="the ended service's pid")
    dismiss.set_defaults(func=cmd_dismiss)
    log = actions.add_parser("log", help="print a service's log (or a rank's, or a node's); --follow: as it grows",
                             description="The last lines of a log this host's registries name (the newest "
                             "running service's, unless --pid, --rank or --node says which), then with --follow "
                             "every line as it is written, until the one who asked goes away.")
    log.add_argument("--pid", type=int, metavar="PID", help="the service (default: the newest running one)")
    log.add_argument("--rank", type=int, metavar="N", help="that service's rank N's own log")
    log.add_argument("--node", type=int, metavar="PID", help="a service node's log, by its agent pid (`dsv4 node ls`)")
    log.add_argument("--previous", action="store_true",
                     help="the previous run's log instead (kept beside the log when the same port, rank or node "
                     "ran before)")
    log.add_argument("--follow", action="store_true", help="keep printing lines as they are written")
    log.set_defaults(func=cmd_log)

    events = sub.add_parser("events", help="what happened on this host: its services, nodes and consoles' events",
                            description="This host's timeline (every file under $DSV4_STATE_DIR/timeline), oldest "
                            "first: services registering, serving, failed (rank, host, reason), stopped, relaunched; "
                            "nodes ending; what a console here did (actions started and ended) and saw of its hosts "
                            "(stale, unreachable, back). Repeats are folded: the latest, how many, since when.")
    events.add_argument("--json", action="store_true", help="one JSON object per event (repeats not folded)")
    events.set_defaults(func=cmd_events)


def _find(pid: int):
    from store import services

    found = services.find(pid)
    if found is None:
        raise UserError(f"no service of this host has pid {pid} (`dsv4 service ls`)")
    return found


def cmd_ls(args: argparse.Namespace) -> int:
    from store import services

    found = services.services()
    if args.json:
        print_json([s.to_json() for s in found])
        return 0
    print_table(None, ("pid", "state", "url", "model", "ended"),
                [(s.pid, s.state, s.url or "-", s.model, s.ending.line() if s.ending else "-") for s in found])
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from store import services

    target = _find(args.pid)
    if target.ended:
        raise UserError(f"pid {args.pid} has ended already ({target.ending.line()}); `dsv4 service dismiss` forgets it")
    how = services.stop(target, args.timeout)
    if args.json:
        print_json({"pid": args.pid, "now": how})
    else:
        print(f"pid {args.pid}: {how}")
    return 0


def cmd_dismiss(args: argparse.Namespace) -> int:
    from store import services

    target = _find(args.pid)
    if not target.ended:
        raise UserError(f"pid {args.pid} is {target.state}: only an ended service is dismissed (stop it first)")
    services.dismiss(target)
    print(f"pid {args.pid}: dismissed")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    import json

    from console.fleet.events import lines
    from store import timeline

    found = timeline.read_dir()
    if args.json:
        for event in found:
            sys.stdout.write(json.dumps(event.to_json(), separators=(",", ":")) + "\n")
    else:
        print("\n".join(lines(found)) if found else "nothing happened yet on this host (its timeline is empty)")
    return 0


def cmd_log(args: argparse.Namespace) -> int:
    from console.data.logs import which_log
    from console.fleet.host import FOLLOWING, FileFeed

    label, path = which_log(args.pid, args.rank, args.node, args.previous)
    print(f"{FOLLOWING}{path}", file=sys.stderr, flush=True)
    feed = FileFeed(label, path)
    parent = os.getppid()
    while True:
        for line in feed.poll():
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
        # whoever asked is gone (its ssh session closed, the console quit): so is this follower
        if not args.follow or os.getppid() != parent:
            return 0
        time.sleep(FOLLOW_POLL_S)
