"""The API key file: one `NAME KEY` a line, read only when it is private, refused in one line
that names the file and the line — never the key."""

from __future__ import annotations

import os

import pytest

from store.api_keys import SecretFileError, read_keys

GOOD = "k" * 32


def _write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_names_and_keys_are_read_in_order_comments_and_blanks_skipped(tmp_path):
    f = _write(tmp_path / "keys", f"# gateway first\n\n  gateway {GOOD}  \nbatch-jobs.2 {'x' * 16}\n")
    keys = read_keys(f)
    assert [(k.name, k.key) for k in keys] == [("gateway", GOOD), ("batch-jobs.2", "x" * 16)]
    assert GOOD not in repr(keys)  # a key never shows in a repr (logs, tracebacks)


@pytest.mark.parametrize(("text", "says"), [
    (f"gateway {GOOD} extra\n", ":1: expected `NAME KEY` (two fields), found 3"),
    (f"{GOOD}\n", ":1: expected `NAME KEY` (two fields), found 1"),
    ("gateway short\n", ":1: the key of 'gateway' must be 16 to 4096 printable ASCII"),
    (f"-lead {GOOD}\n", ":1: a key's name is 1 to 64"),
    (f"a {GOOD}\nb {GOOD}\n", ":2: the key appears twice"),
    (f"a {GOOD}\na {'y' * 20}\n", ":2: the name 'a' appears twice"),
    ("# nothing here\n", "holds no key"),
])
def test_a_malformed_key_file_is_one_line_naming_the_line_never_the_key(tmp_path, text, says):
    f = _write(tmp_path / "keys", text)
    with pytest.raises(SecretFileError) as e:
        read_keys(f)
    message = str(e.value)
    assert says in message and "\n" not in message and f"--api-key-file {f}" in message
    assert GOOD not in message


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o660, 0o666])
def test_a_key_file_others_can_read_or_its_group_can_write_is_refused(tmp_path, mode):
    f = _write(tmp_path / "keys", f"a {GOOD}\n", mode)
    with pytest.raises(SecretFileError, match=r"refused: it is readable or writable by others.*chmod 600"):
        read_keys(f)


def test_a_group_readable_key_file_serves_a_service_group(tmp_path):
    assert read_keys(_write(tmp_path / "keys", f"a {GOOD}\n", 0o640))[0].name == "a"


def test_a_fifo_directory_or_missing_file_is_one_line_and_never_blocks(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for path, says in ((tmp_path / "fifo", "a FIFO"), (tmp_path / "dir", "a directory"),
                       (tmp_path / "none", "no such file")):
        with pytest.raises(SecretFileError, match=says):
            read_keys(path)


def test_binary_content_is_not_a_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_bytes(b"a \xff" + b"k" * 20 + b"\n")
    f.chmod(0o600)
    with pytest.raises(SecretFileError, match="not ASCII text"):
        read_keys(f)
