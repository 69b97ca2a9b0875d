"""What the fleet's actions run on each host: a short list of `dsv4` command lines (each streams
its progress events on stdout), chosen from that host's own snapshot — warm reads a sidecar only
where one exists, prepack replaces one only after asking — so that every host does what the
one-host console would do there. The launch across hosts is `dsv4 node start` on every host
(node 0 first: its free port is the master's), the stop `dsv4 node stop`."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.launch.spec import CACHE, COMPILE, PREPACK, SERVE, LaunchSpec

ACTIONS = ("warm", "prepack", "compile", "purge", "pull", "import", "launch", "stop")
WHAT = {
    "warm": "read the sidecar into the page cache (where there is one), then compile what the launch misses",
    "prepack": "pack the checkpoint into a sidecar for the service's ranks (replacing one that exists)",
    "compile": "compile every program the launch misses into the host's kernel cache",
    "purge": "delete the kernel-cache entries and the sidecar the host's plan calls stale or corrupt",
    "pull": "pull the kernel-cache entries the launch misses from the registry (signed by a trusted key)",
    "import": "bring the kernel-cache entries each host misses from another host of the fleet that holds them: "
              "exported there signed, imported here only if signed by a key this host trusts",
    "launch": "start the service across these hosts: torchrun on each with its node rank",
    "stop": "stop the service's node on each host, node 0 first (SIGTERM: rank 0 drains, then stops the other ranks; a node stopped while node 0 serves is a lost rank: the service fails)",
}


@dataclass(frozen=True)
class Step:
    label: str  # what the row says while it runs
    remote: tuple[str, ...]  # the dsv4 arguments (the host's dsv4 is the first word there)
    events: bool = True  # it streams events on stdout


def _model(spec: LaunchSpec) -> list[str]:
    return [str(spec.model)] if spec.model else []


def steps(action: str, spec: LaunchSpec, snapshot=None, registry: str = "", insecure: bool = False) -> list[Step]:
    """The command lines `action` runs on one host (launch: see `node_start`)."""
    with_events = spec.with_(events="-")
    if action == "warm":
        out = []
        wanted = snapshot.sidecars.wanted if snapshot is not None else None
        if wanted and wanted.size_bytes:
            out.append(Step("warm (read)", ("sidecar", "warm", *_model(spec), "--ranks", str(spec.ranks),
                                            "--events", "-")))
        return [*out, Step("warm (compile)", ("compile", *with_events.argv(COMPILE)))]
    if action == "compile":
        return [Step("compile", ("compile", *with_events.argv(COMPILE)))]
    if action == "prepack":
        return [Step("prepack", ("prepack", *with_events.argv(PREPACK), "--force"))]
    if action == "purge":
        cache = spec.argv(CACHE)
        return [Step("purge (stale entries)", ("cache", "purge", *cache, "--stale", "--yes"), events=False),
                Step("purge (corrupt entries)", ("cache", "purge", *cache, "--corrupt", "--yes"), events=False),
                Step("purge (sidecar)", ("sidecar", "purge", *_model(spec), "--ranks", str(spec.ranks), "--yes"),
                     events=False)]
    if action == "pull":
        return [Step("pull", ("cache", "pull", registry, *spec.argv(CACHE), *(["--insecure"] if insecure else [])),
                     events=False)]
    if action == "stop":
        return [Step("stop", ("node", "stop", "--json"), events=False)]
    raise ValueError(f"unknown fleet action {action}")


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


def export_import(spec: LaunchSpec) -> tuple[Step, Step]:
    """`cache export -o -` on the source, piped into `cache import -` on the target: the entries the
    launch uses, signed by the source's key, checked by the target's trusted keys and live keys."""
    cache = spec.argv(CACHE)
    return (Step("export", ("cache", "export", "-o", "-", *cache), events=False),
            Step("import", ("cache", "import", "-", *cache), events=False))


def node_start(spec: LaunchSpec, hosts: int, node_rank: int, master_addr: str, master_port: int) -> Step:
    """`dsv4 node start` of one host: ranks split evenly over the hosts (--ranks: the service's)."""
    per = spec.ranks // hosts
    serve = spec.with_(master_port=None, events=None).argv(SERVE)
    return Step(f"launch node {node_rank}", ("node", "start", "--json", "--nnodes", str(hosts), "--node-rank",
                                             str(node_rank), "--nproc-per-node", str(per), "--master-addr",
                                             master_addr, "--master-port", str(master_port), *serve), events=False)
