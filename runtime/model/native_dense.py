"""The dense product of `runtime.model.native`'s library (`Native.dense`, C entry `dsv4_dense`), its C++
source appended to the FP4 products' (`native.SOURCE`, which the library's key holds).

A program dequantising an FP8 weight in its graph writes it whole as float32 and reads it back
(the BF16 head: 128 MiB a step at small, 10.5 ms). Here each weight byte is widened where it
multiplies: an FP8 byte put in the high byte of a float16's bits (a byte shuffle), shifted one
down with its sign kept and masked (then exactly the byte's value times 2^-8, subnormals
included) and widened by the cpu's float16 conversion (F16C); a BF16 value by a shift. Some 4
vector instructions for 16 weights, where placing the byte in a float32's bits took 8 for 8
(a `[1024, 1024]` FP8 weight at one row on an AMD Zen 3 core, warm in L3: 2.4 GB/s before, 12
so). With AVX2 and up to 4 rows, an FP8 byte is instead placed in a float32's bits (value ·
2^-120: a sign extension, a shift and a mask, no conversion) against inputs scaled by 2^112, the
very same products (`dense_low`): 11 → 18 GB/s a Zen 3 core in L1. Sums of up to RMAX rows are
held in registers, each widened vector multiplied into every row, a block's rows a few at a time
across a slab of columns so each weight row's bytes are read as one run (tile by tile down a
block's rows read a line a row: a Zen 3 core read the BF16 head at 12 GB/s so, 19 in runs); more
rows widen a block of two units (32 columns, each weight row's bytes of them one run) once into
float panels in L1 and multiply a few rows at a time over each.

The order of a row's sums, one on every path and at every row count (a row's numbers never depend
on the rows beside it): FP8, each scale block's products summed from zero in input order, then
folded into the running sum in block order, `acc = p · 2^(s-119) + acc` (one rounding; the first
block `p · 2^(s-119)`; a block scale byte above 246, whose factor has no float32, `(p · 256) ·
2^(s-127)`, the same number); BF16, one chain of fused multiply-adds in input order. Threads take
contiguous column ranges; a weight under DENSE_PARALLEL_BYTES runs on the calling thread alone (a
team's start and barrier cost more than half its time; on a shared host, a thread descheduled at
a barrier costs a scheduler slice; from 64 KiB on two threads measured faster: 24 → 20 us for a
`[512, 256]` FP8 weight at one row, its team's workers spinning between a step's calls). The FP8
decode assumes subnormal floats are kept (torch's default: `torch.set_flush_denormal(True)` would
zero FP8's subnormals here).
"""

from runtime.model.native_fp4 import per_isa

DENSE_TILE = 16  # the columns of a vector unit of `dsv4_dense`: an FP8 scale block holds whole units
DENSE_MAX_BLOCK = 256  # an FP8 scale block's rows, at most (its DENSE_MAX_BLOCK: a panel's)

DENSE_HEAD = r"""
/* ---- dense weights [in, cols]: BF16, or FP8 (e4m3) with E8M0 scales per (bi x bo) block ---- */
#define DENSE_FP8 1
#define DENSE_FP8_LOW 2          /* FP8 widened as value · 2^-120 against inputs · 2^112 (`dense_low`) */
#define DENSE_UNIT 16              /* columns a vector unit widens */
#define DENSE_KB 8                /* BF16's input block: rows of the weight a tile runs before the next tile */
#define DENSE_PANEL_KB 64          /* BF16's input block through panels */
#define DENSE_PANEL_UNITS 2        /* units a panel widens at once: FP8 at 5-16 rows on a Zen 3 core 9-16 % faster
                                      than one (two cores from memory 3-14 %); four (32 KiB of panels) no faster */
#define DENSE_GROUPS 2             /* BF16's groups of RMAX rows in registers before panels (each widens again):
                                      the head at 8 rows 9.9 -> 6.9 ms; FP8's panels stay faster from RMAX rows */
#define DENSE_FP8_PASS 8           /* FP8's rows of a block a pass across a slab, rows in registers */
#define DENSE_FP8_SLAB 1024        /* FP8's slab (columns): DENSE_SLAB / its block of 128 rows, at most */
#define DENSE_MAX_BLOCK 256        /* FP8's input block (its scale block), at most: a panel's rows */
#define DENSE_PARALLEL_BYTES (64 << 10)
#define DENSE_LOW_ROWS 4          /* AVX2's FP8 rows in registers (DenseAvx2::RMAX): `fp8_low`'s */
#define DENSE_SLAB (128 << 10)       /* bytes of a block's rows of a thread's columns at a time */
static const float DENSE_256 = 256.f;

/* the factor of an FP8 block sum of values · 2^-8 (`dense_fold`): 2^(s - 119); 0 where it has no
   float32 (s > 246: then `dense_fold` multiplies by 256 first) */
static inline float dense_factor(uint8_t s) { return s > 246 ? 0.f : e8m0(s) * 256.f; }

static inline float dense_scalar_value(const uint8_t *w, int64_t k, int kind) {
    uint32_t bits;
    float f;
    if (kind == DENSE_FP8) {  /* the float16 bits of value · 2^-8, widened by hand */
        const uint8_t b = w[k];
        const int e = (b >> 3) & 15, m = b & 7;
        f = e ? (float)(8 + m) * e8m0((uint8_t)(e + 109)) : (float)m * e8m0(110);  /* (8+m)·2^(e-18), m·2^-17 */
        return b & 0x80 ? -f : f;
    }
    uint16_t h;
    memcpy(&h, w + 2 * k, sizeof h);
    bits = (uint32_t)h << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__x86_64__)
/* the byte shuffle putting 16 bytes (both lanes hold them) each in the high byte of a 16-bit word */
#define DENSE_HIGH(k) (char)0x80, (char)(k)
struct DenseAvx2 {
    enum { DV = 2, RMAX = 4, PR = 4 };
    /* R rows: tiles of NT units, NT · DV · R <= 8 sums in registers */
    static constexpr int nt(int r) { return r == 1 ? 4 : r == 2 ? 2 : 1; }
    __attribute__((target("avx2,fma,f16c"))) static inline void fp8(const uint8_t *p, __m256 *d) {
        const __m256i at = _mm256_setr_epi8(DENSE_HIGH(0), DENSE_HIGH(1), DENSE_HIGH(2), DENSE_HIGH(3), DENSE_HIGH(4),
                                            DENSE_HIGH(5), DENSE_HIGH(6), DENSE_HIGH(7), DENSE_HIGH(8), DENSE_HIGH(9),
                                            DENSE_HIGH(10), DENSE_HIGH(11), DENSE_HIGH(12), DENSE_HIGH(13),
                                            DENSE_HIGH(14), DENSE_HIGH(15));
        const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
        /* word = byte << 8; arithmetic shift 1: sign in 15 and 14, exponent and mantissa in 7-13; the
           mask clears 14: float16 bits of value · 2^-8 */
        const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_shuffle_epi8(b, at), 1),
                                           _mm256_set1_epi16((short)0xBF80));
        d[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        d[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
    /* 16 FP8 bytes as floats of value · 2^-120, exactly: each byte sign-extended to 32 bits and
       shifted up 20 puts its sign in bit 31 and its exponent and mantissa in a float32's low
       exponent and high mantissa bits; the mask clears the sign's copies (a zero exponent is then
       float32's subnormal, the same value). Three integer instructions for 8 weights, where the
       float16 conversion above (two per 16 weights) held a Zen 3 core to 11 GB/s in L1, 18 so */
    __attribute__((target("avx2,fma,f16c"))) static inline void fp8_low(const uint8_t *p, __m256 *d) {
        const __m256i m = _mm256_set1_epi32((int)0x87F00000u);
        for (int k = 0; k < 2; k++)
            d[k] = _mm256_castsi256_ps(_mm256_and_si256(
                _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * k))), 20), m));
    }
    __attribute__((target("avx2,fma,f16c"))) static inline void bf16(const uint8_t *p, __m256 *d) {
        for (int k = 0; k < 2; k++)
            d[k] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * k))), 16));
    }
};

struct DenseAvx512 {
    enum { DV = 1, RMAX = 8, PR = 8 };
    static constexpr int nt(int r) { return r <= 2 ? 4 : 2; }
    __attribute__((target("avx512f,avx2,fma,f16c"))) static inline void fp8(const uint8_t *p, __m512 *d) {
        const __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
        d[0] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xBF80)));
    }
    __attribute__((target("avx512f,avx2,fma,f16c"))) static inline void fp8_low(const uint8_t *p, __m512 *d) {
        d[0] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)p)), 20), _mm512_set1_epi32((int)0x87F00000u)));
    }
    __attribute__((target("avx512f,avx2,fma,f16c"))) static inline void bf16(const uint8_t *p, __m512 *d) {
        d[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)),
                                                     16));
    }
};
#endif
"""

# One ISA's dense kernels (`native_fp4.per_isa`: the vector primitives `V` of `native_fp4`, the
# widening `D` of DENSE_HEAD). A tile of NT units, R rows, weight rows b0..b0+kb (one block):
# the block's sums in registers (FP8 from zero, folded into `out`; BF16 from `out`'s running
# sums), the next block's rows of the tile prefetched into L2 as it goes.
DENSE_KERNELS = r"""
namespace NK_NS {
typedef NK_V V;
typedef V::F F;
typedef NK_D D;

/* out = the block's sums p folded in (FP8: p times the block's factor f; BF16: p is the sum) */
NK_ATTR static inline void dense_fold(float *q, F p, F f, int first, int fp8, int big) {
    if (!fp8) V::store(q, p);
    else if (big) V::store(q, first ? V::mul(V::mul(p, V::bcast(&DENSE_256)), f)
                                    : V::fma(V::mul(p, V::bcast(&DENSE_256)), f, V::load(q)));
    else V::store(q, first ? V::mul(p, f) : V::fma(p, f, V::load(q)));
}

/* Rows i0..i0+n of the block b0..b0+kb. FP8: the block's sums start from zero at its first row,
   go on through `part` (row stride ldp) between passes, and are folded into `out` at its last;
   BF16: one chain through `out`. */
template <int R, int NT, int KIND>
NK_ATTR static void dense_regs(const float *x, int64_t in, const uint8_t *w, int64_t ld, const uint8_t *sc,
                               int64_t lds, int64_t bi, int64_t bo, float *out, int64_t cols, int64_t o, int64_t b0,
                               int64_t kb, int64_t i0, int64_t n, float *part, int64_t ldp) {
    constexpr int N = NT * D::DV, B = KIND ? 1 : 2;  /* vectors a row, bytes a weight */
    F p[R][N];
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 16") for (int v = 0; v < N; v++)
            p[r][v] = KIND ? (i0 == b0 ? V::zero() : V::load(part + r * ldp + V::W * v))
                           : (i0 == 0 ? V::zero() : V::load(out + r * cols + o + V::W * v));
    const uint8_t *row = w + B * (i0 * ld + o);
    /* the lines the tile's bytes of a row start (or cross into), once each: the next block's prefetched */
    const int64_t first = (64 - (B * o) % 64) % 64, span = B * DENSE_UNIT * NT;
    for (int64_t i = i0; i < i0 + n; i++, row += B * ld) {
        F d[N];
        for (int64_t a = first; a < span; a += 64) _mm_prefetch((const char *)(row + B * kb * ld + a), _MM_HINT_T1);
        _Pragma("GCC unroll 16") for (int t = 0; t < NT; t++) {
            if (KIND == DENSE_FP8_LOW) D::fp8_low(row + DENSE_UNIT * t, d + D::DV * t);
            else if (KIND) D::fp8(row + DENSE_UNIT * t, d + D::DV * t);
            else D::bf16(row + 2 * DENSE_UNIT * t, d + D::DV * t);
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            const F xv = V::bcast(x + r * in + i);
            _Pragma("GCC unroll 16") for (int v = 0; v < N; v++) p[r][v] = V::fma(xv, d[v], p[r][v]);
        }
    }
    if (KIND && i0 + n < b0 + kb) {  /* the block goes on in the next pass */
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 16") for (int v = 0; v < N; v++) V::store(part + r * ldp + V::W * v, p[r][v]);
        return;
    }
    const uint8_t s = KIND ? sc[(b0 / bi) * lds + o / bo] : 0;
    const float fs = KIND ? (s > 246 ? e8m0(s) : dense_factor(s)) : 1.f;
    const F f = V::bcast(&fs);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 16") for (int v = 0; v < N; v++)
            dense_fold(out + r * cols + o + V::W * v, p[r][v], f, b0 == 0, KIND != 0, s > 246);
}

/* rows beyond RMAX: one unit's block widened once into a panel, then PR rows at a time over it */
template <int N, int KIND>
NK_ATTR static void dense_pass(const float *x, int64_t in, const float *panel, int64_t kb, float *out, int64_t cols,
                               F f, int first, int big) {
    F p[N][D::DV];
    _Pragma("GCC unroll 16") for (int r = 0; r < N; r++)
        _Pragma("GCC unroll 16") for (int v = 0; v < D::DV; v++)
            p[r][v] = (KIND || first) ? V::zero() : V::load(out + r * cols + V::W * v);
    for (int64_t k = 0; k < kb; k++) {
        F wv[D::DV];
        _Pragma("GCC unroll 16") for (int v = 0; v < D::DV; v++) wv[v] = V::load(panel + DENSE_UNIT * k + V::W * v);
        _Pragma("GCC unroll 16") for (int r = 0; r < N; r++) {
            const F xv = V::bcast(x + r * in + k);
            _Pragma("GCC unroll 16") for (int v = 0; v < D::DV; v++) p[r][v] = V::fma(xv, wv[v], p[r][v]);
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < N; r++)
        _Pragma("GCC unroll 16") for (int v = 0; v < D::DV; v++)
            dense_fold(out + r * cols + V::W * v, p[r][v], f, first, KIND != 0, big);
}

/* U units' block widened once into panels (each weight row's bytes of the U units read as one run),
   then PR rows at a time over each unit's */
template <int KIND, int U>
NK_ATTR static void dense_panel(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld,
                                const uint8_t *sc, int64_t lds, int64_t bi, int64_t bo, float *out, int64_t cols,
                                int64_t o0, int64_t b0, int64_t kb) {
    alignas(64) float panels[U * DENSE_MAX_BLOCK * DENSE_UNIT];
    constexpr int B = KIND ? 1 : 2;
    const uint8_t *row = w + B * (b0 * ld + o0);
    for (int64_t k = 0; k < kb; k++, row += B * ld) {
        _mm_prefetch((const char *)(row + B * kb * ld), _MM_HINT_T1);
        _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) {
            F d[D::DV];
            const uint8_t *p = row + B * DENSE_UNIT * u;
            if (KIND == DENSE_FP8_LOW) D::fp8_low(p, d);
            else if (KIND) D::fp8(p, d);
            else D::bf16(p, d);
            _Pragma("GCC unroll 16") for (int v = 0; v < D::DV; v++)
                V::store(panels + (u * kb + k) * DENSE_UNIT + V::W * v, d[v]);
        }
    }
    for (int u = 0; u < U; u++) {
        const float *panel = panels + u * kb * DENSE_UNIT;
        const int64_t o = o0 + DENSE_UNIT * u;
        const uint8_t s = KIND ? sc[(b0 / bi) * lds + o / bo] : 0;
        const float fs = KIND ? (s > 246 ? e8m0(s) : dense_factor(s)) : 1.f;
        const F f = V::bcast(&fs);
        for (int64_t r0 = 0; r0 < rows; r0 += D::PR) {
            const float *xr = x + r0 * in + b0;
            float *q = out + r0 * cols + o;
            switch (rows - r0 < D::PR ? rows - r0 : D::PR) {
#define PASS(n) case n: if constexpr (n <= D::PR) \
                dense_pass<n, KIND>(xr, in, panel, kb, q, cols, f, b0 == 0, s > 246); break;
                PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
            }
        }
    }
}

/* columns c0..c1 (whole units) of every row, rows i0..i0+n of the block b0..b0+kb: tile by tile
   (the widest of NT units that fits before c1 and the scale block's edge, else one unit), rows in
   registers up to RMAX; `part` the FP8 block's sums of column c0 on */
template <int R, int KIND>
NK_ATTR static void dense_tiles(const float *x, int64_t in, const uint8_t *w, int64_t ld, const uint8_t *sc,
                                int64_t lds, int64_t bi, int64_t bo, float *out, int64_t cols, int64_t c0, int64_t c1,
                                int64_t b0, int64_t kb, int64_t i0, int64_t n, float *part, int64_t ldp) {
    constexpr int NT = D::nt(R);
    for (int64_t o = c0; o < c1;) {
        const int64_t wide = DENSE_UNIT * NT;
        if (o + wide <= c1 && (!KIND || o % bo + wide <= bo)) {
            dense_regs<R, NT, KIND>(x, in, w, ld, sc, lds, bi, bo, out, cols, o, b0, kb, i0, n, part + (o - c0), ldp);
            o += wide;
        } else {
            dense_regs<R, 1, KIND>(x, in, w, ld, sc, lds, bi, bo, out, cols, o, b0, kb, i0, n, part + (o - c0), ldp);
            o += DENSE_UNIT;
        }
    }
}

/* columns c0..c1 in slabs of DENSE_SLAB bytes a block (a block's rows of some columns: in L2,
   the next block's prefetched as the tiles run), each block by block */
template <int KIND>
NK_ATTR static void dense_columns(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld,
                                  const uint8_t *sc, int64_t lds, int64_t bi, int64_t bo, float *out, int64_t cols,
                                  int64_t c0, int64_t c1) {
    /* rows in registers RMAX at a time over each pass's weight rows, BF16's up to DENSE_GROUPS
       groups (the later groups read the rows from cache); more rows through panels. BF16's chain
       runs on through a block's end: its blocks may differ by path (a panel's taller) */
    const bool regs = rows <= (KIND ? 1 : DENSE_GROUPS) * D::RMAX;
    const int64_t kb = KIND ? bi : regs ? DENSE_KB : DENSE_PANEL_KB, wide = 4 * DENSE_UNIT;
    const int64_t slab = (DENSE_SLAB / (kb * (KIND ? 1 : 2))) / wide * wide;
    const int64_t chunk = KIND && slab > DENSE_FP8_SLAB ? DENSE_FP8_SLAB : slab > wide ? slab : wide;
    /* FP8 in registers: a block's rows DENSE_FP8_PASS at a time across the slab (each row's bytes of
       the slab read as one run; the block's sums kept in `part` between passes) */
    const int64_t pass = KIND && regs ? DENSE_FP8_PASS : kb;
    alignas(64) float part[KIND ? D::RMAX * DENSE_FP8_SLAB : 1];  /* FP8 rows in registers: one group */
    for (int64_t s0 = c0; s0 < c1; s0 += chunk) {
        const int64_t s1 = s0 + chunk < c1 ? s0 + chunk : c1;
        for (int64_t b0 = 0; b0 < in; b0 += kb) {
            const int64_t n = in - b0 < kb ? in - b0 : kb;
            if (!regs) {
                int64_t o = s0;
                for (; o + DENSE_PANEL_UNITS * DENSE_UNIT <= s1; o += DENSE_PANEL_UNITS * DENSE_UNIT)
                    dense_panel<KIND, DENSE_PANEL_UNITS>(x, rows, in, w, ld, sc, lds, bi, bo, out, cols, o, b0, n);
                for (; o < s1; o += DENSE_UNIT)
                    dense_panel<KIND, 1>(x, rows, in, w, ld, sc, lds, bi, bo, out, cols, o, b0, n);
                continue;
            }
            for (int64_t i0 = b0; i0 < b0 + n; i0 += pass) {
                const int64_t m = b0 + n - i0 < pass ? b0 + n - i0 : pass;
                for (int64_t r0 = 0; r0 < rows; r0 += D::RMAX) {
                    const float *xr = x + r0 * in;
                    float *q = out + r0 * cols, *pr = KIND ? part + r0 * (s1 - s0) : part;
                    switch (rows - r0 < D::RMAX ? rows - r0 : D::RMAX) {
#define TILES(r) case r: if constexpr (r <= D::RMAX) \
                        dense_tiles<r, KIND>(xr, in, w, ld, sc, lds, bi, bo, q, cols, s0, s1, b0, n, i0, m, pr, \
                                             s1 - s0); \
                        break;
                        TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6) TILES(7) TILES(8)
#undef TILES
                    }
                }
            }
        }
    }
}
}  // namespace NK_NS
"""

DENSE_ENTRY = r"""
#include <math.h>
#include <vector>

static void dense_column_scalar(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld, int kind,
                                const uint8_t *scale, int64_t ld_scale, int64_t bi, int64_t bo, float *out,
                                int64_t cols, int64_t c) {
    const int64_t kb = kind == DENSE_FP8 ? bi : in;
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t b0 = 0; b0 < in; b0 += kb) {
            float p = 0.f;
            for (int64_t i = b0; i < b0 + kb && i < in; i++)
                p += x[r * in + i] * dense_scalar_value(w, i * ld + c, kind);
            if (kind != DENSE_FP8) {
                acc = p;
                continue;
            }
            const uint8_t s = scale[(b0 / bi) * ld_scale + c / bo];
            const float t = s > 246 ? p * 256.f * e8m0(s) : p * dense_factor(s);
            acc = b0 ? acc + t : t;
        }
        out[r * cols + c] = acc;
    }
}

/* columns c0..c1 of every row by the instruction set `isa` (whole units; plain C: any columns) */
static void dense_columns(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld, int kind,
                          const uint8_t *scale, int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols,
                          int64_t c0, int64_t c1, int isa) {
#if defined(__x86_64__)
#define DENSE_RUN(ns)                                                                                                  \
    do {                                                                                                               \
        if (kind == DENSE_FP8_LOW)                                                                                     \
            ns::dense_columns<DENSE_FP8_LOW>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, c0, c1);          \
        else if (kind == DENSE_FP8)                                                                                    \
            ns::dense_columns<DENSE_FP8>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, c0, c1);              \
        else ns::dense_columns<0>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, c0, c1);                    \
        return;                                                                                                        \
    } while (0)
    if (isa == 2) DENSE_RUN(isa_avx512);
    if (isa == 1) DENSE_RUN(isa_avx2);
#undef DENSE_RUN
#endif
    for (int64_t c = c0; c < c1; c++)
        dense_column_scalar(x, rows, in, w, ld, kind, scale, ld_scale, bi, bo, out, cols, c);
}

/* The inputs `fp8_low`'s widening multiplies (AVX2, rows in registers): x · 2^112, so that each
   product x · 2^112 · value · 2^-120 is the very product x · value · 2^-8 of the float16 widening
   (powers of two: the same real number, rounded the same in every fused multiply-add), and every
   sum, fold and result the same to the bit on every path. Where an input is 2^16 or more (it
   would overflow), or not a number, the float16 widening runs instead: false. */
static bool dense_low(const float *x, int64_t rows, int64_t in, std::vector<float> &scaled) {
    for (int64_t i = 0; i < rows * in; i++)
        if (!(fabsf(x[i]) < 65536.f)) return false;
    scaled.resize(rows * in);
    for (int64_t i = 0; i < rows * in; i++) scaled[i] = x[i] * 0x1p112f;
    return true;
}

/* out [rows, cols] = x [rows, in] @ w [in, cols] (row stride ld, in elements), both contiguous
   otherwise; FP8 (kind 1) scaled per (bi x bo) block by `scale` [in / bi, cols / bo] (bo a multiple
   of DENSE_UNIT, bi at most DENSE_MAX_BLOCK). Threads take contiguous ranges of whole units
   (a multiple of 4 where there are enough: the widest tiles); the last columns (cols % 16) in
   plain C. */
extern "C" void dsv4_dense(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld, int kind,
                           const uint8_t *scale, int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols,
                           int threads, int isa) {
    isa = run_isa(isa);
    const int64_t whole = isa ? cols / DENSE_UNIT * DENSE_UNIT : 0, units = whole / DENSE_UNIT;
    const int64_t bytes = in * cols * (kind == DENSE_FP8 ? 1 : 2);
    if (bytes < DENSE_PARALLEL_BYTES || units < 2) threads = 1;
    std::vector<float> scaled;  /* the vector columns' inputs and kind; the tail's stay x and kind */
    const bool low = kind == DENSE_FP8 && isa == 1 && rows <= DENSE_LOW_ROWS && dense_low(x, rows, in, scaled);
    const float *xv = low ? scaled.data() : x;
    const int kv = low ? DENSE_FP8_LOW : kind;
    int64_t per = (units + threads - 1) / threads;
    per = units >= 4 * threads ? (per + 3) / 4 * 4 : per;
    const int64_t teams = per ? (units + per - 1) / per : 0;
#pragma omp parallel for schedule(static, 1) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < teams + 1; t++) {
        if (t < teams) {
            const int64_t c0 = t * per * DENSE_UNIT, c1 = (t + 1) * per < units ? (t + 1) * per * DENSE_UNIT : whole;
            dense_columns(xv, rows, in, w, ld, kv, scale, ld_scale, bi, bo, out, cols, c0, c1, isa);
        } else if (whole < cols) {
            dense_columns(x, rows, in, w, ld, kind, scale, ld_scale, bi, bo, out, cols, whole, cols, 0);
        }
    }
}
"""

DENSE_SOURCE = DENSE_HEAD + per_isa(DENSE_KERNELS) + DENSE_ENTRY
