"""The products compiled natively, each weight byte decoded in registers into the rows' sums, never
a float copy of a weight (at most a 16 KiB panel of one): a layer's routed experts (FP4, every
used expert of a layer in one call a weight: `Native.grouped`), and the dense FP8 and BF16
weights of the programs, at few rows (`Native.dense`, through `dsv4::dense`:
`runtime.model.ops.dense_calls`; its C++ in `runtime.model.native_dense`).

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
import operator
import platform
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from runtime.model.native_dense import DENSE_SOURCE, DENSE_TILE

# the C++ of every native product: the FP4 experts' here, the dense weights' after it (`native_dense`)
SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

/* 2^(s - 127) for an E8M0 byte s, exactly: its bits (s = 0: the subnormal 2^-127) */
static inline float e8m0(uint8_t s) {
    uint32_t bits = s ? (uint32_t)s << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* what this cpu runs: 2 AVX-512, 1 AVX2 + FMA, 0 neither; `isa` arguments cap it (tests reach
   every path on one host) */
static int cpu_isa(void) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

#if defined(__x86_64__)
/* the E8M0 scales of 8 columns (s) as floats, 2^(s - 127) exactly (as `e8m0`) */
__attribute__((target("avx2,fma")))
static inline __m256 scale8_avx2(const uint8_t *s) {
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000),
                                                  _mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
}

/* 8 bytes of a byte row (p), times their columns' scales (`scale8_avx2`) -> the low nibbles' values
   and the high ones': an 8-entry table of magnitudes in one register (the permute reads an index's
   low 3 bits only), the sign or-ed in */
__attribute__((target("avx2,fma")))
static inline void decode8_avx2(const uint8_t *p, __m256 scale, __m256 *lo, __m256 *hi) {
    const __m256 table = _mm256_loadu_ps(E2M1);
    const __m256i eight = _mm256_set1_epi32(8);
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i h = _mm256_srli_epi32(b, 4);
    __m256 vl = _mm256_or_ps(_mm256_permutevar8x32_ps(table, b),
                             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, eight), 28)));
    __m256 vh = _mm256_or_ps(_mm256_permutevar8x32_ps(table, h),
                             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(h, eight), 28)));
    *lo = _mm256_mul_ps(vl, scale);
    *hi = _mm256_mul_ps(vh, scale);
}
#endif

/* rows x [R <= 4, 2 half] (contiguous) times the weight: out [R, cols] (contiguous) for the 16
   columns o..o+15, each byte row decoded once, in registers, into every row's sums (the scales once
   a block). Two sums a row, of 8 columns each, so two chains of fused multiply-adds run at once: one
   row's sums of 8 columns a pass waited on each FMA's latency (small's expert weights at one row,
   32 at once on 2 AMD Zen 3 cores: 58 -> 35 us a weight; the scale's bits once a block, not once a
   byte row, and no mask before the permute: part of it). */
#if defined(__x86_64__)
template <int R>
__attribute__((target("avx2,fma")))
static void tile_avx2(const float *x, const uint8_t *packed, int64_t ld_packed, const uint8_t *scale, int64_t ld_scale,
                      float *out, int64_t half, int64_t cols, int64_t group, int64_t o) {
    const int64_t in = 2 * half, per_block = group / 2;
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < half; j0 += per_block) {
        const uint8_t *s = scale + (2 * j0 / group) * ld_scale + o;
        const __m256 s0 = scale8_avx2(s), s1 = scale8_avx2(s + 8);
        for (int64_t j = j0; j < j0 + per_block; j++) {
            __m256 l0, h0, l1, h1;
            _mm_prefetch((const char *)(packed + (j + 16) * ld_packed + o), _MM_HINT_T0);  /* as tile_avx512 */
            decode8_avx2(packed + j * ld_packed + o, s0, &l0, &h0);
            decode8_avx2(packed + j * ld_packed + o + 8, s1, &l1, &h1);
            for (int r = 0; r < R; r++) {
                const __m256 xl = _mm256_set1_ps(x[r * in + 2 * j]), xh = _mm256_set1_ps(x[r * in + 2 * j + 1]);
                acc[r][0] = _mm256_fmadd_ps(xl, l0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xl, l1, acc[r][1]);
                acc[r][0] = _mm256_fmadd_ps(xh, h0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xh, h1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * cols + o, acc[r][0]);
        _mm256_storeu_ps(out + r * cols + o + 8, acc[r][1]);
    }
}
#endif

/* the same for 16 columns and R rows (R <= 16, a constant: the sums stay in registers) with
   AVX-512: a 16-entry table (signs included) in one register. Each decoded vector is scaled once
   (by a power of two: exact) and used by every row, so a row's sums are the same whatever rows
   share its pass. The bytes 16 rows ahead are prefetched: a tile reads 16 of each 64-byte line, a
   row of the weight apart, which the hardware's prefetchers do not follow across pages (a layer's
   experts cold in the cache: 6.7 ms a weight of small's 256-row step without, 5.3 with). */
#if defined(__x86_64__)
template <int R>
__attribute__((target("avx512f")))
static void tile_avx512(const float *x, const uint8_t *packed, int64_t ld_packed, const uint8_t *scale,
                        int64_t ld_scale, float *out, int64_t half, int64_t cols, int64_t group, int64_t o) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    const __m512i fifteen = _mm512_set1_epi32(15), tiny = _mm512_set1_epi32(0x00400000);
    const int64_t in = 2 * half, per_block = group / 2;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < half; j0 += per_block) {
        __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(scale + (2 * j0 / group) * ld_scale + o)));
        __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
        const __m512 sc = _mm512_castsi512_ps(_mm512_mask_blend_epi32(zero, _mm512_slli_epi32(e, 23), tiny));
        for (int64_t j = j0; j < j0 + per_block; j++) {
            _mm_prefetch((const char *)(packed + (j + 16) * ld_packed + o), _MM_HINT_T0);
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(packed + j * ld_packed + o)));
            __m512 vl = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, fifteen), table), sc);
            __m512 vh = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), sc);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * in + 2 * j]), vl, acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * in + 2 * j + 1]), vh, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * cols + o, acc[r]);
}

template <int R>
__attribute__((target("avx512f")))
static void rows_avx512(const float *x, int64_t rows, const uint8_t *packed, int64_t ld_packed, const uint8_t *scale,
                        int64_t ld_scale, float *out, int64_t half, int64_t cols, int64_t group, int64_t o) {
    if (rows == R) {
        tile_avx512<R>(x, packed, ld_packed, scale, ld_scale, out, half, cols, group, o);
    } else if constexpr (R > 1) {
        rows_avx512<R - 1>(x, rows, packed, ld_packed, scale, ld_scale, out, half, cols, group, o);
    }
}
#endif

static void column_scalar(const float *x, int64_t rows, const uint8_t *packed, int64_t ld_packed, const uint8_t *scale,
                          int64_t ld_scale, float *out, int64_t half, int64_t cols, int64_t group, int64_t o) {
    const int64_t in = 2 * half;
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t j = 0; j < half; j++) {
            uint8_t b = packed[j * ld_packed + o];
            float sc = e8m0(scale[(2 * j / group) * ld_scale + o]);
            acc += x[r * in + 2 * j] * (E2M1[b & 15] * sc);
            acc += x[r * in + 2 * j + 1] * (E2M1[b >> 4] * sc);
        }
        out[r * cols + o] = acc;
    }
}

/* many rows with AVX2: a tile's 16 columns decoded once per PANEL_K inputs into a float panel (16
   KiB: it stays in L1), then every row's sums over it, 4 rows a pass: 8 sums in registers, 6 loads
   (2 of the panel, 4 of x) for 8 FMAs. The in-register decode above pays a load of x for every FMA
   and decodes again every 8 rows: on 2 AMD (Zen 3) cores a layer's 32 experts of small at 32 rows
   each ran at 38 GFLOP/s a core that way, 74 so (MKL's float32 GEMM: 85). Six rows a pass (12
   sums) left GCC two sums short of registers: spilled, half the speed. Each sum is the in-register
   one's to the bit: the same decoded values, fused multiply-adds in the same order. */
#define PANEL_K 256
#define PANEL_ROWS 5 /* from these rows of an expert on (fewer: the in-register pass is as fast) */
#if defined(__x86_64__)
template <int R>
__attribute__((target("avx2,fma")))
static void panel_pass_avx2(const float *x, int64_t in, const float *panel, int64_t kn, float *out, int64_t cols,
                            int first) {
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * cols);
        acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * cols + 8);
    }
    for (int64_t k = 0; k < kn; k++) {
        const __m256 w0 = _mm256_load_ps(panel + 16 * k), w1 = _mm256_load_ps(panel + 16 * k + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * in + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * cols, acc[r][0]);
        _mm256_storeu_ps(out + r * cols + 8, acc[r][1]);
    }
}

/* every row of x [rows, in] (from its input k0: x points there) over a panel of kn inputs, into
   out [rows, cols] (from the panel's column: out points there), 4 rows a pass */
__attribute__((target("avx2,fma")))
static void panel_rows_avx2(const float *x, int64_t rows, int64_t in, const float *panel, int64_t kn, float *out,
                            int64_t cols, int first) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const float *xr = x + r0 * in;
        float *outr = out + r0 * cols;
        switch (rows - r0 < 4 ? rows - r0 : 4) {
            case 1: panel_pass_avx2<1>(xr, in, panel, kn, outr, cols, first); break;
            case 2: panel_pass_avx2<2>(xr, in, panel, kn, outr, cols, first); break;
            case 3: panel_pass_avx2<3>(xr, in, panel, kn, outr, cols, first); break;
            default: panel_pass_avx2<4>(xr, in, panel, kn, outr, cols, first); break;
        }
    }
}

__attribute__((target("avx2,fma")))
static void panel_avx2(const float *x, int64_t rows, const uint8_t *packed, int64_t ld_packed, const uint8_t *scale,
                       int64_t ld_scale, float *out, int64_t half, int64_t cols, int64_t group, int64_t o) {
    alignas(32) float panel[PANEL_K * 16];
    const int64_t in = 2 * half;
    for (int64_t k0 = 0; k0 < in; k0 += PANEL_K) {
        const int64_t kn = in - k0 < PANEL_K ? in - k0 : PANEL_K;  /* even: k0 and in are */
        for (int64_t j = k0 / 2; j < (k0 + kn) / 2; j++) {
            __m256 l0, h0, l1, h1;
            const uint8_t *s = scale + (2 * j / group) * ld_scale + o;
            _mm_prefetch((const char *)(packed + (j + 16) * ld_packed + o), _MM_HINT_T0);  /* as tile_avx512 */
            decode8_avx2(packed + j * ld_packed + o, scale8_avx2(s), &l0, &h0);
            decode8_avx2(packed + j * ld_packed + o + 8, scale8_avx2(s + 8), &l1, &h1);
            float *p = panel + 16 * (2 * j - k0);
            _mm256_store_ps(p, l0);
            _mm256_store_ps(p + 8, l1);
            _mm256_store_ps(p + 16, h0);
            _mm256_store_ps(p + 24, h1);
        }
        panel_rows_avx2(x + k0, rows, in, panel, kn, out + o, cols, k0 == 0);
    }
}
#endif

/* a tile is 16 columns with AVX-512 or AVX2 (the sums of up to 16 rows a pass with AVX-512; of up
   to 4, or of a panel, with AVX2), else 8 */
static int64_t tile_width(int avx512, int avx2) { return avx512 || avx2 ? 16 : 8; }

/* columns o..o+width-1 (one tile) of x [rows, 2 half] (contiguous) times the weight into out
   [rows, cols] (contiguous): a pass of rows at a time (each pass decodes the bytes again), or with
   AVX2 from PANEL_ROWS rows on, one panel at a time */
static void tile_rows(const float *x, int64_t rows, const uint8_t *packed, int64_t ld_packed, const uint8_t *scale,
                      int64_t ld_scale, float *out, int64_t half, int64_t cols, int64_t group, int64_t o, int avx512,
                      int avx2) {
#if defined(__x86_64__)
    if (avx2 && !avx512 && rows >= PANEL_ROWS) {
        panel_avx2(x, rows, packed, ld_packed, scale, ld_scale, out, half, cols, group, o);
        return;
    }
#endif
    /* as few passes as a pass's rows allow (16 with AVX-512, 4 with AVX2), as even as they go (42
       rows: 14, 14, 14, not 16, 16, 10): a pass of few rows costs nearly a full one */
    const int64_t width = tile_width(avx512, avx2), per_pass = avx512 ? 16 : avx2 ? 4 : 8;
    const int64_t passes = (rows + per_pass - 1) / per_pass;
    for (int64_t p = 0, r0 = 0; p < passes; p++) {
        const float *xr = x + r0 * 2 * half;
        float *outr = out + r0 * cols;
        const int64_t n = (rows - r0 + passes - p - 1) / (passes - p);
        r0 += n;
#if defined(__x86_64__)
        if (avx512) {
            rows_avx512<16>(xr, n, packed, ld_packed, scale, ld_scale, outr, half, cols, group, o);
            continue;
        }
        if (avx2) {
            switch (n) {
                case 1: tile_avx2<1>(xr, packed, ld_packed, scale, ld_scale, outr, half, cols, group, o); break;
                case 2: tile_avx2<2>(xr, packed, ld_packed, scale, ld_scale, outr, half, cols, group, o); break;
                case 3: tile_avx2<3>(xr, packed, ld_packed, scale, ld_scale, outr, half, cols, group, o); break;
                default: tile_avx2<4>(xr, packed, ld_packed, scale, ld_scale, outr, half, cols, group, o); break;
            }
            continue;
        }
#endif
        for (int64_t c = o; c < o + width; c++)
            column_scalar(xr, n, packed, ld_packed, scale, ld_scale, outr, half, cols, group, c);
    }
}

/* the routed experts of a layer, grouped by expert: x [pairs, 2 half] holds expert ids[k]'s rows
   from starts[k] to starts[k + 1]; each times its expert's weight (packed + ids[k] * packed_stride,
   scale + ids[k] * scale_stride) into out [pairs, cols]. One parallel loop over (expert, tile):
   the experts' rows differ, so the units are handed out as threads free up. */
extern "C" void dsv4_fp4_grouped(const float *x, const int64_t *ids, const int64_t *starts, int64_t used,
                                 const uint8_t *packed, int64_t packed_stride, int64_t ld_packed, const uint8_t *scale,
                                 int64_t scale_stride, int64_t ld_scale, float *out, int64_t half, int64_t cols,
                                 int64_t group, int threads, int isa) {
    const int avx512 = isa >= 2 && cpu_isa() >= 2, avx2 = isa >= 1 && cpu_isa() >= 1;
    const int64_t width = tile_width(avx512, avx2), tiles = cols / width;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 4) nowait
        for (int64_t u = 0; u < used * tiles; u++) {
            const int64_t k = u / tiles, e = ids[k];
            tile_rows(x + starts[k] * 2 * half, starts[k + 1] - starts[k], packed + e * packed_stride, ld_packed,
                      scale + e * scale_stride, ld_scale, out + starts[k] * cols, half, cols, group,
                      width * (u % tiles), avx512, avx2);
        }
#pragma omp for schedule(static)
        for (int64_t k = 0; k < used; k++)
            for (int64_t o = width * tiles; o < cols; o++)
                column_scalar(x + starts[k] * 2 * half, starts[k + 1] - starts[k], packed + ids[k] * packed_stride,
                              ld_packed, scale + ids[k] * scale_stride, ld_scale, out + starts[k] * cols, half, cols,
                              group, o);
    }
}
""" + DENSE_SOURCE

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-x", "c++")


def compiler() -> str:
    """The C++ compiler every program is built with, whose version is in every key
    (`runtime.programs.toolchain.cxx`)."""
    from runtime.programs.toolchain import cxx

    found = cxx()
    if found is None:
        raise RuntimeError("no C++ compiler (CXX, g++, clang++) to build the native products")
    return found


def build(out: Path) -> None:
    """Compile SOURCE into the shared library `out`."""
    with tempfile.TemporaryDirectory(prefix="dsv4-native-") as tmp:
        src = Path(tmp) / "native.cpp"
        src.write_text(SOURCE)
        done = subprocess.run([compiler(), *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)
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
        self.isa = ISA_BEST
        self._cpu_isa = _TORCH_ISA.get(torch.backends.cpu.get_cpu_capability(), ISA_SCALAR)

    @property
    def dense_rows(self) -> int:
        """The most rows `dense` is the faster way for here (`DENSE_MAX_ROWS` of the instruction set it runs)."""
        return DENSE_MAX_ROWS[min(self.isa, self._cpu_isa)]

    @staticmethod
    def _takes(packed: torch.Tensor, scale: torch.Tensor) -> bool:
        return (packed.dim() == 2 and scale.dim() == 2 and packed.dtype == scale.dtype == torch.uint8
                and packed.is_cpu and scale.is_cpu and packed.stride(1) == 1 and scale.stride(1) == 1
                and packed.shape[1] == scale.shape[1] and scale.shape[0] > 0
                and (2 * packed.shape[0]) % (2 * scale.shape[0]) == 0)  # whole bytes in each scale block

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
        _, half, cols = packed.shape
        out = torch.empty(x.shape[0], cols, dtype=torch.float32)
        if out.numel():
            self._grouped(x.data_ptr(), (ctypes.c_int64 * len(ids))(*ids), (ctypes.c_int64 * len(starts))(*starts),
                          len(ids), packed.data_ptr(), packed.stride(0), packed.stride(1), scale.data_ptr(),
                          scale.stride(0), scale.stride(1), out.data_ptr(), half, cols, 2 * half // scale.shape[1],
                          torch.get_num_threads(), self.isa)
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
                    or (w.shape[1] // scale.shape[1]) % DENSE_TILE):
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
