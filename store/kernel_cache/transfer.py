"""Export and import over the cache's layout: entries out as a `Bundle`, a `Bundle` in.

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
id, reference, time). An entry already in its slot is left as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from store.fingerprint import UNKNOWN, describe, diff, fingerprint, sha256_hex
from store.kernel_cache import publish as pub
from store.kernel_cache.bundle import Bundle, BundleError, EntryBundle, signed_message
from store.kernel_cache.entry import Manifest, Origin, Reference, build_changes
from store.kernel_cache.layout import Layout
from store.signing import TRUSTED_KEYS_ENV, TrustedKeys


@dataclass(frozen=True)
class TrustPolicy:
    """Whose compiled code this cache loads. Always: what this host built in roots owned by this
    user (store.kernel_cache.trust). Brought entries: only those signed by one of `trusted`; with
    none, nothing from another host is ever installed (each host compiles for itself)."""

    trusted: TrustedKeys = field(default_factory=TrustedKeys)

    def signer_problem(self, entry: EntryBundle) -> str | None:
        """Why `entry`'s signature is not accepted, or None."""
        sig = entry.signature
        if sig is None:
            return f"{entry.name}: unsigned; this host installs only entries signed by a trusted key"
        key = self.trusted.get(sig.key_id)
        if key is None:
            where = f"the keys in {self.trusted.source}" if self.trusted.source else \
                f"no trusted keys are set (${TRUSTED_KEYS_ENV} or --trusted-keys)"
            return f"{entry.name}: signed by key {sig.key_id} ({sig.signer}), which is not trusted ({where})"
        if not key.verifies(sig.signature, signed_message(entry.manifest)):
            return (f"{entry.name}: the signature by key {sig.key_id} ({key.name}) is not over this entry "
                    "(another entry's, or a changed manifest)")
        return None


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
    out = []
    for e, state in zip(bundle.entries, states, strict=True):
        signer = e.signature.key_id if e.signature else ""
        origin = Origin(e.host or bundle.host, signer, e.reference or bundle.reference, now)
        manifest = replace(e.manifest, origin=origin)
        placed = pub.place(layout, manifest, e.contents)
        path = layout.entry(manifest.program, manifest.fingerprint)
        out.append(Installed(e.name, path, state, placed is not None))
    return out

