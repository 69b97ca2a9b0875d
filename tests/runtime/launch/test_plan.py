"""The launch plan: torch-free, and what it predicts is what the launch then does.

For each perturbation an operator (or bad luck) can cause, the plan made just before a launch
must equal the path that launch takes, program by program and for the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MAX_SEQ, REPO, launch

from console.cli import main as cli
from runtime.launch.plan import make_plan
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome
from runtime.weights import layout
from runtime.weights.prepack import prepack
from store import sidecar
from store.fingerprint import Key
from store.kernel_cache import KernelCache
from store.kernel_cache.inventory import inventory, remove

pytestmark = pytest.mark.slow


def _plan(model_dir: Path, cache_dir: Path, **kw):
    return make_plan(LaunchSpec(model_dir, backend="export", device="cpu", max_seq=kw.pop("max_seq", MAX_SEQ),
                                kernel_cache_dir=cache_dir, **kw), history=[])


def _launch_paths(model_dir: Path, cache_dir: Path, **kw) -> tuple[dict, str, str]:
    launched, events = launch(model_dir, cache_dir=cache_dir, max_slots=1, validate_tokens=2, **kw)
    launched.close()
    ends = {e.phase: e for e in events if e.kind == "end"}
    weights = ends["weights"].detail
    return ends["programs"].detail["programs"], weights["path"], weights.get("reason", "")


def _assert_predicted(model_dir: Path, cache_dir: Path, **kw) -> None:
    print(f"plan then launch: {kw or 'defaults'}", flush=True)  # with -s: where a slow run is
    plan = _plan(model_dir, cache_dir, **{k: v for k, v in kw.items() if k in ("max_seq", "cold_policy")})
    programs, path, reason = _launch_paths(model_dir, cache_dir, **kw)
    assert plan.states() == programs
    assert (plan.weights_path(), plan.sidecar.reason) == (path, reason), plan.sidecar.detail
    return plan


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.heavy  # many cold compiles: `pytest -m heavy`
def test_prediction_equals_outcome_under_every_perturbation(tiny_ckpt, tmp_path, monkeypatch):
    cache_dir = tmp_path / "programs"
    model = tiny_ckpt

    plan = _assert_predicted(model, cache_dir)  # fresh
    assert set(plan.states().values()) == {Outcome.MISS} and plan.sidecar.reason == "missing"
    plan = _assert_predicted(model, cache_dir)  # warm programs
    assert set(plan.states().values()) == {Outcome.HIT}

    prepack(model)
    plan = _assert_predicted(model, cache_dir, cold_policy="read")  # warm + hot sidecar
    assert plan.weights_path() == "MAP"

    moved = model.parent / "renamed"
    model.rename(moved)  # a renamed (or re-mounted) checkpoint is the same checkpoint
    model = moved
    assert _assert_predicted(model, cache_dir, cold_policy="read").weights_path() == "MAP"

    shard = sorted(model.glob("model-*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # touched
    assert _assert_predicted(model, cache_dir).sidecar.reason == "stale"
    prepack(model, force=True)

    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "operator_note": "edited"}))
    plan = _assert_predicted(model, cache_dir)
    assert plan.sidecar.reason == "stale" and set(plan.states().values()) == {Outcome.HIT}
    prepack(model, force=True)

    with monkeypatch.context() as m:
        m.setattr(layout, "PACKER_VERSION", layout.PACKER_VERSION + ".1")
        assert "packer_version" in _assert_predicted(model, cache_dir).sidecar.detail

    for policy in ("reject", "read", "auto"):  # evicted sidecar, under each cold policy
        _evict(sidecar.default_sidecar_path(model, 1))
        _assert_predicted(model, cache_dir, cold_policy=policy)

    with monkeypatch.context() as m:  # an Inductor flag changes the toolchain: every entry STALE
        m.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
        plan = _assert_predicted(model, cache_dir, cold_policy="read")
        assert set(plan.states().values()) == {Outcome.STALE}

    plan = _assert_predicted(model, cache_dir, max_seq=2 * MAX_SEQ, cold_policy="read")  # max_seq changed
    assert set(plan.states().values()) == {Outcome.MISS}

    path = sidecar.default_sidecar_path(model, 1)
    with open(path, "r+b") as f:  # header bytes corrupted
        f.seek(8)
        f.write(b"#")
    assert _assert_predicted(model, cache_dir).sidecar.reason == "corrupt"

    cache = KernelCache(cache_dir)
    victim = _plan(model, cache_dir).programs[0]
    artifact = Path(victim.entry) / "program.pt2"
    artifact.write_bytes(artifact.read_bytes()[:-1] + b"!")  # one entry's artifact corrupted
    plan = _assert_predicted(model, cache_dir)
    assert plan.states()[victim.program] == Outcome.CORRUPT

    other = _plan(model, cache_dir).programs[1]  # one entry built by another toolchain
    entry = Path(other.entry)
    manifest = json.loads((entry / "manifest.json").read_text())
    key = Key.from_json(manifest["key"])
    foreign = Key.of([(n, "2.99.0" if n == "torch" else v) for n, v in key.components])
    cache.publish(other.program, foreign, {"program.pt2": (entry / "program.pt2").read_bytes()})
    remove(cache.layout, [e for e in inventory(cache.layout) if e.fingerprint == other.fingerprint])
    plan = _assert_predicted(model, cache_dir)
    assert plan.states()[other.program] == Outcome.STALE
    assert "torch" in next(p.reason for p in plan.programs if p.program == other.program)


def test_plan_json_is_torch_free_and_says_what_is_wrong_in_one_line(tiny_ckpt, tmp_path):
    code = (
        "import json, sys\n"
        "from console.cli import main\n"
        f"rc = main(['plan', {str(tiny_ckpt)!r}, '--json', '--max-seq', '64', '--kernel-cache-dir', "
        f"{str(tmp_path / 'kc')!r}])\n"
        "assert 'torch' not in sys.modules\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"programs", "sidecar", "kv", "predicted"} <= data.keys()
    assert {"program", "state", "fingerprint", "reason"} <= data["programs"][0].keys()
    assert {"path", "verdict", "reason", "residency"} <= data["sidecar"].keys()

    (tiny_ckpt / "config.json").write_text("{not json")
    assert cli(["plan", str(tiny_ckpt), "--json", "--kernel-cache-dir", str(tmp_path / "kc")]) == 1
    broken = make_plan(LaunchSpec(tiny_ckpt, kernel_cache_dir=tmp_path / "kc"), history=[])
    assert broken.programs == [] and len(broken.problems) == 1 and broken.problems[0].kind == "check"
    assert "config.json" in broken.problems[0].text
    assert broken.sidecar.verdict == "REPACK"


def test_an_entry_the_plan_calls_corrupt_is_purged_even_though_its_listing_looks_current(tiny_ckpt_ro, tmp_path):
    from runtime.launch import purge

    cache = KernelCache(tmp_path / "kc")
    plan = _plan(tiny_ckpt_ro, tmp_path / "kc")
    name = plan.programs[0].program
    cache.publish(name, plan.keys[name], {"program.pt2": b"an artifact"})
    entry = next(e.path for e in inventory(cache.layout) if e.program == name)
    (entry / "program.pt2").write_bytes(b"an artifacT")  # same size: only the sha256 tells
    plan = _plan(tiny_ckpt_ro, tmp_path / "kc")
    assert plan.states()[name] == Outcome.CORRUPT
    targets = purge.targets(plan)
    assert [(t.kind, t.program) for t in targets] == [("program", name)] and "sha256" in targets[0].reason
    assert purge.purge(plan, targets) == targets
    assert not entry.exists() and _plan(tiny_ckpt_ro, tmp_path / "kc").states()[name] == Outcome.MISS
