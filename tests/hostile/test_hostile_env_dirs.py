"""Issue 11 item 7: the cache, state or data dir env var pointing at a file is one line, exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO as ROOT

pytestmark = pytest.mark.slow

CONSOLE = [str(Path(sys.executable).parent / "dsv4-console"), "--once", "--json"]
CASES = [
    ("DSV4_DATA_DIR", [sys.executable, "-m", "console.cli", "check"]),  # the embedded default lives there
    ("DSV4_KERNEL_CACHE_DIR", [sys.executable, "-m", "console.cli", "cache", "ls"]),
    ("DSV4_STATE_DIR", [sys.executable, "-m", "console.cli", "serve", "{model}", "--port", "0", "--backend", "eager"]),
    ("DSV4_DATA_DIR", CONSOLE),
    ("DSV4_KERNEL_CACHE_DIR", CONSOLE),
    ("DSV4_STATE_DIR", CONSOLE),
]


@pytest.mark.parametrize(("var", "argv"), CASES, ids=[f"{v}-{a[2] if a[1] == '-m' else 'console'}" for v, a in CASES])
def test_a_dir_variable_naming_a_file_is_one_line(var, argv, tmp_path, tiny_ckpt_ro):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    argv = [a.format(model=tiny_ckpt_ro) for a in argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, var: str(a_file)})
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"${var}" in lines[0] and "Traceback" not in out.stderr
