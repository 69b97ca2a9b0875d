"""Export and import over the cache's layout: entries out as a `Bundle`, a `Bundle` in.

Export (`export_entries`) reads the selected entries verified (every artifact's sha256, as a
load does) and signs them: the one way entries leave a cache, whatever carries them on (a file,
a registry, a service's process group).

Import takes a `Bundle` value, whatever brought it (a file, a registry, a service's process
group), and installs nothing unless every entry passes, in this order:

1. its signature is by a key the `TrustPolicy` trusts (else one line naming the signer's key
   id, or "unsigned");
2. the archive was safe (`Bundle.problem`, see store.kernel_cache.bundle);
3. every artifact matches its manifest's size and sha256;
4. its key equals this host's live key for its program (the caller's `Reference`: this package
   never computes keys): another toolchain or source is refused naming the component; another
   configuration only (layout, max_seq, ranks) is refused unless `other_layout`, then installed
   as an other-layout entry.

Then each entry is published through the cache's own staging and single rename
(`publish.place`), its manifest kept as its producer wrote it plus an `origin` (host, signer key
id, reference, time). An entry already in its slot is left as it is. Every entry is staged
before any is renamed: a cache that cannot take them (a full disk, a read-only root) is one
line (`InstallError`) and none of them is installed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from store.errors import UserError
from store.fingerprint import UNKNOWN, Key, describe, diff, fingerprint, sha256_hex
from store.kernel_cache import inventory as inv
from store.kernel_cache import publish as pub
from store.kernel_cache.bundle import Bundle, BundleError, EntryBundle, Signature, signed_message
from store.kernel_cache.entry import (
    CORRUPT,
    CURRENT,
    PARTIAL,
    QUARANTINED,
    Corrupt,
    Manifest,
    Origin,
    Reference,
    build_changes,
)  # fmt: skip
from store.kernel_cache.layout import Layout
from store.signing import TRUSTED_KEYS_ENV, SigningKey, TrustedKeys

if TYPE_CHECKING:
    from store.kernel_cache.cache import KernelCache


@dataclass(frozen=True)
class Exported:
    """Entries read out of a cache for travel, and what was asked for but not read."""

    entries: tuple[EntryBundle, ...]
    missing: tuple[str, ...] = ()  # programs of the asked keys without a verified entry here
    skipped: tuple[str, ...] = ()  # entries that failed to read or verify, one line each

    def bundle(self) -> Bundle:
        return Bundle.of(self.entries)


def export_entries(
    cache: KernelCache,
    *,
    keys: Mapping[str, Key] | None = None,
    program: str | None = None,
    current: Reference | None = None,
    signer: SigningKey | None = None,
) -> Exported:
    """The verified entries of exactly one selection, signed by `signer` when given: `keys`
    (program → live key: the entries a launch loads), `program` (every readable entry of it),
    or `current` (every entry current against that reference). Reads verify every artifact's
    sha256 and have no side effect (nothing is quarantined or counted as a hit)."""
    if sum(x is not None for x in (keys, program, current)) != 1:
        raise ValueError("export_entries: give exactly one of keys, program, current")
    out: list[EntryBundle] = []
    missing: list[str] = []
    skipped: list[str] = []
    if keys is not None:
        for name, key in keys.items():
            found = cache.probe(name, key)
            if found.hit:
                out.append(EntryBundle.of(found.manifest, found.contents))
            else:
                missing.append(name)
    else:
        for e in inv.inventory(cache.layout, current):
            if e.state in (CORRUPT, PARTIAL, QUARANTINED) or (e.program != program if program else e.state != CURRENT):
                continue
            try:
                out.append(EntryBundle.of(*cache.read_verified(e.path, e.program, e.fingerprint)))
            except (Corrupt, FileNotFoundError) as err:
                skipped.append(f"{e.program}/{e.fingerprint[:12]}: {err}")
    if signer is not None:
        out = [e.signed(signer) for e in out]
    return Exported(tuple(out), tuple(missing), tuple(skipped))


@dataclass(frozen=True)
class TrustPolicy:
    """Whose compiled code this cache loads. Always: what this host built in roots owned by this
    user (store.kernel_cache.trust). Brought entries: only those signed by one of `trusted`; with
    none, nothing from another host is ever installed (each host compiles for itself)."""

    trusted: TrustedKeys = field(default_factory=TrustedKeys)

    def signer_problem(self, entry: EntryBundle) -> str | None:
        """Why `entry`'s signature is not accepted, or None."""
        if problem := self.key_problem(entry.name, entry.signature):
            return problem
        sig = entry.signature
        key = self.trusted.get(sig.key_id)
        if not key.verifies(sig.signature, signed_message(entry.manifest)):
            return (f"{entry.name}: the signature by key {sig.key_id} ({key.name}) is not over this entry "
                    "(another entry's, or a changed manifest)")
        return None

    def key_problem(self, name: str, sig: Signature | None) -> str | None:
        """Why no signature like `sig` is accepted, whatever it is over (none, or by a key not
        trusted), or None: what a transport checks before it fetches an entry's bytes."""
        if sig is None:
            return f"{name}: unsigned; this host installs only entries signed by a trusted key"
        if self.trusted.get(sig.key_id) is None:
            where = f"the keys in {self.trusted.source}" if self.trusted.source else \
                f"no trusted keys are set (${TRUSTED_KEYS_ENV} or --trusted-keys)"
            return f"{name}: signed by key {sig.key_id} ({sig.signer}), which is not trusted ({where})"
        return None


class InstallError(UserError):
    """An accepted import that the cache's filesystem cannot take (full, read-only, not writable):
    one line; nothing installed."""


@dataclass(frozen=True)
class Installed:
    """One entry an import accepted: where it is now, and whether this import placed it."""

    name: str
    path: Path
    state: str  # "current" | "other-layout"
    placed: bool  # False: an entry was already in its slot (left as it was)


def integrity_problem(entry: EntryBundle) -> str | None:
    for f in entry.manifest.files:
        data = entry.contents.get(f.name)
        if data is None:
            return f"{entry.name}: {f.name} is missing"
        if len(data) != f.size:
            return f"{entry.name}: {f.name} has {len(data)} bytes, its manifest says {f.size}"
        if sha256_hex(data) != f.sha256:
            return f"{entry.name}: {f.name} does not match its sha256"
    return None


def key_problem(manifest: Manifest, reference: Reference, other_layout: bool) -> tuple[str | None, str]:
    """(why the entry is refused or None, its state here) against this host's live keys."""
    name = f"{manifest.program}/{manifest.fingerprint[:12]}"
    live = reference.keys.get(manifest.program)
    if live is None:
        return (f"{name}: this host has no live key for program {manifest.program} (not a program of the "
                "launch the flags describe: pass its --model and launch flags)"), ""
    if fingerprint(live) == manifest.fingerprint:
        return None, "current"
    changes = [c for c in diff(manifest.key, live) if c.new != UNKNOWN]
    build = build_changes(changes, manifest, live.as_dict())
    if build:
        components = ", ".join(c.component for c in build)
        return f"{name}: built for another {components} ({describe(build)}); this host can never load it", ""
    if not other_layout:
        return f"{name}: for another layout ({describe(changes)}); pass --other-layout to keep it as such", ""
    return None, "other-layout"


def accept(bundle: Bundle, policy: TrustPolicy, reference: Reference, other_layout: bool = False) -> list[str]:
    """Every check of the module docstring, in its order; BundleError (one line) at the first
    that fails. The states the entries will have here, in bundle order."""
    problems = [p for e in bundle.entries if (p := policy.signer_problem(e))]
    if problems:
        raise BundleError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    if bundle.problem:
        raise BundleError(bundle.problem)
    if not bundle.entries:
        raise BundleError("the bundle holds no entries")
    for e in bundle.entries:
        if problem := integrity_problem(e):
            raise BundleError(problem)
    states = []
    for e in bundle.entries:
        problem, state = key_problem(e.manifest, reference, other_layout)
        if problem:
            raise BundleError(problem)
        states.append(state)
    return states


def import_bundle(
    layout: Layout, bundle: Bundle, policy: TrustPolicy, reference: Reference, *, other_layout: bool = False
) -> list[Installed]:
    """Check `bundle` (`accept`), then publish each entry with its origin."""
    states = accept(bundle, policy, reference, other_layout)
    now = time.time()
    manifests = [replace(e.manifest, origin=Origin(e.host or bundle.host, e.signature.key_id if e.signature else "",
                                                   e.reference or bundle.reference, now)) for e in bundle.entries]
    try:
        placed = pub.place(layout, [(m, e.contents) for m, e in zip(manifests, bundle.entries, strict=True)])
    except OSError as e:  # staged all before placing any: none of them is in place
        raise InstallError(f"kernel cache {layout.root}: cannot install {len(manifests)} entries "
                           f"({e.strerror or e}); nothing was installed (free some space, or choose another "
                           "--kernel-cache-dir)") from None
    return [Installed(e.name, layout.entry(m.program, m.fingerprint), state, p is not None)
            for e, m, state, p in zip(bundle.entries, manifests, states, placed, strict=True)]

