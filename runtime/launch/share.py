"""Programs across the hosts of one service: each missing program compiled once for the service.

Ranks on one host share its kernel cache: the lowest rank of each host (its *leader*) compiles
what that host misses and the others wait for it, then HIT. Across hosts each has its own cache
(local disks), and two modes apply, decided the same way on every rank from what each leader
posts (its host, the programs it misses, their recorded compile seconds, its signing key's id
and the ids it trusts):

- **shared**: every leader can sign and trusts every other leader's key. The programs missing
  anywhere are split: one a host already holds is shipped by that host, the rest are handed out
  longest first (by recorded compile seconds) to the least loaded host. Each leader compiles its
  share in its pool, then every leader sends its entries, signed, over the service's process
  group (a subgroup of the leaders), and each installs the ones it lacks through the kernel
  cache's import (`store.kernel_cache.transfer`: a trusted signature, every artifact's sha256,
  the entry's key equal to this host's live key), with their origin;
- **each**: otherwise (a host without a signing key, or one that does not trust another's):
  nobody loads another host's code; every leader compiles what its host misses, all at once.

The waits between hosts are progress-aware (`Group.wait(stall=…)`): a slower host is waited for
while it is alive and its events move.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.events import Emitter, Phase
from runtime.launch.phases import RegistrationError
from store.units import format_size

SHARED, EACH, ONE_HOST = "shared", "each", "one host"


@dataclass(frozen=True)
class HostView:
    """What one host's leader posts before the programs are split."""

    rank: int
    host: str
    missing: tuple[str, ...]
    seconds: dict[str, float] = field(default_factory=dict)  # recorded compile seconds, where known
    signer: str = ""  # the id of the key this host signs with ("" : none)
    trusts: tuple[str, ...] = ()  # the key ids whose entries this host installs
    why: str = ""  # why this host cannot take part in sharing ("" : it can)

    def line(self) -> str:
        return json.dumps({"rank": self.rank, "host": self.host, "missing": list(self.missing),
                           "seconds": self.seconds, "signer": self.signer, "trusts": list(self.trusts),
                           "why": self.why}, sort_keys=True)

    @classmethod
    def from_line(cls, text: str) -> HostView:
        raw = json.loads(text)
        return cls(int(raw["rank"]), str(raw["host"]), tuple(raw["missing"]),
                   {str(k): float(v) for k, v in raw.get("seconds", {}).items()}, str(raw.get("signer", "")),
                   tuple(raw.get("trusts", ())), str(raw.get("why", "")))


@dataclass(frozen=True)
class Sharing:
    """How the service gets its missing programs: the mode and why, each leader's compile share
    and what it ships (programs it compiles or already holds that another host lacks)."""

    mode: str
    why: str
    views: tuple[HostView, ...]
    compiles: dict[int, tuple[str, ...]] = field(default_factory=dict)
    ships: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def leaders(self) -> list[int]:
        return [v.rank for v in self.views]

    def host(self, rank: int) -> str:
        return next(v.host for v in self.views if v.rank == rank)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "why": self.why, "hosts": [v.host for v in self.views],
                "compiles": {self.host(r): list(p) for r, p in self.compiles.items()},
                "ships": {self.host(r): list(p) for r, p in self.ships.items() if p}}


def decide(views: list[HostView]) -> Sharing:
    """The mode and the split, from every leader's view (the same on every rank)."""
    views = sorted(views, key=lambda v: v.rank)
    if len(views) == 1:
        v = views[0]
        return Sharing(ONE_HOST, "one host: its ranks share one kernel cache", (v,), {v.rank: v.missing})
    own = {v.rank: v.missing for v in views}
    if why := _why_not_shared(views):
        return Sharing(EACH, why, tuple(views), own)
    needed = sorted({p for v in views for p in v.missing})
    ships: dict[int, list[str]] = {v.rank: [] for v in views}
    compiles: dict[int, list[str]] = {v.rank: [] for v in views}
    to_compile = []
    for program in needed:
        holder = next((v.rank for v in views if program not in v.missing), None)
        if holder is None:
            to_compile.append(program)
        else:
            ships[holder].append(program)
    seconds = {p: max(v.seconds.get(p, 0.0) for v in views) for p in to_compile}
    load = dict.fromkeys(compiles, 0.0)
    for program in sorted(to_compile, key=lambda p: (-seconds[p], p)):  # longest first, to the least loaded
        rank = min(load, key=lambda r: (load[r], len(compiles[r]), r))
        compiles[rank].append(program)
        ships[rank].append(program)
        load[rank] += seconds[program] or 1.0  # never recorded: count it as one unit of work
    return Sharing(SHARED, f"every host signs its entries and trusts the others' keys ({len(views)} hosts)",
                   tuple(views), {r: tuple(p) for r, p in compiles.items()}, {r: tuple(p) for r, p in ships.items()})


def _why_not_shared(views: list[HostView]) -> str:
    for v in views:
        if not v.signer:
            return f"{v.host} cannot sign its entries ({v.why or 'no signing key'}); each host compiles for itself"
    for v in views:
        for other in views:
            if other is not v and other.signer not in v.trusts:
                return (f"{v.host} does not trust {other.host}'s key {other.signer} (add it to its trusted keys); "
                        "each host compiles for itself")
    return ""


# ---- what this host can do --------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """This host's signing key and trusted keys, as a launch finds them: its --signing-key and
    --trusted-keys, else the environment, else the defaults."""

    signing: Any = None  # store.signing.SigningKey
    trusted: Any = None  # store.signing.TrustedKeys
    why: str = ""  # why this host cannot share ("" : it can)

    @classmethod
    def of(cls, spec) -> Keys:
        """The keys a launch of `spec` (runtime.launch.spec.LaunchSpec) uses."""
        from store.errors import UserError
        from store.paths import signing_key_path
        from store.signing import TRUSTED_KEYS_ENV, TrustedKeys, env_path, load_signing_key

        trusted_path = env_path(spec.trusted_keys, TRUSTED_KEYS_ENV)
        if trusted_path is None:
            return cls(why=f"no trusted keys (--trusted-keys or ${TRUSTED_KEYS_ENV})")
        path = signing_key_path(spec.signing_key)
        if not path.exists():
            return cls(why=f"no signing key at {path} (`dsv4 keys generate`)")
        try:
            return cls(load_signing_key(path), TrustedKeys.load(trusted_path))
        except UserError as e:
            return cls(why=str(e))

    def line(self) -> str:
        """What the plan says of this host: whether it can take part in sharing, and why not."""
        if self.why:
            return f"across hosts: each host compiles what it misses ({self.why})"
        return (f"across hosts: programs compiled once per service and shipped signed by key "
                f"{self.signing.public.id} where every host trusts the others ({len(self.trusted.keys)} trusted)")


def host_view(plan, rank: int, host: str, keys: Keys) -> HostView:
    """This host's view: the programs its cache misses now (another launch may have published
    some since the plan), their recorded compile seconds, and its keys."""
    from runtime.programs.pool import compile_history

    if plan.cache is None:  # an untrusted cache root: the prepare that follows says so, in one line
        return HostView(rank, host, tuple(p.program for p in plan.programs if p.state.compiles),
                        why="its kernel cache is not trusted")
    missing = tuple(p.program for p in plan.programs if p.state.compiles
                    and not plan.cache.probe(p.program, plan.keys[p.program], verify=False).hit)
    seconds = {p: s for p, (s, _rss) in compile_history(plan.cache.root, missing).items()}
    if keys.why:
        return HostView(rank, host, missing, seconds, why=keys.why)
    return HostView(rank, host, missing, seconds, keys.signing.public.id, tuple(keys.trusted.keys), "")


# ---- the programs phase's part ------------------------------------------------------------------


def before_programs(plan, group, emitter: Emitter, stall: float, compile_share) -> dict[str, Any]:
    """Every rank, before it prepares its programs: on a leader, its host's share compiled and
    the entries it lacks received (shared mode); elsewhere, its leader done. The programs event's
    detail about it. `compile_share(programs)` compiles and publishes those programs here."""
    leader = group.leader()

    def shown(line: str) -> None:  # whom this rank waits for, and what they do
        emitter.log(Phase.PROGRAMS, line)

    if leader != group.rank:  # this host's leader compiles (or receives) for it
        group.wait("programs-ready", [leader], "programs", stall=stall, shown=shown)
        return {"host_leader": leader}
    keys = Keys.of(plan.spec) if len(set(group.hosts)) > 1 else Keys(why="one host")
    view = host_view(plan, group.rank, group.hosts[group.rank], keys)
    leaders = sorted({group.leader(r) for r in range(group.world)})
    posted = group.gather("programs-hosts", view.line(), "programs", ranks=leaders, stall=stall, shown=shown)
    sharing = decide([HostView.from_line(line) for line in posted])
    detail: dict[str, Any] = {"sharing": sharing.to_json(), "host_leader": leader}
    emitter.log(Phase.PROGRAMS, _said(sharing, group.rank), sharing=sharing.to_json())
    if sharing.mode != SHARED:
        return detail  # this leader's prepare compiles what its host misses
    mine = sharing.compiles.get(group.rank, ())
    t0 = time.perf_counter()
    if mine:
        compile_share(set(mine))
    compiled_s = time.perf_counter() - t0
    group.gather("programs-compiled", "", "programs", ranks=leaders, stall=stall, shown=shown)
    detail.update(compiled_here=list(mine), compile_wall_s=round(compiled_s, 3),
                  **_ship(plan, group, sharing, keys, view, emitter))
    return detail


def after_programs(group) -> None:
    """A leader's programs are all in its host's cache: its host's other ranks may HIT them."""
    if group.leader() == group.rank:
        group.post("programs-ready")


def _said(sharing: Sharing, rank: int) -> str:
    if sharing.mode != SHARED:
        return f"programs: {sharing.mode}: {sharing.why}"
    split = ", ".join(f"{len(sharing.compiles[r])} on {sharing.host(r)}" for r in sharing.leaders)
    return f"programs: shared across {len(sharing.leaders)} hosts ({sharing.why}): compiled {split}"


def _ship(plan, group, sharing: Sharing, keys: Keys, view: HostView, emitter: Emitter) -> dict[str, Any]:
    """Every leader's entries to every other leader, in rank order: the entries of `ships`
    signed by their host; each receiver installs (verified) the ones its host misses."""
    from store import kernel_cache as kc

    policy, reference = kc.TrustPolicy(keys.trusted), kc.Reference(keys=plan.keys)
    sent = received = received_bytes = 0
    verify_s = 0.0
    for src in sharing.leaders:
        if src == group.rank:
            # a program that failed to compile here is not shipped: the others compile it themselves
            exported = kc.export_entries(plan.cache, keys={p: plan.keys[p] for p in sharing.ships.get(src, ())},
                                         signer=keys.signing)
            buf = io.BytesIO()
            kc.write_bundle(buf, exported.bundle())
            group.share_bytes(buf.getvalue(), src, sharing.leaders)
            sent = len(exported.entries)
            continue
        data = group.share_bytes(None, src, sharing.leaders)
        t0 = time.perf_counter()
        bundle = kc.read_bundle(io.BytesIO(data), f"rank {src} on {sharing.host(src)}")
        wanted = tuple(e for e in bundle.entries if e.manifest.program in view.missing)
        if wanted:
            try:
                installed = kc.import_bundle(plan.cache.layout, replace(bundle, entries=wanted), policy, reference)
            except kc.BundleError as e:
                raise RegistrationError(f"programs: refused the entries of {sharing.host(src)}: {e}") from None
            except kc.InstallError as e:
                raise RegistrationError(f"programs: the entries of {sharing.host(src)}: {e}") from None
            received += sum(i.placed for i in installed)
            received_bytes += sum(f.size for e in wanted for f in e.manifest.files)
        seconds = time.perf_counter() - t0
        verify_s += seconds
        if wanted:
            emitter.log(Phase.PROGRAMS, f"received {len(wanted)} entries ({format_size(len(data))}) from "
                        f"{sharing.host(src)}, verified and installed in {seconds:.2f} s")
    return {"shipped": sent, "received": received, "received_bytes": received_bytes,
            "verify_s": round(verify_s, 4)}
