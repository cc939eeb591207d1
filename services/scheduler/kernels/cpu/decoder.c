/* A stack of pre-norm decoder layers with the library's linears (int8.c's rs_int8_linear: int8,
 * or bf16 on AMX) in one call (models/layer_stack.py).
 *
 * Why: the model's Python loop over the layers (models/decoder.py, _fused_layers) makes six
 * C calls a layer, and between them Python allocates outputs, finds metadata and crosses
 * ctypes: ~5 ms of a 15 ms batch-1 int8 step on one core, measured by perf. This file runs
 * the same calls, in the same order and with the same arguments, from C, so a step gives
 * the Python loop's bits and the loop's overhead is paid once a step instead of once a layer.
 *
 * Layer i, T tokens, h the residual stream [T, H] (updated in place), x the last layer's
 * output [T, H] (layer 0 reads h as it is, without a residual add):
 *   qkv  = int8_linear(qkv, pre 1: add_rms_norm(x, residual h, input_norm))
 *   q    = rotary_store(qkv) (k and v into the layer's pool rows at loc)
 *   attn = decode_attention(q) per attention part (the deterministic extend's per-token
 *          queries, then the decode queries; parts[p].n tokens each, in packed order)
 *   o    = int8_linear(o, attn)
 *   gu   = int8_linear(gate_up, pre 1: add_rms_norm(o, residual h, post_norm))
 *   x    = int8_linear(down, pre 2: silu_and_mul(gu))
 * The caller adds the last x to h (torch's add, as the Python loop).
 */
#include "common.h"

/* One linear's packed weights (layers/cpu_linear.py's CpuLinear buffers; ws, comp NULL for bf16). */
typedef struct {
    const int8_t *wp;    /* bf16 on AMX: the tile layout's bf16 elements */
    const float *ws;
    const int32_t *comp;
    const float *bias;   /* NULL: none */
    int64_t N, K, Kp;    /* out features, in features, in features padded to 4 */
} rs_int8_weights;

typedef struct {
    rs_int8_weights qkv, o, gate_up, down;
    const void *input_norm, *post_norm;  /* [H], the activations' dtype */
    void *k_buf, *v_buf;                 /* the layer's pool, [N, Hkv, D] */
    int64_t rope;                        /* index into cos / sin */
    int64_t window;                      /* sliding window in tokens, 0: global */
    float input_eps, post_eps, scale, softcap;
} rs_decoder_layer;

/* n consecutive tokens whose attention runs as decode queries (rs_decode_attention's arguments). */
typedef struct {
    int64_t n;
    const int64_t *kv_indices;
    int64_t idx_stride;
    const int64_t *rows;      /* NULL: query b reads row b */
    const int64_t *seq_lens;
} rs_attn_part;

static void linear(int kernel, int pre, const rs_int8_weights *w, const void *x, void *residual, const void *norm_w,
                   float eps, int64_t T, void *out, int is_bf16) {
    rs_int8_linear(kernel, pre, x, residual, norm_w, eps, T, w->K, w->Kp, w->wp, w->ws, w->comp, w->bias, out, w->N,
                   is_bf16, is_bf16);
}

/* kernels[4]: the kernel ids of qkv, o, gate_up and down at T rows (rs_int8_linear's).
 * cos[r], sin[r]: rope table r, [T, D]. loc: int64 [T] pool rows of the tokens. x: [T, H] out.
 * Returns 0, or -1 where scratch could not be allocated (nothing then written). */
int rs_decoder_layers(const rs_decoder_layer *layers, int64_t L, const int *kernels, void *h, void *x, int64_t T,
                    int64_t H, int64_t Hq, int64_t Hkv, int64_t D, const void *const *cos, const void *const *sin,
                    const int64_t *loc, const rs_attn_part *parts, int64_t nparts, int is_bf16) {
    const int64_t es = is_bf16 ? 2 : 4;
    int64_t width = Hq * D > H ? Hq * D : H;  /* q, attention output and o share one buffer's size */
    int64_t qkv_n = 0, gu_n = 0;
    for (int64_t i = 0; i < L; i++) {
        if (layers[i].qkv.N > qkv_n) qkv_n = layers[i].qkv.N;
        if (layers[i].gate_up.N > gu_n) gu_n = layers[i].gate_up.N;
    }
    char *qkv = malloc((size_t)(T * qkv_n * es)), *q = malloc((size_t)(T * width * es));
    char *attn = malloc((size_t)(T * width * es)), *o = malloc((size_t)(T * width * es));
    char *gu = malloc((size_t)(T * gu_n * es));
    int rc = qkv && q && attn && o && gu ? 0 : -1;
    for (int64_t i = 0; i < L && rc == 0; i++) {
        const rs_decoder_layer *l = &layers[i];
        linear(kernels[0], 1, &l->qkv, i ? x : h, i ? h : NULL, l->input_norm, l->input_eps, T, qkv, is_bf16);
        rs_rotary_store(qkv, l->qkv.N, cos[l->rope], sin[l->rope], loc, q, l->k_buf, l->v_buf, T, Hq, Hkv, D,
                        is_bf16);
        int64_t first = 0;
        for (int64_t p = 0; p < nparts; p++) {
            const rs_attn_part *a = &parts[p];
            if (a->n > 0)
                rs_decode_attention(q + first * Hq * D * es, l->k_buf, l->v_buf, a->kv_indices, a->idx_stride, a->rows,
                                    a->seq_lens, attn + first * Hq * D * es, a->n, Hq, Hkv, D, l->scale, l->window,
                                    l->softcap, is_bf16);
            first += a->n;
        }
        linear(kernels[1], 0, &l->o, attn, NULL, NULL, 0.0f, T, o, is_bf16);
        linear(kernels[2], 1, &l->gate_up, o, h, l->post_norm, l->post_eps, T, gu, is_bf16);
        linear(kernels[3], 2, &l->down, gu, NULL, NULL, 0.0f, T, x, is_bf16);
    }
    free(qkv);
    free(q);
    free(attn);
    free(o);
    free(gu);
    return rc;
}
