/* int8 linears (layers/quant.py): per-output-channel symmetric int8 weights, run either as
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
 */
#include "int8.h"

int rs_int8_available(void) { return HAVE_INT8; }

#if HAVE_INT8
#define MR_MAX 8
#define NR_MAX 4
/* Weights below this many bytes run on one thread (a parallel region costs more than reading them). */
#ifndef INT8_PARALLEL_BYTES
#define INT8_PARALLEL_BYTES 65536
#endif

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

/* Thread tid's channel blocks [*first, *last) of nbp: a contiguous range of groups of NR_MAX
 * blocks (so a thread's weights are one contiguous stream); within it every row tile. */
static inline void int8_thread_blocks(int64_t nbp, int tid, int nth, int64_t *first, int64_t *last) {
    rs_split((nbp + NR_MAX - 1) / NR_MAX, tid, nth, first, last);
    *first *= NR_MAX;
    *last = *last * NR_MAX < nbp ? *last * NR_MAX : nbp;
}

/* Rows m0 .. m1-1 of x [M, K] (bf16 or fp32) -> xq u8 [M, Kp] (q + 128, padding 128), xs fp32
 * [M] = amax / 127 (0 for an all-zero row). */
static void quantize_rows(const void *x, int64_t m0, int64_t m1, int64_t K, int64_t Kp, uint8_t *xq, float *xs,
                          int is_bf16) {
    for (int64_t m = m0; m < m1; m++) {
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

/* Channel blocks first .. last-1 of out [M, N] (row stride ldo; bf16 when is_bf16, else fp32) =
 * dequantized (xq . w^T) (+ bias fp32 [N]). */
static void w8a8_blocks(const uint8_t *xq, const float *xs, int64_t M, int64_t Kp, const int8_t *wp, const float *ws,
                        const int32_t *comp, const float *bias, void *out, int64_t N, int64_t ldo, int is_bf16,
                        int64_t first, int64_t last) {
    for (int64_t nb = first; nb < last; nb += NR_MAX) {
        const int nr = last - nb >= NR_MAX ? NR_MAX : (int)(last - nb);
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

/* Channel blocks first .. last-1 of the weight-only product of xf (fp32 [M, Kp], zero-padded). */
static void w8_blocks(const float *xf, int64_t M, int64_t Kp, const int8_t *wp, const float *ws, const float *bias,
                      void *out, int64_t N, int64_t ldo, int is_bf16, int64_t first, int64_t last) {
    for (int64_t nb = first; nb < last; nb += NR_MAX) {
        const int8_t *blk = int8_block(wp, Kp, nb);
        const int full = last - nb >= NR_MAX;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            if (full) w8_tile(xf, Kp, m, 2, NR_MAX, blk, ws, bias, out, ldo, nb * 16, N, is_bf16);
            else for (int64_t j = 0; j < last - nb; j++)
                w8_tile(xf, Kp, m, 2, 1, blk + j * 64, ws, bias, out, ldo, (nb + j) * 16, N, is_bf16);
        }
        for (; m < M; m++) {
            if (full) w8_tile(xf, Kp, m, 1, NR_MAX, blk, ws, bias, out, ldo, nb * 16, N, is_bf16);
            else for (int64_t j = 0; j < last - nb; j++)
                w8_tile(xf, Kp, m, 1, 1, blk + j * 64, ws, bias, out, ldo, (nb + j) * 16, N, is_bf16);
        }
    }
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

/* Channel blocks first .. last-1 of the weight-only product of bf16 x [M, K] (K == Kp). */
static void w8_bf16_blocks(const bf16_t *x, int64_t M, int64_t K, const int8_t *wp, const float *ws, const float *bias,
                           void *out, int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last) {
    __m512i *wb = aligned_alloc(64, sizeof(__m512i) * (K / 2));  /* one block, k-pair order */
    for (int64_t nb = first; nb < last; nb++) {
        int8_widen_bf16(int8_block(wp, K, nb), K, wb);
        int64_t m = 0;
        for (; m + W8_BF16_MR <= M; m += W8_BF16_MR)
            w8_bf16_rows(x, K, m, W8_BF16_MR, wb, ws, bias, out, ldo, nb * 16, N, out_bf16);
        for (; m < M; m++) w8_bf16_rows(x, K, m, 1, wb, ws, bias, out, ldo, nb * 16, N, out_bf16);
    }
    free(wb);
}
#else
#define HAVE_W8_BF16 0
static void w8_bf16_blocks(const bf16_t *x, int64_t M, int64_t K, const int8_t *wp, const float *ws, const float *bias,
                           void *out, int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last) { abort(); }
#endif
int rs_w8_bf16_available(void) { return HAVE_W8_BF16; }

/* W8A8 runs on AMX-INT8 tiles (amx.c, the same bits) from this many rows: below it a step
 * reads weights, and the AVX-512 tiles keep up (measured: bench/RESULTS.md). */
#ifndef W8A8_AMX_MIN_ROWS
#define W8A8_AMX_MIN_ROWS 8
#endif

typedef struct {
    int kernel, pre, in_bf16, out_bf16, rows_in_region, w8a8_amx;
    const void *x, *norm_w;
    void *residual, *out;
    float eps;
    int64_t M, K, Kp, N;
    const int8_t *wp;
    const float *ws, *bias;
    const int32_t *comp;
    void *xin;     /* the kernel's input [M, K]: x, or pre's output */
    uint8_t *xq;   /* W8A8: the quantized rows [M, Kp] and their scales [M] */
    float *xs;
    float *xf;     /* weight-only fp32: the rows in fp32, zero-padded [M, Kp] */
    bf16_t *xa;    /* AMX: the bf16 rows, zero rows to a multiple of 16 */
} linear_args;

/* Rows m0 .. m1-1 of the kernel's input: pre's output, then W8A8's quantized rows or the fp32 rows. */
static void prepare_rows(const linear_args *a, int64_t m0, int64_t m1) {
    if (a->pre == 1) {
        float *v = malloc(sizeof(float) * a->K);
        rs_add_rms_norm_rows(a->x, a->residual, a->norm_w, a->xin, m0, m1, a->K, a->eps, a->in_bf16, v);
        free(v);
    } else if (a->pre == 2) {
        rs_silu_and_mul_rows(a->x, a->xin, m0, m1, a->K, a->in_bf16);
    }
    if (a->kernel == 0) quantize_rows(a->xin, m0, m1, a->K, a->Kp, a->xq, a->xs, a->in_bf16);
    if (a->kernel == 1)
        for (int64_t m = m0; m < m1; m++)
            for (int64_t k = 0; k < a->Kp; k++) a->xf[m * a->Kp + k] = k < a->K ? load(a->xin, m * a->K + k, a->in_bf16) : 0.0f;
    if (a->kernel >= 3) memcpy(a->xa + m0 * a->K, (const bf16_t *)a->xin + m0 * a->K, sizeof(bf16_t) * (m1 - m0) * a->K);
}

/* The whole linear in one region: each thread prepares its share of the rows (above 16 rows;
 * below, the caller prepared them before the region), waits for the others, then runs its
 * channel blocks (int8_thread_blocks). */
static void linear_task(void *ctx, int tid, int nth) {
    const linear_args *a = ctx;
    if (a->rows_in_region) {
        int64_t m0, m1;
        rs_split(a->M, tid, nth, &m0, &m1);
        prepare_rows(a, m0, m1);
        rs_barrier(nth);
    }
    int64_t first, last;
    int8_thread_blocks((a->N + 15) / 16, tid, nth, &first, &last);
    if (a->kernel == 0 && a->w8a8_amx)
        rs_w8a8_amx_blocks(a->xq, a->xs, a->M, a->Kp, a->wp, a->ws, a->comp, a->bias, a->out, a->N, a->N, a->out_bf16,
                           first, last);
    else if (a->kernel == 0)
        w8a8_blocks(a->xq, a->xs, a->M, a->Kp, a->wp, a->ws, a->comp, a->bias, a->out, a->N, a->N, a->out_bf16, first, last);
    else if (a->kernel == 1)
        w8_blocks(a->xf, a->M, a->Kp, a->wp, a->ws, a->bias, a->out, a->N, a->N, a->out_bf16, first, last);
    else if (a->kernel == 2)
        w8_bf16_blocks((const bf16_t *)a->xin, a->M, a->K, a->wp, a->ws, a->bias, a->out, a->N, a->N, a->out_bf16,
                       first, last);
    else if (a->kernel == 3)
        rs_w8_amx_blocks(a->xa, a->M, a->K, a->wp, a->ws, a->bias, a->out, a->N, a->N, a->out_bf16, first, last);
    else
        rs_bf16_amx_blocks(a->xa, a->M, a->K, (const bf16_t *)a->wp, a->bias, a->out, a->N, a->N, a->out_bf16, first,
                           last);
}

/* One int8 linear with its input's producer fused in front, in one parallel region (one call
 * from Python instead of two at batch 1; the same bits as the two calls):
 *   pre 0: x [M, K] as it is;
 *   pre 1: RMSNorm of x, or with residual of residual + x (written back), weight norm_w
 *          (rs_add_rms_norm);
 *   pre 2: x is gate_up [M, 2K]: SiLU(gate) * up (rs_silu_and_mul).
 * kernel 0: W8A8, 1: weight-only fp32, 2: weight-only bf16 (see above), 3: weight-only on AMX
 * (amx.c; bf16 x, K a multiple of 32, rs_w8_amx_available()); 4: bf16 weights on AMX (wp: the
 * B tile layout of amx.c's rs_bf16_amx_blocks, ws and comp unused; bf16 x, K a multiple of 32). Each output is
 * computed by one thread in a fixed order, so the result does not depend on the threads. */
void rs_int8_linear(int kernel, int pre, const void *x, void *residual, const void *norm_w, float eps, int64_t M,
                    int64_t K, int64_t Kp, const int8_t *wp, const float *ws, const int32_t *comp, const float *bias,
                    void *out, int64_t N, int in_bf16, int out_bf16) {
    const int w8a8_amx = kernel == 0 && M >= W8A8_AMX_MIN_ROWS && Kp % 64 == 0 && rs_w8a8_amx_available();
    linear_args a = {kernel, pre, in_bf16, out_bf16, M > 16, w8a8_amx, x, norm_w, residual, out, eps, M, K, Kp, N, wp,
                     ws, bias, comp, (void *)x, NULL, NULL, NULL, NULL};
    if (pre) a.xin = malloc((size_t)(M * K * (in_bf16 ? 2 : 4)));
    if (kernel == 0) {
        const int64_t Mp = w8a8_amx ? (M + 15) / 16 * 16 : M;  /* AMX: whole row tiles, padding q = 0 */
        a.xq = aligned_alloc(64, (size_t)((Mp * Kp + 63) / 64 * 64));
        memset(a.xq + M * Kp, 128, (size_t)((Mp - M) * Kp));
        a.xs = malloc(sizeof(float) * M);
    } else if (kernel == 1) {
        a.xf = malloc(sizeof(float) * M * Kp);
    } else if (kernel >= 3) {
        const int64_t Mp = (M + 15) / 16 * 16;
        a.xa = aligned_alloc(64, sizeof(bf16_t) * Mp * K);
        memset(a.xa + M * K, 0, sizeof(bf16_t) * (Mp - M) * K);
    }
    if (!a.rows_in_region) prepare_rows(&a, 0, M);
    rs_parallel(linear_task, &a, a.rows_in_region || kernel >= 2 || w8a8_amx || N * Kp > INT8_PARALLEL_BYTES);
    if (pre) free(a.xin);
    free(a.xq);
    free(a.xs);
    free(a.xf);
    free(a.xa);
}
#else
void rs_int8_linear(int kernel, int pre, const void *x, void *residual, const void *norm_w, float eps, int64_t M,
                    int64_t K, int64_t Kp, const int8_t *wp, const float *ws, const int32_t *comp, const float *bias,
                    void *out, int64_t N, int in_bf16, int out_bf16) { abort(); }
int rs_w8_bf16_available(void) { return 0; }
#endif
