"""Every action, defined once, for any host (this one, one over ssh, a fake): the `dsv4` command
lines it runs there, chosen from that host's own snapshot. Warm reads the sidecar where there is
one (the host says) and compiles what the launch misses; prepack replaces one only after asking;
purge lists what that host's plan allows it to delete, and deletes only what was confirmed and a
fresh look there still allows; an import pipes `cache export` on the host that holds the entries
into `cache import` on the one that misses them; the first run's `create` makes the embedded
default checkpoint.

A launch has two forms, one action: on a fleet of one (the one-host console), `dsv4 service start`
— `dsv4 serve` detached under a supervisor that records how it ended, its registry record printed,
so the console attaches to it as it re-attaches to any —; across hosts, `dsv4 node start` on every
host (node 0 first: its free port is the master's). A stop likewise: one service, by its pid
(`dsv4 service stop`, SIGTERM then SIGKILL after a timeout), or the fleet's nodes (`dsv4 node
stop`, node 0 first). `console.fleet.runner` runs them; the console and `dsv4 fleet` start them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runtime.launch.spec import CACHE, COMPILE, PLAN, PREPACK, SERVE, LaunchSpec

ACTIONS = ("warm", "prepack", "compile", "purge", "pull", "import", "launch", "stop", "dismiss", "create")
WHAT = {
    "warm": "read the sidecar into the page cache (where there is one), then compile what the launch misses",
    "prepack": "pack the checkpoint into a sidecar for the service's ranks (replacing one that exists)",
    "compile": "compile every program the launch misses into the host's kernel cache",
    "purge": "delete the kernel-cache entries and the sidecar the host's plan calls stale or corrupt",
    "pull": "pull the kernel-cache entries the launch misses from the registry (signed by a trusted key)",
    "import": "bring the kernel-cache entries each host misses from another host of the fleet that holds them: "
              "exported there signed, imported here only if signed by a key this host trusts",
    "launch": "start the service across these hosts: torchrun on each with its node rank, node 0 first",
    "stop": "stop the service's node on each host, node 0 first (SIGTERM: rank 0 drains, then stops the other ranks; "
            "a node stopped while node 0 serves is a lost rank: the service fails)",
    "dismiss": "forget an ended service of the host (its record goes)",
    "create": "create the embedded default checkpoint (the first run)",
}
ONE_HOST_LAUNCH = "start `dsv4 serve` on this host, detached (it outlives the console), its ending recorded"
PLAN_SCOPE, CACHE_SCOPE = "plan", "cache"  # runtime.launch.purge's scopes


@dataclass(frozen=True, kw_only=True)
class Step:
    label: str  # what the host's row says while it runs
    args: tuple[str, ...]  # the dsv4 arguments (the host's dsv4 is the first word there)
    unit: str = ""  # what its progress counts: bytes, programs
    rate: float | None = None  # units per second in earlier runs on that host: an ETA before its own shows
    items: Mapping[str, float] = field(default_factory=dict)  # a compile's expected seconds per program


def _model(spec: LaunchSpec) -> list[str]:
    return [str(spec.model)] if spec.model else []


def steps(action: str, spec: LaunchSpec, snapshot=None, registry: str = "", insecure: bool = False) -> list[Step]:
    """The command lines `action` runs on one host (launch: `node_start`; import: `export_import`;
    purge: `purge_args`, after asking)."""
    from console.data.eta import program_seconds

    with_events = spec.with_(events="-")
    wanted = snapshot.sidecars.wanted if snapshot is not None else None
    planned = snapshot.programs.entries if snapshot is not None else ()
    compile_ = Step(label="compile", args=("compile", *with_events.argv(COMPILE)), unit="programs",
                    items=program_seconds(planned))
    if action == "warm":
        read = Step(label="warm (read)", args=("sidecar", "warm", *_model(spec), "--ranks", str(spec.ranks),
                                              "--if-present", "--events", "-"),
                    unit="bytes", rate=wanted.read_bytes_per_s if wanted else None)
        return [read, Step(label="warm (compile)", args=compile_.args, unit="programs", items=compile_.items)]
    if action == "compile":
        return [compile_]
    if action == "prepack":
        rate = wanted.size_bytes / wanted.pack_seconds if wanted and wanted.pack_seconds and wanted.size_bytes else None
        return [Step(label="prepack", args=("prepack", *with_events.argv(PREPACK), "--force"), unit="bytes", rate=rate)]
    if action == "pull":
        return [Step(label="pull", args=("cache", "pull", registry, *spec.argv(CACHE),
                                         *(["--insecure"] if insecure else [])))]
    if action == "stop":
        return [Step(label="stop", args=("node", "stop", "--json"))]
    if action == "create":
        from store.paths import default_preset

        return [Step(label=f"creating the default {default_preset()} checkpoint (first run)",
                     args=("check", "--events", "-"), unit="bytes")]
    raise ValueError(f"{action}: not a one-step action (launch, import and purge have their own)")


def purge_args(spec: LaunchSpec, scope: str = PLAN_SCOPE, paths: Sequence[str] | None = None) -> tuple[str, ...]:
    """`dsv4 purge`: with `paths` None, what it would delete (a dry run); else delete those of
    them a fresh look still allows."""
    chosen = ("--dry-run",) if paths is None else ("--yes", *(x for p in paths for x in ("--only", p)))
    return ("purge", *spec.argv(PLAN), "--scope", scope, "--json", *chosen)


def source_for(target, readings) -> tuple[str, list[str]]:
    """The host to bring `target`'s missing programs from: the reachable one whose plan HITs the
    most of them under the very same keys (another toolchain's entries would be refused anyway);
    ("", []) when none holds any."""
    wanted = {p.program: p.fingerprint for p in target.snapshot.programs.entries if p.state != "HIT"}
    best: tuple[str, list[str]] = ("", [])
    for r in readings:
        if r.host == target.host or r.snapshot is None or not r.reachable:
            continue
        held = sorted(p.program for p in r.snapshot.programs.entries
                      if p.state == "HIT" and p.program in wanted and p.fingerprint == wanted[p.program])
        if len(held) > len(best[1]):
            best = (r.host, held)
    return best


def export_import(spec: LaunchSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`cache export -o -` on the source, piped into `cache import -` on the target: the entries the
    launch uses, signed by the source's key, checked by the target's trusted keys and live keys."""
    cache = spec.argv(CACHE)
    return ("cache", "export", "-o", "-", *cache), ("cache", "import", "-", *cache)


def node_start(spec: LaunchSpec, hosts: int, node_rank: int, master_addr: str, master_port: int) -> Step:
    """`dsv4 node start` of one host: the service's ranks (--ranks) split evenly over the hosts."""
    per = spec.ranks // hosts
    serve = spec.with_(master_port=None, events=None).argv(SERVE)
    return Step(label=f"launch node {node_rank}", args=(
        "node", "start", "--json", "--nnodes", str(hosts), "--node-rank", str(node_rank), "--nproc-per-node", str(per),
        "--master-addr", master_addr, "--master-port", str(master_port), *serve))


def service_start(spec: LaunchSpec) -> Step:
    """`dsv4 service start`: the launch of a fleet of one — `dsv4 serve` with the launch flags,
    detached under its supervisor; its registry record printed (one JSON line)."""
    return Step(label="start the service, detached",
                args=("service", "start", "--json", *spec.with_(events=None).argv(SERVE)))


def service_stop(pid: int, timeout: float) -> tuple[str, ...]:
    """Stop one service of a host (SIGTERM: it drains; SIGKILL after `timeout`)."""
    return ("service", "stop", str(pid), "--timeout", f"{timeout:g}", "--json")


def service_dismiss(pid: int) -> tuple[str, ...]:
    """Forget an ended service of a host (its record goes)."""
    return ("service", "dismiss", str(pid))
