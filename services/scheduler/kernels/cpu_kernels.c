/* CPU kernels of the scheduler's "cpu" attention backend (kernels/cpu_kernels.py builds and
 * loads this file; see its docstring for shapes, dtypes and numerics).
 *
 * - rs_decode_attention: one query per request over its keys, read in place from the
 *   token-granular paged KV pool through the request's row of KV indices (no gathered
 *   copy), grouped-query heads sharing each K/V row, scores and softmax in fp32 (the
 *   two-pass form: scores, then max-subtracted exp and the value sum); optionally a
 *   sliding window (only the last `window` keys of each request are read) and attention
 *   logit soft-capping (cap * tanh(s / cap), Gemma 2).
 * - rs_rotary_store: rotary embedding of the q and k heads of a fused qkv row (the
 *   rotate_half form of Llama checkpoints), q to its output, k and v into the pool rows.
 * - rs_add_rms_norm: optional residual add, then RMSNorm (Zhang & Sennrich 2019).
 * - rs_silu_and_mul: SiLU(gate) * up over a fused gate/up row.
 *
 * Element-wise kernels round to bf16 exactly where the torch reference rounds (each torch
 * op rounds its result), so they give the torch path's bits; compiled with
 * -ffp-contract=off so no multiply-add is fused behind their back. Attention keeps its
 * intermediates in fp32 (explicit fmaf) and rounds only its output.
 *
 * Tensors are passed as raw pointers to contiguous data; is_bf16 selects bfloat16 (as
 * uint16 bits) or float32 elements. OpenMP threads come from the caller's thread (torch
 * loads libgomp first, so this library shares torch's runtime and thread count).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion, bit for bit. */
static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const bf16_t rounded = (bf16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (bf16_t)0x7FC0 : rounded;
}

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((bf16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* What storing v in the model dtype and reading it back gives. */
static inline float round_to(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* exp for x <= 88: Cephes' expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp),
 * written so the compiler vectorizes it (glibc's expf is not vectorized without -ffast-math). */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

/* Reductions in a fixed order: LANES partial sums (element i into lane i % LANES), then the
 * lanes in order. The compiler may vectorize the lanes (that keeps each lane's order) but
 * may not reassociate, so a row's sum does not depend on which thread computes it or on
 * its scratch buffer's alignment -- an `omp simd reduction` may peel a different number of
 * leading elements for a differently aligned buffer, and did: RMSNorm gave a token other
 * bits in a batch of 64 (threaded) than alone. Deterministic inference relies on this. */
#define LANES 16
static inline float sum_lanes(const float *part) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += part[l];
    return s;
}

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

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 elements at p as fp32 (bf16 widens exactly: its bits are the high half of a float). */
static inline __attribute__((always_inline)) __m512 load16(const char *p, int is_bf16) {
    if (is_bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* exp_f32 on 16 lanes (the same Cephes steps). */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_add_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* Round 16 floats to bf16 (round to nearest even, NaN to 0x7FC0), as bits in the high
 * halves of 32-bit lanes (so "& 0xFFFF0000" reads it back as a float). */
static inline __attribute__((always_inline)) __m512i round_bf16_512(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0x7FC00000), r);
}

static inline __attribute__((always_inline)) void store16_bf16(bf16_t *p, __m512i high_halves) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(high_halves, 16)));
}

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

/* decode_one_* with AVX-512 registers; D is a constant at each call (64, 128 or 256), so
 * the loops over D unroll and the value sums stay in registers. */
static inline __attribute__((always_inline)) void decode_one_avx512(
    const float *qf, const char *k, const char *v, const int64_t *idx, int64_t L, int64_t row_bytes,
    int64_t G, const int64_t D, float *scores, void *out_row, float softcap, int is_bf16) {
    const int64_t nv = D / 16, es = is_bf16 ? 2 : 4;
    for (int64_t j = 0; j < L; j++) {
        const char *kr = k + idx[j] * row_bytes;
        if (j + 6 < L) {
            const char *next = k + idx[j + 6] * row_bytes;
            for (int64_t c = 0; c < D * es; c += 64) __builtin_prefetch(next + c);
        }
        __m512 kv[16];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nv; c++) kv[c] = load16(kr + c * 16 * es, is_bf16);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
#pragma GCC unroll 16
            for (int64_t c = 1; c < nv; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * 16), kv[c], a);
            scores[g * L + j] = _mm512_reduce_add_ps(a);
        }
    }
    if (softcap > 0.0f) soft_cap(scores, G * L, softcap);
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * L;
        const float inv = 1.0f / exp_minus_max(sg, L);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < L; j++) {
            const char *vr = v + idx[j] * row_bytes;
            if (g == 0 && j + 6 < L) {
                const char *next = v + idx[j + 6] * row_bytes;
                for (int64_t c = 0; c < D * es; c += 64) __builtin_prefetch(next + c);
            }
            const __m512 p = _mm512_set1_ps(sg[j]);
#pragma GCC unroll 16
            for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_fmadd_ps(p, load16(vr + c * 16 * es, is_bf16), acc[c]);
        }
        float res[256];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(res + c * 16, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
        for (int64_t d = 0; d < D; d++) store(out_row, g * D + d, res[d], is_bf16);
    }
}
#define HAVE_AVX512_DECODE 1
#else
#define HAVE_AVX512_DECODE 0
#endif

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
    const int64_t max_len = idx_stride;
    const int64_t G = Hq / Hkv;
    const int64_t es = is_bf16 ? 2 : 4;
#pragma omp parallel if (B * Hkv > 1)
    {
        float *qf = malloc(sizeof(float) * G * D);
        float *acc = malloc(sizeof(float) * G * D);
        float *scores = malloc(sizeof(float) * G * (max_len > 0 ? max_len : 1));
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < Hkv; h++) {
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
#if HAVE_AVX512_DECODE
                const char *kh = (const char *)k_buf + h * D * es, *vh = (const char *)v_buf + h * D * es;
                if (D == 64 && is_bf16) {
                    decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 64, scores, out_row, softcap, 1);
                    continue;
                } else if (D == 64) {
                    decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 64, scores, out_row, softcap, 0);
                    continue;
                } else if (D == 128 && is_bf16) {
                    decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 128, scores, out_row, softcap, 1);
                    continue;
                } else if (D == 128) {
                    decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 128, scores, out_row, softcap, 0);
                    continue;
                } else if (D == 256 && is_bf16) {
                    decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 256, scores, out_row, softcap, 1);
                    continue;
                } else if (D == 256) {
                    decode_one_avx512(qf, kh, vh, idx, L, Hkv * D * es, G, 256, scores, out_row, softcap, 0);
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
        }
        free(qf);
        free(acc);
        free(scores);
    }
}

/* qkv: [T, qkv_stride] rows holding Hq q heads, Hkv k heads, Hkv v heads of D elements;
 * cos, sin: [T, D]; loc: int64 [T] pool rows; q_out: [T, Hq, D]; k_buf, v_buf: [N, Hkv, D].
 * Per element, as the torch reference: round(round(x * cos) + round(rotate_half(x) * sin)). */
void rs_rotary_store(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin, const int64_t *loc,
                     void *q_out, void *k_buf, void *v_buf, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                     int is_bf16) {
    const int64_t half = D / 2;
    const int64_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for if (T > 16)
    for (int64_t t = 0; t < T; t++) {
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

/* x, out: [T, H]; residual: [T, H] or NULL; weight: [H]. With a residual: residual =
 * round(residual + x) in place, then normalize it; without: normalize x. out =
 * round(weight * round(v * rsqrt(mean(v^2) + eps))), v in fp32: transformers' LlamaRMSNorm. */
void rs_add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t T, int64_t H,
                     float eps, int is_bf16) {
#pragma omp parallel if (T > 16)
    {
        float *v = malloc(sizeof(float) * H);
#pragma omp for
        for (int64_t t = 0; t < T; t++) {
            const int64_t o = t * H;
            if (residual) {
                for (int64_t i = 0; i < H; i++) {
                    v[i] = round_to(load(residual, o + i, is_bf16) + load(x, o + i, is_bf16), is_bf16);
                    store(residual, o + i, v[i], is_bf16);
                }
            } else {
                for (int64_t i = 0; i < H; i++) v[i] = load(x, o + i, is_bf16);
            }
            float part[LANES] = {0};
            int64_t i = 0;
            for (; i + LANES <= H; i += LANES)
                for (int l = 0; l < LANES; l++) part[l] += v[i + l] * v[i + l];
            for (int l = 0; i < H; i++, l++) part[l] += v[i] * v[i];
            const float ss = sum_lanes(part);
            const float inv = 1.0f / sqrtf(ss / (float)H + eps);
            for (int64_t i = 0; i < H; i++)
                store(out, o + i, load(weight, i, is_bf16) * round_to(v[i] * inv, is_bf16), is_bf16);
        }
        free(v);
    }
}

/* gate_up: [T, 2I] (gate then up); out: [T, I] = round(round(silu(gate)) * up). */
void rs_silu_and_mul(const void *gate_up, void *out, int64_t T, int64_t I, int is_bf16) {
#pragma omp parallel for if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        if (is_bf16) {
            const bf16_t *g = (const bf16_t *)gate_up + t * 2 * I, *u = g + I;
            bf16_t *o = (bf16_t *)out + t * I;
            int64_t i = 0;
#if HAVE_AVX512_DECODE
            for (; i + 16 <= I; i += 16) {
                const __m512 x = load16((const char *)(g + i), 1);
                const __m512 sl = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
                const __m512 sr = _mm512_castsi512_ps(round_bf16_512(sl));
                store16_bf16(o + i, round_bf16_512(_mm512_mul_ps(sr, load16((const char *)(u + i), 1))));
            }
#endif
            for (; i < I; i++) {
                float x = bf16_to_f32(g[i]);
                float s = bf16_to_f32(f32_to_bf16(x / (1.0f + exp_f32(-x))));
                o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)gate_up + t * 2 * I, *u = g + I;
            float *o = (float *)out + t * I;
            int64_t i = 0;
#if HAVE_AVX512_DECODE
            for (; i + 16 <= I; i += 16) {
                const __m512 x = _mm512_loadu_ps(g + i);
                const __m512 sl = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
                _mm512_storeu_ps(o + i, _mm512_mul_ps(sl, _mm512_loadu_ps(u + i)));
            }
#endif
            for (; i < I; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * int8 linears (layers/quant.py): per-output-channel symmetric int8 weights, run either as
 * W8A8 (activations quantized per token on the fly, VNNI u8 x s8 dot products summed
 * exactly in int32) or weight-only (int8 weights widened to fp32, fp32 FMAs against the
 * activations as they are). Both read one packed layout, VNNI's blocks interleaved by four:
 * for each group of 64 output channels (4 blocks of 16), for each group of 4 input channels,
 * the 4 blocks' 16 x 4 bytes (channel-major), i.e. w_packed[Np/64][Kp/4][4][16][4], N and K
 * zero-padded to multiples of 64 and 4: a thread's weights are one sequential stream.
 *
 * W8A8 (the dynamic per-token scheme of LLM.int8()'s vector-wise quantization without the
 * outlier split, Dettmers et al. 2022; SmoothQuant's W8A8 kernels, Xiao et al. 2023): a row
 * x is quantized to q = round(x * 127 / amax(|x|)) and stored as u8 q + 128 (vpdpbusd
 * multiplies unsigned by signed bytes), so the int32 dot product carries 128 * sum_k w[n,k],
 * which comp[n] holds and the epilogue subtracts: y[m,n] = (acc - comp[n]) * w_scale[n] *
 * x_scale[m] + bias[n]. The int32 sum is exact, so a row's output does not depend on the
 * batch, the tile or the thread: W8A8 is batch-invariant by construction.
 * ------------------------------------------------------------------------------------- */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_INT8 1
#else
#define HAVE_INT8 0
#endif

int rs_int8_available(void) { return HAVE_INT8; }

#if HAVE_INT8
#define MR_MAX 8
#define NR_MAX 4
/* Weights below this many bytes run on one thread (a parallel region costs more than reading them). */
#ifndef INT8_PARALLEL_BYTES
#define INT8_PARALLEL_BYTES 65536
#endif

/* Block b's 64 bytes of input channels 0..3 (the next 4 are 256 bytes on). */
static inline const int8_t *int8_block(const int8_t *wp, int64_t Kp, int64_t b) {
    return wp + (b >> 2) * Kp * 64 + (b & 3) * 64;
}

/* acc[i][j] = sum over k of xq[i][k] * w block j, for MR rows and NR 16-channel blocks of
 * one group (w: the first block's, ``int8_block``). */
static inline __attribute__((always_inline)) void int8_tile(const uint8_t *xq, int64_t ldx, const int8_t *w,
                                                           int64_t K4, const int MR, const int NR,
                                                           __m512i acc[MR_MAX][NR_MAX]) {
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K4; k++) {
        __m512i wv[NR_MAX];
        _mm_prefetch((const char *)(w + (k + 8) * 256), _MM_HINT_T0);
        for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_si512((const void *)(w + j * 64 + k * 256));
        for (int i = 0; i < MR; i++) {
            int32_t a4;
            memcpy(&a4, xq + i * ldx + k * 4, 4);
            const __m512i a = _mm512_set1_epi32(a4);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], a, wv[j]);
        }
    }
}

/* 16 outputs of row m from channel n0 on: y = float(acc - comp) * ws * xs + bias, masked to N. */
static inline __attribute__((always_inline)) void int8_store(__m512 y, void *out, int64_t m, int64_t ldo, int64_t n0,
                                                            int64_t N, int is_bf16) {
    const __mmask16 mask = N - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1u);
    if (is_bf16) {
        const __m512i r = _mm512_srli_epi32(round_bf16_512(y), 16);
        _mm256_mask_storeu_epi16((bf16_t *)out + m * ldo + n0, mask, _mm512_cvtepi32_epi16(r));
    } else {
        _mm512_mask_storeu_ps((float *)out + m * ldo + n0, mask, y);
    }
}

static inline __attribute__((always_inline)) __m512 load_bias(const float *bias, int64_t n0, int64_t N) {
    if (!bias) return _mm512_setzero_ps();
    const __mmask16 mask = N - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1u);
    return _mm512_maskz_loadu_ps(mask, bias + n0);
}

static inline __attribute__((always_inline)) void w8a8_tile(const uint8_t *xq, const float *xs, int64_t ldx, int64_t m0,
                                                           const int8_t *wp, const float *ws, const int32_t *comp,
                                                           const float *bias, void *out, int64_t ldo, int64_t nb0,
                                                           int64_t Kp, int64_t N, const int MR, const int NR, int is_bf16) {
    __m512i acc[MR_MAX][NR_MAX];
    int8_tile(xq + m0 * ldx, ldx, int8_block(wp, Kp, nb0), Kp / 4, MR, NR, acc);
    for (int j = 0; j < NR; j++) {
        const int64_t n0 = (nb0 + j) * 16;
        if (n0 >= N) break;
        const __m512i c = _mm512_loadu_si512((const void *)(comp + n0));
        const __m512 s = _mm512_loadu_ps(ws + n0), b = load_bias(bias, n0, N);
        for (int i = 0; i < MR; i++) {
            const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], c)), s);
            int8_store(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs[m0 + i])), b), out, m0 + i, ldo, n0, N, is_bf16);
        }
    }
}

/* Each thread takes a contiguous range of groups of NR_MAX channel blocks (so a thread's
 * weights are one contiguous stream); within it every row tile of MR_MAX rows. */
#define INT8_THREAD_RANGE(NBP, first, last)                                                   \
    const int64_t groups = ((NBP) + NR_MAX - 1) / NR_MAX;                                     \
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();                        \
    const int64_t first = groups * tid / nth * NR_MAX, last = groups * (tid + 1) / nth * NR_MAX;

#include <omp.h>

/* x [M, K] (bf16 or fp32) -> xq u8 [M, Kp] (q + 128, padding 128), xs fp32 [M] = amax / 127
 * (0 for an all-zero row). */
static void rs_quantize_rows(const void *x, int64_t M, int64_t K, int64_t Kp, uint8_t *xq, float *xs, int is_bf16) {
#pragma omp parallel for if (M > 16)
    for (int64_t m = 0; m < M; m++) {
        const char *row = (const char *)x + m * K * (is_bf16 ? 2 : 4);
        __m512 mx = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(row + k * (is_bf16 ? 2 : 4), is_bf16)));
        float amax = _mm512_reduce_max_ps(mx);
        for (int64_t t = k; t < K; t++) amax = fmaxf(amax, fabsf(load(x, m * K + t, is_bf16)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xs[m] = amax / 127.0f;
        uint8_t *q = xq + m * Kp;
        const __m512 vinv = _mm512_set1_ps(inv);
        for (k = 0; k + 16 <= K; k += 16) {
            const __m512 v = _mm512_mul_ps(load16(row + k * (is_bf16 ? 2 : 4), is_bf16), vinv);
            const __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));  /* nearest even */
            _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(qi));
        }
        for (; k < K; k++) q[k] = (uint8_t)(128 + (int)nearbyintf(load(x, m * K + k, is_bf16) * inv));
        for (; k < Kp; k++) q[k] = 128;
    }
}

/* out [M, N] (row stride ldo; bf16 when is_bf16, else fp32) = dequantized (xq . w^T) (+ bias fp32 [N]). */
static void rs_w8a8_gemm(const uint8_t *xq, const float *xs, int64_t M, int64_t Kp, const int8_t *wp, const float *ws,
                  const int32_t *comp, const float *bias, void *out, int64_t N, int64_t ldo, int is_bf16) {
    const int64_t nbp = (N + 15) / 16;
#pragma omp parallel if (N * Kp > INT8_PARALLEL_BYTES)
    {
        INT8_THREAD_RANGE(nbp, first, last)
        for (int64_t nb = first; nb < last && nb < nbp; nb += NR_MAX) {
            const int nr = nbp - nb >= NR_MAX ? NR_MAX : (int)(nbp - nb);
            int64_t m = 0;
            /* 8 rows x 2 blocks: 16 accumulators, and 2 x 16 x Kp weight bytes stay in L1 across row tiles */
            for (; m + 8 <= M; m += 8)
                for (int j = 0; j < nr; j += 2) {
                    if (nr - j >= 2) w8a8_tile(xq, xs, Kp, m, wp, ws, comp, bias, out, ldo, nb + j, Kp, N, 8, 2, is_bf16);
                    else w8a8_tile(xq, xs, Kp, m, wp, ws, comp, bias, out, ldo, nb + j, Kp, N, 8, 1, is_bf16);
                }
            for (; m < M; m++) {
                if (nr == 4) w8a8_tile(xq, xs, Kp, m, wp, ws, comp, bias, out, ldo, nb, Kp, N, 1, 4, is_bf16);
                else for (int j = 0; j < nr; j++) w8a8_tile(xq, xs, Kp, m, wp, ws, comp, bias, out, ldo, nb + j, Kp, N, 1, 1, is_bf16);
            }
        }
    }
}

/* rs_quantize_rows then rs_w8a8_gemm in one call (one crossing from Python at batch 1). */
static void rs_w8a8_linear(const void *x, int64_t M, int64_t K, int64_t Kp, const int8_t *wp, const float *ws,
                    const int32_t *comp, const float *bias, void *out, int64_t N, int in_bf16, int out_bf16) {
    uint8_t *xq = malloc((size_t)(M * Kp));
    float *xs = malloc(sizeof(float) * M);
    rs_quantize_rows(x, M, K, Kp, xq, xs, in_bf16);
    rs_w8a8_gemm(xq, xs, M, Kp, wp, ws, comp, bias, out, N, N, out_bf16);
    free(xq);
    free(xs);
}

/* Weight-only: out [M, N] = x [M, K] (bf16/fp32) . dequantized w^T (+ bias): one fp32 FMA
 * chain per output, over k in vdpbf16ps's order (k+1 before k in each pair: its pseudo-code
 * in the Intel SDM), so for bf16 activations this gives the bits of rs_w8_bf16_gemm (whose
 * products are exact in fp32 as these are; only denormals, which vdpbf16ps flushes, could
 * differ) and int8wo stays batch-invariant when the kernel changes with the batch size. A
 * tile is MR rows x NR blocks of one group: the NR chains hide the FMA latency. For a few
 * rows, where the step reads weights and does not compute. */
static inline __attribute__((always_inline)) void w8_tile(const float *xf, int64_t Kp, int64_t m0, const int MR,
                                                         const int NR, const int8_t *wblk, const float *ws,
                                                         const float *bias, void *out, int64_t ldo, int64_t n0,
                                                         int64_t N, int is_bf16) {
    __m512 acc[2][NR_MAX];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < Kp; k += 4) {
        __m512 wf[NR_MAX][4];
        _mm_prefetch((const char *)(wblk + (k + 32) * 64), _MM_HINT_T0);
        for (int j = 0; j < NR; j++) {
            const __m512i w4 = _mm512_loadu_si512((const void *)(wblk + j * 64 + k * 64));
            for (int r = 0; r < 4; r++)  /* byte r of each channel's 4, sign-extended */
                wf[j][r] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w4, 24 - 8 * r), 24));
        }
        for (int i = 0; i < MR; i++) {
            const float *xr = xf + (m0 + i) * Kp + k;
            const __m512 x0 = _mm512_set1_ps(xr[0]), x1 = _mm512_set1_ps(xr[1]);
            const __m512 x2 = _mm512_set1_ps(xr[2]), x3 = _mm512_set1_ps(xr[3]);
            for (int j = 0; j < NR; j++) {
                acc[i][j] = _mm512_fmadd_ps(x1, wf[j][1], acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(x0, wf[j][0], acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(x3, wf[j][3], acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(x2, wf[j][2], acc[i][j]);
            }
        }
    }
    for (int j = 0; j < NR; j++) {
        const int64_t n = n0 + 16 * j;
        if (n >= N) break;
        const __m512 s = _mm512_loadu_ps(ws + n), b = load_bias(bias, n, N);
        for (int i = 0; i < MR; i++) int8_store(_mm512_add_ps(_mm512_mul_ps(acc[i][j], s), b), out, m0 + i, ldo, n, N, is_bf16);
    }
}

static void rs_w8_gemm(const void *x, int64_t M, int64_t K, int64_t Kp, const int8_t *wp, const float *ws, const float *bias,
                void *out, int64_t N, int64_t ldo, int in_bf16, int is_bf16) {
    const int64_t nbp = (N + 15) / 16;
    float *xf = malloc(sizeof(float) * M * Kp);  /* the rows in fp32, zero-padded to Kp */
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < Kp; k++) xf[m * Kp + k] = k < K ? load(x, m * K + k, in_bf16) : 0.0f;
#pragma omp parallel if (N * Kp > INT8_PARALLEL_BYTES)
    {
        INT8_THREAD_RANGE(nbp, first, last)
        for (int64_t nb = first; nb < last && nb < nbp; nb += NR_MAX) {
            const int8_t *blk = int8_block(wp, Kp, nb);
            const int full = nbp - nb >= NR_MAX;
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) {
                if (full) w8_tile(xf, Kp, m, 2, NR_MAX, blk, ws, bias, out, ldo, nb * 16, N, is_bf16);
                else for (int64_t j = 0; j < nbp - nb; j++)
                    w8_tile(xf, Kp, m, 2, 1, blk + j * 64, ws, bias, out, ldo, (nb + j) * 16, N, is_bf16);
            }
            for (; m < M; m++) {
                if (full) w8_tile(xf, Kp, m, 1, NR_MAX, blk, ws, bias, out, ldo, nb * 16, N, is_bf16);
                else for (int64_t j = 0; j < nbp - nb; j++)
                    w8_tile(xf, Kp, m, 1, 1, blk + j * 64, ws, bias, out, ldo, (nb + j) * 16, N, is_bf16);
            }
        }
    }
    free(xf);
}

/* Weight-only on AVX-512-BF16, for bf16 activations and many rows: each thread widens one
 * 16-channel block of int8 weights to bf16 once (exact: |q| <= 127 has 7 significant bits)
 * into k-pair order, then every row runs vdpbf16ps against it (bf16 x bf16 products are
 * exact in fp32; the sum is fp32 in k-pair order, the same for every row count and tile).
 * K must be a multiple of 4 (K == Kp). */
#if defined(__AVX512BF16__)
#define HAVE_W8_BF16 1
#define W8_BF16_MR 8
static inline __attribute__((always_inline)) void w8_bf16_rows(const bf16_t *x, int64_t K, int64_t m0, const int MR,
                                                              const __m512i *wb, const float *ws, const float *bias,
                                                              void *out, int64_t ldo, int64_t n0, int64_t N,
                                                              int out_bf16) {
    __m512 acc[W8_BF16_MR];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp++) {
        const __m512bh w = (__m512bh)wb[kp];
        for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, x + (m0 + i) * K + 2 * kp, 4);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    const __m512 s = _mm512_loadu_ps(ws + n0), b = load_bias(bias, n0, N);
    for (int i = 0; i < MR; i++) int8_store(_mm512_add_ps(_mm512_mul_ps(acc[i], s), b), out, m0 + i, ldo, n0, N, out_bf16);
}

/* bf16 bits of byte r of each 32-bit lane (an int8), in the low half of the lane. */
static inline __attribute__((always_inline)) __m512i int8_lane_to_bf16(__m512i w4, int r) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w4, 24 - 8 * r), 24));
    return _mm512_srli_epi32(_mm512_castps_si512(f), 16);
}

static void rs_w8_bf16_gemm(const bf16_t *x, int64_t M, int64_t K, const int8_t *wp, const float *ws, const float *bias,
                     void *out, int64_t N, int64_t ldo, int out_bf16) {
    const int64_t nbp = (N + 15) / 16;
#pragma omp parallel
    {
        INT8_THREAD_RANGE(nbp, first, last)
        __m512i *wb = aligned_alloc(64, sizeof(__m512i) * (K / 2));  /* one block, k-pair order */
        for (int64_t nb = first; nb < last && nb < nbp; nb++) {
            const int8_t *blk = int8_block(wp, K, nb);
            for (int64_t k = 0; k < K; k += 4) {
                const __m512i w4 = _mm512_loadu_si512((const void *)(blk + k * 64));
                wb[k / 2] = _mm512_or_si512(int8_lane_to_bf16(w4, 0), _mm512_slli_epi32(int8_lane_to_bf16(w4, 1), 16));
                wb[k / 2 + 1] = _mm512_or_si512(int8_lane_to_bf16(w4, 2), _mm512_slli_epi32(int8_lane_to_bf16(w4, 3), 16));
            }
            int64_t m = 0;
            for (; m + W8_BF16_MR <= M; m += W8_BF16_MR)
                w8_bf16_rows(x, K, m, W8_BF16_MR, wb, ws, bias, out, ldo, nb * 16, N, out_bf16);
            for (; m < M; m++) w8_bf16_rows(x, K, m, 1, wb, ws, bias, out, ldo, nb * 16, N, out_bf16);
        }
        free(wb);
    }
}
#else
#define HAVE_W8_BF16 0
static void rs_w8_bf16_gemm(const bf16_t *x, int64_t M, int64_t K, const int8_t *wp, const float *ws, const float *bias,
                     void *out, int64_t N, int64_t ldo, int out_bf16) { abort(); }
#endif
int rs_w8_bf16_available(void) { return HAVE_W8_BF16; }

/* One int8 linear with its input's producer fused in front (one call from Python instead of
 * two at batch 1; the same bits as the two calls):
 *   pre 0: x [M, K] as it is;
 *   pre 1: RMSNorm of x, or with residual of residual + x (written back), weight norm_w
 *          (rs_add_rms_norm);
 *   pre 2: x is gate_up [M, 2K]: SiLU(gate) * up (rs_silu_and_mul).
 * kernel 0: W8A8, 1: weight-only fp32, 2: weight-only bf16 (see above). */
void rs_int8_linear(int kernel, int pre, const void *x, void *residual, const void *norm_w, float eps, int64_t M,
                    int64_t K, int64_t Kp, const int8_t *wp, const float *ws, const int32_t *comp, const float *bias,
                    void *out, int64_t N, int in_bf16, int out_bf16) {
    void *tmp = NULL;
    if (pre) {
        tmp = malloc((size_t)(M * K * (in_bf16 ? 2 : 4)));
        if (pre == 1) rs_add_rms_norm(x, residual, norm_w, tmp, M, K, eps, in_bf16);
        else rs_silu_and_mul(x, tmp, M, K, in_bf16);
        x = tmp;
    }
    if (kernel == 0) rs_w8a8_linear(x, M, K, Kp, wp, ws, comp, bias, out, N, in_bf16, out_bf16);
    else if (kernel == 1) rs_w8_gemm(x, M, K, Kp, wp, ws, bias, out, N, N, in_bf16, out_bf16);
    else rs_w8_bf16_gemm((const bf16_t *)x, M, K, wp, ws, bias, out, N, N, out_bf16);
    free(tmp);
}
#else
void rs_int8_linear(int kernel, int pre, const void *x, void *residual, const void *norm_w, float eps, int64_t M,
                    int64_t K, int64_t Kp, const int8_t *wp, const float *ws, const int32_t *comp, const float *bias,
                    void *out, int64_t N, int in_bf16, int out_bf16) { abort(); }
int rs_w8_bf16_available(void) { return 0; }
#endif
