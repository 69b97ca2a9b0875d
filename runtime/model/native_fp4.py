"""The FP4 experts' product of `runtime.model.native`'s library (`Native.grouped`, C entry
`dsv4_fp4_grouped`): its C++ source, which the library's source starts with (`native.SOURCE`,
held in the library's key), with the helpers the dense product's (`native_dense`) also uses: the
E8M0 scale's bits, the cpu's instruction set, the float panels' passes. See `runtime.model.native`
for what the product does and how fast."""

FP4_SOURCE = r"""
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

/* 8 bytes of a byte row (p), times their columns' scales (`scale8_avx2`) -> the even inputs' values
   and the odd ones' (the serving byte: magnitudes in bits 0-2 and 3-5, signs in 6 and 7,
   `runtime.weights.pack.serving_fp4`): an 8-entry table of magnitudes in one register (the permute
   reads an index's low 3 bits only), the sign bit moved to float's and or-ed in */
__attribute__((target("avx2,fma")))
static inline void decode8_avx2(const uint8_t *p, __m256 scale, __m256 *lo, __m256 *hi) {
    const __m256 table = _mm256_loadu_ps(E2M1);
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256 vl = _mm256_or_ps(_mm256_permutevar8x32_ps(table, b),
                             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x40)), 25)));
    __m256 vh = _mm256_or_ps(_mm256_permutevar8x32_ps(table, _mm256_srli_epi32(b, 3)),
                             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24)));
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
    const __m512i seven = _mm512_set1_epi32(7), tiny = _mm512_set1_epi32(0x00400000);
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
            /* the table's index (the permute reads its low 4 bits): magnitude in bits 0-2, sign in 3;
               bit by bit, `seven ? magnitude's source : sign's source` (ternary logic 0xCA) */
            __m512i b3 = _mm512_srli_epi32(b, 3), b4 = _mm512_srli_epi32(b, 4);
            __m512 vl = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_ternarylogic_epi32(seven, b, b3, 0xCA), table), sc);
            __m512 vh = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_ternarylogic_epi32(seven, b3, b4, 0xCA), table), sc);
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
            acc += x[r * in + 2 * j] * (E2M1[(b & 7) | ((b >> 3) & 8)] * sc);
            acc += x[r * in + 2 * j + 1] * (E2M1[((b >> 3) & 7) | ((b >> 4) & 8)] * sc);
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
   the experts' rows differ, so the units are handed out as threads free up; of two weights of the
   same shape (w1 and w3), both in that one loop. Run by a team already started (`omp for`s, the last
   with its barrier): `dsv4_fp4_grouped` alone, or a phase of `dsv4_fp4_ffn_in`'s and `_out`'s
   (`native_ffn`). */
struct Weights {  /* weights[count] (stacks of the same shape): their products share one loop */
    const uint8_t *packed[2], *scale[2];
    float *out[2];
    int count;
};

static void grouped_in_team(const float *x, const int64_t *ids, const int64_t *starts, int64_t used,
                            const Weights &w, int64_t packed_stride, int64_t ld_packed, int64_t scale_stride,
                            int64_t ld_scale, int64_t half, int64_t cols, int64_t group, int avx512, int avx2) {
    const int64_t width = tile_width(avx512, avx2), tiles = cols / width, units = used * tiles;
#pragma omp for schedule(dynamic, 4) nowait
    for (int64_t u = 0; u < w.count * units; u++) {
        const int64_t m = u / units, k = (u % units) / tiles, e = ids[k];
        tile_rows(x + starts[k] * 2 * half, starts[k + 1] - starts[k], w.packed[m] + e * packed_stride, ld_packed,
                  w.scale[m] + e * scale_stride, ld_scale, w.out[m] + starts[k] * cols, half, cols, group,
                  width * (u % tiles), avx512, avx2);
    }
#pragma omp for schedule(static)
    for (int64_t mk = 0; mk < w.count * used; mk++) {
        const int64_t m = mk / used, k = mk % used;
        for (int64_t o = width * tiles; o < cols; o++)
            column_scalar(x + starts[k] * 2 * half, starts[k + 1] - starts[k], w.packed[m] + ids[k] * packed_stride,
                          ld_packed, w.scale[m] + ids[k] * scale_stride, ld_scale, w.out[m] + starts[k] * cols, half,
                          cols, group, o);
    }
}

extern "C" void dsv4_fp4_grouped(const float *x, const int64_t *ids, const int64_t *starts, int64_t used,
                                 const uint8_t *packed, int64_t packed_stride, int64_t ld_packed, const uint8_t *scale,
                                 int64_t scale_stride, int64_t ld_scale, float *out, int64_t half, int64_t cols,
                                 int64_t group, int threads, int isa) {
    const int avx512 = isa >= 2 && cpu_isa() >= 2, avx2 = isa >= 1 && cpu_isa() >= 1;
    const Weights w = {{packed, nullptr}, {scale, nullptr}, {out, nullptr}, 1};
#pragma omp parallel num_threads(threads)
    grouped_in_team(x, ids, starts, used, w, packed_stride, ld_packed, scale_stride, ld_scale, half, cols, group,
                    avx512, avx2);
}
"""
