"""The kernel cache: a fingerprinted, verified, concurrent-safe store of compiled programs.

Layout (format version 1)::

    <root>/dsv4-kernel-cache.json             ownership marker (format version inside)
    <root>/v1/<program>/<fingerprint>/        one entry: artifact file(s) + manifest.json
    <root>/v1/<program>/.tmp-<fp>.<host>.<pid>.<rand>/   a writer's staging dir (ignored by readers)
    <root>/v1/<program>/<fingerprint>/.hits   hit stamp: one byte appended per hit
    <root>/v1/.locks/<program>.<fingerprint>.lock        compile lock (filelock)
    <root>/quarantine/<program>--<fp>--<time>--<rand>/  entries that failed to read/verify/load
    <root>/.trash/                            entries being deleted (rename first, delete after)

Modules, each importing only those before it: `entry` (the manifest, results, entry states,
and the judgement of an entry or of a MISS: pure data), `layout` (the root and its settings as
one frozen value, the paths derived from it), `trust` (marker, ownership, permissions),
`quarantine` (moving entries aside, and reading their records), `read` (verified or structural
reads of an entry, listing a program's entries), `inventory` (ls, verify, gc, purge, trash),
`publish` (lock, staging, seal, rename) and `cache` (the interface that composes them:
lookup/probe, get_or_build, publish, reject; the only module holding a `KernelCache`).

Entry states (`EntryState`): `current`, `other-layout`, `stale` (see below), `corrupt` (an
entry in its slot that cannot be read: bad manifest, missing or wrong-size artifact),
`partial` (a writer's staging dir) and `quarantined` (moved aside after failing to read,
verify or load; its reason is the record's). `gc` removes corrupt, quarantined and abandoned
partial entries before it evicts anything; `purge --corrupt` selects corrupt and quarantined.

The manifest records the full key, which of its components describe a *configuration*
(deployment layout, model dims, signature, backend, device kind: `config_components`), the
sha256 and size of every artifact file, compile seconds, creation time and producer host/pid.

"Current environment" without a live key: this package never imports torch, so it cannot
compute keys. Callers hand it a `Reference`: the live keys of the programs they can build now
(full check), plus the component values they know for every program (typically the toolchain:
torch version, device capability, compiler, env flags; values equal to UNKNOWN are not
compared). An entry is `stale` only when a component present both in it and in the
reference differs and is not a configuration component: such an entry can never HIT again.
Differences in configuration components (or components only one side has) make it
`other-layout`. An entry whose program has no live key and whose known components match is
reported `current` with a reason saying source and layout were not checked: `purge --stale`
only ever deletes entries that are provably unusable.
"""

from store.kernel_cache.bundle import Bundle, BundleError, EntryBundle, read_bundle, write_bundle
from store.kernel_cache.cache import KernelCache
from store.kernel_cache.entry import (
    CORRUPT,
    CURRENT,
    FORMAT_VERSION,
    HITS,
    LOCKS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_QUARANTINE_NOTE_BYTES,
    OTHER_LAYOUT,
    PARTIAL,
    QUARANTINE,
    QUARANTINE_NOTE,
    QUARANTINED,
    STALE,
    STATES,
    TRASH,
    VERSION_DIR,
    ArtifactFile,
    Entry,
    EntryState,
    Fetch,
    Hit,
    Manifest,
    Miss,
    Origin,
    Reference,
    Verification,
    check_program_name,
    judge,
)  # fmt: skip
from store.kernel_cache.inventory import STAGING_MAX_AGE
from store.kernel_cache.layout import LOCK_TIMEOUT, Layout
from store.kernel_cache.publish import MIN_FREE_BYTES
from store.kernel_cache.transfer import (
    Exported,
    Installed,
    InstallError,
    TrustPolicy,
    export_entries,
    import_bundle,
)
from store.kernel_cache.trust import MARKER, UntrustedCacheError

__all__ = [
    "CORRUPT", "CURRENT", "FORMAT_VERSION", "HITS", "LOCKS", "LOCK_TIMEOUT", "MANIFEST", "MARKER",
    "MAX_MANIFEST_BYTES", "MAX_QUARANTINE_NOTE_BYTES", "MIN_FREE_BYTES", "OTHER_LAYOUT",
    "PARTIAL", "QUARANTINE", "QUARANTINED", "QUARANTINE_NOTE", "STAGING_MAX_AGE", "STALE", "STATES",
    "TRASH", "VERSION_DIR", "ArtifactFile", "Bundle", "BundleError", "Entry", "EntryBundle", "EntryState",
    "Exported", "Fetch", "Hit", "InstallError", "Installed", "KernelCache", "Layout", "Manifest", "Miss",
    "Origin", "Reference", "TrustPolicy", "UntrustedCacheError", "Verification", "check_program_name",
    "export_entries", "import_bundle", "judge", "read_bundle", "write_bundle",
]  # fmt: skip
