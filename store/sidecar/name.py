"""The sidecar's file name, built, globbed and parsed here and nowhere else.

`dsv4-packed.r<ranks>.safetensors`, beside the checkpoint. Staging files of writers are
`.tmp-<final name>.<host>.<pid>.<rand>` (store.atomic) and never match.
"""

from __future__ import annotations

import re
from pathlib import Path

FILE_PREFIX = "dsv4-packed"
SUFFIX = ".safetensors"
_NAME = re.compile(rf"{re.escape(FILE_PREFIX)}\.r(\d+){re.escape(SUFFIX)}")


def file_name(ranks: int) -> str:
    return f"{FILE_PREFIX}.r{int(ranks)}{SUFFIX}"


def default_sidecar_path(model_dir: Path | str, ranks: int) -> Path:
    """Where the sidecar for `ranks` lives: beside the checkpoint."""
    return Path(model_dir) / file_name(ranks)


def glob_pattern(model_dir: Path | str) -> Path:
    """The pattern of every sidecar beside a checkpoint, as shown to people."""
    return Path(model_dir) / f"{FILE_PREFIX}.r*{SUFFIX}"


def ranks_of(path: Path | str) -> int | None:
    """The ranks a sidecar file name says, or None for any other name."""
    m = _NAME.fullmatch(Path(path).name)
    return None if m is None else int(m.group(1))


def find_sidecars(model_dir: Path | str) -> list[Path]:
    """The published sidecars beside a checkpoint (staging files are never listed)."""
    found = Path(model_dir).glob(f"{FILE_PREFIX}.r*{SUFFIX}")
    return sorted(p for p in found if ranks_of(p) is not None)
