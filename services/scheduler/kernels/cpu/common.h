/* What the scheduler's CPU kernels share (attention.c, elementwise.c, int8.c, which
 * kernels/cpu_kernels.py compiles into one library and loads; its docstring has the shapes,
 * dtypes and numerics): bf16 <-> fp32 conversion, element loads and stores in either dtype,
 * exp, fixed-order lane sums, their AVX-512 forms, and the exported kernels' prototypes.
 *
 * Tensors are passed as raw pointers to contiguous data; is_bf16 selects bfloat16 (as
 * uint16 bits) or float32 elements. Parallel regions go through rs_parallel (parallel.c:
 * a persistent worker pool, or OpenMP), with the caller's thread count (torch loads libgomp
 * first, so this library shares torch's runtime and thread count). Every file is compiled
 * with -ffp-contract=off, so no multiply-add is fused behind the code's back.
 */
#ifndef RS_COMMON_H
#define RS_COMMON_H

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
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* A parallel region's work: thread tid of nth (tid 0 is the caller). */
typedef void (*rs_task)(void *ctx, int tid, int nth);
/* fn(ctx, tid, nth) on every thread of a region (parallel.c); parallel == 0: on the caller alone. */
void rs_parallel(rs_task fn, void *ctx, int parallel);
/* Every thread of the region waits for the others (nth: the task's). */
void rs_barrier(int nth);
/* Thread tid's share [*first, *last) of n items, contiguous and in order: n * tid / nth on. */
static inline void rs_split(int64_t n, int tid, int nth, int64_t *first, int64_t *last) {
    *first = n * tid / nth;
    *last = n * (tid + 1) / nth;
}

/* Row-range forms of rs_add_rms_norm and rs_silu_and_mul (elementwise.c), for kernels that run
 * them inside their own region; v: H floats of scratch. */
void rs_add_rms_norm_rows(const void *x, void *residual, const void *weight, void *out, int64_t t0, int64_t t1,
                          int64_t H, float eps, int is_bf16, float *v);
void rs_silu_and_mul_rows(const void *gate_up, void *out, int64_t t0, int64_t t1, int64_t I, int is_bf16);

/* The library's entry points (kernels/cpu_kernels.py and layers/quant.py bind them through
 * ctypes); each file's comments say what they compute. */
void rs_decode_attention(const void *q, const void *k_buf, const void *v_buf, const int64_t *kv_indices,
                         int64_t idx_stride, const int64_t *rows, const int64_t *seq_lens, void *out, int64_t B,
                         int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t window, float softcap,
                         int is_bf16);
void rs_rotary_store(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin, const int64_t *loc,
                     void *q_out, void *k_buf, void *v_buf, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                     int is_bf16);
void rs_add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t T, int64_t H,
                     float eps, int is_bf16);
void rs_silu_and_mul(const void *gate_up, void *out, int64_t T, int64_t I, int is_bf16);
int rs_set_pool(int on);
int rs_pool_threads(void);
int rs_int8_available(void);
int rs_w8_bf16_available(void);
void rs_int8_linear(int kernel, int pre, const void *x, void *residual, const void *norm_w, float eps, int64_t M,
                    int64_t K, int64_t Kp, const int8_t *wp, const float *ws, const int32_t *comp, const float *bias,
                    void *out, int64_t N, int in_bf16, int out_bf16);

#endif
