"""A named program function's source components, remembered across processes: reused only while
every file they came from holds the same bytes and every module lookup answers the same."""

from __future__ import annotations

import os
import textwrap

import pytest

from runtime.programs import source_hash, source_memo
from store.paths import state_dir


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project root of its own holding package `memopkg`, and a process with no parse in it."""
    root = tmp_path / "project"
    (root / "memopkg").mkdir(parents=True)
    (root / "memopkg" / "__init__.py").write_text("")
    write(root / "memopkg" / "a.py", """
        from memopkg import b

        def f(x):
            return b.g(x) + 1
        """)
    write(root / "memopkg" / "b.py", "def g(x):\n    return x * 2\n")
    monkeypatch.setattr(source_hash, "PROJECT_ROOT", root)
    monkeypatch.setattr(source_hash, "_VENV", root / ".venv")
    new_process()
    yield root
    new_process()


def write(path, source: str) -> None:
    path.write_text(textwrap.dedent(source))


def new_process() -> None:
    """Forget what this process parsed and hashed, as a fresh one would not have it."""
    for cached in (source_hash._module_file, source_hash._parse, source_hash._digest_of):
        cached.cache_clear()
    source_hash._UNITS.clear()


def computations(monkeypatch) -> list[str]:
    """The roots computed from the files from now on (not recalled)."""
    seen: list[str] = []
    real = source_memo.traced_components

    def counted(root):
        seen.append(root)
        return real(root)

    monkeypatch.setattr(source_memo, "traced_components", counted)
    return seen


def test_components_are_remembered_with_every_file_they_came_from(project, monkeypatch):
    first = source_memo.source_components("memopkg.a:f")
    assert [n for n, _ in first] == ["source:memopkg.a.f", "source:memopkg.b.g"]
    assert (state_dir() / source_memo.MEMO_FILE).is_file()
    entry = source_memo._roots()["memopkg.a:f"]
    assert set(entry["files"]) == {str(project / "memopkg" / "a.py"), str(project / "memopkg" / "b.py")}
    assert entry["lookups"]["memopkg.b"] == str(project / "memopkg" / "b.py")
    new_process()
    computed = computations(monkeypatch)
    assert source_memo.source_components("memopkg.a:f") == first
    assert computed == []  # recalled: nothing parsed


def test_a_changed_byte_in_a_reached_file_computes_them_again(project, monkeypatch):
    first = source_memo.source_components("memopkg.a:f")
    b = project / "memopkg" / "b.py"
    st = os.stat(b)
    b.write_text("def g(x):\n    return x * 3\n")  # same size, same mtime: only the bytes tell
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    new_process()
    computed = computations(monkeypatch)
    second = source_memo.source_components("memopkg.a:f")
    assert computed == ["memopkg.a:f"]
    assert dict(second)["source:memopkg.b.g"] != dict(first)["source:memopkg.b.g"]
    assert dict(second)["source:memopkg.a.f"] == dict(first)["source:memopkg.a.f"]
    new_process()
    assert source_memo.source_components("memopkg.a:f") == second  # and remembered so


def test_a_module_lookup_answering_otherwise_computes_them_again(project, monkeypatch):
    source_memo.source_components("memopkg.a:f")
    b = project / "memopkg" / "b.py"
    (project / "memopkg" / "b").mkdir()
    b.rename(project / "memopkg" / "b" / "__init__.py")  # the same source, found elsewhere
    new_process()
    computed = computations(monkeypatch)
    again = source_memo.source_components("memopkg.a:f")
    assert computed == ["memopkg.a:f"]
    assert source_memo._roots()["memopkg.a:f"]["lookups"]["memopkg.b"] == str(project / "memopkg" / "b" / "__init__.py")
    assert [n for n, _ in again] == ["source:memopkg.a.f", "source:memopkg.b.g"]


@pytest.mark.parametrize("bad", ["garbage", "fifo", "other python", "wrong types", "others may write", "a link"])
def test_a_memo_not_of_this_version_or_not_trusted_is_ignored_and_rewritten(project, monkeypatch, bad):
    expected = source_memo.source_components("memopkg.a:f")
    memo = state_dir() / source_memo.MEMO_FILE
    raw = memo.read_text()
    memo.unlink()
    if bad == "garbage":
        memo.write_bytes(b"\x00{not json")
    elif bad == "fifo":
        os.mkfifo(memo)  # never opened blocking
    elif bad == "other python":
        memo.write_text(raw.replace('"python": ', '"python": "2.7 ', 1))
    elif bad == "wrong types":
        memo.write_text(raw.replace('"components": [[', '"components": [[7, ', 1))
    elif bad == "others may write":  # what it says picks compiled code: trusted as a cache root is
        memo.write_text(raw)
        memo.chmod(0o666)
    else:
        (memo.parent / "elsewhere.json").write_text(raw)
        memo.symlink_to(memo.parent / "elsewhere.json")
    new_process()
    computed = computations(monkeypatch)
    assert source_memo.source_components("memopkg.a:f") == expected
    assert computed == ["memopkg.a:f"]
    new_process()
    assert source_memo.recall("memopkg.a:f") == expected  # the computation wrote it anew, private
    assert memo.is_file() and not memo.is_symlink() and memo.stat().st_mode & 0o777 == 0o600


def test_a_unit_that_cannot_be_read_is_never_remembered(project):
    assert source_memo.source_components("memopkg.missing:f") == [("source:memopkg.missing.f", source_hash.UNKNOWN)]
    assert "memopkg.missing:f" not in source_memo._roots()
