"""Fork server for the SIGKILL trials (run by test_rel_crash.py as a separate process).

usage: crashworker.py TARGET WORKDIR SEED TRIALS OUT_JSON

Imports torch and the project once, then forks one child per trial (a torch import costs
seconds; a fork costs milliseconds). The parent does no torch compute before forking, so the
children never inherit a started OpenMP pool. Each trial: fork a child running the target,
sleep a seeded random delay within the target's measured duration, SIGKILL it, reap it, and
check the files on disk. After the trials one child runs the target to completion (the "next
run"), which must sweep the leftovers and succeed. Results go to OUT_JSON.

TARGET is one of prepack | publish | warm | launch (see the classes below).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402  (imported once here, inherited by every child)
import torch._dynamo  # noqa: E402
import torch.export  # noqa: E402

# One intra-op thread: the parent warms torch up in-process (lazy initialisation inherited by
# every child) without starting a thread pool that a forked child could deadlock on.
torch.set_num_threads(1)

from store import pagecache, sidecar  # noqa: E402
from store.atomic import is_staging  # noqa: E402
from store.kernel_cache import CORRUPT, CURRENT, PARTIAL, QUARANTINED, Hit, KernelCache  # noqa: E402
from store.kernel_cache.inventory import inventory, remove  # noqa: E402


def fork_run(fn) -> int:
    """Fork a child running fn(); returns its pid once it has started."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            os.write(w, b"S")
            os.close(w)
            fn()
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    return pid


def run_to_end(fn) -> int:
    pid = fork_run(fn)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def sidecar_data_sha(path: Path) -> str | None:
    """sha256 of a sidecar's tensor bytes (the header's created/pack_seconds vary), or None
    when no file is there; raises sidecar.CorruptSidecar when the file is not whole."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        header = sidecar.read_header(fd, os.fstat(fd).st_size)
        with open(fd, "rb", closefd=False) as f:
            f.seek(header.data_start)
            return hashlib.sha256(f.read()).hexdigest()
    finally:
        os.close(fd)


def staging_files(directory: Path) -> list[str]:
    try:
        return sorted(p.name for p in directory.iterdir() if is_staging(p.name))
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------------------------------
# Targets: setup() (unkilled children, measures the duration), run() (the child's work),
# check(before) -> list of violations, final() -> list of violations after the next run.


class Prepack:
    """`runtime.weights.prepack.prepack(force=True)`: odd trials replace a valid sidecar, even ones
    write where none exists."""

    def __init__(self, work: Path):
        self.ckpt = work / "ckpt"
        self.final = sidecar.default_sidecar_path(self.ckpt, 1)

    def run(self) -> None:
        from runtime.weights.prepack import prepack

        prepack(self.ckpt, force=True)

    def setup(self) -> float:
        self.run()  # warm-up in the parent
        t0 = time.monotonic()
        assert run_to_end(self.run) == 0
        duration = time.monotonic() - t0
        self.ref = sidecar_data_sha(self.final)
        self.copy = self.ckpt.parent / "reference.safetensors"
        shutil.copy2(self.final, self.copy)
        return duration

    def before(self, trial: int) -> str | None:
        if trial % 2 == 0:
            self.final.unlink(missing_ok=True)
            return None
        if not self.final.exists():
            shutil.copy2(self.copy, self.final)
        return sidecar_data_sha(self.final)

    def valid(self) -> bool:
        from runtime.weights.prepack import judge

        try:
            ok_bytes = sidecar_data_sha(self.final) == self.ref
        except sidecar.CorruptSidecar:
            return False
        return ok_bytes and judge(self.ckpt, 1, cold_policy="read").action == sidecar.MAP

    def check(self, before: str | None) -> tuple[list[str], bool]:
        problems, lost = [], False
        if self.final.exists() and not self.valid():
            problems.append("partial or invalid sidecar at the final path")
            lost = before is not None
        if before is not None and not self.final.exists():
            problems.append("the previous valid sidecar is gone")
            lost = True
        return problems, lost

    def leftovers(self) -> list[str]:
        return staging_files(self.ckpt)

    def final_run(self) -> list[str]:
        problems = []
        if run_to_end(self.run) != 0:
            problems.append("the next prepack failed")
        if not self.valid():
            problems.append("the next prepack did not leave a valid sidecar")
        if self.leftovers():
            problems.append(f"leftovers not swept: {self.leftovers()}")
        return problems


class Publish:
    """`runtime.programs.build.prepare(spec, backend="export")` compiling and publishing a tiny
    sample program into a cache that already holds another (bystander) program."""

    def __init__(self, work: Path):
        self.root = work / "programs"
        self.cache = KernelCache(self.root)

    def _prepare(self, name: str):
        import sample_programs

        from runtime.programs.build import prepare

        return prepare(sample_programs.spec(name), cache=KernelCache(self.root), backend="export")

    def run(self) -> None:
        self._prepare("mlp")

    def setup(self) -> float:
        self._prepare("bystander")  # in the parent: warms export up for every child
        [self.bystander] = [e for e in inventory(self.cache.layout) if e.program == "bystander"]
        self.bystander_bytes = {p.name: p.read_bytes() for p in self.bystander.path.iterdir() if p.name != ".hits"}
        t0 = time.monotonic()
        assert run_to_end(self.run) == 0
        return time.monotonic() - t0

    def before(self, trial: int) -> None:
        # The program must be absent so the child compiles and publishes it again.
        remove(self.cache.layout,
               [e for e in inventory(self.cache.layout) if e.program == "mlp" and e.state != PARTIAL])

    def check(self, before: None) -> tuple[list[str], bool]:
        problems, lost = [], False
        for e in inventory(self.cache.layout):
            if e.state in (CORRUPT, QUARANTINED):
                problems.append(f"corrupt entry {e.program}/{e.fingerprint[:12]}: {e.reason}")
            if e.program == "mlp" and e.state == CURRENT and not self._verifies(e):
                problems.append("a published mlp entry does not verify")
        now = {p.name: p.read_bytes() for p in self.bystander.path.iterdir() if p.name != ".hits"} \
            if self.bystander.path.is_dir() else {}
        if now != self.bystander_bytes:
            problems.append("the bystander entry changed or vanished")
            lost = True
        return problems, lost

    def _verifies(self, entry) -> bool:
        from store.kernel_cache import MANIFEST, Manifest

        manifest = Manifest.parse((entry.path / MANIFEST).read_bytes(), entry.program, entry.fingerprint)
        return isinstance(self.cache.probe(entry.program, manifest.key), Hit)

    def leftovers(self) -> list[str]:
        return sorted(e.path.name for e in inventory(self.cache.layout) if e.state == PARTIAL)

    def final_run(self) -> list[str]:
        self.before(0)

        def run_and_compare() -> None:
            import sample_programs

            prepared = self._prepare("mlp")
            assert prepared.outcome == "compiled", prepared
            x = sample_programs.inputs()
            assert torch.allclose(prepared.run(*x), sample_programs.scaled_mlp(*x))

        problems = []
        if run_to_end(run_and_compare) != 0:
            problems.append("the next compile+publish failed or computed a wrong result")
        if self.leftovers():
            problems.append(f"staging dirs not swept: {self.leftovers()}")
        if any(e.state != CURRENT for e in inventory(self.cache.layout)):
            problems.append("cache not all current after the next run")
        return problems


class Warm:
    """`dsv4 sidecar warm` work: evict, then warm with remember=True (writes the throughput
    file of the state dir through a staged rename)."""

    def __init__(self, work: Path):
        self.ckpt = work / "ckpt"
        self.path = sidecar.default_sidecar_path(self.ckpt, 1)
        self.state = Path(os.environ["DSV4_STATE_DIR"])

    def run(self) -> None:
        pagecache.evict(self.path)
        pagecache.warm(self.path, remember=True)

    def setup(self) -> float:
        from runtime.weights.prepack import prepack

        assert run_to_end(lambda: prepack(self.ckpt, force=True)) == 0
        self.ref = sha(self.path)
        t0 = time.monotonic()
        assert run_to_end(self.run) == 0
        return time.monotonic() - t0

    def before(self, trial: int) -> None:
        return None

    def check(self, before: None) -> tuple[list[str], bool]:
        problems, lost = [], False
        if sha(self.path) != self.ref:
            problems.append("the sidecar changed")
            lost = True
        tp = self.state / pagecache.THROUGHPUT_FILE
        try:
            if tp.exists():
                json.loads(tp.read_text())["bytes_per_s"]
                if not pagecache.read_throughput().measured:
                    problems.append("the throughput file is not usable")
        except (ValueError, KeyError) as e:
            problems.append(f"partial throughput file: {e}")
        return problems, lost

    def leftovers(self) -> list[str]:
        return staging_files(self.state)

    def final_run(self) -> list[str]:
        problems = []
        if run_to_end(self.run) != 0:
            problems.append("the next warm failed")
        pagecache.read_throughput()  # must not raise
        if self.leftovers():
            problems.append(f"leftovers not swept: {self.leftovers()}")
        return problems


class Launch:
    """Registration (eager backend, a valid sidecar to map, launch history on)."""

    def __init__(self, work: Path):
        self.ckpt = work / "ckpt"
        self.path = sidecar.default_sidecar_path(self.ckpt, 1)
        self.tokens = work / "tokens.json"

    def run(self, record: bool = False) -> None:
        from runtime.events import Emitter
        from runtime.launch.registration import register
        from runtime.launch.spec import LaunchSpec

        spec = LaunchSpec(self.ckpt, backend="eager", device="cpu", max_seq=64, validate_tokens=2)
        launched = register(spec, Emitter())
        if record:
            self.tokens.write_text(json.dumps(launched.validation_tokens))
        launched.close()

    def setup(self) -> float:
        from runtime.weights.prepack import prepack

        assert run_to_end(lambda: prepack(self.ckpt, force=True)) == 0
        pagecache.warm(self.path, remember=False)
        self.ref = sha(self.path)
        self.run()  # warm-up in the parent
        t0 = time.monotonic()
        assert run_to_end(lambda: self.run(record=True)) == 0
        self.ref_tokens = json.loads(self.tokens.read_text())
        return time.monotonic() - t0

    def before(self, trial: int) -> None:
        return None

    def check(self, before: None) -> tuple[list[str], bool]:
        from store.history import history_path, read_history

        problems, lost = [], False
        if sha(self.path) != self.ref:
            problems.append("the sidecar changed")
            lost = True
        lines = history_path().read_text().splitlines() if history_path().exists() else []
        bad = [line for line in lines if not _json_ok(line)]
        if bad:
            problems.append(f"{len(bad)} partial launch-history lines")
        read_history()  # must not raise
        return problems, lost

    def leftovers(self) -> list[str]:
        return staging_files(self.ckpt)

    def final_run(self) -> list[str]:
        self.tokens.unlink(missing_ok=True)
        problems = []
        if run_to_end(lambda: self.run(record=True)) != 0:
            problems.append("the next launch failed")
        elif json.loads(self.tokens.read_text()) != self.ref_tokens:
            problems.append("the next launch produced other tokens")
        return problems


def _json_ok(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


TARGETS = {"prepack": Prepack, "publish": Publish, "warm": Warm, "launch": Launch}


def main(target: str, work: str, seed: str, trials: str, out: str) -> None:
    t = TARGETS[target](Path(work))
    duration = t.setup()
    rng = random.Random(int(seed))
    killed = completed = lost = 0
    violations: list[str] = []
    leftovers_seen = 0
    for trial in range(int(trials)):
        before = t.before(trial)
        delay = rng.uniform(0.0, duration * 1.1)
        pid = fork_run(t.run)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code == -signal.SIGKILL:
            killed += 1
        elif code == 0:
            completed += 1
        else:
            violations.append(f"trial {trial}: child exited {code} without being killed")
        problems, was_lost = t.check(before)
        lost += was_lost
        violations += [f"trial {trial} (delay {delay:.3f} s): {p}" for p in problems]
        leftovers_seen = max(leftovers_seen, len(t.leftovers()))
    final = t.final_run()
    result = {
        "target": target, "seed": int(seed), "trials": int(trials), "killed": killed,
        "completed_before_kill": completed, "duration_s": round(duration, 3),
        "violations": violations, "data_lost": lost, "max_leftovers": leftovers_seen,
        "final_problems": final,
    }  # fmt: skip
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:6])
