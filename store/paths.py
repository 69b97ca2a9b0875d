"""Default locations, from the user's platform dirs, each overridable by an env variable."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "dsv4-console"


def _dir(env: str, default: str) -> Path:
    value = os.environ.get(env)
    path = Path(value).expanduser() if value else Path(default)
    if os.path.lexists(path) and not path.is_dir():  # checked here: every user of it gets one line
        from store.errors import UserError

        where = f"${env}={value}" if value else str(path)
        raise UserError(f"{where} is not a directory; point {env} at a directory")
    return path


def kernel_cache_dir(override: Path | str | None = None) -> Path:
    """The kernel cache root: `override` (a --kernel-cache-dir value), else
    $DSV4_KERNEL_CACHE_DIR, else the user cache dir. The one resolver of this default."""
    if override:
        return Path(override).expanduser()
    return _dir("DSV4_KERNEL_CACHE_DIR", str(Path(platformdirs.user_cache_dir(APP)) / "programs"))


DEFAULT_KERNEL_CACHE_MAX_SIZE = "10G"


def kernel_cache_limit() -> int:
    """The kernel cache's size limit for gc: $DSV4_KERNEL_CACHE_MAX_SIZE (e.g. 20G), else 10G."""
    from store.errors import UserError
    from store.units import parse_size

    text = os.environ.get("DSV4_KERNEL_CACHE_MAX_SIZE") or DEFAULT_KERNEL_CACHE_MAX_SIZE
    try:
        return parse_size(text)
    except ValueError as e:
        raise UserError(f"$DSV4_KERNEL_CACHE_MAX_SIZE={text}: {e}; set a size such as 20G") from None


def data_dir() -> Path:
    return _dir("DSV4_DATA_DIR", platformdirs.user_data_dir(APP))


def state_dir() -> Path:
    return _dir("DSV4_STATE_DIR", platformdirs.user_state_dir(APP))


def default_preset() -> str:
    """The embedded default's preset: `small` (the demo size), or $DSV4_DEFAULT_PRESET."""
    return os.environ.get("DSV4_DEFAULT_PRESET", "small")


def default_model_dir(preset: str | None = None, seed: int = 0) -> Path:
    """Where the embedded default checkpoint lives (created on first use by runtime.synth.checkpoint)."""
    return data_dir() / "models" / f"{preset or default_preset()}-seed{seed}"


def signing_key_path(override: Path | str | None = None) -> Path:
    """Where `dsv4 keys generate` writes and `cache export|push` read the signing key:
    `override` (--out / --signing-key), else $DSV4_SIGNING_KEY, else the user config dir."""
    if override:
        return Path(override).expanduser()
    value = os.environ.get("DSV4_SIGNING_KEY")
    return Path(value).expanduser() if value else Path(platformdirs.user_config_dir(APP)) / "signing.key"
