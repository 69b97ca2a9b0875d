"""A separate process using the kernel cache, for the concurrency and crash tests.

usage: worker_kernel_cache.py ROOT MODE OUT GO
  MODE lock    get_or_build with the compile lock (default timeout)
  MODE nolock  get_or_build that never waits for the lock (every racer may compile)
  MODE kill    the build stages part of its artifact, writes OUT and sleeps until killed
Waits until file GO exists (so all racers start together), then writes a JSON result to OUT.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.fingerprint import Key
from store.kernel_cache import KernelCache

PROGRAM = "racer"
PAYLOAD = b"compiled program bytes " * 4096


def key() -> Key:
    return Key.of({"backend": "export", "source:worker.build": "1", "torch": "2.13.0"})


def main(root: str, mode: str, out: str, go: str) -> None:
    while not Path(go).exists():
        time.sleep(0.01)
    cache = KernelCache(root, lock_timeout=0 if mode == "nolock" else 120)

    def build(staging: Path) -> None:
        half = len(PAYLOAD) // 2
        (staging / "program.pt2").write_bytes(PAYLOAD[:half])
        if mode == "kill":
            Path(out).write_text("staged")
            time.sleep(600)
        time.sleep(0.3)  # a compile takes a while: racers must overlap
        with open(staging / "program.pt2", "ab") as f:
            f.write(PAYLOAD[half:])

    fetch = cache.get_or_build(PROGRAM, key(), build)
    result = {
        "built": fetch.built,
        "verified": fetch.hit.data("program.pt2") == PAYLOAD,
        "published": fetch.hit.path is not None,
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
