"""The FP4 experts' product of `runtime.model.native`'s library (`Native.grouped`, C entry
`dsv4_fp4_grouped`): its C++ source, which the library's source starts with (`native.SOURCE`,
held in the library's key), with the helpers the dense product's (`native_dense`) also uses: the
E8M0 scale's bits, the cpu's instruction set, the kernels compiled once per instruction set
(`per_isa`). See `runtime.model.native` for what the product does and how fast.

The order of a row's sums, the same on every path of an instruction set and at every row count:
each scale group's products summed from zero in input order (fused multiply-adds of the unscaled
e2m1 values, exact), then folded into the row's sum in group order (`acc = p · 2^(s-127) + acc`,
one rounding; the first group `p · 2^(s-127)`). The scale multiplies a group's sum, never each
weight: one multiply a vector of weights fewer than scaling every weight, the same numbers to
float32 rounding, and a row's never depend on the rows beside it."""

# The C++ of a kernel family written once over an instruction set's vector type and primitives
# (`V`: the vector `F`, its `W` lanes, the primitives) and compiled once per set: the AVX2 copy
# is the one this host's tests run on every path; the AVX-512 copy shares every loop with it, so
# only its primitives are its own.
ISAS = (("isa_avx2", "avx2,fma,f16c", "Avx2", "DenseAvx2"),
        ("isa_avx512", "avx512f,avx2,fma,f16c", "Avx512", "DenseAvx512"))


def per_isa(template: str) -> str:
    """`template` compiled once per vector instruction set: in namespace NK_NS, its functions
    given NK_ATTR (that set's target) over that set's primitives NK_V (and the dense widening NK_D,
    `native_dense`)."""
    out = ["#if defined(__x86_64__)"]
    for ns, target, traits, dense in ISAS:
        out += [f"#define NK_NS {ns}", f'#define NK_ATTR __attribute__((target("{target}")))', f"#define NK_V {traits}",
                f"#define NK_D {dense}", template, "#undef NK_NS", "#undef NK_ATTR", "#undef NK_V", "#undef NK_D"]
    return "\n".join([*out, "#endif"])


FP4_MAX_GROUP = 64  # inputs a scale group, at most (its FP4_MAX_GROUP: a panel's rows)

FP4_HEAD = r"""
#include <stdint.h>
#include <string.h>
#include <omp.h>
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

/* what this cpu runs: 2 AVX-512 (with AVX2, FMA, F16C), 1 AVX2 + FMA + F16C, 0 none of them;
   `isa` arguments cap it (tests reach every path on one host) */
static int cpu_isa(void) {
#if defined(__x86_64__)
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
#endif
    return 0;
}

#if defined(__x86_64__)
/* AVX2: 8 lanes. An FP4 unit (32 columns of a byte row: 64 weights) is 4 vectors whose columns
   are permuted ({0,2,4,6 | 16,18,20,22}, {1,3,..}, {8,10,..}, {9,11,..}): each code's value is
   made as a bfloat16 (its high and low byte each from a 16-entry table, `vpshufb`, the sign or-ed
   in), two bytes interleaved to words and a word widened to a float by a shift or a mask: some 3
   instructions a vector of 8 weights, where widening each byte to 32 bits first (a permute of an
   8-entry table, then the sign) took 6. Sums stay in that order; `unpermute` puts a unit's 32
   floats in column order once, at the end. */
struct Avx2 {
    typedef __m256 F;
    enum { W = 8, NU = 4, RMAX = 2, PR = 4, PV = 2 };
    __attribute__((target("avx2,fma,f16c"))) static inline F zero() { return _mm256_setzero_ps(); }
    __attribute__((target("avx2,fma,f16c"))) static inline F bcast(const float *p) { return _mm256_broadcast_ss(p); }
    __attribute__((target("avx2,fma,f16c"))) static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    __attribute__((target("avx2,fma,f16c"))) static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    __attribute__((target("avx2,fma,f16c"))) static inline F load(const float *p) { return _mm256_loadu_ps(p); }
    __attribute__((target("avx2,fma,f16c"))) static inline void store(float *p, F a) { _mm256_storeu_ps(p, a); }
    /* a unit's 32 bytes -> the even inputs' values (ODD 0) or the odd inputs' (ODD 1), d[4] (the
       serving byte: magnitudes in bits 0-2 and 3-5, signs in 6 and 7, `runtime.weights.pack.serving_fp4`).
       A half at a time: its 4 vectors are multiplied in before the other half is made, so a row's
       sums, the tables and both halves never need more than the 16 registers (all of them at once
       spilled the sums to the stack, and every sum then waited on a store and a load) */
    template <int ODD>
    __attribute__((target("avx2,fma,f16c"))) static inline void fp4_half(const uint8_t *p, F *d) {
        /* bfloat16 of 0, .5, 1, 1.5, 2, 3, 4, 6: high bytes, low bytes */
        const __m256i th = _mm256_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0, 0, 0, 0, 0, 0, 0, 0,
                                            0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m256i tl = _mm256_setr_epi8(0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0,
                                            0, 0, 0, 0, 0, 0, 0, 0,
                                            0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0,
                                            0, 0, 0, 0, 0, 0, 0, 0);
        const __m256i seven = _mm256_set1_epi8(7), top = _mm256_set1_epi8((char)0x80);
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
        const __m256i b = _mm256_loadu_si256((const __m256i *)p);
        const __m256i i = _mm256_and_si256(ODD ? _mm256_srli_epi16(b, 3) : b, seven);
        const __m256i h = _mm256_or_si256(_mm256_shuffle_epi8(th, i), _mm256_and_si256(ODD ? b : _mm256_add_epi8(b, b),
                                                                                        top));
        const __m256i l = _mm256_shuffle_epi8(tl, i);
        const __m256i w[2] = {_mm256_unpacklo_epi8(l, h), _mm256_unpackhi_epi8(l, h)};
        for (int k = 0; k < 2; k++) {
            d[2 * k] = _mm256_castsi256_ps(_mm256_slli_epi32(w[k], 16));
            d[2 * k + 1] = _mm256_castsi256_ps(_mm256_and_si256(w[k], high));
        }
    }
    __attribute__((target("avx2,fma,f16c"))) static inline void fp4(const uint8_t *p, F *lo, F *hi) {
        fp4_half<0>(p, lo);
        fp4_half<1>(p, hi);
    }
    /* a unit's 32 E8M0 scale bytes -> 2^(s - 127) in the unit's column order (as `e8m0`) */
    __attribute__((target("avx2,fma,f16c"))) static inline void scales(const uint8_t *s, F *f) {
        const __m256i z = _mm256_setzero_si256(), high = _mm256_set1_epi32((int)0xFFFF0000u);
        const __m256i b = _mm256_loadu_si256((const __m256i *)s);
        const __m256i w[2] = {_mm256_unpacklo_epi8(b, z), _mm256_unpackhi_epi8(b, z)};
        for (int k = 0; k < 4; k++) {
            const __m256i e = (k & 1) ? _mm256_and_si256(w[k / 2], high) : _mm256_slli_epi32(w[k / 2], 16);
            const __m256i v = _mm256_slli_epi32(e, 7);
            f[k] = _mm256_castsi256_ps(_mm256_blendv_epi8(v, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(v, z)));
        }
    }
    /* a unit's 32 floats stored in the vectors' order -> column order, in place */
    __attribute__((target("avx2,fma,f16c"))) static inline void unpermute(float *q) {
        const F a0 = load(q), a1 = load(q + 8), a2 = load(q + 16), a3 = load(q + 24);
        const F l0 = _mm256_unpacklo_ps(a0, a1), h0 = _mm256_unpackhi_ps(a0, a1);
        const F l1 = _mm256_unpacklo_ps(a2, a3), h1 = _mm256_unpackhi_ps(a2, a3);
        store(q, _mm256_permute2f128_ps(l0, h0, 0x20));
        store(q + 8, _mm256_permute2f128_ps(l1, h1, 0x20));
        store(q + 16, _mm256_permute2f128_ps(l0, h0, 0x31));
        store(q + 24, _mm256_permute2f128_ps(l1, h1, 0x31));
    }
};

/* AVX-512: 16 lanes, a unit 2 vectors in column order: each code an index into a 16-entry table
   (signs included) held in one register, `vpermps` */
struct Avx512 {
    typedef __m512 F;
    enum { W = 16, NU = 2, RMAX = 8, PR = 8, PV = 1 };
    __attribute__((target("avx512f"))) static inline F zero() { return _mm512_setzero_ps(); }
    __attribute__((target("avx512f"))) static inline F bcast(const float *p) { return _mm512_set1_ps(*p); }
    __attribute__((target("avx512f"))) static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    __attribute__((target("avx512f"))) static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    __attribute__((target("avx512f"))) static inline F load(const float *p) { return _mm512_loadu_ps(p); }
    __attribute__((target("avx512f"))) static inline void store(float *p, F a) { _mm512_storeu_ps(p, a); }
    template <int ODD>
    __attribute__((target("avx512f"))) static inline void fp4_half(const uint8_t *p, F *d) {
        const __m512 table = _mm512_loadu_ps(E2M1);
        const __m512i seven = _mm512_set1_epi32(7);
        for (int k = 0; k < 2; k++) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
            const __m512i b3 = _mm512_srli_epi32(b, 3);
            /* the index (the permute reads its low 4 bits): magnitude in bits 0-2, sign in 3; bit by
               bit `seven ? magnitude's source : sign's source` (ternary logic 0xCA) */
            d[k] = _mm512_permutexvar_ps(ODD ? _mm512_ternarylogic_epi32(seven, b3, _mm512_srli_epi32(b, 4), 0xCA)
                                             : _mm512_ternarylogic_epi32(seven, b, b3, 0xCA), table);
        }
    }
    __attribute__((target("avx512f"))) static inline void fp4(const uint8_t *p, F *lo, F *hi) {
        fp4_half<0>(p, lo);
        fp4_half<1>(p, hi);
    }
    __attribute__((target("avx512f"))) static inline void scales(const uint8_t *s, F *f) {
        for (int k = 0; k < 2; k++) {
            const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s + 16 * k)));
            const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
            f[k] = _mm512_castsi512_ps(_mm512_mask_blend_epi32(zero, _mm512_slli_epi32(e, 23),
                                                               _mm512_set1_epi32(0x00400000)));
        }
    }
    static inline void unpermute(float *) {}
};
#endif

/* one column of an FP4 weight, plain C (no vector unit, or a column past the last whole unit): the
   same order of sums, in separate multiplies and adds */
static void column_scalar(const float *x, int64_t rows, const uint8_t *packed, int64_t ld_packed, const uint8_t *scale,
                          int64_t ld_scale, float *out, int64_t half, int64_t cols, int64_t group, int64_t o) {
    const int64_t in = 2 * half, per = group / 2;
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t j0 = 0; j0 < half; j0 += per) {
            float p = 0.f;
            for (int64_t j = j0; j < j0 + per; j++) {
                const uint8_t b = packed[j * ld_packed + o];
                p += x[r * in + 2 * j] * E2M1[(b & 7) | ((b >> 3) & 8)];
                p += x[r * in + 2 * j + 1] * E2M1[((b >> 3) & 7) | ((b >> 4) & 8)];
            }
            const float f = e8m0(scale[(j0 / per) * ld_scale + o]);
            acc = j0 ? acc + p * f : p * f;
        }
        out[r * cols + o] = acc;
    }
}
"""

# Columns o0..o1 (whole units of 32) of rows x [rows, in] times an FP4 weight, into out [rows,
# cols]: groups outer, units inner, so a thread reads a group's byte rows (a few KiB) while it
# runs every unit of its columns over them, with the next group's prefetched (a unit reads 32 of
# each row's bytes, a row apart: the hardware's prefetchers followed few of them, a layer's
# experts read cold at 2 GB/s a core, 5.5 with this). Up to RMAX rows their group sums are held
# in registers, each decoded vector multiplied into every row; more rows decode a group of a unit
# once into a float panel (8 KiB at most: it stays in L1) and multiply PR rows at a time over it:
# the same values, sums in the same order, the same numbers to the bit. A row's running sum lives
# in `out`, in the unit's vector order until its last group (`unpermute`).
FP4_KERNELS = r"""
namespace NK_NS {
typedef NK_V V;
typedef V::F F;

template <int R>
NK_ATTR static void fp4_regs(const float *x, const uint8_t *w, int64_t ld, const uint8_t *sc, int64_t lds, float *out,
                             int64_t half, int64_t cols, int64_t group, int64_t o0, int64_t o1) {
    const int64_t in = 2 * half, per = group / 2;
    for (int64_t j0 = 0; j0 < half; j0 += per) {
        for (int64_t o = o0; o < o1; o += 32) {
            F p[R][V::NU];
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
                _Pragma("GCC unroll 16") for (int v = 0; v < V::NU; v++) p[r][v] = V::zero();
            const uint8_t *row = w + j0 * ld + o;
            for (int64_t j = j0; j < j0 + per; j++, row += ld) {
                _mm_prefetch((const char *)(row + per * ld), _MM_HINT_T0);  /* the next group's (never faults) */
                F d[V::NU];
                V::template fp4_half<0>(row, d);  /* the even input's values, then the odd one's */
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
                    const F xl = V::bcast(x + r * in + 2 * j);
                    _Pragma("GCC unroll 16") for (int v = 0; v < V::NU; v++) p[r][v] = V::fma(xl, d[v], p[r][v]);
                }
                V::template fp4_half<1>(row, d);
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
                    const F xh = V::bcast(x + r * in + 2 * j + 1);
                    _Pragma("GCC unroll 16") for (int v = 0; v < V::NU; v++) p[r][v] = V::fma(xh, d[v], p[r][v]);
                }
            }
            F f[V::NU];
            V::scales(sc + (j0 / per) * lds + o, f);
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
                _Pragma("GCC unroll 16") for (int v = 0; v < V::NU; v++) {
                    float *q = out + r * cols + o + V::W * v;
                    V::store(q, j0 ? V::fma(p[r][v], f[v], V::load(q)) : V::mul(p[r][v], f[v]));
                }
        }
    }
}

/* n <= PR rows over a decoded group of a unit (panel [group][32], the unit's vector order) */
template <int N>
NK_ATTR static void fp4_pass(const float *x, int64_t in, const float *panel, int64_t group, const F *f, float *out,
                             int64_t cols, int first) {
    _Pragma("GCC unroll 16") for (int h = 0; h < V::NU; h += V::PV) {
        F p[N][V::PV];
        _Pragma("GCC unroll 16") for (int r = 0; r < N; r++)
            _Pragma("GCC unroll 16") for (int v = 0; v < V::PV; v++) p[r][v] = V::zero();
        for (int64_t k = 0; k < group; k++) {
            F wv[V::PV];
            _Pragma("GCC unroll 16") for (int v = 0; v < V::PV; v++) wv[v] = V::load(panel + 32 * k + V::W * (h + v));
            _Pragma("GCC unroll 16") for (int r = 0; r < N; r++) {
                const F xv = V::bcast(x + r * in + k);
                _Pragma("GCC unroll 16") for (int v = 0; v < V::PV; v++) p[r][v] = V::fma(xv, wv[v], p[r][v]);
            }
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < N; r++)
            _Pragma("GCC unroll 16") for (int v = 0; v < V::PV; v++) {
                float *q = out + r * cols + V::W * (h + v);
                V::store(q, first ? V::mul(p[r][v], f[h + v]) : V::fma(p[r][v], f[h + v], V::load(q)));
            }
    }
}

NK_ATTR static void fp4_panel(const float *x, int64_t rows, const uint8_t *w, int64_t ld, const uint8_t *sc,
                              int64_t lds, float *out, int64_t half, int64_t cols, int64_t group, int64_t o0,
                              int64_t o1) {
    alignas(64) float panel[64 * 32];
    const int64_t in = 2 * half, per = group / 2;
    for (int64_t j0 = 0; j0 < half; j0 += per)
        for (int64_t o = o0; o < o1; o += 32) {
            const uint8_t *row = w + j0 * ld + o;
            for (int64_t j = 0; j < per; j++, row += ld) {
                _mm_prefetch((const char *)(row + per * ld), _MM_HINT_T0);
                F lo[V::NU], hi[V::NU];
                V::fp4(row, lo, hi);
                _Pragma("GCC unroll 16") for (int v = 0; v < V::NU; v++) {
                    V::store(panel + 64 * j + V::W * v, lo[v]);
                    V::store(panel + 64 * j + 32 + V::W * v, hi[v]);
                }
            }
            F f[V::NU];
            V::scales(sc + (j0 / per) * lds + o, f);
            for (int64_t r0 = 0; r0 < rows; r0 += V::PR) {
                const float *xr = x + r0 * in + 2 * j0;
                float *q = out + r0 * cols + o;
                switch (rows - r0 < V::PR ? rows - r0 : V::PR) {
#define PASS(n) case n: if constexpr (n <= V::PR) fp4_pass<n>(xr, in, panel, group, f, q, cols, j0 == 0); break;
                    PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
                }
            }
        }
}

/* columns o0..o1 (whole units) of every row: in registers up to RMAX rows, else through panels;
   then each unit's sums in column order */
NK_ATTR static void fp4_columns(const float *x, int64_t rows, const uint8_t *w, int64_t ld, const uint8_t *sc,
                                int64_t lds, float *out, int64_t half, int64_t cols, int64_t group, int64_t o0,
                                int64_t o1) {
    if (rows > V::RMAX) {
        fp4_panel(x, rows, w, ld, sc, lds, out, half, cols, group, o0, o1);
    } else {
        switch (rows) {
#define REGS(n) case n: if constexpr (n <= V::RMAX) \
            fp4_regs<n>(x, w, ld, sc, lds, out, half, cols, group, o0, o1); break;
            REGS(1) REGS(2) REGS(3) REGS(4) REGS(5) REGS(6) REGS(7) REGS(8)
#undef REGS
            default: return;
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = o0; o < o1; o += 32) V::unpermute(out + r * cols + o);
}
}  // namespace NK_NS
"""

FP4_GROUPED = r"""
#define FP4_UNIT 32       /* columns a vector unit covers (both instruction sets) */
#define FP4_MAX_GROUP 64  /* inputs a scale group, at most (the panel's rows) */
#define FP4_CHUNK 128     /* columns of a thread's piece of work, at least (a few lines of each byte row) */

/* columns o0..o1 of rows x [rows, 2 half] times one weight, by the instruction set `isa` (2, 1, 0) */
static void fp4_columns(const float *x, int64_t rows, const uint8_t *w, int64_t ld, const uint8_t *sc, int64_t lds,
                        float *out, int64_t half, int64_t cols, int64_t group, int64_t o0, int64_t o1, int isa) {
#if defined(__x86_64__)
    if (isa == 2) return isa_avx512::fp4_columns(x, rows, w, ld, sc, lds, out, half, cols, group, o0, o1);
    if (isa == 1) return isa_avx2::fp4_columns(x, rows, w, ld, sc, lds, out, half, cols, group, o0, o1);
#endif
    for (int64_t o = o0; o < o1; o++) column_scalar(x, rows, w, ld, sc, lds, out, half, cols, group, o);
}

/* the routed experts of a layer, grouped by expert: x [pairs, 2 half] holds expert ids[k]'s rows
   from starts[k] to starts[k + 1]; each times its expert's weight (packed + ids[k] * packed_stride,
   scale + ids[k] * scale_stride) into out [pairs, cols]. One parallel loop over (weight, expert,
   piece of columns): the experts' rows differ, so the pieces are handed out as threads free up;
   of two weights of the same shape (w1 and w3), both in that one loop. Run by a team already
   started (`omp for`s, the last with its barrier): `dsv4_fp4_grouped` alone, or a phase of
   `dsv4_fp4_ffn_in`'s and `_out`'s (`native_ffn`). */
struct Weights {  /* weights[count] (stacks of the same shape): their products share one loop */
    const uint8_t *packed[2], *scale[2];
    float *out[2];
    int count;
};

static void grouped_in_team(const float *x, const int64_t *ids, const int64_t *starts, int64_t used,
                            const Weights &w, int64_t packed_stride, int64_t ld_packed, int64_t scale_stride,
                            int64_t ld_scale, int64_t half, int64_t cols, int64_t group, int isa) {
    const int64_t whole = isa ? cols / FP4_UNIT * FP4_UNIT : 0;
    /* pieces as wide as the threads allow: a piece of whole byte rows reads its weight as one
       stream (FP4_CHUNK columns of each row read a few lines a row apart); narrower ones only
       where there are too few weights to keep every thread busy */
    const int64_t weights = w.count * used, parts = weights ? (2 * omp_get_num_threads() + weights - 1) / weights : 1;
    int64_t piece = (whole + parts - 1) / parts;
    piece = piece < FP4_CHUNK ? FP4_CHUNK : (piece + FP4_UNIT - 1) / FP4_UNIT * FP4_UNIT;
    const int64_t chunks = (whole + piece - 1) / piece, units = used * chunks;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t u = 0; u < w.count * units; u++) {
        const int64_t m = u / units, k = (u % units) / chunks, c = u % chunks, e = ids[k];
        const int64_t o0 = c * piece, o1 = o0 + piece < whole ? o0 + piece : whole;
        fp4_columns(x + starts[k] * 2 * half, starts[k + 1] - starts[k], w.packed[m] + e * packed_stride, ld_packed,
                    w.scale[m] + e * scale_stride, ld_scale, w.out[m] + starts[k] * cols, half, cols, group, o0, o1,
                    isa);
    }
#pragma omp for schedule(static)
    for (int64_t mk = 0; mk < w.count * used; mk++) {
        const int64_t m = mk / used, k = mk % used;
        fp4_columns(x + starts[k] * 2 * half, starts[k + 1] - starts[k], w.packed[m] + ids[k] * packed_stride,
                    ld_packed, w.scale[m] + ids[k] * scale_stride, ld_scale, w.out[m] + starts[k] * cols, half, cols,
                    group, whole, cols, 0);
    }
}

/* the instruction set to run: the cpu's, capped by the caller's `isa` */
static int run_isa(int isa) { return isa < cpu_isa() ? isa : cpu_isa(); }

extern "C" void dsv4_fp4_grouped(const float *x, const int64_t *ids, const int64_t *starts, int64_t used,
                                 const uint8_t *packed, int64_t packed_stride, int64_t ld_packed, const uint8_t *scale,
                                 int64_t scale_stride, int64_t ld_scale, float *out, int64_t half, int64_t cols,
                                 int64_t group, int threads, int isa) {
    const Weights w = {{packed, nullptr}, {scale, nullptr}, {out, nullptr}, 1};
    isa = run_isa(isa);
#pragma omp parallel num_threads(threads)
    grouped_in_team(x, ids, starts, used, w, packed_stride, ld_packed, scale_stride, ld_scale, half, cols, group, isa);
}
"""

FP4_SOURCE = FP4_HEAD + per_isa(FP4_KERNELS) + FP4_GROUPED
