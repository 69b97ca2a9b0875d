"""The FP4 products built natively (`runtime.model.native`): `experts.native`'s compiled form,
built from C++ source through the kernel cache and loaded from the verified bytes; its fused
products the eager products' to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from runtime.model import ops
from runtime.model.dims import Dims
from runtime.model.moe import _expert_tensors
from runtime.model.native import ISA_AVX2, ISA_BEST, ISA_SCALAR, Native, load
from runtime.programs.build import ARTIFACT, prepare
from runtime.programs.catalog import EXPERTS_NATIVE, EXPERTS_PICKED, build_programs
from runtime.programs.spec import build_function, program_key
from store.fingerprint import diff
from store.kernel_cache import Hit, KernelCache

MAX_SEQ = 64


@pytest.fixture(params=[ISA_SCALAR, ISA_AVX2, ISA_BEST], ids=["c", "avx2", "best"])
def native(native_library, request) -> Native:
    """Each of the library's paths this cpu has (a cap above the cpu's runs what it has)."""
    lib = load(native_library)
    lib.isa = request.param
    return lib


def _random(shape_in: int, shape_out: int, group: int, gen, low: int = 0, high: int = 241):
    packed = torch.randint(0, 256, (shape_in // 2, shape_out), dtype=torch.uint8, generator=gen)
    scale = torch.randint(low, high, (shape_in // group, shape_out), dtype=torch.uint8, generator=gen)
    return packed, scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _grouped_args(counts: list[int]) -> tuple[list[int], list[int]]:
    used = [e for e, count in enumerate(counts) if count]
    starts = [0]
    for e in used:
        starts.append(starts[-1] + counts[e])
    return used, starts


def test_the_grouped_product_is_each_experts_eager_product_and_a_rows_sums_never_depend_on_its_pass(native):
    """Every used expert's rows (1 to 40: in registers, with AVX2 from 3 rows on through a decoded
    panel a few rows a pass, uneven last passes; 640 inputs, many groups) times its own weight of the
    stacks, whole units and a column tail: each expert's x @ W to float32 rounding. A row's numbers are the same
    alone as among others (every path sums each row on its own, in one order): a request's tokens
    do not depend on who shares its step."""
    gen = torch.Generator().manual_seed(5)
    for rows_in, cols, group in ((256, 64, 32), (128, 20, 32), (64, 40, 16), (640, 48, 32)):
        stacks = [_random(rows_in, cols, group, gen, 118, 128) for _ in range(6)]
        packed, scale = torch.stack([p for p, _ in stacks]), torch.stack([q for _, q in stacks])
        counts = [3, 0, 40, 1, 17, 2]
        ids, starts = _grouped_args(counts)
        x = torch.randn(starts[-1], rows_in, generator=gen)
        got = native.grouped(x, ids, starts, packed, scale)
        assert got is not None and got.shape == (x.shape[0], cols)
        for k, e in enumerate(ids):
            part = slice(starts[k], starts[k + 1])
            assert _rel(got[part], x[part] @ ops.fp4_weight(packed[e], scale[e])) < 1e-5
            for r in (part.start, part.stop - 1):  # the row alone, as its expert's only row
                alone = native.grouped(x[r:r + 1], [e], [0, 1], packed, scale)
                assert torch.equal(alone, got[r:r + 1])


def test_every_decoded_weight_is_the_eager_decodes_number_exactly(native):
    """Rows of the identity pick the weight's rows out one by one, so the product is the decoded
    weight itself: every byte, E8M0 scales 0 (the subnormal 2^-127), 1, 127 and 240, equal to
    the eager decode bit for bit (a zero's sign aside: 0 · w + 0 is +0)."""
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(2, 1)  # [32, 16]: 64 inputs, each byte
    eye = torch.eye(64)
    for s in (0, 1, 127, 240):
        scale = torch.full((2, 16), s, dtype=torch.uint8)
        got = native.grouped(eye, [0], [0, 64], every[None], scale[None])
        assert torch.equal(got, ops.fp4_weight(every, scale))


def test_the_grouped_product_refuses_ids_and_bounds_it_cannot_trust(native):
    gen = torch.Generator().manual_seed(6)
    packed, scale = (torch.stack(t) for t in zip(*(_random(64, 32, 32, gen, 118, 128) for _ in range(3)), strict=True))
    x = torch.randn(4, 64, generator=gen)
    ok = [0, 2], [0, 1, 4]
    assert native.grouped(x, *ok, packed, scale) is not None
    for ids, starts in (([0, 3], ok[1]), ([-1, 2], ok[1]),  # no such expert
                        (ok[0], [0, 1, 5]), (ok[0], [1, 1, 4]),  # past x, not from 0
                        (ok[0], [0, 3, 2]), (ok[0], [0, 4]),  # backwards, short
                        ([0.0, 2.0], ok[1]), (ok[0], [0, 1.5, 4])):  # not whole numbers
        assert native.grouped(x, ids, starts, packed, scale) is None
    assert native.grouped(x.double(), *ok, packed, scale) is None and \
        native.grouped(x[:, :32], *ok, packed, scale) is None
    assert native.grouped(x, *ok, packed[:0], scale[:0]) is None  # no experts at all


@pytest.mark.slow
def test_experts_native_is_built_from_its_source_through_the_kernel_cache_and_runs_the_experts(tiny_packed, tmp_path):
    """Cold: compiled (a shared library, in the cache); warm: a HIT loaded from the verified
    bytes; either way a layer's routed experts finish its block as the eager grouped way does (to
    float32 rounding: the products run fused), at every row count, and the eager tier's function
    is that eager way itself."""
    config, layout, weights = tiny_packed
    programs = build_programs(config, layout, MAX_SEQ)
    spec = programs.specs[EXPERTS_NATIVE]
    cache = KernelCache(tmp_path / "kc")
    cold = prepare(spec, cache=cache, backend="export")
    warm = prepare(spec, cache=cache, backend="export")
    assert (cold.outcome, warm.outcome) == ("compiled", "hit") and warm.artifact_bytes > 0
    hit = cache.lookup(spec.name, program_key(spec, "export"))
    assert isinstance(hit, Hit) and hit.data(ARTIFACT)[:4] == b"\x7fELF"  # a shared library
    eager, grouped = build_function(spec), build_function(programs.specs[EXPERTS_PICKED])  # run eagerly: grouped
    experts = _expert_tensors(weights["layers.1"])
    tensors = [experts[t.name.removeprefix("w.")] for t in spec.inputs if t.name.startswith("w.")]
    d, gen = Dims.of(config, MAX_SEQ), torch.Generator().manual_seed(2)
    for rows in (1, 5, 40):
        parts = (torch.randn(rows, d.hc, d.hidden, generator=gen), torch.rand(rows, d.hc, generator=gen),
                 torch.rand(rows, d.hc, d.hc, generator=gen), torch.randn(rows, d.hidden, generator=gen),
                 torch.randint(0, config.n_routed_experts, (rows, d.topk), generator=gen),
                 torch.rand(rows, d.topk, generator=gen), torch.randn(rows, d.hidden, generator=gen))
        want = eager(*parts, *tensors)
        got = cold.run(*parts, *tensors)
        assert _rel(got, want) < 1e-5 and torch.equal(warm.run(*parts, *tensors), got)
        assert torch.equal(grouped(*parts, *tensors), want)


def test_experts_natives_key_holds_its_source_and_the_compiler_whatever_the_backend(tiny_packed):
    config, layout, _ = tiny_packed
    spec = build_programs(config, layout, MAX_SEQ).specs[EXPERTS_NATIVE]
    for backend in ("export", "aoti"):
        key = program_key(spec, backend).as_dict()
        assert "source:runtime.model.native.SOURCE" in key and "source:runtime.model.native.FLAGS" in key
        assert "compiler" in key
    a, b = program_key(spec, "export"), program_key(spec, "aoti")
    assert {c.component for c in diff(a, b)} == {"backend"}


def _fp8(rows_in: int, cols: int, block: int, gen, low: int = 118, high: int = 128):
    """Random FP8 bytes (no NaN: 0x7f, 0xff) [in, cols] and E8M0 scales [in/block, cols/block]."""
    q = torch.randint(0, 127, (rows_in, cols), dtype=torch.uint8, generator=gen)
    q |= torch.randint(0, 2, q.shape, dtype=torch.uint8, generator=gen) << 7
    scale = torch.randint(low, high, (rows_in // block, cols // block), dtype=torch.uint8, generator=gen)
    return q.view(torch.float8_e4m3fn), scale


def test_the_dense_product_is_the_eager_product_and_a_rows_sums_never_depend_on_its_pass(native):
    """FP8 weights with their block scales and BF16 ones, whole tiles and a column tail, 1 to 19
    rows (several passes, a short last one; with AVX2 from 5 FP8 rows or 9 BF16 ones on through
    decoded panels, 64 weight rows each): x @ the eagerly dequantised weight to float32 rounding,
    and each row's numbers the same alone as among others."""
    gen = torch.Generator().manual_seed(7)
    cases = [(*_fp8(256, 96, 32, gen), "fp8"), (*_fp8(128, 256, 128, gen), "fp8"), (*_fp8(64, 64, 32, gen), "fp8"),
             (torch.randn(96, 80, generator=gen).bfloat16(), None, "bf16"),
             (torch.randn(64, 40, generator=gen).bfloat16(), None, "bf16")]
    for w, scale, kind in cases:
        stored = {"w.weight": w} if scale is None else {"w.qweight": w, "w.qscale": scale}
        want_w = ops.weight(stored, "w")
        for rows in (1, 2, 3, 8, 9, 19):
            x = torch.randn(rows, w.shape[0], generator=gen)
            got = native.dense(x, w, scale)
            assert got is not None and got.shape == (rows, w.shape[1]), kind
            assert _rel(got, x @ want_w) < 1e-5, (kind, rows)
            assert torch.equal(native.dense(x[-1:], w, scale), got[-1:])


def test_fp8_in_registers_is_the_panels_product_to_the_bit_even_at_float32s_edges(native):
    """With AVX2, up to 4 rows widen FP8 in float32's bits against inputs scaled by 2^112
    (`native_dense.dense_low`), from 5 rows on through float16 into panels: the same products, so
    the same numbers to the bit, also where the products fall below float32's normal range (inputs
    near 2^-120, subnormal weights) and where an input of 2^16 or more (or infinity) makes the
    few rows take the float16 widening instead."""
    gen = torch.Generator().manual_seed(9)
    w, scale = _fp8(256, 128, 128, gen, low=100, high=140)
    filler = torch.randn(7, 256, generator=gen)
    for factor in (1.0, 2.0 ** -120, 2.0 ** -100, 2.0 ** 15):
        for x in (torch.randn(2, 256, generator=gen) * factor, torch.cat([torch.randn(1, 256) * factor,
                                                                           torch.full((1, 256), 70000.0)])):
            few, many = native.dense(x, w, scale), native.dense(torch.cat([x, filler]), w, scale)
            assert torch.equal(few, many[:2]), factor
    x = torch.randn(2, 256, generator=gen)
    x[1, 3] = float("inf")
    few, many = native.dense(x, w, scale), native.dense(torch.cat([x, filler]), w, scale)
    assert torch.equal(few[0], many[0]) and torch.equal(few[1].isnan(), many[1].isnan())


def test_a_dense_block_scale_past_float32s_factor_still_multiplies_exactly(native):
    """An E8M0 block scale above 246 (its sums' factor 2^(s - 119) has no float32): each weight is
    still its byte's value times 2^(s - 127) exactly, or infinite where that overflows, as a float64
    dequantisation rounds it (the eager one's float16 route wraps such scales)."""
    every = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).to(torch.uint8)
    q = every[torch.arange(32 * 64) % every.numel()].reshape(32, 64).view(torch.float8_e4m3fn)
    for s in (247, 250, 254):
        scale = torch.full((1, 2), s, dtype=torch.uint8)
        want = (q.to(torch.float64) * 2.0 ** (s - 127)).float()
        assert torch.equal(native.dense(torch.eye(32), q, scale), want)


def test_every_dense_weight_is_the_eager_dequantisations_number_exactly(native):
    """Identity rows pick the weight's rows out: every FP8 byte but NaN's, subnormals included,
    times E8M0 scales 0, 1, 127 and 240, and BF16 values, bit for bit the eager dequantisation's."""
    every = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).to(torch.uint8)  # 254 bytes
    q = every[torch.arange(32 * 64) % every.numel()].reshape(32, 64).view(torch.float8_e4m3fn)
    eye = torch.eye(32)
    for s in (0, 1, 127, 240):
        scale = torch.full((1, 2), s, dtype=torch.uint8)
        assert torch.equal(native.dense(eye, q, scale), ops.weight({"w.qweight": q, "w.qscale": scale}, "w"))
    b = torch.randn(32, 48).bfloat16()
    assert torch.equal(native.dense(eye, b), b.float())


def test_the_dense_product_refuses_what_it_cannot_read(native):
    gen = torch.Generator().manual_seed(8)
    q, scale = _fp8(64, 64, 32, gen)
    x = torch.randn(2, 64, generator=gen)
    assert native.dense(x, q, scale) is not None
    odd_q, odd_scale = _fp8(64, 48, 8, gen)  # a scale block of 8 columns splits a 16-column unit
    for args in ((x, q, None), (x, q, scale.float()), (x, q, scale.repeat(1, 2)[:, :3]),
                 (x, q, scale[:1].expand(3, 2)), (x, q, scale.t()),
                 (x, odd_q, odd_scale), (x[:, :32], q, scale), (x.double(), q, scale),
                 (x, q.view(torch.uint8), scale), (x, torch.randn(64, 64), None),
                 (x, torch.randn(64, 64).bfloat16(), scale), (x[0], q, scale)):
        assert native.dense(*args) is None
    narrow = torch.randn(64, 8).bfloat16()  # no whole unit: column by column, fine at a few rows only
    assert native.dense(torch.randn(4, 64), narrow) is not None
    assert native.dense(torch.randn(5, 64), narrow) is None


@pytest.mark.slow
def test_every_layer_program_and_the_head_multiply_natively_where_the_native_products_are_built(tiny_packed,
                                                                                                 native_library):
    """The catalog marks every layer program (prefill and decode), the head and the MTP input; traced, each of their
    FP8 and BF16 products is one `dsv4::dense` call, which runs the native products once they are
    loaded and the eager dequantisation before: the same numbers to float32 rounding."""
    from runtime.programs.build import export_program

    config, layout, weights = tiny_packed
    specs = build_programs(config, layout, MAX_SEQ).specs
    marked = {n for n, s in specs.items() if (s.captures or {}).get("native_dense")}
    assert marked == {n for n in specs if n.startswith(("head.", "layer.", "mtp.input."))}

    def dense_calls(name: str) -> int:
        graph = export_program(specs[name]).graph_module
        return sum(1 for m in graph.modules() if isinstance(m, torch.fx.GraphModule)
                   for node in m.graph.nodes if node.target is torch.ops.dsv4.dense.default)

    decode = next(n for n in marked if n.startswith("layer.") and n.endswith(".decode"))
    assert dense_calls(decode) > 0 and dense_calls("head.decode") == 1
    assert dense_calls(decode.replace(".decode", ".prefill")) == dense_calls(decode)
    top = weights["top"]
    x = torch.randn(3, config.hidden_size)
    with ops.native_restored():  # what this process loaded so far (other tests' programs) after
        ops.use_native(None)
        eager = ops.dense(x, top["head.weight"], None)
        assert _rel(eager, x @ top["head.weight"].float()) < 1e-6
        ops.use_native(load(native_library))
        assert _rel(ops.dense(x, top["head.weight"], None), eager) < 1e-5


class _Counting:
    """Native products that count the products asked of them (the eager result, so any is right)."""

    dense_rows = 4

    def __init__(self):
        self.asked: list[int] = []

    def dense(self, x, w, scale=None):
        self.asked.append(x.shape[0])
        return ops.matmul(x, ops.weight({"w.qweight": w, "w.qscale": scale}, "w"))


def test_more_rows_than_the_native_product_is_faster_for_multiply_the_widened_weight(monkeypatch, serving):
    """`dsv4::dense` asks the native products for up to their `dense_rows` rows (a prefill's few);
    beyond, eagerly: block by block up to FP8_BLOCK_ROWS (`fp8_blocks`), past them a GEMM of the
    widened weight (faster there), column chunks of a large weight at a time."""
    gen = torch.Generator().manual_seed(9)
    q, scale = _fp8(256, 96, 32, gen)
    counting = _Counting()
    serving(counting)
    want = ops.weight({"w.qweight": q, "w.qscale": scale}, "w")
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 256, generator=gen)
        assert _rel(torch.ops.dsv4.dense(x, q, scale), x @ want) < 1e-5
    assert counting.asked == [1, 4]
    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 256 * 32)  # a weight over it: 32 columns at a time
    widths, real = [], ops.matmul
    monkeypatch.setattr(ops, "matmul", lambda a, b: widths.append(b.shape[1]) or real(a, b))
    x = torch.randn(ops.FP8_BLOCK_ROWS + 1, 256, generator=gen)
    assert _rel(torch.ops.dsv4.dense(x, q, scale), x @ want) < 1e-5
    assert widths == [32, 32, 32]


def test_a_grouped_output_multiplies_each_groups_own_columns_as_a_product_of_its_own(monkeypatch, native_library):
    """`ops.linear_groups` (V4's grouped attention output): each group's rows times its own output
    columns, through `linear` (so natively: one product a group, of the real library here), equal
    to the whole dequantised weight's einsum to float32 rounding; groups that split a scale block
    take the einsum."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 64, generator=gen)  # [T, G, in]
    q, scale = _fp8(64, 4 * 64, 32, gen)
    stored = {"w.qweight": q, "w.qscale": scale}
    want = torch.einsum("tgi,igo->tgo", x, ops.weight(stored, "w").reshape(64, 4, 64))
    asked = []
    real = load(native_library)
    monkeypatch.setattr(ops, "_native_dense", real)
    monkeypatch.setattr(real, "dense", lambda x, w, s=None, f=real.dense: asked.append(tuple(w.shape)) or f(x, w, s))
    got = ops.linear_groups(stored, "w", x)
    assert got.shape == (3, 4, 64) and _rel(got, want) < 1e-5
    assert asked == [(64, 64)] * 4
    bf16 = torch.randn(64, 4 * 64, generator=gen).bfloat16()
    got = ops.linear_groups({"w.weight": bf16}, "w", x)
    assert _rel(got, torch.einsum("tgi,igo->tgo", x, bf16.float().reshape(64, 4, 64))) < 1e-5
    assert len(asked) == 8
    q, scale = _fp8(64, 2 * 48, 32, gen)  # 48 columns a group: a scale block split
    stored = {"w.qweight": q, "w.qscale": scale}
    x2 = x[:, :2]
    got = ops.linear_groups(stored, "w", x2)
    assert _rel(got, torch.einsum("tgi,igo->tgo", x2, ops.weight(stored, "w").reshape(64, 2, 48))) < 1e-6
    assert len(asked) == 8


def test_the_eager_tier_multiplies_natively_once_the_native_products_are_loaded(monkeypatch):
    """Run eagerly (the eager tier, standing in for programs that still compile), an FP8 or BF16
    product on the cpu of up to `dense_rows` rows goes to the native products once a launch has
    loaded them (`experts.native`), as the compiled programs' do; before, and beyond those rows,
    the widened weight. FP4 experts go their own way (`moe._experts_grouped`)."""
    gen = torch.Generator().manual_seed(3)
    q, scale = _fp8(128, 64, 32, gen)
    bf16 = torch.randn(128, 48, generator=gen).bfloat16()
    want = ops.weight({"w.qweight": q, "w.qscale": scale}, "w")
    counting = _Counting()
    for loaded in (None, counting):
        monkeypatch.setattr(ops, "_native_dense", loaded)
        for rows in (1, 4, 5):
            x = torch.randn(rows, 128, generator=gen)
            assert _rel(ops.linear({"w.qweight": q, "w.qscale": scale}, "w", x), x @ want) < 1e-5
        assert counting.asked == ([] if loaded is None else [1, 4])
    counting.dense = lambda x, w, scale=None: counting.asked.append(("bf16", x.shape[0])) or x @ w.float()
    x = torch.randn(2, 128, generator=gen)
    assert _rel(ops.linear({"w.weight": bf16}, "w", x), x @ bf16.float()) < 1e-6
    assert counting.asked[-1] == ("bf16", 2)
    packed = torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=gen)
    ops.linear({"w.qweight": packed, "w.qscale": torch.full((4, 48), 127, dtype=torch.uint8)}, "w", x)
    assert counting.asked[-1] == ("bf16", 2)  # an FP4 weight: not asked here
