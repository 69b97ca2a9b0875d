"""The model's building blocks: norms and the matmuls of packed (FP8, FP4) and float weights,
dequantised or native. See `runtime.model.forward` for the conventions these follow; RoPE is
`runtime.model.rope`, the hyper-connections `runtime.model.hyper_connections`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from runtime.model.codes import (
    CODES_AT,
    FP8_CODE_EXP,
    FP16_CODE_EXP,
    SIGNS_AT,
    code_scales,
    e2m1,
    fp4_float16,
    fp8_float16,
    traced_scales,
)
from runtime.toolchain import cpu_vendor

NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return y if weight is None else y * weight.float()


_TRACING = threading.Lock()
_interpreted = False  # a plain global: torch.cond's tracer reads it, where a ContextVar breaks it


@contextlib.contextmanager
def interpreted_trace() -> Iterator[None]:
    """Trace for a graph that runs op by op (the export backend): there the eager formulations —
    the fewest, largest ops — beat the elementwise ones written for a compiler to fuse (decoding
    FP4 in integer ops, op by op, made tiny's batched service 0.59× packer 2's). One such trace
    at a time per process."""
    global _interpreted
    with _TRACING:
        _interpreted = True
        try:
            yield
        finally:
            _interpreted = False


def fusing() -> bool:
    """Is this being traced for a compiler that fuses it into kernels (inductor, AOTInductor)?"""
    return torch.compiler.is_compiling() and not _interpreted


class NativeProducts(Protocol):
    """The products compiled natively (`runtime.model.native`): the grouped experts' FP4
    (`moe._experts_grouped`), and the programs' dense FP8 and BF16 weights at few rows
    (`dsv4::dense`), widened in registers where they multiply."""

    def grouped(self, x: torch.Tensor, ids: Sequence[int], starts: Sequence[int], packed: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor | None:
        """Each expert ids[k]'s rows x[starts[k]:starts[k + 1]] times its weight of the stacks
        (packed, scale) [experts, …], fused; None where it does not serve."""

    def dense(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [rows, in] @ w [in, out] (FP8 with its E8M0 block scales, or BF16); None where it
        does not serve."""

    @property
    def dense_rows(self) -> int:
        """Up to how many rows `dense` is faster than a GEMM of the widened weight."""

    def ffn(self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w13: tuple[torch.Tensor, ...],
            w2: tuple[torch.Tensor, torch.Tensor], swiglu: Callable[..., torch.Tensor]) -> torch.Tensor | None:
        """A layer's routed experts over rows x with their choices and gates, fused
        (`moe.routed_fused`); None where it does not serve."""


def weight(w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A matmul weight [.., in, out] as float32: a packed one dequantised per block from the
    checkpoint's bytes (value(qweight) · 2^(qscale - 127), qscale one E8M0 byte per block; FP4
    codes decoded from their bytes here, where they multiply), or a float one as is. Block sizes
    follow from the shapes: the packer stores whole blocks only."""
    q = w.get(name + ".qweight")
    if q is None:
        return w[name + ".weight"].float()
    e = w[name + ".qscale"]
    if q.dtype == torch.uint8:
        return fp4_weight(q, e)
    *lead, i, o = q.shape
    gi, go = e.shape[-2], e.shape[-1]
    if q.dtype == torch.float8_e4m3fn and q.is_cpu and not torch.compiler.is_compiling():
        values = fp8_float16(q).float().view(*lead, gi, i // gi, go, o // go)  # value · 2^-8
        return values.mul_(code_scales(e, FP8_CODE_EXP).reshape(*lead, gi, 1, go, 1)).view(*lead, i, o)
    scale = torch.exp2(e.float() - 127.0).reshape(*lead, gi, 1, go, 1)
    return (q.float().reshape(*lead, gi, i // gi, go, o // go) * scale).reshape(*lead, i, o)


def fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 bytes [.., in/2, out] with their E8M0 scales [.., in/group, out] → float32 [.., in, out].
    Run eagerly or op by op: the codes as float16 bit patterns (`fp4_float16`), widened and
    scaled in place: about 4× faster than the 256-entry table lookup it replaced, which paid an
    int32 copy of the bytes (torch's lookups take no uint8 index) and a gather."""
    *lead, half, o = packed.shape
    gi = scale.shape[-2]
    if fusing():
        s = traced_scales(scale)
        values = e2m1_values(packed).reshape(*lead, gi, 2 * half // gi, o)
        return (values * s.reshape(*lead, gi, 1, o)).reshape(*lead, 2 * half, o)
    s = code_scales(scale, FP16_CODE_EXP).reshape(*lead, gi, 1, o)
    values = fp4_float16(packed).float().reshape(*lead, gi, 2 * half // gi, o)
    values = values * s if torch.compiler.is_compiling() else values.mul_(s)
    return values.reshape(*lead, 2 * half, o)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """FP4 bytes [.., in/2, out] (byte j of a column: inputs 2j and 2j+1, as
    `runtime.weights.pack.serving_fp4` places their bits) → their values [.., in, out] as float32.

    Two ways to the same numbers, one per executor. Run eagerly (or op by op), the codes' float16
    bit patterns (`fp4_float16`): a few whole-tensor integer passes. Traced for a compiler, the
    codes decoded in integers (`e2m1`) through broadcast shifts and masks: inductor fuses that into
    the kernel that multiplies, vectorised along the outputs, with no codes buffer."""
    *lead, half, o = packed.shape
    if not fusing():
        return (fp4_float16(packed).float() * 2.0 ** FP16_CODE_EXP).reshape(*lead, 2 * half, o)
    b = packed.to(torch.int32).unsqueeze(-2)
    which = torch.arange(2, dtype=torch.int32, device=packed.device).reshape(2, 1)  # even, odd
    # shifted by CODES_AT, masked by SIGNS_AT: made from an arange, as the nibbles' shift was
    return e2m1(b >> which * CODES_AT[1], b & (SIGNS_AT[0] << which)).reshape(*lead, 2 * half, o)


def fp4_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [.., in] times FP4 weights of its own (packed [.., in/2, out], E8M0 scale [.., in/g, out])
    → [.., out], for a traced program: each byte is read once and both its codes are decoded and
    multiplied where they are used (the even input by the even code, the odd by the odd), summed
    within each scale block, and only each block's sum multiplied by its scale (one multiply per
    block, not per weight: 1.75× packer 2's int8 form at one row, compiled, where scaling every
    weight was 1.08×). One fused kernel, vectorised along the outputs, with no weight buffer."""
    *lead, half, o = packed.shape
    gi = scale.shape[-2]
    b = packed.to(torch.int32).reshape(*lead, gi, half // gi, o)
    pairs = x.reshape(*x.shape[:-1], gi, half // gi, 2)
    even, odd = (e2m1(b >> at, b & sign) for at, sign in zip(CODES_AT, SIGNS_AT, strict=True))
    block = (pairs[..., 0, None] * even + pairs[..., 1, None] * odd).sum(-2)  # [.., in/g, out]
    return (block * traced_scales(scale)).sum(-2)


# A weight whose float copy would be larger than this is dequantised and multiplied a few output
# columns at a time. One float copy of small's output head is 128 MiB, allocated afresh (and
# page-faulted) on every call: 5× the matmul itself; a chunk of a few MiB is reused from the
# allocator and stays in cache. At most MAX_CHUNKS, so a traced program stays small. The routed
# experts' dense path (traced, or eagerly on an accelerator) dequantises a few experts at a time
# (at most MAX_EXPERT_CHUNKS chunks): never a float copy of a whole layer's experts. 8 chunks of
# small's 32 experts (4 at a time, 8 MiB a weight) ran a dense step of 8 rows 1.25× faster than 4
# chunks, compiled, and 1.09× eagerly.
CHUNK_ELEMENTS = 1 << 20
MAX_CHUNKS = 16
MAX_EXPERT_CHUNKS = 8


def chunk_units(count: int, unit_elements: int, align: int = 1, most: int | None = None) -> int:
    """Units (of `unit_elements` floats each) per chunk of `count`: about CHUNK_ELEMENTS floats,
    at most `most` (MAX_CHUNKS) chunks, a multiple of `align`."""
    size = max(CHUNK_ELEMENTS // unit_elements, -(-count // (most or MAX_CHUNKS)), 1)
    return -(-size // align) * align


# torch's float32 matmul on the cpu calls MKL, which on this project's AMD hosts ran a GEMM of a
# few rows 2-3x slower than oneDNN's (small's expert weight [1024, 512]: 4 rows 106 vs 47 us, 32
# rows 244 vs 116, 128 rows 744 vs 338; the same float32 math). oneDNN costs about 15 us a call
# more, so one row (a GEMV: 28 vs 46 us) and small weights (tiny's experts, [256, 128]: 8 rows
# 8 vs 16 us) stay with MKL. On Intel's cores MKL runs its own kernels and is the faster (a
# Sapphire Rapids host: 4 rows 28 vs 87 us, 32 rows 139 vs 206): there everything stays MKL.
# oneDNN's linear op takes the weight [out, in]: ours, [in, out], transposed as a view.
def _onednn_linear() -> Any:
    """oneDNN's linear op where it beats MKL's GEMMs (an AMD cpu), else None."""
    if not torch.backends.mkldnn.is_available() or cpu_vendor() != "AuthenticAMD":
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_ONEDNN_LINEAR = _onednn_linear()
ONEDNN_MIN_ROWS = 2
ONEDNN_MIN_WEIGHTS = 1 << 17


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w [in, out]: through oneDNN's linear when run eagerly on the cpu in float32,
    for two rows or more of a weight of ONEDNN_MIN_WEIGHTS or more (see above); otherwise (one
    row, a small weight, another device or dtype) torch's. Traced on the cpu, such a product is
    `dsv4::matmul` (see below), which makes the same choice when the program runs."""
    if (_ONEDNN_LINEAR is not None and x.dim() == 2 and w.numel() >= ONEDNN_MIN_WEIGHTS and x.is_cpu
            and x.dtype == w.dtype == torch.float32):
        if torch.compiler.is_compiling():
            return torch.ops.dsv4.matmul(x, w)
        if x.shape[0] >= ONEDNN_MIN_ROWS:
            return _ONEDNN_LINEAR(x, w.t(), None, "none", [], "")
    return x @ w


# Inductor lowers oneDNN's linear only onto a constant weight it prepacks, never onto one dequantised
# in the graph (`LoweringException: NotImplementedError: Pointwise`). An op of our own is a call it
# leaves alone: a program calls back into `matmul` (about 10 us a call more), which picks by the
# rows it gets. Compiled by AOTInductor, one `[1024, 512]` weight dequantised in the program and
# multiplied: 1 row 72 vs 62 us through MKL, 8 rows 130 vs 199, 32 rows 215 vs 344, 256 rows 793 vs
# 1733 (a decode step of eight sequences' prompts). A program that calls it needs this module
# imported before it loads (`runtime.programs.build`).
#
# Our ops are defined through a `Library`, not `torch.library.custom_op`, whose kernel wrapper imports
# torch._dynamo at a process's first call: half a second of every hot launch's validate phase.
_OPS = torch.library.Library("dsv4", "DEF")


def _op(schema: str, impl: Any, key: str = "CPU") -> None:
    """Define dsv4::<schema> run by `impl` (for dispatch key `key`), its result [rows of x, columns of w]."""
    name = schema.partition("(")[0]
    _OPS.define(schema)
    _OPS.impl(name, impl, key)
    torch.library.register_fake(f"dsv4::{name}", lambda x, w, *_: x.new_empty(x.shape[0], w.shape[1]), lib=_OPS)


_op("matmul(Tensor x, Tensor w) -> Tensor", matmul)


# The native products this process loaded (from the kernel cache's verified bytes: `experts.native`,
# `runtime.programs.build`), which `dsv4::dense` runs; None before, or where none is built.
_native_dense: NativeProducts | None = None
_dense_calls = threading.local()  # per thread: tracing a program whose dense products are calls (`dense_calls`)


def use_native(native: NativeProducts | None) -> None:
    """The native products this process runs from now (None: none), `dsv4::dense`'s kernel with
    them where their library has one (the last one's released first)."""
    global _native_dense
    if _native_dense is not None and _native_dense is not native:
        getattr(_native_dense, "release_ops", lambda: None)()
    _native_dense = native
    if native is not None:
        getattr(native, "register_ops", lambda: False)()


def native_products() -> NativeProducts | None:
    """The native products this process runs (`use_native`); None where none are loaded."""
    return _native_dense


@contextlib.contextmanager
def native_restored() -> Iterator[None]:
    """A block that may `use_native` other products (a benchmark's, a test's): the products that
    served before it serve again after it."""
    before = _native_dense
    try:
        yield
    finally:
        use_native(before)


@contextlib.contextmanager
def dense_calls(on: bool = True) -> Iterator[None]:
    """Trace a program whose FP8 and BF16 products are `dsv4::dense` calls (traced on the cpu),
    which multiply natively up to the native products' `dense_rows` once they are loaded, else
    widen the weight eagerly for a GEMM. A program dequantising such a weight in its graph writes it
    whole as float32 and reads it back for every product, whatever its rows: natively each byte is
    read once (small, one row: a `[1024, 1024]` FP8 weight 135 us against 3.1 ms eager, the BF16
    head 1.4 ms against 10.5 compiled); and at many rows inductor's widening in the graph was no
    faster than the eager one (a `[1024, 512]` FP8 weight at 256 rows, 2 AMD cores: 2.6 ms against
    2.9; at 32 rows 1.9 against 1.2). A 6-token prompt's prefill of `small` took 0.23 s, 0.16 of
    it widening every layer's weights."""
    before = getattr(_dense_calls, "on", False)
    _dense_calls.on = on
    try:
        yield
    finally:
        _dense_calls.on = before


def dense(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x @ w (FP8 with its block scales, or BF16), run eagerly by `linear`: natively if the native
    products are loaded, take it and are the faster at these rows, else dequantised for a GEMM:
    what `dsv4::dense` runs. The native product is asked first, as `linear` would: a program calls
    this some 170 times a decode step of small, and the weight dict and checks `linear` builds
    around it are time in Python each call."""
    if (out := _native_product(x, w, scale)) is not None:
        return out
    return linear({"w.weight": w} if scale is None else {"w.qweight": w, "w.qscale": scale}, "w", x)


# The native products' library serves `dsv4::dense` on the cpu with a kernel of its own while it is
# loaded (`runtime.model.native_op`: no Python on a program's ~170 calls a decode step), which
# takes precedence over this kernel (CompositeExplicitAutograd) and hands what it does not multiply
# to `dsv4::dense_eager`: this same function.
_op("dense(Tensor x, Tensor w, Tensor? scale) -> Tensor", dense, "CompositeExplicitAutograd")
_op("dense_eager(Tensor x, Tensor w, Tensor? scale) -> Tensor", dense)


def _native_product(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | None:
    """x @ w by the native products this process loaded, where they take it and are the faster
    at these rows (`dense_rows`); else None."""
    native = _native_dense
    return native.dense(x, w, scale) if native is not None and x.shape[0] <= native.dense_rows else None


def linear(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """x @ W for a packed or a float weight, both stored [in, out]; a large one by column chunks.
    FP4 eagerly at few rows: block by block (`fp4_blocks`). FP8 or BF16 on the cpu: traced in a
    program of `dense_calls`, a `dsv4::dense` call; run eagerly, natively at few rows once the
    native products are loaded (`experts.native`, which a launch compiles first), else FP8 block by
    block up to FP8_BLOCK_ROWS (`fp8_blocks`). The eager tier's decode step of `small`, one
    sequence, 2 AMD cores: 91-155 ms, 49-76 with them (`dsv4 bench packing`, the host's speed swinging)."""
    q = w.get(name + ".qweight")
    if q is not None and q.dtype == torch.uint8:  # FP4: two inputs a byte
        # eagerly only, asked first: a traced row count compared here would become a guard on it
        few = not torch.compiler.is_compiling() and x.dim() == q.dim() == 2 and x.shape[0] <= FP4_BLOCK_ROWS
        return _by_columns(fp4_blocks if few else _dequantised, w, name, x, 2 * q.shape[-2], q.shape[-1])
    stored = w[name + ".weight"] if q is None else q
    if x.is_cpu and x.dim() == 2 and stored.dim() == 2 and stored.dtype in (torch.float8_e4m3fn, torch.bfloat16):
        scale = w.get(name + ".qscale")
        if torch.compiler.is_compiling():
            if getattr(_dense_calls, "on", False):
                return torch.ops.dsv4.dense(x, stored, scale)
        elif (out := _native_product(x, stored, scale)) is not None:
            return out
        elif scale is not None and x.shape[0] <= FP8_BLOCK_ROWS:
            return _by_columns(fp8_blocks, w, name, x, *stored.shape)
    return _by_columns(_dequantised, w, name, x, *stored.shape[-2:])


def _dequantised(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    return matmul(x, weight(w, name))


def _by_columns(product: Callable[..., torch.Tensor], w: dict[str, torch.Tensor], name: str, x: torch.Tensor,
                i: int, o: int) -> torch.Tensor:
    """product(w, name, x), weight `name` [i, o] values: whole where a float copy fits a chunk,
    else a few output columns (whole scale blocks) at a time."""
    if i * o <= CHUNK_ELEMENTS:  # fits one chunk (what `chunk_units` would say, in one product)
        return product(w, name, x)
    step = chunk_units(o, i, _block_columns(w, name))
    if step >= o:
        return product(w, name, x)
    return torch.cat([product(_columns(w, name, c, c + step), name, x) for c in range(0, o, step)], dim=-1)


# Up to how many rows `fp4_blocks` multiplies an FP4 weight eagerly (a decode step's rows of an
# expert). Small's experts, 2 AMD cores, against the dequantised product: 1.2-1.8× at 1-4 rows; from
# 6 rows less (1.07-1.5×), and some runs of [512, 1024] 2-4× slower at 6 and 16 rows (not reproduced).
FP4_BLOCK_ROWS = 4


def fp4_blocks(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ FP4 weight `name` ([in/2, out] bytes, E8M0 scales [in/g, out]) run eagerly
    for few rows: each block of g inputs times its codes' values unscaled (`fp4_float16`, one
    batched matmul, a block a batch), then each block's sums [in/g, rows, out] scaled and added. The
    scale multiplies those sums, not every weight: one float32 pass over the weight fewer than
    dequantising it whole (`fp4_weight`; what it bought: docs/formats.md). The same
    products added in another order: within float32's rounding of the whole weight's product."""
    q, scale = w[name + ".qweight"], w[name + ".qscale"]
    return _block_sums(x, fp4_float16(q), code_scales(scale, FP16_CODE_EXP))


# Up to how many rows `fp8_blocks` multiplies an FP8 weight eagerly, where no native product does:
# a decode step's, as FP4's. A [1024, 1024] weight, 2 AMD cores, against its float16-route
# dequantisation and a GEMM: 1 row 0.47 against 0.58 ms, 4 rows 0.45 / 0.52 (64 rows 0.89 / 0.99,
# 256 rows 2.6 / 2.4). Not further: a GEMM rounds a row alike at any row count, so a prefill's rows
# come out the same whether it holds one prompt or several (an `n` request's shared prefill draws
# what each choice alone would; the blocks round otherwise).
FP8_BLOCK_ROWS = FP4_BLOCK_ROWS


def fp8_blocks(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ FP8 weight `name` ([in, out] e4m3, E8M0 scales [in/128, out/128]) run eagerly
    where no native product does: as `fp4_blocks`, each 128 × 128 block's sums scaled, not its
    weights (the scale pass over the whole weight saved)."""
    q, scale = w[name + ".qweight"], w[name + ".qscale"]
    return _block_sums(x, fp8_float16(q), code_scales(scale, FP8_CODE_EXP))


def _block_sums(x: torch.Tensor, codes: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ a weight's codes (float16 [.., out], its `in` rows in input order, unscaled)
    whose scale blocks have the factors [in blocks, out blocks]: the codes widened to float32, one
    batched matmul of each input block by its codes, then the sums [in blocks, rows, out] scaled
    and added."""
    blocks, per = factors.shape
    o, rows = codes.shape[-1], x.shape[0]
    values = codes.float().view(blocks, -1, o)
    sums = torch.bmm(x.reshape(rows, blocks, -1).transpose(0, 1), values)
    return sums.view(blocks, rows, per, o // per).mul_(factors.view(blocks, 1, per, 1)).sum(0).view(rows, o)


def _block_columns(w: dict[str, torch.Tensor], name: str) -> int:
    """Output columns per scale block of weight `name` (1 for a float one)."""
    q = w.get(name + ".qweight")
    return 1 if q is None else q.shape[-1] // w[name + ".qscale"].shape[-1]


def _columns(w: dict[str, torch.Tensor], name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
    """Weight `name`'s output columns start..stop (whole scale blocks) as a weight of its own: views."""
    q = w.get(name + ".qweight")
    if q is None:
        return {name + ".weight": w[name + ".weight"][..., start:stop]}
    block = _block_columns(w, name)
    return {name + ".qweight": q[..., start:stop],
            name + ".qscale": w[name + ".qscale"][..., start // block:stop // block]}


def linear_groups(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """x [T, G, in] times each group's own output columns of weight `name` [in, G·out] (group g:
    columns g·out..): [T, G, out]. Each group is a `linear` of its own columns, so an FP8 or BF16
    one is a native product where `linear`'s are (a `dsv4::dense` call traced): dequantised whole
    in a program's graph, V4's grouped attention output (`attn.wo_a`, [512, 1024] FP8 at small)
    was widened every step by inductor's one-value-at-a-time FP8 conversion, a fifth of a decode
    step of small. Groups that split a scale block: dequantised whole, for one einsum."""
    groups = x.shape[1]
    cols = w.get(name + ".qweight", w.get(name + ".weight")).shape[-1]
    per = cols // groups
    if per % _block_columns(w, name):
        return torch.einsum("tgi,igo->tgo", x, weight(w, name).reshape(x.shape[-1], groups, per))
    return torch.stack([linear(_columns(w, name, g * per, (g + 1) * per), name, x[:, g]) for g in range(groups)], dim=1)
