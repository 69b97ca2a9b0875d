"""The FP4 products built natively (`runtime.model.fp4_native`): `experts.one`'s compiled form,
built from C++ source through the kernel cache and loaded from the verified bytes; its decode
exactly the eager one's numbers, its fused product the eager product's to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from runtime.model import fp4_native, ops
from runtime.model.dims import Dims
from runtime.model.moe import _expert_tensors, expert_ffn
from runtime.programs.build import ARTIFACT, prepare
from runtime.programs.catalog import EXPERTS_ONE, build_programs
from runtime.programs.spec import build_function, program_key
from store.fingerprint import diff
from store.kernel_cache import Hit, KernelCache

MAX_SEQ = 64


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("fp4") / "fp4.so"
    fp4_native.build(out)
    return out.read_bytes()


@pytest.fixture(params=[fp4_native.ISA_SCALAR, fp4_native.ISA_AVX2, fp4_native.ISA_BEST], ids=["c", "avx2", "best"])
def native(library, request) -> fp4_native.Native:
    """Each of the library's paths this cpu has (a cap above the cpu's runs what it has)."""
    native = fp4_native.load(library)
    native.isa = request.param
    return native


def _random(shape_in: int, shape_out: int, group: int, gen, low: int = 0, high: int = 241):
    packed = torch.randint(0, 256, (shape_in // 2, shape_out), dtype=torch.uint8, generator=gen)
    scale = torch.randint(low, high, (shape_in // group, shape_out), dtype=torch.uint8, generator=gen)
    return packed, scale


def test_the_native_decode_gives_the_eager_decodes_numbers_exactly(native):
    """Every byte and every E8M0 scale below 241 (the eager decode's own exact range), the
    subnormal 2^-127 of a zero scale included; whole rows of the vector loop and scalar tails;
    a column slice (a large weight's chunk, `ops.linear`) read through its row stride."""
    gen = torch.Generator().manual_seed(0)
    for rows, cols, group in ((1024, 512, 32), (512, 1024, 32), (64, 24, 16), (256, 7, 32), (32, 3, 32)):
        packed, scale = _random(rows, cols, group, gen)
        got = native.decode(packed, scale)
        assert got.dtype == torch.float32 and got.shape == (rows, cols)
        assert torch.equal(got, ops.fp4_weight(packed, scale))
        assert torch.equal(got.view(torch.int32), ops.fp4_weight(packed, scale).view(torch.int32))  # -0.0 too
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(2, 1)  # [32, 16]: 64 inputs
    for s in (0, 1, 127, 240):
        scale = torch.full((2, 16), s, dtype=torch.uint8)
        assert torch.equal(native.decode(every, scale), ops.fp4_weight(every, scale))
    packed, scale = _random(256, 64, 32, gen)
    chunk = packed[:, 16:40], scale[:, 16:40]
    assert not chunk[0].is_contiguous()
    assert torch.equal(native.decode(*chunk), ops.fp4_weight(*chunk))


def test_what_the_native_decode_does_not_take_goes_to_the_eager_one(native):
    gen = torch.Generator().manual_seed(1)
    packed, scale = _random(64, 32, 32, gen)
    stacked = packed.expand(3, -1, -1), scale.expand(3, -1, -1)  # several experts: not one weight
    assert torch.equal(native.decode(*stacked), ops.fp4_weight(*stacked))
    columns = packed.t(), scale  # a column stride other than 1
    assert torch.equal(native.decode(*columns), ops.fp4_weight(*columns))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_fused_product_is_the_eager_products_for_up_to_fused_rows(native):
    """Rows 1..FUSED_ROWS (non-contiguous rows too), whole tiles of 8 columns and a tail, a column
    slice through its row stride: x @ W as the eager decode + matmul give it, to float32 rounding
    (the sums run in another order); more rows, or what it does not take, are left to `ops.linear`."""
    gen = torch.Generator().manual_seed(3)
    for rows_in, cols in ((1024, 512), (256, 20), (64, 5)):
        packed, scale = _random(rows_in, cols, 32, gen, 118, 128)
        w = ops.fp4_weight(packed, scale)
        for rows in range(1, fp4_native.FUSED_ROWS + 1):
            x = torch.randn(rows, rows_in, generator=gen)
            got = native.matmul(x, packed, scale)
            assert got is not None and got.shape == (rows, cols) and _rel(got, x @ w) < 1e-5
        x = torch.randn(3, 2 * rows_in, generator=gen)[:, ::2]  # rows with a stride
        assert _rel(native.matmul(x, packed, scale), x @ w) < 1e-5
    packed, scale = _random(256, 64, 32, gen, 118, 128)
    chunk = packed[:, 8:40], scale[:, 8:40]
    x = torch.randn(4, 256, generator=gen)
    assert _rel(native.matmul(x, *chunk), x @ ops.fp4_weight(*chunk)) < 1e-5
    assert native.matmul(torch.randn(fp4_native.FUSED_ROWS + 1, 256), packed, scale) is None
    assert native.matmul(x.double(), packed, scale) is None and native.matmul(x[:, :128], packed, scale) is None
    assert native.matmul(x[:0], packed, scale) is None


def test_experts_one_is_built_from_its_source_through_the_kernel_cache_and_runs_the_expert(tiny_packed, tmp_path):
    """Cold: compiled (a shared library, in the cache); warm: a HIT loaded from the verified
    bytes; either way each expert over its rows gives the eager expert's numbers (to float32
    rounding: few rows run fused), and the eager tier's function is the eager expert itself."""
    config, layout, weights = tiny_packed
    spec = build_programs(config, layout, MAX_SEQ).specs[EXPERTS_ONE]
    cache = KernelCache(tmp_path / "kc")
    cold = prepare(spec, cache=cache, backend="export")
    warm = prepare(spec, cache=cache, backend="export")
    assert (cold.outcome, warm.outcome) == ("compiled", "hit") and warm.artifact_bytes > 0
    hit = cache.lookup(spec.name, program_key(spec, "export"))
    assert isinstance(hit, Hit) and hit.data(ARTIFACT)[:4] == b"\x7fELF"  # a shared library
    d = Dims.of(config, MAX_SEQ)
    eager = build_function(spec)
    names = [t.name.removeprefix("w.") for t in spec.inputs[1:]]
    experts = _expert_tensors(weights["layers.1"])
    gen = torch.Generator().manual_seed(2)
    for e, rows in ((0, 1), (3, 5), (7, 40)):
        x = torch.randn(rows, config.hidden_size, generator=gen)
        one = [experts[n][e] for n in names]
        want = expert_ffn(d, dict(zip(names, one, strict=True)), x)
        assert _rel(cold.run(x, *one), want) < 1e-5 and torch.equal(warm.run(x, *one), cold.run(x, *one))
        assert torch.equal(eager(x, *one), want)


def test_experts_ones_key_holds_its_source_and_the_compiler_whatever_the_backend(tiny_packed):
    config, layout, _ = tiny_packed
    spec = build_programs(config, layout, MAX_SEQ).specs[EXPERTS_ONE]
    for backend in ("export", "aoti"):
        key = program_key(spec, backend).as_dict()
        assert "source:runtime.model.fp4_native.SOURCE" in key and "source:runtime.model.fp4_native.FLAGS" in key
        assert "compiler" in key
    a, b = program_key(spec, "export"), program_key(spec, "aoti")
    assert {c.component for c in diff(a, b)} == {"backend"}
