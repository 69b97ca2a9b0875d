"""The dense product of `runtime.model.native`'s library (`Native.dense`, C entry `dsv4_dense`), its C++
source appended to the FP4 products' (`native.SOURCE`, which the library's key holds).

A program dequantising an FP8 weight in its graph writes it whole as float32
and reads it back (the BF16 head: 128 MiB a step at small, 10.5 ms). Here 32 columns of a row (one
64-byte line of BF16) widen by shifts (FP8: its bits placed in a float32's, which is then the
byte's value times 2^-120, subnormals included, so times 2^120 exactly, then the block's scale:
the eager dequantisation's very number), each multiplied into up to 8 rows' sums held in
registers (AVX-512; AVX2: 2 rows, or from DENSE_PANEL_ROWS rows on, decoded once a chunk into a
float panel that every row is multiplied over: `dense_panel_avx2`). Threads take blocks of columns,
each block's rows 16 (a panel: 64) at a time, so the weight streams from memory once in runs a
block wide (small, 1 row: a `[1024, 1024]` FP8 weight 135 us, MKL on a float copy 164; the head 1.4
ms; 8 rows: 250 us and 3.2 ms; on 2 AMD Zen 3 cores with panels a `[1024, 512]` one 0.16 ms at 8
rows, 1.6 at 256, against 0.37 and 11.5 in 2-row passes). A decode step of small: 49 ms → 31 for
one sequence, 88 → 66 for eight. The FP8 decode assumes subnormal floats are kept (torch's
default: `torch.set_flush_denormal(True)` would zero FP8's subnormals here).
"""

DENSE_TILE = 32  # the columns of a tile of `dsv4_dense` (its DENSE_TILE): an FP8 scale block holds whole tiles

DENSE_SOURCE = r"""
/* ---- dense weights [in, cols]: BF16, or FP8 (e4m3) with E8M0 scales per (bi x bo) block ---- */

#define DENSE_FP8 1
#define DENSE_TILE 32 /* columns a tile: one 64-byte line of a BF16 row */
#define DENSE_PANEL_ROWS 4 /* from these rows on with AVX2, through panels (`dense_panel_avx2`) */
#define DENSE_PANEL_K 64   /* weight rows a panel */

/* an FP8 byte's bits placed in a float32's: the sign, then exponent and mantissa 20 bits up; every
   value, subnormals included, is then the byte's value times 2^-120 exactly (the exponent bias 120 off) */
static const float FP8_UNBIAS = 1329227995784915872903807060280344576.f; /* 2^120 */

static inline float dense_value(const uint8_t *w, int64_t k, int kind) {
    uint32_t bits;
    float f;
    if (kind == DENSE_FP8) {
        bits = ((uint32_t)(w[k] & 0x80) << 24) | ((uint32_t)(w[k] & 0x7f) << 20);
        memcpy(&f, &bits, sizeof f);
        return f * FP8_UNBIAS;
    }
    uint16_t h;
    memcpy(&h, w + 2 * k, sizeof h);
    bits = (uint32_t)h << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__x86_64__)
__attribute__((target("avx512f")))
static inline __m512 fp8x16_avx512(const uint8_t *p) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24),
                                   _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(FP8_UNBIAS));
}

__attribute__((target("avx512f")))
static inline __m512 bf16x16_avx512(const uint8_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* rows x [R, in] times the tile's columns o..o+31 of weight rows i0..i1, added to out (set, when
   i0 is 0): R rows' sums in registers, each weight vector decoded once for all of them */
template <int R, int KIND>
__attribute__((target("avx512f")))
static void dense_tile_avx512(const float *x, int64_t in, const uint8_t *w, int64_t ld, const uint8_t *scale,
                              int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols, int64_t o,
                              int64_t i0, int64_t i1) {
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; r++) {
        a0[r] = i0 ? _mm512_loadu_ps(out + r * cols + o) : _mm512_setzero_ps();
        a1[r] = i0 ? _mm512_loadu_ps(out + r * cols + o + 16) : _mm512_setzero_ps();
    }
    for (int64_t i = i0; i < i1; i++) {
        __m512 lo, hi;
        if (KIND == DENSE_FP8) {
            const __m512 sc = _mm512_set1_ps(e8m0(scale[(i / bi) * ld_scale + o / bo]));
            lo = _mm512_mul_ps(fp8x16_avx512(w + i * ld + o), sc);
            hi = _mm512_mul_ps(fp8x16_avx512(w + i * ld + o + 16), sc);
        } else {
            lo = bf16x16_avx512(w + 2 * (i * ld + o));
            hi = bf16x16_avx512(w + 2 * (i * ld + o + 16));
        }
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * in + i]);
            a0[r] = _mm512_fmadd_ps(xv, lo, a0[r]);
            a1[r] = _mm512_fmadd_ps(xv, hi, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * cols + o, a0[r]);
        _mm512_storeu_ps(out + r * cols + o + 16, a1[r]);
    }
}

template <int R, int KIND>
__attribute__((target("avx512f")))
static void dense_rows_avx512(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld,
                              const uint8_t *scale, int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols,
                              int64_t o, int64_t i0, int64_t i1) {
    if (rows == R) {
        dense_tile_avx512<R, KIND>(x, in, w, ld, scale, ld_scale, bi, bo, out, cols, o, i0, i1);
    } else if constexpr (R > 1) {
        dense_rows_avx512<R - 1, KIND>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, o, i0, i1);
    }
}

__attribute__((target("avx2,fma")))
static inline __m256 fp8x8_avx2(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24),
                                   _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(FP8_UNBIAS));
}

__attribute__((target("avx2,fma")))
static inline __m256 bf16x8_avx2(const uint8_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the same with AVX2, two rows at most (the 16 registers hold 2 rows x 4 sums, 4 weight vectors) */
template <int R, int KIND>
__attribute__((target("avx2,fma")))
static void dense_tile_avx2(const float *x, int64_t in, const uint8_t *w, int64_t ld, const uint8_t *scale,
                            int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols, int64_t o,
                            int64_t i0, int64_t i1) {
    __m256 a[R][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) a[r][q] = i0 ? _mm256_loadu_ps(out + r * cols + o + 8 * q) : _mm256_setzero_ps();
    for (int64_t i = i0; i < i1; i++) {
        __m256 v[4];
        if (KIND == DENSE_FP8) {
            const __m256 sc = _mm256_set1_ps(e8m0(scale[(i / bi) * ld_scale + o / bo]));
            for (int q = 0; q < 4; q++) v[q] = _mm256_mul_ps(fp8x8_avx2(w + i * ld + o + 8 * q), sc);
        } else {
            for (int q = 0; q < 4; q++) v[q] = bf16x8_avx2(w + 2 * (i * ld + o + 8 * q));
        }
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_set1_ps(x[r * in + i]);
            for (int q = 0; q < 4; q++) a[r][q] = _mm256_fmadd_ps(xv, v[q], a[r][q]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(out + r * cols + o + 8 * q, a[r][q]);
}

/* many rows with AVX2: 16 columns of weight rows i0..i1 decoded into a float panel (as `panel_avx2`
   does for the FP4 experts), then every row's sums over it, 4 rows a pass (`panel_rows_avx2`): the
   same values and fused multiply-adds in the same order as `dense_tile_avx2`, so the same sums to
   the bit, with the weight decoded once, not every 2 rows */
template <int KIND>
__attribute__((target("avx2,fma")))
static void dense_panel_avx2(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld,
                             const uint8_t *scale, int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols,
                             int64_t o, int64_t i0, int64_t i1) {
    alignas(32) float panel[DENSE_PANEL_K * 16];
    for (int64_t i = i0; i < i1; i++) {
        float *p = panel + 16 * (i - i0);
        if (KIND == DENSE_FP8) {
            const __m256 sc = _mm256_set1_ps(e8m0(scale[(i / bi) * ld_scale + o / bo]));
            _mm256_store_ps(p, _mm256_mul_ps(fp8x8_avx2(w + i * ld + o), sc));
            _mm256_store_ps(p + 8, _mm256_mul_ps(fp8x8_avx2(w + i * ld + o + 8), sc));
        } else {
            _mm256_store_ps(p, bf16x8_avx2(w + 2 * (i * ld + o)));
            _mm256_store_ps(p + 8, bf16x8_avx2(w + 2 * (i * ld + o + 8)));
        }
    }
    panel_rows_avx2(x + i0, rows, in, panel, i1 - i0, out + o, cols, i0 == 0);
}
#endif

static void dense_column_scalar(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld, int kind,
                                const uint8_t *scale, int64_t ld_scale, int64_t bi, int64_t bo, float *out,
                                int64_t cols, int64_t c) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t i = 0; i < in; i++) {
            float v = dense_value(w, i * ld + c, kind);
            if (kind == DENSE_FP8) v *= e8m0(scale[(i / bi) * ld_scale + c / bo]);
            acc += x[r * in + i] * v;
        }
        out[r * cols + c] = acc;
    }
}

/* one tile's columns for weight rows i0..i1, every row of x, in passes of as many rows as the
   registers hold (AVX-512 or AVX2: the plain C path goes column by column, `dsv4_dense`) */
#if defined(__x86_64__)
template <int KIND>
static void dense_tile(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld, const uint8_t *scale,
                       int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols, int64_t o, int64_t i0,
                       int64_t i1, int avx512) {
    const int64_t width = avx512 ? 8 : 2;
    for (int64_t r0 = 0; r0 < rows; r0 += width) {
        const int64_t n = rows - r0 < width ? rows - r0 : width;
        const float *xr = x + r0 * in;
        float *outr = out + r0 * cols;
        if (avx512)
            dense_rows_avx512<8, KIND>(xr, n, in, w, ld, scale, ld_scale, bi, bo, outr, cols, o, i0, i1);
        else if (n == 2)
            dense_tile_avx2<2, KIND>(xr, in, w, ld, scale, ld_scale, bi, bo, outr, cols, o, i0, i1);
        else
            dense_tile_avx2<1, KIND>(xr, in, w, ld, scale, ld_scale, bi, bo, outr, cols, o, i0, i1);
    }
}
#endif

/* out [rows, cols] = x [rows, in] @ w [in, cols] (row stride ld, in elements), both contiguous
   otherwise; FP8 (kind 1) scaled per (bi x bo) block by `scale` [in / bi, cols / bo] (bo a multiple
   of DENSE_TILE). The columns go to threads in blocks of whole tiles, each block's weight rows in
   chunks of DENSE_CHUNK: a chunk of a block is read from memory once, in runs a block wide, and
   stays in the cache while every tile and row pass of it runs (one tile down every row, a line
   from each 64 KiB row of small's head: 1.9x slower). */
#define DENSE_CHUNK 16
extern "C" void dsv4_dense(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t ld, int kind,
                           const uint8_t *scale, int64_t ld_scale, int64_t bi, int64_t bo, float *out, int64_t cols,
                           int threads, int isa) {
    isa = isa < cpu_isa() ? isa : cpu_isa();
    const int64_t tiles = isa ? cols / DENSE_TILE : 0;
    const int panels = isa == 1 && rows >= DENSE_PANEL_ROWS;
    int64_t per = tiles / (2 * (int64_t)threads);  /* two blocks a thread at least, 128 tiles at most */
    per = per < 1 ? 1 : per > 128 ? 128 : per;
    const int64_t blocks = (tiles + per - 1) / per;
#pragma omp parallel num_threads(threads)
    {
#if defined(__x86_64__)
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t t1 = (b + 1) * per < tiles ? (b + 1) * per : tiles, chunk = panels ? DENSE_PANEL_K : DENSE_CHUNK;
            for (int64_t i0 = 0; i0 < in; i0 += chunk) {
                const int64_t i1 = i0 + chunk < in ? i0 + chunk : in;
                for (int64_t t = b * per; t < t1; t++) {
                    if (panels && kind == DENSE_FP8)
                        for (int64_t o = DENSE_TILE * t; o < DENSE_TILE * (t + 1); o += 16)
                            dense_panel_avx2<DENSE_FP8>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, o, i0, i1);
                    else if (panels)
                        for (int64_t o = DENSE_TILE * t; o < DENSE_TILE * (t + 1); o += 16)
                            dense_panel_avx2<0>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, o, i0, i1);
                    else if (kind == DENSE_FP8)
                        dense_tile<DENSE_FP8>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, DENSE_TILE * t,
                                              i0, i1, isa >= 2);
                    else
                        dense_tile<0>(x, rows, in, w, ld, scale, ld_scale, bi, bo, out, cols, DENSE_TILE * t, i0, i1,
                                      isa >= 2);
                }
            }
        }
#endif
#pragma omp for schedule(static)
        for (int64_t c = DENSE_TILE * tiles; c < cols; c++)
            dense_column_scalar(x, rows, in, w, ld, kind, scale, ld_scale, bi, bo, out, cols, c);
    }
}
"""
