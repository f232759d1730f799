/* Token-wise matching on CPU: the two max reductions of a chunk of similarities, fused, and the backward
 * pass as gathers and scatter-adds, for float32. Loaded through ctypes by token_matching_native.py, which
 * compiles this file on first use; token_matching.py keeps a pure-torch path with the same results.
 *
 * Why C: after torch's batched product of a chunk (cache-sized), the row maxima, the column maxima and
 * their arg-maxima take about ten passes over the chunk with torch operations (``max`` with indices is
 * ~10x slower than ``amax`` on CPU); here they are one pass over data that is still in the cache.
 *
 * The vectors are GCC/clang vector extensions of 16 floats: AVX-512 registers where the machine has them
 * (compiled with -march=native), pairs of AVX2 registers or quadruples of SSE registers elsewhere.
 * Ties go to the first maximum, as torch.max does: lanes only move on a strict ">", and the lanes that hold
 * the maximum give the smallest index.
 */
#include <stdint.h>
#include <stdlib.h>

#define W 16
typedef float vf __attribute__((vector_size(4 * W), aligned(4)));   /* unaligned loads allowed */
typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4)));

static inline vf blend_f(vf a, vf b, vi take_b) { return (vf)(((vi)a & ~take_b) | ((vi)b & take_b)); }
static inline vi blend_i(vi a, vi b, vi take_b) { return (a & ~take_b) | (b & take_b); }

/* Max and first arg-max of row[0..m). */
static inline float row_max(const float *row, int64_t m, int32_t *arg)
{
    int64_t j = 0;
    float best;
    int32_t best_i;
    if (m >= W) {
        vi iota, step;
        for (int t = 0; t < W; t++) { iota[t] = t; step[t] = W; }
        vf vmax = *(const vf *)row;
        vi vidx = iota;
        vi cur = iota + step;
        for (j = W; j + W <= m; j += W, cur += step) {
            vf x = *(const vf *)(row + j);
            vi gt = x > vmax;
            vmax = blend_f(vmax, x, gt);
            vidx = blend_i(vidx, cur, gt);
        }
        best = vmax[0];
        best_i = vidx[0];
        for (int t = 1; t < W; t++)
            if (vmax[t] > best || (vmax[t] == best && vidx[t] < best_i)) { best = vmax[t]; best_i = vidx[t]; }
    } else {
        best = row[0];
        best_i = 0;
        j = 1;
    }
    for (; j < m; j++)
        if (row[j] > best) { best = row[j]; best_i = (int32_t)j; }
    *arg = best_i;
    return best;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* One row of the chunk: its maxima over each key item's m columns (and first arg-max), and the running
 * column maxima cmax/carg updated with the row's values (row index l), in a single pass over the row. */
static inline void row_pass(const float *row, int64_t cb, int64_t m, int32_t l, float *cmax, int32_t *carg,
                            double *rsum, int16_t *idx1_l, int64_t idx1_step)
{
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    const __m512i lv = _mm512_set1_epi32(l);
    for (int64_t b = 0; b < cb; b++) {
        const float *seg = row + b * m;
        float *cm = cmax + b * m;
        int32_t *ca = carg + b * m;
        __m512 vmax = ninf;
        int64_t j = 0;
        for (; j < m; j += W) {
            __mmask16 in = (m - j >= W) ? (__mmask16)0xFFFF : (__mmask16)((1u << (m - j)) - 1u);
            __m512 x = _mm512_mask_loadu_ps(ninf, in, seg + j);
            vmax = _mm512_max_ps(vmax, x);
            __m512 c = _mm512_maskz_loadu_ps(in, cm + j);
            __mmask16 gt = _mm512_mask_cmp_ps_mask(in, x, c, _CMP_GT_OQ) | (l == 0 ? in : 0);
            _mm512_mask_storeu_ps(cm + j, gt, x);
            _mm512_mask_storeu_epi32(ca + j, gt, lv);
        }
        float best = _mm512_reduce_max_ps(vmax);
        /* First column holding the maximum (the data is still in L1). */
        const __m512 bv = _mm512_set1_ps(best);
        int32_t arg = 0;
        for (j = 0; j < m; j += W) {
            __mmask16 in = (m - j >= W) ? (__mmask16)0xFFFF : (__mmask16)((1u << (m - j)) - 1u);
            __mmask16 eq = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, seg + j), bv, _CMP_EQ_OQ);
            if (eq) { arg = (int32_t)j + __builtin_ctz(eq); break; }
        }
        rsum[b] += best;
        idx1_l[b * idx1_step] = (int16_t)arg;
    }
}
#endif

/* s: one chunk of similarities, contiguous [h][ca][n][cb][m] (query item a, query token l, key item b, key
 * token j). For every (head, a, b):
 *   t2v = mean_l max_j s,  idx1[l] = argmax_j s   (each query token's best key token)
 *   v2t = mean_j max_l s,  idx2[j] = argmax_l s   (each key token's best query token)
 * Outputs are written through element strides (st: t2v/v2t [head, a, b]; s1: idx1 [head, a, l, b];
 * s2: idx2 [head, a, b, j]) so that the caller passes views into the whole batch's tensors.
 * Returns 0, or -1 when the scratch memory cannot be had. */
int tm_reduce_chunk(const float *s, int64_t h, int64_t ca, int64_t n, int64_t cb, int64_t m,
                    float *t2v, float *v2t, const int64_t *st,
                    int16_t *idx1, const int64_t *s1, int16_t *idx2, const int64_t *s2)
{
    const int64_t row_len = cb * m;
    float *cmax = malloc(sizeof(float) * row_len);
    int32_t *carg = malloc(sizeof(int32_t) * row_len);
    double *rsum = malloc(sizeof(double) * cb);
    if (!cmax || !carg || !rsum) { free(cmax); free(carg); free(rsum); return -1; }
    for (int64_t hh = 0; hh < h; hh++) {
        for (int64_t a = 0; a < ca; a++) {
            const float *blk = s + (hh * ca + a) * n * row_len;
            for (int64_t b = 0; b < cb; b++) rsum[b] = 0.0;
            for (int64_t l = 0; l < n; l++) {
                const float *row = blk + l * row_len;
#if defined(__AVX512F__)
                row_pass(row, cb, m, (int32_t)l, cmax, carg, rsum, idx1 + hh * s1[0] + a * s1[1] + l * s1[2], s1[3]);
                continue;
#endif
                /* Row maxima, one per key item b. */
                for (int64_t b = 0; b < cb; b++) {
                    int32_t arg;
                    rsum[b] += row_max(row + b * m, m, &arg);
                    idx1[hh * s1[0] + a * s1[1] + l * s1[2] + b * s1[3]] = (int16_t)arg;
                }
                /* Column maxima: the running maximum of every column, updated by this row. */
                if (l == 0) {
                    for (int64_t j = 0; j < row_len; j++) { cmax[j] = row[j]; carg[j] = 0; }
                    continue;
                }
                int64_t j = 0;
                vi cur;
                for (int t = 0; t < W; t++) cur[t] = (int32_t)l;
                for (; j + W <= row_len; j += W) {
                    vf x = *(const vf *)(row + j);
                    vf c = *(vf *)(cmax + j);
                    vi gt = x > c;
                    *(vf *)(cmax + j) = blend_f(c, x, gt);
                    *(vi *)(carg + j) = blend_i(*(vi *)(carg + j), cur, gt);
                }
                for (; j < row_len; j++)
                    if (row[j] > cmax[j]) { cmax[j] = row[j]; carg[j] = (int32_t)l; }
            }
            for (int64_t b = 0; b < cb; b++) {
                double csum = 0.0;
                for (int64_t j = 0; j < m; j++) {
                    csum += cmax[b * m + j];
                    idx2[hh * s2[0] + a * s2[1] + b * s2[2] + j * s2[3]] = (int16_t)carg[b * m + j];
                }
                int64_t o = hh * st[0] + a * st[1] + b * st[2];
                t2v[o] = (float)(rsum[b] / (double)n);
                v2t[o] = (float)(csum / (double)m);
            }
        }
    }
    free(cmax);
    free(carg);
    free(rsum);
    return 0;
}

static inline void axpy(float *restrict y, const float *restrict x, float w, int64_t d)
{
    for (int64_t i = 0; i < d; i++) y[i] += w * x[i];
}

/* Backward pass. q [h][A][n][d], k [h][B][m][d], idx1 [h][A][n][B], idx2 [h][A][B][m], w1 and w2 [h][A][B]:
 * the incoming gradients of t2v and v2t already divided by n and m (either may be NULL). A query token
 * (a, l) that won key token j of item b gets w1·k[b, j] and gives w1·q[a, l] to it; likewise for the key
 * tokens' winners with w2. Two passes, so that every gradient row is summed by one call in a fixed order
 * whatever the split over threads: dq over query items [a_lo, a_hi), dk over key items [b_lo, b_hi). */
void tm_backward_dq(const float *q, const float *k, int64_t h, int64_t A, int64_t n, int64_t B, int64_t m,
                    int64_t d, const int16_t *idx1, const int16_t *idx2, const float *w1, const float *w2,
                    float *dq, int64_t a_lo, int64_t a_hi)
{
    (void)q;
    for (int64_t hh = 0; hh < h; hh++) {
        const float *kh = k + hh * B * m * d;
        for (int64_t a = a_lo; a < a_hi; a++) {
            float *dqa = dq + (hh * A + a) * n * d;
            if (w1) {
                const float *wa = w1 + (hh * A + a) * B;
                const int16_t *i1 = idx1 + (hh * A + a) * n * B;
                for (int64_t l = 0; l < n; l++)
                    for (int64_t b = 0; b < B; b++)
                        axpy(dqa + l * d, kh + (b * m + i1[l * B + b]) * d, wa[b], d);
            }
            if (w2) {
                const float *wa = w2 + (hh * A + a) * B;
                const int16_t *i2 = idx2 + (hh * A + a) * B * m;
                for (int64_t b = 0; b < B; b++)
                    for (int64_t j = 0; j < m; j++)
                        axpy(dqa + i2[b * m + j] * d, kh + (b * m + j) * d, wa[b], d);
            }
        }
    }
}

void tm_backward_dk(const float *q, const float *k, int64_t h, int64_t A, int64_t n, int64_t B, int64_t m,
                    int64_t d, const int16_t *idx1, const int16_t *idx2, const float *w1, const float *w2,
                    float *dk, int64_t b_lo, int64_t b_hi)
{
    (void)k;
    for (int64_t hh = 0; hh < h; hh++) {
        for (int64_t b = b_lo; b < b_hi; b++) {
            float *dkb = dk + (hh * B + b) * m * d;
            for (int64_t a = 0; a < A; a++) {
                const float *qa = q + (hh * A + a) * n * d;
                if (w1) {
                    const float w = w1[(hh * A + a) * B + b];
                    const int16_t *i1 = idx1 + (hh * A + a) * n * B + b;
                    for (int64_t l = 0; l < n; l++)
                        axpy(dkb + i1[l * B] * d, qa + l * d, w, d);
                }
                if (w2) {
                    const float w = w2[(hh * A + a) * B + b];
                    const int16_t *i2 = idx2 + ((hh * A + a) * B + b) * m;
                    for (int64_t j = 0; j < m; j++)
                        axpy(dkb + j * d, qa + i2[j] * d, w, d);
                }
            }
        }
    }
}
