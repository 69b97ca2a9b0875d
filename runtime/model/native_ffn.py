"""A layer's routed experts in two native calls (`Native.ffn`, C entries `dsv4_fp4_ffn_in` and
`dsv4_fp4_ffn_out`): their C++ source, appended to the FP4 and dense products' (`native.SOURCE`,
which the library's key holds).

What `moe._experts_grouped` did in some twenty torch ops and three native calls a layer, in two
calls, each one team of threads, with torch's SwiGLU between them: the rows' (row, expert) pairs
sorted by expert (a counting sort, stable: each expert's rows in row order, as the torch ops'
stable argsort), each pair's row gathered, every used expert's w1 and w3 over its own rows (the
FP4 products of `dsv4_fp4_grouped`: each byte decoded once per pass of rows, or once into a
panel); then w2 likewise, and each row's sum of its experts' outputs times their gates, a product
then an add in the sorted pairs' order: the torch ops' `index_add_`. The same numbers to the bit,
and a row's never depend on the rows beside it. Choices outside 0..n-1 (another rank's experts)
are skipped, as the torch ops skip them.
"""

FFN_SOURCE = r"""
/* ---- a layer's routed experts: sort and gather, w1 and w3 (`dsv4_fp4_ffn_in`), then w2 and the
   gate-weighted sum (`dsv4_fp4_ffn_out`); the SwiGLU between them is torch's ---- */
#include <vector>

/* the plan both calls share, in the caller's int64 buffer [2 choices + 2 n + 2]: at[choices] (each
   choice's place among the sorted pairs; -1: skipped), order[choices] (the choice at each place),
   ids[n] (the used experts, in order), starts[n + 1] (each used expert's first place, then the
   pairs), used */
static void ffn_plan(const int64_t *idx, int64_t choices, int64_t n, int64_t *plan) {
    int64_t *at = plan, *order = at + choices, *ids = order + choices, *starts = ids + n, *used = starts + n + 1;
    std::vector<int64_t> next(n, 0);
    for (int64_t p = 0; p < choices; p++)
        if (idx[p] >= 0 && idx[p] < n) next[idx[p]]++;  /* counts, for now */
    int64_t u = 0, place = 0;
    starts[0] = 0;
    for (int64_t e = 0; e < n; e++) {
        const int64_t count = next[e];
        next[e] = place;
        if (count) {
            ids[u++] = e;
            starts[u] = place + count;
        }
        place += count;
    }
    for (int64_t p = 0; p < choices; p++) {  /* stable: each expert's pairs in row order */
        at[p] = -1;
        if (idx[p] >= 0 && idx[p] < n) {
            at[p] = next[idx[p]]++;
            order[at[p]] = p;
        }
    }
    *used = u;
}

/* x [rows, hidden] with each row's k choices idx [rows, k] of n experts: the plan, each pair's row
   gathered (xs [pairs, hidden], experts in order), and every used expert's w1 and w3 ([n, hidden/2,
   inter] FP4 with their scales) over its rows, into a and b [pairs, inter]; returns the pairs */
extern "C" int64_t dsv4_fp4_ffn_in(const float *x, int64_t rows, int64_t hidden, const int64_t *idx, int64_t k,
                                   int64_t n, const uint8_t *w1, const uint8_t *s1, const uint8_t *w3,
                                   const uint8_t *s3, int64_t stride, int64_t ld, int64_t sstride, int64_t sld,
                                   int64_t group, int64_t inter, int64_t *plan, float *xs, float *a, float *b,
                                   int threads, int isa) {
    isa = run_isa(isa);
    const int64_t choices = rows * k;
    ffn_plan(idx, choices, n, plan);
    const int64_t *order = plan + choices, *ids = order + choices, *starts = ids + n, used = starts[n + 1];
    const int64_t pairs = starts[used];
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t q = 0; q < pairs; q++)
            memcpy(xs + q * hidden, x + (order[q] / k) * hidden, hidden * sizeof(float));
        const Weights w = {{w1, w3}, {s1, s3}, {a, b}, 2};
        grouped_in_team(xs, ids, starts, used, w, stride, ld, sstride, sld, hidden / 2, inter, group, isa);
    }
    return pairs;
}

/* the activations act [pairs, inter] (the plan's order) times each used expert's w2 ([n, inter/2,
   hidden]) into y [pairs, hidden], then out [rows, hidden] = each row's sum of its pairs' y times
   their gates [rows, k], in the pairs' order (a product, then an add: as `index_add_` of the torch
   ops rounds; k <= 64) */
extern "C" void dsv4_fp4_ffn_out(const float *act, int64_t rows, int64_t hidden, const float *gates, int64_t k,
                                 int64_t n, const uint8_t *w2, const uint8_t *s2, int64_t stride, int64_t ld,
                                 int64_t sstride, int64_t sld, int64_t group, int64_t inter, const int64_t *plan,
                                 float *y, float *out, int threads, int isa) {
    isa = run_isa(isa);
    const int64_t choices = rows * k, *at = plan, *ids = plan + 2 * choices, *starts = ids + n, used = starts[n + 1];
#pragma omp parallel num_threads(threads)
    {
        const Weights w = {{w2, nullptr}, {s2, nullptr}, {y, nullptr}, 1};
        grouped_in_team(act, ids, starts, used, w, stride, ld, sstride, sld, inter / 2, hidden, group, isa);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t mine[64], m = 0;  /* the row's choices, by their place among the pairs */
            for (int64_t c = 0; c < k; c++)
                if (at[r * k + c] >= 0) {
                    int64_t j = m++;
                    for (; j > 0 && at[mine[j - 1]] > at[r * k + c]; j--) mine[j] = mine[j - 1];
                    mine[j] = r * k + c;
                }
            float *o = out + r * hidden;
            for (int64_t j = 0; j < hidden; j++) o[j] = 0.0f;
            for (int64_t i = 0; i < m; i++) {
                const float g = gates[mine[i]], *yq = y + at[mine[i]] * hidden;
                for (int64_t j = 0; j < hidden; j++) {
                    const float term = g * yq[j];
                    o[j] += term;
                }
            }
        }
    }
}
"""
