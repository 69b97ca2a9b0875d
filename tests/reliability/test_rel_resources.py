"""Resource faults: a full filesystem, EACCES on the cache root, a read-only sidecar directory.

Real faults where the sandbox allows them: a size-limited tmpfs (`mount -t tmpfs -o size=`), a
read-only bind mount, and a process running as uid 65534 for EACCES (root bypasses file modes).
Where mounting is impossible the full-filesystem cases fall back to an injected ENOSPC.
Expected: one clear error (exit 1, one line, no traceback) or a clean fallback; nothing lost.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import REPO
from relcounts import record

from store.kernel_cache.inventory import inventory

TESTS = REPO / "tests"
sys.path.insert(0, str(TESTS))


@contextlib.contextmanager
def mounted(target: Path, *args: str):
    """Mount (e.g. tmpfs with size=, or a bind) at target; yields False when impossible."""
    target.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", *args, str(target)], capture_output=True).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


@contextlib.contextmanager
def read_only_bind(source: Path, target: Path):
    with mounted(target, "--bind", str(source)) as ok:
        if ok and subprocess.run(["mount", "-o", "remount,bind,ro", str(target)],
                                 capture_output=True).returncode != 0:
            ok = False
        yield ok


def tree_sha(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300, **kw)


def one_clear_line(proc: subprocess.CompletedProcess) -> bool:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("sidecar ")]
    return proc.returncode == 1 and "Traceback" not in proc.stderr and len(lines) == 1


def test_full_filesystem_prepack_is_one_clear_error_and_leaves_nothing(tiny_ckpt, tmp_path, tmp_path_factory,
                                                                        monkeypatch):
    before = tree_sha(tiny_ckpt)
    full = tmp_path / "full"
    with mounted(full, "-t", "tmpfs", "-o", "size=2m", "tmpfs") as ok:
        if ok:
            proc = cli("prepack", str(tiny_ckpt), "--out", str(full))
            # refused before it starts: the plan knows the sidecar's size and the disk's free space
            clean = one_clear_line(proc) and "a prepack writes 6.1 MiB" in proc.stderr and "2.0 MiB free" in proc.stderr
            leftovers = list(full.iterdir())
            injection = "tmpfs size=2m (sidecar 6.1 MiB)"
        else:  # no mount in this sandbox: inject ENOSPC where the writer reserves space
            from store.errors import UserError

            def enospc(*_):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(os, "posix_fallocate", enospc)
            from runtime.weights.prepack import prepack

            full.mkdir(exist_ok=True)
            with pytest.raises(UserError, match="no space") as e:
                prepack(tiny_ckpt, out=full)
            clean, leftovers, injection = "no space" in str(e.value), list(full.iterdir()), "injected ENOSPC"
            proc = None
    lost = int(tree_sha(tiny_ckpt) != before)
    record(tmp_path_factory, "resource: full filesystem (prepack)", injection=injection, trials=1,
           clean_error=int(clean and not leftovers), data_lost=lost)
    assert clean, proc.stderr if proc else ""
    assert leftovers == []
    assert not lost


def test_full_filesystem_kernel_cache_runs_uncached_and_keeps_valid_entries(tmp_path, tmp_path_factory,
                                                                             monkeypatch):
    import sample_programs
    import torch

    import store.kernel_cache.publish as kc_publish
    from runtime.programs.build import prepare
    from store.kernel_cache import Hit, KernelCache

    monkeypatch.setattr(kc_publish, "MIN_FREE_BYTES", 16 << 10)  # the threshold scaled to a 256k tmpfs
    full = tmp_path / "full"
    with mounted(full, "-t", "tmpfs", "-o", "size=256k", "tmpfs") as ok:
        cache = KernelCache(full / "programs")
        kept = prepare(sample_programs.spec("kept"), cache=cache, backend="export")
        assert kept.outcome == "compiled"
        if ok:
            fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)
            with contextlib.suppress(OSError):  # fill the filesystem
                while os.write(fd, b"\0" * 4096):
                    pass
            os.close(fd)
            injection = "tmpfs size=256k, filled"
        else:
            monkeypatch.setattr(kc_publish, "free_bytes", lambda _p: 0)
            injection = "injected ENOSPC"
        prepared = prepare(sample_programs.spec("mlp"), cache=cache, backend="export")
        x = sample_programs.inputs()
        correct = bool(torch.allclose(prepared.run(*x), sample_programs.scaled_mlp(*x)))
        states = [(e.program, e.state) for e in inventory(cache.layout)]
        again = prepare(sample_programs.spec("kept"), cache=cache, backend="export")
        key_hit = isinstance(cache.lookup("kept", _key(cache, "kept")), Hit)
    fallback = prepared.outcome == "uncached" and correct and states == [("kept", "current")]
    lost = int(again.outcome != "hit" or not key_hit)
    record(tmp_path_factory, "resource: full filesystem (kernel cache)", injection=injection, trials=1,
           recovered=int(fallback), data_lost=lost, note="program compiled and run unpublished (outcome uncached)")
    assert prepared.outcome == "uncached" and correct
    assert states == [("kept", "current")]  # no partial entry, the valid one kept
    assert not lost


def _key(cache, program):
    from store.kernel_cache import MANIFEST, Manifest

    [entry] = [e for e in inventory(cache.layout) if e.program == program]
    return Manifest.parse((entry.path / MANIFEST).read_bytes(), program, entry.fingerprint).key


NOBODY = 65534
EACCES_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    import os
    import torch, torch.export, torch._dynamo, sample_programs
    from runtime.programs.build import prepare
    from store.errors import UserError
    from store.kernel_cache import KernelCache
    prepare(sample_programs.spec("warmup"), cache=None, backend="export")  # imports done as root
    os.setgid({uid}); os.setuid({uid})  # the python binary is not executable for uid {uid} here
    try:
        p = prepare(sample_programs.spec("mlp"), cache=KernelCache(sys.argv[1]), backend="export")
    except UserError as e:
        print(f"error: {{e}}", file=sys.stderr)
        sys.exit(1)
    x = sample_programs.inputs()
    assert torch.allclose(p.run(*x), sample_programs.scaled_mlp(*x))
    print(p.outcome)
    """
)


@pytest.mark.parametrize("case", ["own-read-only-root", "root-owned-by-another-user"])
def test_eacces_on_the_cache_root_is_a_clean_fallback_or_one_clear_error(case, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as uid 65534 (EACCES is only real for a non-root uid)")
    base = Path(tempfile.mkdtemp(prefix="dsv4-eacces-"))
    try:
        os.chmod(base, 0o755)
        root = base / "programs"
        root.mkdir(mode=0o755)
        if case == "own-read-only-root":
            os.chown(root, NOBODY, NOBODY)
            os.chmod(root, 0o555)  # its owner cannot create v1/: EACCES
        else:
            os.chmod(root, 0o700)  # root's, unreadable for uid 65534
        script = base / "child.py"
        script.write_text(EACCES_SCRIPT.format(repo=str(REPO), tests=str(TESTS), uid=NOBODY))
        os.chmod(script, 0o644)
        env = {k: v for k, v in os.environ.items() if k != "HOME"} | {"HOME": str(base), "TMPDIR": "/tmp"}
        proc = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True,
                              env=env, cwd=base, timeout=300)
        listing = sorted(os.listdir(root))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if case == "own-read-only-root":
        ok = proc.returncode == 0 and proc.stdout.strip() == "uncached" and listing == []
        outcome = {"recovered": int(ok)}
    else:
        ok = one_clear_line(proc) and "refusing to load programs" in proc.stderr and listing == []
        outcome = {"clean_error": int(ok)}
    record(tmp_path_factory, f"resource: EACCES cache root ({case})",
           injection="child dropping to uid 65534: "
           + ("root 0555 owned by it" if case == "own-read-only-root" else "root 0700 owned by root"),
           trials=1, **outcome)
    assert ok, (proc.returncode, proc.stdout, proc.stderr[-3000:])


def test_read_only_sidecar_directory(tiny_ckpt, tmp_path, tmp_path_factory):
    from conftest import launch

    ro = tmp_path / "ro"
    before = tree_sha(tiny_ckpt)
    with read_only_bind(tiny_ckpt, ro) as ok:
        if not ok:
            record(tmp_path_factory, "resource: read-only sidecar dir", injection="ro bind mount", trials=0,
                   skipped=1, note="mount impossible in this sandbox")
            pytest.skip("no read-only bind mount possible here")
        proc = cli("prepack", str(ro))
        launched, _ = launch(ro, backend="eager", validate_tokens=2)
        path = launched.phases["weights"]["path"], launched.phases["weights"]["reason"]
        launched.close()
    clean = one_clear_line(proc) and "cannot write the sidecar here" in proc.stderr
    fallback = path == ("REPACK", "missing")
    lost = int(tree_sha(tiny_ckpt) != before)
    record(tmp_path_factory, "resource: read-only sidecar dir", injection="read-only bind mount of the checkpoint",
           trials=2, clean_error=int(clean), recovered=int(fallback), data_lost=lost,
           note="prepack: exit 1, one line; launch: REPACK (missing) and serves")
    assert clean, proc.stderr
    assert fallback
    assert not lost
