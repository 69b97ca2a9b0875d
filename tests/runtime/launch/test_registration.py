"""Registration end to end on the tiny preset: phases, paths taken, events, history, KV sizing."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import launch

from runtime.events import PHASES, parse
from runtime.launch.registration import RegistrationError
from store.history import read_history


def _ends(events):
    return {e.phase: e for e in events if e.kind == "end"}


def test_cold_launch_compiles_every_program_and_repacks(cold_export_launch):
    _, launched, events = cold_export_launch
    ends = _ends(events)
    counts = ends["programs"].detail["counts"]
    assert counts["MISS"] == len(launched.programs.specs) and counts["HIT"] == 0
    assert set(counts) == {"HIT", "MISS", "STALE", "CORRUPT", "UNTRUSTED", "EAGER"}  # every outcome, as it happened
    assert ends["weights"].detail["path"] == "REPACK" and ends["weights"].detail["reason"] == "missing"
    assert ends["kv"].detail["slots"] >= 1
    assert len(launched.validation_tokens) == 8


def test_phase_order_and_programs_overlap_weights(cold_export_launch):
    _, _, events = cold_export_launch
    starts = [e.phase for e in events if e.kind == "start"]
    assert starts[0] == "check" and set(starts[1:3]) == {"programs", "weights"}
    assert starts[3:] == ["upload", "kv", "validate"]
    t = {(e.phase, e.kind): e.ts for e in events if e.kind in ("start", "end")}
    # both started before either finished: they ran concurrently
    assert t[("programs", "start")] < t[("weights", "end")] and t[("weights", "start")] < t[("programs", "end")]
    assert t[("upload", "start")] >= max(t[("programs", "end")], t[("weights", "end")])


def test_event_stream_schema(cold_export_launch):
    _, _, events = cold_export_launch
    for e in events:
        line = e.line()
        again = parse(line)
        assert again.phase == e.phase and again.kind == e.kind
        raw = json.loads(line)
        assert raw["v"] == 1 and raw["phase"] in PHASES and isinstance(raw["ts"], float)
        if e.kind == "progress":
            assert {"done", "total", "unit"} <= raw.keys()
        if e.kind == "end":
            assert raw["seconds"] >= 0
    progress = [e for e in events if e.phase == "programs" and e.kind == "progress"]
    assert {p.detail["outcome"] for p in progress} == {"MISS"}
    assert [p.done for p in progress] == list(range(1, len(progress) + 1))


def test_warm_launch_hits_programs_maps_sidecar_and_gives_identical_tokens(cold_export_launch, tiny_ckpt_ro, tmp_path):
    cache_dir, cold, _ = cold_export_launch
    model_dir = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_ro, model_dir)
    # programs warm, no sidecar yet
    warm, events = launch(model_dir, cache_dir=cache_dir)
    ends = _ends(events)
    assert ends["programs"].detail["counts"]["HIT"] == len(warm.programs.specs)
    assert ends["weights"].detail["path"] == "REPACK"
    assert warm.validation_tokens == cold.validation_tokens
    # the plan verified every HIT; the launch loaded those very bytes: each artifact hashed once
    programs = ends["programs"].detail
    entries = [Path(p["entry"]) for p in ends["check"].detail["plan"]["programs"]]
    artifacts = sum((entry / "program.pt2").stat().st_size for entry in entries)
    assert programs["verified_bytes"] == programs["artifact_bytes"] == artifacts > 0
    warm.close()
    # prepack, then the weights are mapped from the sidecar
    from runtime.weights.prepack import prepack
    from store.pagecache import warm as warm_pages

    info = prepack(model_dir, ranks=1)
    warm_pages(info.path)
    mapped, events = launch(model_dir, cache_dir=cache_dir)
    ends = _ends(events)
    assert ends["weights"].detail["path"] == "MAP", ends["weights"].detail
    assert ends["upload"].detail["zero_copy"] is True
    assert mapped.validation_tokens == cold.validation_tokens
    prompt = [5, 9, 200, 31]
    a = list(mapped.engine.generate(prompt, 5))
    mapped.close()
    eager, _ = launch(model_dir, backend="eager", use_sidecar=False)
    assert list(eager.engine.generate(prompt, 5)) == a
    eager.close()


@pytest.mark.slow
def test_history_record(tiny_ckpt_ro):
    launched, _ = launch(tiny_ckpt_ro, backend="eager", history=True)
    launched.close()
    # register() records failures itself; the serve command records successes when listening
    launched.record(0.0, "ok")
    record = read_history()[-1]
    assert record["outcome"] == "ok" and record["preset"] == "tiny" and record["backend"] == "eager"
    assert set(record["phases"]) >= {"check", "programs", "weights", "upload", "kv", "validate"}
    assert record["phases"]["weights"]["path"] == "REPACK"
    with pytest.raises(RegistrationError):
        launch(tiny_ckpt_ro, backend="eager", history=True, device_memory=4096)
    failed = read_history()[-1]
    assert failed["outcome"] == "error" and "kv" in failed["phases"] and "error" in failed["phases"]["kv"]


def test_kv_too_small_is_one_clear_error(tiny_ckpt_ro):
    with pytest.raises(RegistrationError) as e:
        launch(tiny_ckpt_ro, backend="eager", device_memory=64 * 1024)
    msg = str(e.value)
    for word in ("kv:", "total 64.0 KiB", "utilization 0.9", "used", "free"):
        assert word in msg


def test_kv_allocation_halves_on_failure(tiny_ckpt_ro, monkeypatch):
    from runtime.launch.device import Device, OutOfMemory

    real = Device.allocate
    limit = {"bytes": None}

    def flaky(self, shape, dtype=torch.float32):
        t = real(self, shape, dtype)
        if limit["bytes"] is not None and self.allocated > limit["bytes"]:
            raise OutOfMemory("injected: device fragmented")
        return t

    from runtime.programs.catalog import kv_slot_bytes

    monkeypatch.setattr(Device, "allocate", flaky)
    launched, events = launch(tiny_ckpt_ro, backend="eager", max_slots=4, validate_tokens=2)
    per_slot = kv_slot_bytes(launched.programs)
    launched.close()
    limit["bytes"] = int(2.5 * per_slot)  # room for two slots, not four
    launched, events = launch(tiny_ckpt_ro, backend="eager", max_slots=4, validate_tokens=2)
    kv = _ends(events)["kv"].detail
    assert kv["slots"] == 2 and kv["attempts"][0]["slots"] == 4
    assert launched.engine.slots == 2
    launched.close()


def test_bad_contract_fails_in_check(tiny_ckpt):
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["norm.weight"]
    (tiny_ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RegistrationError, match="check: .* breaks the tensor contract"):
        launch(tiny_ckpt, backend="eager")


@pytest.mark.slow
def test_aoti_launch_compiles_then_hits_with_the_same_tokens(cold_export_launch, tiny_ckpt_ro, tmp_path):
    """AOTInductor end to end: cold (every program compiled and published), then warm (every
    program a verified HIT); greedy tokens equal the export launch's."""
    _, export_launch, _ = cold_export_launch
    cold, events = launch(tiny_ckpt_ro, backend="aoti", cache_dir=tmp_path / "programs")
    assert _ends(events)["programs"].detail["counts"]["MISS"] == len(cold.programs.specs)
    cold.close()
    warm, events = launch(tiny_ckpt_ro, backend="aoti", cache_dir=tmp_path / "programs")
    assert _ends(events)["programs"].detail["counts"]["HIT"] == len(warm.programs.specs)
    assert warm.validation_tokens == cold.validation_tokens == export_launch.validation_tokens
    warm.close()
