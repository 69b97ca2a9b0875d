"""Programs: keys from specs, compile from the signature, prepare through the cache, load safely."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sample_programs as sp
import torch
from conftest import TESTS

from console.cli import main as cli
from runtime.programs import build as programs
from runtime.programs import spec as program_spec
from runtime.programs.build import ARTIFACT, prepare
from runtime.programs.source_hash import source_components
from runtime.programs.spec import CaptureError, ProgramSpec, build_function, program_key
from store.fingerprint import UNKNOWN, fingerprint
from store.kernel_cache import QUARANTINE, KernelCache
from store.kernel_cache.inventory import inventory


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "programs")


def _same(run, tokens: int = 7) -> bool:
    x = sp.inputs(tokens=tokens)
    return torch.allclose(run(*x), sp.scaled_mlp(*x))


def test_export_round_trip_compiles_once_then_hits_with_same_outputs(cache):
    first = prepare(sp.spec(), cache=cache, backend="export")
    second = prepare(sp.spec(), cache=cache, backend="export")
    assert (first.outcome, first.miss_kind, first.reason) == ("compiled", "absent", "not cached")
    assert (second.outcome, second.miss_kind, second.reason) == ("hit", "", "")
    assert first.fingerprint == second.fingerprint
    assert _same(second.run, tokens=7) and _same(second.run, tokens=33)  # dynamic dim honoured


def test_layout_change_misses_as_another_configuration(cache):
    prepare(sp.spec(tp=1), cache=cache, backend="export")
    other = prepare(sp.spec(tp=2), cache=cache, backend="export")
    assert other.outcome == "compiled"
    assert other.reason.startswith("not cached for this configuration: layout")


def _load_module(path: Path, source: str):
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source_hashes(module) -> list[str]:
    return [v for _, v in source_components(module.f)]


def test_comments_whitespace_and_docstrings_do_not_change_the_source_key(tmp_path):
    plain = _load_module(tmp_path / "a.py", "def f(x):\n    return x + 1\n")
    noisy = _load_module(
        tmp_path / "b.py",
        '''
        def f(x):   # add one
            """Docstrings are documentation, not code."""

            return x   +   1   # really
        ''',
    )
    changed = _load_module(tmp_path / "c.py", "def f(x):\n    return x + 2\n")
    assert _source_hashes(plain) == _source_hashes(noisy)
    assert _source_hashes(plain) != _source_hashes(changed)


def test_source_key_covers_the_project_functions_a_program_calls():
    names = [n for n, _ in source_components(sp.scaled_mlp)]
    assert names == ["source:sample_programs._gate", "source:sample_programs.scaled_mlp"]


def test_key_covers_toolchain_and_relevant_env_only(monkeypatch):
    base = program_key(sp.spec(), "aoti")
    components = base.as_dict()
    assert components["torch"] == torch.__version__
    assert components["torch.git"] == torch.version.git_version
    assert components["compiler"] != UNKNOWN and "device.cpu" in components
    assert "compiler" not in program_key(sp.spec(), "export").as_dict()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    assert program_key(sp.spec(), "aoti") == base
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    assert program_key(sp.spec(), "aoti").as_dict()["env"] == {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}


def test_function_without_readable_source_is_compiled_but_never_cached(cache):
    namespace: dict = {}
    exec("def anonymous(x, w, scale):\n    return (x @ w) * scale\n", namespace)
    spec = ProgramSpec("anonymous", namespace["anonymous"], sp.spec().inputs, sp.spec().dims)
    prepared = prepare(spec, cache=cache, backend="export")
    assert prepared.outcome == "uncached" and "unknown components" in prepared.reason
    assert inventory(cache.layout) == []
    x = sp.inputs()
    assert torch.allclose(prepared.run(*x), namespace["anonymous"](*x))


def test_entry_that_fails_to_load_is_quarantined_and_recompiled(cache):
    key = program_key(sp.spec(), "export")
    cache.publish("mlp", key, {ARTIFACT: b"verified bytes that are no program"})
    prepared = prepare(sp.spec(), cache=cache, backend="export")
    assert prepared.outcome == "compiled" and _same(prepared.run)
    assert len(list((cache.root / QUARANTINE).iterdir())) == 1
    assert prepare(sp.spec(), cache=cache, backend="export").outcome == "hit"


def test_eager_backend_bypasses_the_cache(cache):
    prepared = prepare(sp.spec(), cache=cache, backend="eager")
    assert prepared.outcome == "eager" and prepared.run is sp.scaled_mlp
    assert inventory(cache.layout) == []


def test_why_judges_a_model_program_by_its_live_key(cache, tiny_ckpt_ro, monkeypatch, capsys):
    from runtime.model.config import load_config
    from runtime.programs.catalog import build_programs
    from runtime.weights.layout import PackedLayout

    config = load_config(tiny_ckpt_ro)
    spec = build_programs(config, PackedLayout(config, 1), 64).specs["embed.decode"]
    prepare(spec, cache=cache, backend="export")
    args = ["cache", "why", "embed.decode", "--cache-dir", str(cache.root), "--model", str(tiny_ckpt_ro),
            "--max-seq", "64"]
    # the live key uses the default backend (aoti): the export entry is another configuration
    assert cli(args) == 1
    assert "not cached for this configuration: backend is export here; this launch uses aoti" in capsys.readouterr().out
    assert cli([*args, "--backend", "export"]) == 0


CHILD = """
import sys, torch
import sample_programs as sp
from runtime.programs.build import prepare
from store.kernel_cache import KernelCache
prepared = prepare(sp.spec(), cache=KernelCache(sys.argv[1]), backend="export")
print(prepared.outcome, flush=True)
sys.stdin.readline()
x = sp.inputs(tokens=11)
print(torch.allclose(prepared.run(*x), sp.scaled_mlp(*x)), flush=True)
"""


@pytest.mark.slow
def test_purge_while_another_process_holds_a_loaded_program(cache):
    prepare(sp.spec(), cache=cache, backend="export")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cache.root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "hit"
        assert cli(["cache", "purge", "--all", "--yes", "--cache-dir", str(cache.root)]) == 0
        assert inventory(cache.layout) == []
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip() == "True"


@pytest.mark.slow
def test_aoti_package_round_trip_through_the_cache(cache):
    first = prepare(sp.spec(), cache=cache, backend="aoti")
    second = prepare(sp.spec(), cache=cache, backend="aoti")
    assert (first.outcome, second.outcome) == ("compiled", "hit")
    assert _same(first.run) and _same(second.run, tokens=40)
    entry = cache.root / "v1" / "mlp" / second.fingerprint
    assert second.fingerprint == fingerprint(program_key(sp.spec(), "aoti"))
    assert (entry / ARTIFACT).stat().st_size > 0
    # a process that loaded it and ends (as a stopped service, or a rank: its atexit handlers, then
    # os._exit) leaves no extraction directory of the package behind
    child = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import atexit, os, sys
        from pathlib import Path
        from runtime.programs import build
        program = build._load_aoti(Path(sys.argv[1]).read_bytes())
        print("\\n".join(str(p) for p in build._mapped_extractions() if p.is_dir()), flush=True)
        atexit._run_exitfuncs()
        os._exit(0)
    """), str(entry / ARTIFACT)], capture_output=True, text=True, timeout=120)
    made = child.stdout.split()
    assert child.returncode == 0 and made, child.stderr[-2000:]
    assert not [p for p in made if Path(p).exists()]


def test_programs_compile_from_the_signature_with_weights_as_inputs():
    exported = programs.export_program(sp.spec())
    assert dict(exported.state_dict) == {} and dict(exported.constants) == {}
    placeholders = [n.name for n in exported.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(sp.spec().inputs)


def scale_by(k: float, shift: float = 0.0):
    """A factory: the program closes over its arguments only."""

    def scaled(x, w, scale):
        return (x @ w) * scale * k + shift

    return scaled


def leaky(k: float):
    """A factory whose program closes over a value derived outside its captures."""
    doubled = [k, k]

    def scaled(x, w, scale):
        return (x @ w) * scale * doubled[0]

    return scaled


def _factory_spec(factory: str, **captures) -> ProgramSpec:
    return ProgramSpec("scaled", f"test_build:{factory}", sp.spec().inputs, sp.spec().dims,
                       captures=captures)


def test_programs_from_one_factory_with_different_captures_never_share_an_entry(cache):
    two, three = _factory_spec("scale_by", k=2.0), _factory_spec("scale_by", k=3.0)
    assert program_key(two, "export") != program_key(three, "export")
    assert "captures" in program_spec.CONFIG_COMPONENTS
    first, second = prepare(two, cache=cache, backend="export"), prepare(three, cache=cache, backend="export")
    assert first.fingerprint != second.fingerprint and second.outcome == "compiled"
    x = sp.inputs()
    assert torch.allclose(second.run(*x), (x[0] @ x[1]) * x[2] * 3.0)
    assert prepare(two, cache=cache, backend="export").outcome == "hit"


def test_a_program_capturing_a_value_outside_its_key_is_refused(cache):
    with pytest.raises(CaptureError, match="not in its key"):
        build_function(_factory_spec("leaky", k=2.0))
    with pytest.raises(CaptureError):
        prepare(_factory_spec("leaky", k=2.0), cache=cache, backend="export")
    assert inventory(cache.layout) == []
    made_elsewhere = ProgramSpec("closure", scale_by(2.0), sp.spec().inputs, sp.spec().dims)
    with pytest.raises(CaptureError):  # a closure with no captures declared: its 2.0 is in no key
        build_function(made_elsewhere)


def test_a_module_constant_the_program_reads_is_in_its_key(tmp_path):
    source = "LIMIT = {}\n\ndef f(x):\n    return x.clamp(max=LIMIT)\n"
    a = _load_module(tmp_path / "ka.py", source.format(1.0))
    b = _load_module(tmp_path / "kb.py", source.format(2.0))
    assert [n for n, _ in source_components(a.f)] == ["source:ka.LIMIT", "source:ka.f"]
    assert _source_hashes(a) != _source_hashes(b)


def test_model_program_keys_need_no_torch(tiny_ckpt_ro):
    code = (
        "import sys\n"
        "from runtime.launch.plan import program_keys\n"
        "from runtime.launch.spec import LaunchSpec\n"
        f"keys = program_keys(LaunchSpec({str(tiny_ckpt_ro)!r}, max_seq=64, backend='export'))\n"
        "assert keys and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=TESTS.parent)
