/* Element-wise kernels of the scheduler's "cpu" attention backend, which the model runs in
 * place of its norms and activation (common.h: the helpers and conventions).
 *
 * - rs_add_rms_norm: optional residual add, then RMSNorm (Zhang & Sennrich 2019).
 * - rs_silu_and_mul: SiLU(gate) * up over a fused gate/up row.
 *
 * They round to bf16 exactly where the torch reference rounds (each torch op rounds its
 * result), so they give the torch path's bits.
 */
#include "common.h"

/* x, out: [T, H]; residual: [T, H] or NULL; weight: [H]. With a residual: residual =
 * round(residual + x) in place, then normalize it; without: normalize x. out =
 * round(weight * round(v * rsqrt(mean(v^2) + eps))), v in fp32: transformers' LlamaRMSNorm.
 * Rows t0 .. t1-1 (v: H floats of scratch). */
void rs_add_rms_norm_rows(const void *x, void *residual, const void *weight, void *out, int64_t t0, int64_t t1,
                          int64_t H, float eps, int is_bf16, float *v) {
    for (int64_t t = t0; t < t1; t++) {
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
}

typedef struct {
    const void *x, *weight;
    void *residual, *out;
    int64_t T, H;
    float eps;
    int is_bf16;
} norm_args;

static void norm_task(void *ctx, int tid, int nth) {
    const norm_args *a = ctx;
    int64_t t0, t1;
    rs_split(a->T, tid, nth, &t0, &t1);
    float *v = malloc(sizeof(float) * a->H);
    rs_add_rms_norm_rows(a->x, a->residual, a->weight, a->out, t0, t1, a->H, a->eps, a->is_bf16, v);
    free(v);
}

/* rs_add_rms_norm_rows over all T rows, split by rows over the threads above 16 rows. */
void rs_add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t T, int64_t H,
                     float eps, int is_bf16) {
    norm_args a = {x, weight, residual, out, T, H, eps, is_bf16};
    rs_parallel(norm_task, &a, T > 16);
}

/* gate_up: [T, 2I] (gate then up); out: [T, I] = round(round(silu(gate)) * up), rows t0 .. t1-1. */
void rs_silu_and_mul_rows(const void *gate_up, void *out, int64_t t0, int64_t t1, int64_t I, int is_bf16) {
    for (int64_t t = t0; t < t1; t++) {
        if (is_bf16) {
            const bf16_t *g = (const bf16_t *)gate_up + t * 2 * I, *u = g + I;
            bf16_t *o = (bf16_t *)out + t * I;
            int64_t i = 0;
#if HAVE_AVX512
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
#if HAVE_AVX512
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

typedef struct {
    const void *gate_up;
    void *out;
    int64_t T, I;
    int is_bf16;
} silu_args;

static void silu_task(void *ctx, int tid, int nth) {
    const silu_args *a = ctx;
    int64_t t0, t1;
    rs_split(a->T, tid, nth, &t0, &t1);
    rs_silu_and_mul_rows(a->gate_up, a->out, t0, t1, a->I, a->is_bf16);
}

/* rs_silu_and_mul_rows over all T rows, split by rows over the threads above 16 rows. */
void rs_silu_and_mul(const void *gate_up, void *out, int64_t T, int64_t I, int is_bf16) {
    silu_args a = {gate_up, out, T, I, is_bf16};
    rs_parallel(silu_task, &a, T > 16);
}

/* The index of each row's largest value, as torch.argmax gives it: a NaN counts as the
 * largest (the first NaN wins), and of equal values the first. Greedy sampling's argmax over
 * a [B, vocab] fp32 logits batch: torch's reduction reads ~0.7 G values/s, this one at the
 * cache's speed (one pass for the maximum and NaNs, one to find its first index). */
static int64_t argmax_row(const float *r, int64_t N) {
#if HAVE_AVX512
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t k = 0; k < N; k += 16) {
        const __mmask16 in = N - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - k)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(mx, in, r + k);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
    }
    if (!nan) {
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int64_t k = 0; k < N; k += 16) {
            const __mmask16 in = N - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - k)) - 1u);
            const __mmask16 eq = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, r + k), m, _CMP_EQ_OQ);
            if (eq) return k + __builtin_ctz(eq);
        }
    }
#endif
    int64_t best = 0;
    for (int64_t k = 0; k < N; k++) {
        if (isnan(r[k])) return k;
        if (r[k] > r[best]) best = k;
    }
    return best;
}

typedef struct {
    const float *x;
    int64_t *out;
    int64_t M, N;
} argmax_args;

static void argmax_task(void *ctx, int tid, int nth) {
    const argmax_args *a = ctx;
    int64_t m0, m1;
    rs_split(a->M, tid, nth, &m0, &m1);
    for (int64_t m = m0; m < m1; m++) a->out[m] = argmax_row(a->x + m * a->N, a->N);
}

/* x: fp32 [M, N] (N >= 1) -> out: int64 [M], split by rows over the threads from 4 rows. */
void rs_argmax(const float *x, int64_t *out, int64_t M, int64_t N) {
    argmax_args a = {x, out, M, N};
    rs_parallel(argmax_task, &a, M >= 4);
}
