/* Attention kernels of the scheduler's "cpu" attention backend (common.h: the helpers and
 * the conventions every kernel follows).
 *
 * - rs_decode_attention: one query per request over its keys, read in place from the
 *   token-granular paged KV pool through the request's row of KV indices (no gathered
 *   copy), grouped-query heads sharing each K/V row, scores and softmax in fp32 (the
 *   two-pass form: scores, then max-subtracted exp and the value sum); optionally a
 *   sliding window (only the last `window` keys of each request are read) and attention
 *   logit soft-capping (cap * tanh(s / cap), Gemma 2). With AVX-512 (head dims 64, 128,
 *   256: decode_one_avx512) each K and V row is loaded and widened once for its G heads,
 *   and the scores are summed 16 keys at a time by a transpose tree that adds the same
 *   lane pairs as the per-key _mm512_reduce_add_ps it replaced (the same bits, 15 shuffles
 *   for 16 scores instead of 64); the portable form (DEFINE_DECODE_ONE) goes key by key.
 * - rs_rotary_store: rotary embedding of the q and k heads of a fused qkv row (the
 *   rotate_half form of Llama checkpoints), q to its output, k and v into the pool rows.
 *
 * Attention keeps its intermediates in fp32 (explicit fmaf) and rounds only its output;
 * rs_rotary_store rounds to bf16 where the torch reference rounds, as the element-wise
 * kernels do (elementwise.c).
 */
#include "common.h"

#include <stdatomic.h>

/* Soft-capping of n scores in place: cap * tanh(s / cap) (cap > 0). */
static void soft_cap(float *s, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
}

/* Attention of one (request, KV head): G query heads against L keys at rows idx[0..L-1].
 * qf: [G, D] fp32, pre-scaled; scores: [G, L] scratch; acc: [G, D] scratch; out rows of
 * the G heads at out_row (stride D elements). */
#define DEFINE_DECODE_ONE(NAME, T, LD)                                                             \
    static void NAME(const float *qf, const T *k, const T *v, const int64_t *idx, int64_t L,       \
                     int64_t row_stride, int64_t G, int64_t D, float *scores, float *acc,          \
                     void *out_row, float softcap, int is_bf16) {                                  \
        for (int64_t j = 0; j < L; j++) {                                                          \
            const T *kr = k + idx[j] * row_stride;                                                 \
            if (j + 4 < L) __builtin_prefetch(k + idx[j + 4] * row_stride);                        \
            for (int64_t g = 0; g < G; g++) {                                                      \
                const float *qg = qf + g * D;                                                      \
                float part[LANES] = {0};                                                           \
                int64_t d = 0;                                                                     \
                for (; d + LANES <= D; d += LANES)                                                 \
                    for (int l = 0; l < LANES; l++) part[l] = fmaf(qg[d + l], LD(kr[d + l]), part[l]); \
                for (int l = 0; d < D; d++, l++) part[l] = fmaf(qg[d], LD(kr[d]), part[l]);        \
                scores[g * L + j] = sum_lanes(part);                                               \
            }                                                                                      \
        }                                                                                          \
        if (softcap > 0.0f) soft_cap(scores, G * L, softcap);                                      \
        float sums[G];                                                                             \
        for (int64_t g = 0; g < G; g++) {                                                          \
            float *sg = scores + g * L;                                                            \
            float m = -INFINITY;                                                                   \
            for (int64_t j = 0; j < L; j++) m = sg[j] > m ? sg[j] : m;                             \
            float part[LANES] = {0};                                                               \
            for (int64_t j = 0; j < L; j++) {                                                      \
                sg[j] = exp_f32(sg[j] - m);                                                        \
                part[j % LANES] += sg[j];                                                          \
            }                                                                                      \
            sums[g] = sum_lanes(part);                                                             \
        }                                                                                          \
        memset(acc, 0, sizeof(float) * G * D);                                                     \
        for (int64_t j = 0; j < L; j++) {                                                          \
            const T *vr = v + idx[j] * row_stride;                                                 \
            if (j + 4 < L) __builtin_prefetch(v + idx[j + 4] * row_stride);                        \
            for (int64_t g = 0; g < G; g++) {                                                      \
                float p = scores[g * L + j];                                                       \
                float *ag = acc + g * D;                                                           \
                _Pragma("omp simd") for (int64_t d = 0; d < D; d++) ag[d] = fmaf(p, LD(vr[d]), ag[d]); \
            }                                                                                      \
        }                                                                                          \
        for (int64_t g = 0; g < G; g++) {                                                          \
            float inv = 1.0f / sums[g];                                                            \
            for (int64_t d = 0; d < D; d++) store(out_row, g * D + d, acc[g * D + d] * inv, is_bf16); \
        }                                                                                          \
    }

#define LOAD_F32(x) (x)
DEFINE_DECODE_ONE(decode_one_bf16, bf16_t, bf16_to_f32)
DEFINE_DECODE_ONE(decode_one_f32, float, LOAD_F32)

#if HAVE_AVX512
/* softmax numerator in place over s[0..L-1]: exp(s - max); returns the sum. */
static inline float exp_minus_max(float *s, int64_t L) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    float m = _mm512_reduce_max_ps(mv);
    for (; j < L; j++) m = s[j] > m ? s[j] : m;
    const __m512 mm = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (j = 0; j < L; j += 16) {
        const __mmask16 k = L - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - j)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mm));
        _mm512_mask_storeu_ps(s + j, k, e);
        sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(sv);
}

/* Sums of 16 vectors at once, each in the order of _mm512_reduce_add_ps (GCC's: lane i +
 * lane i+8, then i + i+4, i + i+2, i + i+1), so a score has the bits the per-key reduction
 * gave. p holds 16 vectors x_0..x_15 (16 floats each); lane l of the result is the sum of
 * x_{r(l)}, r the 4-bit reversal (what this tree's lane order works out to; the caller
 * stores key t's vector at x_{r(t)}). Each level pairs the same lanes as the reduction (a
 * blend and one permute feed one add for two vectors); fp addition is commutative, so only
 * the pairs matter, not which operand is first. 15 x (permute, blend, add) for 16 sums,
 * where 16 reductions took 4 shuffles and 4 dependent adds each. */
static inline __attribute__((always_inline)) __m512 sum16(const float *p) {
    const __m512i i2 = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
    const __m512i i4 = _mm512_setr_epi32(1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
    __m512 y[8], z[4], w[2];
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) {  /* i + i+8: [a 0..7 | b 8..15] + [a 8..15 | b 0..7] */
        const __m512 a = _mm512_loadu_ps(p + 32 * m), b = _mm512_loadu_ps(p + 32 * m + 16);
        y[m] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4(a, b, 0x4E));
    }
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++)  /* i + i+4 within each half: 128-bit blocks (a0 b1 a2 b3) + (a1 b0 a3 b2) */
        z[m] = _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, y[2 * m], y[2 * m + 1]),
                             _mm512_permutex2var_ps(y[2 * m], i2, y[2 * m + 1]));
#pragma GCC unroll 2
    for (int m = 0; m < 2; m++)  /* i + i+2 in each 128-bit block: (a0 a1 b2 b3) + (a2 a3 b0 b1) */
        w[m] = _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, z[2 * m], z[2 * m + 1]),
                             _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], 0x4E));
    /* i + i+1: (a0 b1 a2 b3) + (a1 b0 a3 b2) */
    return _mm512_add_ps(_mm512_mask_blend_ps(0xAAAA, w[0], w[1]), _mm512_permutex2var_ps(w[0], i4, w[1]));
}

/* The value sums of query heads g0..g0+GC-1 (GC * D / 16 accumulators, in registers): each
 * V row is loaded (and widened) once for the GC heads instead of once per head; each
 * accumulator's chain over the keys is the same. */
static inline __attribute__((always_inline)) void value_sums(
    const float *scores, const float *inv, const char *v, const int64_t *idx, int64_t L, int64_t row_bytes,
    int64_t g0, const int GC, const int64_t D, void *out_row, int is_bf16) {
    const int64_t nv = D / 16, es = is_bf16 ? 2 : 4;
    __m512 acc[6][16];
#pragma GCC unroll 6
    for (int g = 0; g < GC; g++)
#pragma GCC unroll 16
        for (int64_t c = 0; c < nv; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        const char *vr = v + idx[j] * row_bytes;
        if (g0 == 0 && j + 6 < L) {
            const char *next = v + idx[j + 6] * row_bytes;
            for (int64_t c = 0; c < D * es; c += 64) __builtin_prefetch(next + c);
        }
        __m512 p[6];
#pragma GCC unroll 6
        for (int g = 0; g < GC; g++) p[g] = _mm512_set1_ps(scores[(g0 + g) * L + j]);
#pragma GCC unroll 16
        for (int64_t c = 0; c < nv; c++) {
            const __m512 x = load16(vr + c * 16 * es, is_bf16);
#pragma GCC unroll 6
            for (int g = 0; g < GC; g++) acc[g][c] = _mm512_fmadd_ps(p[g], x, acc[g][c]);
        }
    }
#pragma GCC unroll 6
    for (int g = 0; g < GC; g++) {
        float res[256];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nv; c++)
            _mm512_storeu_ps(res + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g0 + g])));
        for (int64_t d = 0; d < D; d++) store(out_row, (g0 + g) * D + d, res[d], is_bf16);
    }
}

/* decode_one_* with AVX-512 registers; D is a constant at each call (64, 128 or 256), so
 * the loops over D unroll and the value sums stay in registers. Scores: each K row is
 * loaded (and widened) once for the G heads; a key's per-lane products are stored for
 * sum16, which every 16 keys turns each head's 16 vectors into 16 scores (the last L % 16
 * keys are reduced one at a time: the same bits). Values: value_sums over chunks of at
 * most 24 / (D / 16) heads (24 accumulators), of near-equal sizes.
 * scratch: G * 512 floats, 4096-aligned; head g's 2 KB holds its key vectors (1 KB) and
 * then a copy of its q row, so no q load shares its address's low 12 bits with a vector
 * store still in flight (a load that does waits as if it depended on the store: "4K
 * aliasing", which cost this kernel a fifth of its time). */
static inline __attribute__((always_inline)) void decode_one_avx512(
    const float *qf, const char *k, const char *v, const int64_t *idx, int64_t L, int64_t row_bytes,
    int64_t G, const int64_t D, float *scores, float *scratch, void *out_row, float softcap, int is_bf16) {
    static const uint8_t rev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    const int64_t nv = D / 16, es = is_bf16 ? 2 : 4;
    for (int64_t g = 0; g < G; g++) memcpy(scratch + g * 512 + 256, qf + g * D, sizeof(float) * D);
    for (int64_t j = 0; j < L; j++) {
        const char *kr = k + idx[j] * row_bytes;
        if (j + 6 < L) {
            const char *next = k + idx[j + 6] * row_bytes;
            for (int64_t c = 0; c < D * es; c += 64) __builtin_prefetch(next + c);
        }
        __m512 kv[16];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nv; c++) kv[c] = load16(kr + c * 16 * es, is_bf16);
        float *pj = scratch + rev4[j & 15] * 16;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = scratch + g * 512 + 256;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
#pragma GCC unroll 16
            for (int64_t c = 1; c < nv; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * 16), kv[c], a);
            _mm512_storeu_ps(pj + g * 512, a);
        }
        if ((j & 15) == 15)
            for (int64_t g = 0; g < G; g++) _mm512_storeu_ps(scores + g * L + j - 15, sum16(scratch + g * 512));
    }
    for (int64_t j = L & ~(int64_t)15; j < L; j++)
        for (int64_t g = 0; g < G; g++)
            scores[g * L + j] = _mm512_reduce_add_ps(_mm512_loadu_ps(scratch + g * 512 + rev4[j & 15] * 16));
    if (softcap > 0.0f) soft_cap(scores, G * L, softcap);
    float inv[G];
    for (int64_t g = 0; g < G; g++) inv[g] = 1.0f / exp_minus_max(scores + g * L, L);
    const int gmax = 24 / nv;
    for (int64_t g0 = 0; g0 < G;) {
        const int64_t left = G - g0, chunks = (left + gmax - 1) / gmax, gc = (left + chunks - 1) / chunks;
        switch (gc) {  /* gc <= gmax, a constant here: the larger cases compile away */
#define VALUE_SUMS(n) \
    case n: \
        if (n <= gmax) value_sums(scores, inv, v, idx, L, row_bytes, g0, n, D, out_row, is_bf16); \
        break;
            VALUE_SUMS(1) VALUE_SUMS(2) VALUE_SUMS(3) VALUE_SUMS(4) VALUE_SUMS(5) VALUE_SUMS(6)
#undef VALUE_SUMS
        }
        g0 += gc;
    }
}
#endif

typedef struct {
    const void *q, *k_buf, *v_buf;
    const int64_t *kv_indices, *rows, *seq_lens;
    void *out;
    int64_t idx_stride, B, Hq, Hkv, D, window;
    float scale, softcap;
    int is_bf16;
    _Atomic int64_t next;  /* the next (request, KV head) item to take */
} attn_args;

/* Threads take (request, KV head) items one at a time from a shared counter (requests'
 * lengths differ); which thread computes an item does not change its result. */
static void attention_task(void *ctx, int tid, int nth) {
    (void)tid;
    (void)nth;
    attn_args *a = ctx;
    const void *q = a->q, *k_buf = a->k_buf, *v_buf = a->v_buf;
    const int64_t *kv_indices = a->kv_indices, *rows = a->rows, *seq_lens = a->seq_lens;
    void *out = a->out;
    const int64_t idx_stride = a->idx_stride, Hq = a->Hq, Hkv = a->Hkv, D = a->D, window = a->window;
    const float scale = a->scale, softcap = a->softcap;
    const int is_bf16 = a->is_bf16;
    const int64_t max_len = idx_stride;
    const int64_t G = Hq / Hkv;
    const int64_t es = is_bf16 ? 2 : 4;
    float *qf = malloc(sizeof(float) * G * D);
    float *acc = malloc(sizeof(float) * G * D);
    float *scores = malloc(sizeof(float) * G * (max_len > 0 ? max_len : 1));
    float *scratch = aligned_alloc(4096, 4096 * ((G + 1) / 2));  /* decode_one_avx512's, G * 2 KB */
    for (int64_t item; (item = atomic_fetch_add(&a->next, 1)) < a->B * Hkv;) {
        const int64_t b = item / Hkv, h = item % Hkv;
        int64_t L = seq_lens[b] < max_len ? seq_lens[b] : max_len;
        const int64_t first = window > 0 && L > window ? L - window : 0;
        L -= first;
        const int64_t head0 = b * Hq + h * G;
        if (L <= 0) {
            memset((char *)out + head0 * D * es, 0, G * D * es);
            continue;
        }
        for (int64_t e = 0; e < G * D; e++) qf[e] = load(q, head0 * D + e, is_bf16) * scale;
        const int64_t *idx = kv_indices + (rows ? rows[b] : b) * idx_stride + first;
        char *out_row = (char *)out + head0 * D * es;
#if HAVE_AVX512
        const char *kh = (const char *)k_buf + h * D * es, *vh = (const char *)v_buf + h * D * es;
        if (D == 64 && is_bf16) {
            decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 64, scores, scratch, out_row, softcap, 1);
            continue;
        } else if (D == 64) {
            decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 64, scores, scratch, out_row, softcap, 0);
            continue;
        } else if (D == 128 && is_bf16) {
            decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 128, scores, scratch, out_row, softcap, 1);
            continue;
        } else if (D == 128) {
            decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 128, scores, scratch, out_row, softcap, 0);
            continue;
        } else if (D == 256 && is_bf16) {
            decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 256, scores, scratch, out_row, softcap, 1);
            continue;
        } else if (D == 256) {
            decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 256, scores, scratch, out_row, softcap, 0);
            continue;
        }
#endif
        if (is_bf16)
            decode_one_bf16(qf, (const bf16_t *)k_buf + h * D, (const bf16_t *)v_buf + h * D, idx, L,
                            Hkv * D, G, D, scores, acc, out_row, softcap, 1);
        else
            decode_one_f32(qf, (const float *)k_buf + h * D, (const float *)v_buf + h * D, idx, L,
                           Hkv * D, G, D, scores, acc, out_row, softcap, 0);
    }
    free(qf);
    free(acc);
    free(scores);
    free(scratch);
}

/* q: [B, Hq, D]; k_buf, v_buf: [N, Hkv, D]; kv_indices: int64 [R, idx_stride]; rows: int64
 * [B], the row of kv_indices that query b reads, or NULL for row b (R = B); the first
 * seq_lens[b] entries of that row are used, clamped to idx_stride; seq_lens: int64 [B]; a
 * query with no keys gets zeros; out: [B, Hq, D]. Query head h*G+g uses KV head h
 * (G = Hq / Hkv). window > 0: only the last `window` of those keys (the query sits at
 * position seq_len - 1 and sees positions > seq_len - 1 - window); softcap > 0: scores
 * become softcap * tanh(score / softcap) before the softmax. Each query's result depends
 * only on its own q, keys and values (one thread computes it, in a fixed order): with
 * ``rows`` the extend part of a step runs through this kernel too, so a token's attention
 * is the same whether it is decoded, prefilled, prefilled in another chunk or batched with
 * other requests. */
void rs_decode_attention(const void *q, const void *k_buf, const void *v_buf, const int64_t *kv_indices,
                         int64_t idx_stride, const int64_t *rows, const int64_t *seq_lens, void *out, int64_t B,
                         int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t window, float softcap,
                         int is_bf16) {
    attn_args a = {q, k_buf, v_buf, kv_indices, rows, seq_lens, out, idx_stride, B, Hq, Hkv, D, window,
                   scale, softcap, is_bf16, 0};
    rs_parallel(attention_task, &a, B * Hkv > 1);
}

/* qkv: [T, qkv_stride] rows holding Hq q heads, Hkv k heads, Hkv v heads of D elements;
 * cos, sin: [T, D]; loc: int64 [T] pool rows; q_out: [T, Hq, D]; k_buf, v_buf: [N, Hkv, D].
 * Per element, as the torch reference: round(round(x * cos) + round(rotate_half(x) * sin)). */
typedef struct {
    const void *qkv, *cos, *sin;
    const int64_t *loc;
    void *q_out, *k_buf, *v_buf;
    int64_t qkv_stride, T, Hq, Hkv, D;
    int is_bf16;
} rotary_args;

static void rotary_task(void *ctx, int tid, int nth) {
    const rotary_args *a = ctx;
    const void *qkv = a->qkv, *cos = a->cos, *sin = a->sin;
    const int64_t *loc = a->loc;
    void *q_out = a->q_out, *k_buf = a->k_buf, *v_buf = a->v_buf;
    const int64_t qkv_stride = a->qkv_stride, Hq = a->Hq, Hkv = a->Hkv, D = a->D;
    const int is_bf16 = a->is_bf16;
    const int64_t half = D / 2;
    const int64_t es = is_bf16 ? 2 : 4;
    int64_t t0, t1;
    rs_split(a->T, tid, nth, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t row = t * qkv_stride;
        for (int64_t head = 0; head < Hq + Hkv; head++) {
            const int64_t x0 = row + head * D;
            void *dst;
            int64_t o;
            if (head < Hq) {
                dst = q_out;
                o = (t * Hq + head) * D;
            } else {
                dst = k_buf;
                o = (loc[t] * Hkv + head - Hq) * D;
            }
            for (int64_t d = 0; d < D; d++) {
                float x = load(qkv, x0 + d, is_bf16);
                float rh = d < half ? -load(qkv, x0 + d + half, is_bf16) : load(qkv, x0 + d - half, is_bf16);
                float a = round_to(x * load(cos, t * D + d, is_bf16), is_bf16);
                float b = round_to(rh * load(sin, t * D + d, is_bf16), is_bf16);
                store(dst, o + d, a + b, is_bf16);
            }
        }
        memcpy((char *)v_buf + loc[t] * Hkv * D * es, (const char *)qkv + (row + (Hq + Hkv) * D) * es,
               Hkv * D * es);
    }
}

void rs_rotary_store(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin, const int64_t *loc,
                     void *q_out, void *k_buf, void *v_buf, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                     int is_bf16) {
    rotary_args a = {qkv, cos, sin, loc, q_out, k_buf, v_buf, qkv_stride, T, Hq, Hkv, D, is_bf16};
    rs_parallel(rotary_task, &a, T > 16);
}
