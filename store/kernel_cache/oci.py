"""Kernel-cache entries as OCI artifacts in a registry (store.registry speaks the API).

One artifact per entry, tagged with the entry's key digest (its fingerprint):

- manifest: `application/vnd.oci.image.manifest.v1+json`, `artifactType`
  `application/vnd.dsv4.kernel-cache.entry.v1`, annotations `dev.dsv4.program`,
  `dev.dsv4.backend`, `dev.dsv4.toolchain` (torch version, device capability),
  `dev.dsv4.host` (who pushed it), `dev.dsv4.signature` (the entry's signature.json, as in a
  bundle) and `org.opencontainers.image.created`;
- config: the key's canonical JSON (`application/vnd.dsv4.kernel-cache.key.v1+json`), so the
  config digest *is* `sha256:<fingerprint>`;
- layers: the entry's manifest.json (`…manifest.v1+json`), then each artifact
  (`…artifact.v1`), each titled (`org.opencontainers.image.title`) with its file name.

Pull fetches by the live key's digest, checks the config is that key, and the signer before any
blob: the signature annotation must be by a trusted key before a layer is fetched, and over the
entry's manifest (the first layer, at most MAX_MANIFEST_BYTES) before an artifact is: an untrusted
publisher costs one small request, never an artifact's download. It caps every layer at its
descriptor's size (and an artifact's descriptor at its manifest's size: a layer far larger than
its manifest says is refused before it is fetched), re-hashes every blob against its descriptor
and yields the same `Bundle` value a bundle file gives, for the same import checks.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from typing import Any

from store.fingerprint import Key, canonical_json, fingerprint
from store.kernel_cache.bundle import Bundle, BundleError, EntryBundle, Signature
from store.kernel_cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Corrupt, Manifest
from store.kernel_cache.transfer import TrustPolicy
from store.registry import OCI_MANIFEST, Client, RegistryError, Repository

ARTIFACT_TYPE = "application/vnd.dsv4.kernel-cache.entry.v1"
KEY_TYPE = "application/vnd.dsv4.kernel-cache.key.v1+json"
MANIFEST_TYPE = "application/vnd.dsv4.kernel-cache.manifest.v1+json"
FILE_TYPE = "application/vnd.dsv4.kernel-cache.artifact.v1"
TITLE = "org.opencontainers.image.title"
A_PROGRAM, A_BACKEND, A_TOOLCHAIN = "dev.dsv4.program", "dev.dsv4.backend", "dev.dsv4.toolchain"
A_HOST, A_SIGNATURE = "dev.dsv4.host", "dev.dsv4.signature"

__all__ = ["Repository", "pull", "push"]


def _toolchain(key: Key) -> str:
    parts = key.as_dict()
    device = next((f"{n}={canonical_json(v)[:60]}" for n, v in parts.items() if n.startswith("device.")), "")
    return f"torch {parts.get('torch', '?')}, {device}"


def push(repo: Repository, entry: EntryBundle, client: Client | None = None) -> str:
    """Push one signed entry; the reference it is at (`REGISTRY/REPO@sha256:…`)."""
    client = client or Client(repo)
    m = entry.manifest
    raw_manifest = json.dumps(m.to_json(), indent=1, sort_keys=True).encode()
    config = canonical_json(m.key.to_json()).encode()
    layers = [_descriptor(MANIFEST_TYPE, client.put_blob(raw_manifest), len(raw_manifest), MANIFEST)]
    for f in m.files:
        layers.append(_descriptor(FILE_TYPE, client.put_blob(entry.contents[f.name]), f.size, f.name))
    annotations = {
        A_PROGRAM: m.program, A_BACKEND: str(m.key.as_dict().get("backend", "")), A_TOOLCHAIN: _toolchain(m.key),
        A_HOST: socket.gethostname(), "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime()),
    }
    if entry.signature is not None:
        annotations[A_SIGNATURE] = json.dumps(entry.signature.to_json(), sort_keys=True)
    body = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": KEY_TYPE, "digest": client.put_blob(config), "size": len(config)},
        "layers": layers, "annotations": annotations,
    }
    digest = client.put_manifest(m.fingerprint, json.dumps(body, indent=1).encode())
    return f"{repo}@{digest}"


def _descriptor(media_type: str, digest: str, size: int, title: str) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": digest, "size": size, "annotations": {TITLE: title}}


def pull(repo: Repository, wanted: Mapping[str, Key], policy: TrustPolicy, client: Client | None = None) -> Bundle:
    """The entries of `wanted` (program → live key) that the registry holds, as one Bundle;
    RegistryError (one line) when the registry fails mid-way, BundleError when an entry is not
    signed as `policy` asks or an artifact is not what it claims. Programs the registry lacks are
    left out (nothing is read of them)."""
    client = client or Client(repo)
    entries = []
    for program, key in wanted.items():
        fp = fingerprint(key)
        found = client.get_manifest(fp)
        if found is None:
            continue
        body, digest = found
        entries.append(_entry(client, repo, program, fp, body, digest, policy))
    if not entries:
        raise RegistryError(f"{repo}: holds none of the {len(wanted)} programs this launch misses")
    return Bundle(entries[0].host, time.time(), tuple(entries), str(repo))


def _entry(client: Client, repo: Repository, program: str, fp: str, body: bytes, digest: str,
           policy: TrustPolicy) -> EntryBundle:
    where = f"{repo}:{fp[:12]}"
    try:
        doc = json.loads(body)
        config, layers, notes = doc["config"], list(doc["layers"]), dict(doc.get("annotations") or {})
        descriptors = [(str(d["mediaType"]), str(d["digest"]), int(d["size"]), str((d.get("annotations") or {})
                        .get(TITLE, ""))) for d in layers]
        config_digest = str(config["digest"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise BundleError(f"{where}: not a dsv4 kernel-cache artifact (malformed manifest)") from None
    if doc.get("artifactType") != ARTIFACT_TYPE or notes.get(A_PROGRAM) != program:
        raise BundleError(f"{where}: not a dsv4 kernel-cache artifact of program {program}")
    if config_digest != f"sha256:{fp}":  # the config is the key: its digest is the fingerprint
        raise BundleError(f"{where}: its config is not the key it is tagged with")
    if not descriptors or descriptors[0][0] != MANIFEST_TYPE or descriptors[0][2] > MAX_MANIFEST_BYTES:
        raise BundleError(f"{where}: its first layer is not an entry manifest of at most {MAX_MANIFEST_BYTES} bytes")
    signature = None
    if A_SIGNATURE in notes:
        try:
            signature = Signature.parse(str(notes[A_SIGNATURE]).encode())
        except ValueError as e:
            raise BundleError(f"{where}: {e}") from None
    if problem := policy.key_problem(f"{program}/{fp[:12]}", signature):  # before any blob is fetched
        raise BundleError(problem)
    try:
        manifest = Manifest.parse(client.get_blob(descriptors[0][1], descriptors[0][2]), program, fp)
    except Corrupt as e:
        raise BundleError(f"{where}: {e}") from None
    if problem := policy.signer_problem(EntryBundle(manifest, {}, signature)):  # before any artifact is
        raise BundleError(problem)
    sizes = {f.name: f.size for f in manifest.files}
    contents = {}
    for media_type, blob, size, title in descriptors[1:]:
        if media_type != FILE_TYPE or title not in sizes or title in contents:
            raise BundleError(f"{where}: layer {title or blob[:19]!r} is not an artifact its manifest lists")
        if size != sizes[title]:  # refused before a byte is fetched
            raise BundleError(f"{where}: layer {title} is {size} bytes, its manifest says {sizes[title]}")
        contents[title] = client.get_blob(blob, size)
    return EntryBundle(manifest, contents, signature, host=str(notes.get(A_HOST, repo.registry)),
                       reference=f"{repo}@{digest}")
