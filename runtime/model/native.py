"""The products compiled natively, each weight byte decoded in registers into the rows' sums, never
a float copy of a weight (at most a 16 KiB panel of one): a layer's routed experts (FP4, every
used expert of a layer in one call a weight: `Native.grouped`), and the dense FP8 and BF16
weights of the programs, up to `dense_rows` rows (`Native.dense`, through `dsv4::dense`:
`runtime.model.ops.dense_calls`); their C++ in `runtime.model.native_fp4` and
`runtime.model.native_dense`.

Run eagerly, the decode alone takes several whole-tensor passes (`ops.fp4_weight`: about 300 us for
small's `[1024, 512]` expert weight on a Sapphire Rapids host, 2 threads); compiled by inductor, one
fused kernel of some forty vector instructions a code (about 200 us), and then the matmul reads the
float weight back. Here each code is an index into a table held in one vector register (AVX-512: a
16-lane permute, signs included; AVX2: an 8-lane one, the sign or-ed in; plain C elsewhere), times
the block's scale built from the E8M0 byte's bits: one weight's x @ W in 28 us for one row, 30 for
4, 45 for 8, 155 for 32 (decoded natively then multiplied by MKL: 62, 118, 159, 213); 16 rows' sums
a pass (AVX-512), each pass decoding again, at about 200 GFLOP/s on 2 cores from 16 rows up, MKL's
own rate at these shapes. With AVX2, from PANEL_ROWS rows of an expert on, a tile's columns are
decoded once per PANEL_K inputs into a float panel held in L1 and every row is multiplied over it
(`panel_avx2`): 2 AMD Zen 3 cores, a layer's experts of small at 32 rows each, 74 GFLOP/s a core
against 38 with the decode in registers. Each decoded weight is the eager decode's very number (both
products are exact; an E8M0 byte of 241 or more, a weight past 2^114, overflows the eager one's
float16 form); the products sum in another order than a GEMM, the same numbers to float32 rounding,
and each row on its own: a row's sums do not depend on the rows beside it.

This is compiled code: `experts.native`'s artifact on the cpu (`runtime.programs.catalog`), built by
the programs phase through the kernel cache like every program (its source, the flags and the
compiler in the key: `runtime.programs.spec.program_key`), and loaded only from the bytes the
cache verified (`load`). Plain C++ with no torch header, so it compiles in about a second; its
OpenMP loop runs on torch's own OpenMP runtime (the library is loaded after torch, whose
libgomp.so.1 then serves it), never a second thread pool spinning beside torch's.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import platform
import subprocess
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from runtime.model.native_dense import DENSE_MAX_BLOCK, DENSE_SOURCE, DENSE_TILE
from runtime.model.native_ffn import FFN_SOURCE
from runtime.model.native_fp4 import FP4_MAX_GROUP, FP4_SOURCE
from runtime.model.native_op import OP_SOURCE, op_flags

# the C++ of every native product: the FP4 experts' (`native_fp4`), the dense weights' after it
# (`native_dense`, which calls the FP4 source's helpers), a layer's routed experts' (`native_ffn`)
SOURCE = FP4_SOURCE + DENSE_SOURCE + FFN_SOURCE + OP_SOURCE
FFN_MAX_TOPK = 64  # the most choices a row `dsv4_fp4_ffn_out` sums (its per-row list)
FFN_SEEN = 256  # sets of experts' tensors `Native.ffn` remembers checked (a model's layers, a few times over)

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-x", "c++")


def compiler() -> str:
    """The C++ compiler every program is built with, whose version is in every key
    (`runtime.toolchain.cxx`)."""
    from runtime.toolchain import cxx

    found = cxx()
    if found is None:
        raise RuntimeError("no C++ compiler (CXX, g++, clang++) to build the native products")
    return found


def build(out: Path) -> None:
    """Compile SOURCE into the shared library `out` (with `dsv4::dense`'s kernel where torch has the
    stable ABI's headers: `native_op`)."""
    ops = op_flags()
    compile_flags, link_flags = [f for f in ops if f.startswith(("-D", "-I"))], [f for f in ops if f.startswith("-l")]
    search = [f for f in ops if f.startswith("-L")]
    with tempfile.TemporaryDirectory(prefix="dsv4-native-") as tmp:
        src = Path(tmp) / "native.cpp"
        src.write_text(SOURCE)
        done = subprocess.run([compiler(), *compile_flags, *search, *FLAGS, str(src), "-x", "none", "-o", str(out),
                               *link_flags], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"the native products did not compile ({platform.machine()}): {done.stderr.strip()[-2000:]}")


# the instruction sets a `Native` may use, at most (the library picks what the cpu has below it)
ISA_SCALAR, ISA_AVX2, ISA_BEST = 0, 1, 2
# The most rows `ops.dense` asks of `dsv4_dense`, by the instruction set it runs: with AVX-512 it
# reads the weight once per pass of 8 rows, so from some rows on a GEMM of the widened weight is the
# faster (`ops.dense` runs that then; on Sapphire Rapids from about 32 rows). With AVX2, from 4 rows
# on, each chunk of the weight is decoded once into a panel and every row multiplied over it
# (`dense_panel_avx2`; 2 rows a pass in registers before). A [1024, 512] FP8 weight on 2 AMD (Zen 3)
# cores, native against the eager widening + oneDNN GEMM, ms: 0.16 / 0.47 at 8 rows, 0.30 / 1.3 at
# 32, 1.6 / 2.6 at 256, 3.4 / 5.0 at 512, 7.5 / 7.8 at 1024 (a [1024, 1024] one: 27 / 17 there).
DENSE_MAX_ROWS = {ISA_SCALAR: 4, ISA_AVX2: 512, ISA_BEST: 32}
ISA_NAMES = {ISA_SCALAR: "plain C", ISA_AVX2: "AVX2", ISA_BEST: "AVX-512"}
_TORCH_ISA = {"AVX512": ISA_BEST, "AVX2": ISA_AVX2}  # torch.backends.cpu.get_cpu_capability()'s names


class Native:
    """`ops.NativeProducts` through the library loaded from verified bytes: a layer's routed experts'
    stacked weights (packed [experts, in/2, out], scale [experts, in/group, out], on the cpu,
    columns contiguous); anything else None, left to the eager way."""

    def __init__(self, library: ctypes.CDLL):
        self._library = library  # held: the functions live as long as their library
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._grouped = library.dsv4_fp4_grouped
        self._grouped.restype = None
        self._grouped.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ctypes.c_int,
                                  ctypes.c_int]
        self._dense = library.dsv4_dense
        self._dense.restype = None
        self._dense.argtypes = [ptr, i64, i64, ptr, i64, ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ctypes.c_int,
                                ctypes.c_int]
        self._ffn_in, self._ffn_out = library.dsv4_fp4_ffn_in, library.dsv4_fp4_ffn_out
        self._ffn_in.restype, self._ffn_out.restype = i64, None
        self._ffn_in.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr,
                                 ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._ffn_out.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr,
                                  ctypes.c_int, ctypes.c_int]
        self._cpu_isa = _TORCH_ISA.get(torch.backends.cpu.get_cpu_capability(), ISA_SCALAR)
        self._ffn_seen: dict[int, tuple] = {}  # `_ffn_weights`' checked sets
        # `dsv4::dense`'s kernel in the library (`native_op`), where it was built in
        self._ops = {name: getattr(library, name, None) for name in ("dsv4_ops_configure", "dsv4_ops_register",
                                                                      "dsv4_ops_release")}
        if self._ops["dsv4_ops_configure"] is not None:
            self._ops["dsv4_ops_configure"].argtypes = [ctypes.c_int, i64]
        self.isa = ISA_BEST

    @property
    def isa(self) -> int:
        """The instruction set the products may use, at most (tests lower it to reach every path)."""
        return self._isa

    @isa.setter
    def isa(self, isa: int) -> None:
        self._isa = isa
        if self._ops["dsv4_ops_configure"] is not None:  # the op's kernel multiplies as `dense` does
            self._ops["dsv4_ops_configure"](isa, self.dense_rows)

    def register_ops(self) -> bool:
        """Serve `dsv4::dense` on the cpu from this library (`native_op`) while it serves the
        process (`ops.use_native`); False where it was built without."""
        register = self._ops["dsv4_ops_register"]
        return register is not None and bool(register())

    def release_ops(self) -> None:
        """`dsv4::dense` back to its Python kernel."""
        if self._ops["dsv4_ops_release"] is not None:
            self._ops["dsv4_ops_release"]()

    @property
    def isa_name(self) -> str:
        """The instruction set the products run here."""
        return ISA_NAMES[min(self.isa, self._cpu_isa)]

    @property
    def dense_rows(self) -> int:
        """The most rows `dense` is the faster way for here (`DENSE_MAX_ROWS` of the instruction set it runs)."""
        return DENSE_MAX_ROWS[min(self.isa, self._cpu_isa)]

    @staticmethod
    def _takes(packed: torch.Tensor, scale: torch.Tensor) -> bool:
        return (packed.dim() == 2 and scale.dim() == 2 and packed.dtype == scale.dtype == torch.uint8
                and packed.is_cpu and scale.is_cpu and packed.stride(1) == 1 and scale.stride(1) == 1
                and packed.shape[1] == scale.shape[1] and scale.shape[0] > 0
                and packed.shape[0] % scale.shape[0] == 0  # whole bytes in each scale group
                and 2 * packed.shape[0] // scale.shape[0] <= FP4_MAX_GROUP)

    def grouped(self, x: torch.Tensor, ids: Sequence[int], starts: Sequence[int], packed: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor | None:
        """Rows x [pairs, in], expert ids[k]'s from starts[k] to starts[k + 1], each times its
        expert's weight of the stacks packed [experts, in/2, out] and scale [experts, in/group,
        out]: [pairs, out], every row fused (16 rows' sums a pass); None if these are not such.
        The ids and bounds are the host's own numbers (checked here: the C loop indexes by them),
        so a step of few rows pays no tensor op for them."""
        if (packed.dim() != 3 or scale.dim() != 3 or not 0 < packed.shape[0] == scale.shape[0]
                or not self._takes(packed[0], scale[0]) or x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu
                or x.shape[1] != 2 * packed.shape[1] or len(starts) != len(ids) + 1
                or not all(isinstance(v, int) and 0 <= v < packed.shape[0] for v in ids)
                or not (starts[0] == 0 and starts[-1] == x.shape[0] and all(map(operator.le, starts, starts[1:])))
                or not all(isinstance(v, int) for v in starts)):
            return None
        x = x.contiguous()
        out = torch.empty(x.shape[0], packed.shape[2], dtype=torch.float32)
        if out.numel():
            self.grouped_call(x, ids, starts, packed, scale, out)()
        return out

    def grouped_call(self, x: torch.Tensor, ids: Sequence[int], starts: Sequence[int], packed: torch.Tensor,
                     scale: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """`grouped`'s product into `out`, unchecked (`grouped` checks them), as a call to make
        again while these tensors live: what it passes the library made once (the products
        bench times the product alone, without `grouped`'s checks, some 20 us a call)."""
        _, half, cols = packed.shape
        return functools.partial(
            self._grouped, x.data_ptr(), (ctypes.c_int64 * len(ids))(*ids), (ctypes.c_int64 * len(starts))(*starts),
            len(ids), packed.data_ptr(), packed.stride(0), packed.stride(1), scale.data_ptr(), scale.stride(0),
            scale.stride(1), out.data_ptr(), half, cols, 2 * half // scale.shape[1], torch.get_num_threads(), self.isa)

    def _ffn_weights(self, w13: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, torch.Tensor]) -> tuple | None:
        """The experts' part of `ffn`'s checks and arguments, made once per set of tensors (a
        layer's experts are the same tensors every step: some 40 us of checks a layer a step in
        Python otherwise) and found again by identity and data pointer (weak references: the
        cache keeps no weight alive); None where they are not such."""
        tensors = (*w13, *w2)
        seen = self._ffn_seen.get(id(tensors[0]))
        if seen is not None and all(r() is t and t.data_ptr() == ptr for r, t, ptr in zip(seen[0], tensors, seen[1],
                                                                                            strict=True)):
            return seen[2]
        p1, q1, p3, q3, p2, q2 = tensors
        if (p1.dim() != 3 or p2.dim() != 3 or q1.dim() != 3 or q2.dim() != 3 or p1.shape != p3.shape
                or q1.shape != q3.shape or p1.stride() != p3.stride() or q1.stride() != q3.stride()
                or not 0 < p1.shape[0] == q1.shape[0] or p2.shape[0] != p1.shape[0] or q2.shape[0] != p1.shape[0]
                or p2.shape[2] != 2 * p1.shape[1] or 2 * p2.shape[1] != p1.shape[2]
                or not all(self._takes(p[0], q[0]) for p, q in ((p1, q1), (p3, q3), (p2, q2)))):
            return None
        args = ((p1.data_ptr(), q1.data_ptr(), p3.data_ptr(), q3.data_ptr(), p1.stride(0), p1.stride(1), q1.stride(0),
                 q1.stride(1), 2 * p1.shape[1] // q1.shape[1], p1.shape[2]),
                (p2.data_ptr(), q2.data_ptr(), p2.stride(0), p2.stride(1), q2.stride(0), q2.stride(1),
                 2 * p2.shape[1] // q2.shape[1], p1.shape[2]), p1.shape[0], p1.shape[2], p2.shape[2])
        if len(self._ffn_seen) >= FFN_SEEN:
            self._ffn_seen.clear()
        self._ffn_seen[id(p1)] = (tuple(weakref.ref(t) for t in tensors), tuple(t.data_ptr() for t in tensors), args)
        return args

    def ffn(self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w13: tuple[torch.Tensor, ...],
            w2: tuple[torch.Tensor, torch.Tensor], swiglu) -> torch.Tensor | None:
        """A layer's routed experts over rows x [rows, hidden] with their choices idx [rows, k]
        (local ids; outside 0..n-1 skipped) and gates [rows, k]: w13 = (w1, w1's scale, w3, w3's
        scale) [n, hidden/2, inter] / [n, hidden/group, inter], w2 = (w2, its scale) [n, inter/2,
        hidden], `swiglu(a, b)` the activation between them (torch's): each row's gate-weighted sum
        of its experts' outputs [rows, hidden], `native_ffn`'s two calls; None if these are not such."""
        if (x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu or idx.dim() != 2 or idx.shape[0] != x.shape[0]
                or idx.dtype != torch.int64 or not idx.is_cpu or gates.shape != idx.shape
                or gates.dtype != torch.float32 or not gates.is_cpu or not 0 < idx.shape[1] <= FFN_MAX_TOPK):
            return None
        weights = self._ffn_weights(w13, w2)
        rows, hidden = x.shape
        if weights is None or weights[4] != hidden:
            return None
        args_in, args_out, n, inter, _ = weights
        if rows == 0:
            return torch.zeros(0, hidden)
        x, idx, gates = x.contiguous(), idx.contiguous(), gates.contiguous()
        k = idx.shape[1]
        choices = rows * k
        plan = torch.empty(2 * choices + 2 * n + 2, dtype=torch.int64)
        scratch = torch.empty(choices * (hidden + 2 * inter), dtype=torch.float32)
        threads, at = torch.get_num_threads(), scratch.data_ptr()
        pairs = self._ffn_in(x.data_ptr(), rows, hidden, idx.data_ptr(), k, n, *args_in, plan.data_ptr(), at,
                             at + 4 * choices * hidden, at + 4 * choices * (hidden + inter), threads, self.isa)
        a = scratch[choices * hidden:choices * hidden + pairs * inter].view(pairs, inter)
        b = scratch[choices * (hidden + inter):choices * (hidden + inter) + pairs * inter].view(pairs, inter)
        act = swiglu(a, b).contiguous()
        out = torch.empty(rows, hidden, dtype=torch.float32)
        # the gathered rows are spent: w2's outputs take their place at the scratch's start
        self._ffn_out(act.data_ptr(), rows, hidden, gates.data_ptr(), k, n, *args_out, plan.data_ptr(), at,
                      out.data_ptr(), threads, self.isa)
        return out

    def dense(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [rows, in] @ w [in, out] for a BF16 weight, or an FP8 (e4m3) one with its E8M0 block
        scales [in / bi, out / bo] (bo a multiple of DENSE_TILE), every weight read once from memory
        and widened in registers (`dsv4_dense`); None if these are not such, left to the eager way —
        so is a weight narrower than a tile at more rows than the plain C path serves (it would run
        column by column: a `[1024, 16]` one at 256 rows took 2 ms, widened for a GEMM 0.17)."""
        if (x.dim() != 2 or w.dim() != 2 or x.dtype != torch.float32 or not (x.is_cpu and w.is_cpu)
                or x.shape[1] != w.shape[0] or w.stride(1) != 1 or w.shape[1] == 0
                or (w.shape[1] < DENSE_TILE and x.shape[0] > DENSE_MAX_ROWS[ISA_SCALAR])):
            return None
        fp8 = w.dtype == torch.float8_e4m3fn
        if fp8:
            if (scale is None or scale.dim() != 2 or scale.dtype != torch.uint8 or not scale.is_cpu
                    or scale.stride(1) != 1 or not 0 < scale.shape[0] <= w.shape[0] or scale.shape[1] <= 0
                    or w.shape[0] % scale.shape[0] or w.shape[1] % scale.shape[1]
                    or (w.shape[1] // scale.shape[1]) % DENSE_TILE or w.shape[0] // scale.shape[0] > DENSE_MAX_BLOCK):
                return None
        elif w.dtype != torch.bfloat16 or scale is not None:
            return None
        x = x.contiguous()
        rows, cols = x.shape[0], w.shape[1]
        out = torch.empty(rows, cols, dtype=torch.float32)
        if out.numel():
            bi, bo = (w.shape[0] // scale.shape[0], cols // scale.shape[1]) if fp8 else (1, 1)
            self._dense(x.data_ptr(), rows, w.shape[0], w.data_ptr(), w.stride(0), int(fp8),
                        scale.data_ptr() if fp8 else None, scale.stride(0) if fp8 else 0, bi, bo, out.data_ptr(),
                        cols, torch.get_num_threads(), self.isa)
        return out


def load(data: bytes) -> Native:
    """The library from verified bytes: written to a private (0600) temp file only while it is
    dlopened, never loaded from a path that could change since (as `build._load_aoti`)."""
    with tempfile.NamedTemporaryFile(prefix="dsv4-native-", suffix=".so") as f:
        f.write(data)
        f.flush()
        return Native(ctypes.CDLL(f.name, mode=ctypes.RTLD_LOCAL))
