/* What the int8 kernels share (int8.c: W8A8 and weight-only on AVX-512; amx.c: weight-only on
 * AMX-BF16): the packed weight layout's addressing (int8.c's comment describes the layout),
 * widening a block to bf16, and the epilogue's masked stores. */
#ifndef RS_INT8_H
#define RS_INT8_H

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_INT8 1
#else
#define HAVE_INT8 0
#endif

#if HAVE_INT8
/* Block b's 64 bytes of input channels 0..3 (the next 4 are 256 bytes on). */
static inline const int8_t *int8_block(const int8_t *wp, int64_t Kp, int64_t b) {
    return wp + (b >> 2) * Kp * 64 + (b & 3) * 64;
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

/* bf16 bits of byte r of each 32-bit lane (an int8), in the low half of the lane. */
static inline __attribute__((always_inline)) __m512i int8_lane_to_bf16(__m512i w4, int r) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w4, 24 - 8 * r), 24));
    return _mm512_srli_epi32(_mm512_castps_si512(f), 16);
}

/* One 16-channel block (int8_block) widened to bf16 (exact: |q| <= 127 has 7 significant bits)
 * in k-pair order: wb[k/2] holds channel j's (k, k+1) in dword j, k in the low half -- the
 * operand of vdpbf16ps and AMX's B tile rows. K a multiple of 4. */
static inline void int8_widen_bf16(const int8_t *blk, int64_t K, __m512i *wb) {
    for (int64_t k = 0; k < K; k += 4) {
        const __m512i w4 = _mm512_loadu_si512((const void *)(blk + k * 64));
        wb[k / 2] = _mm512_or_si512(int8_lane_to_bf16(w4, 0), _mm512_slli_epi32(int8_lane_to_bf16(w4, 1), 16));
        wb[k / 2 + 1] = _mm512_or_si512(int8_lane_to_bf16(w4, 2), _mm512_slli_epi32(int8_lane_to_bf16(w4, 3), 16));
    }
}

/* amx.c: channel blocks first .. last-1 of the weight-only product of bf16 xa [Mp, K] (Mp: M
 * rounded up to 16, the padding rows zero; K a multiple of 32) on AMX tiles; rows < M stored. */
void rs_w8_amx_blocks(const bf16_t *xa, int64_t M, int64_t K, const int8_t *wp, const float *ws, const float *bias,
                      void *out, int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last);

/* amx.c: channel blocks first .. last-1 of the W8A8 product of xq u8 [Mp, Kp] (Mp: M rounded up
 * to 16, the padding rows 128; Kp a multiple of 64) on AMX-INT8 tiles: the bits of int8.c's
 * w8a8_blocks. */
void rs_w8a8_amx_blocks(const uint8_t *xq, const float *xs, int64_t M, int64_t Kp, const int8_t *wp, const float *ws,
                        const int32_t *comp, const float *bias, void *out, int64_t N, int64_t ldo, int out_bf16,
                        int64_t first, int64_t last);

/* amx.c: channel blocks first .. last-1 of bf16 xa [Mp, K] (as rs_w8_amx_blocks') times bf16
 * weights packed in the B tile layout (amx.c), + bias, on AMX-BF16 tiles. */
void rs_bf16_amx_blocks(const bf16_t *xa, int64_t M, int64_t K, const bf16_t *wp, const float *bias, void *out,
                        int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last);
#endif
int rs_w8_amx_available(void);
int rs_w8a8_amx_available(void);

#endif
