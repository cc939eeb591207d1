/* Weight-only int8 on AMX-BF16 (layers/quant.py's ``w8amx``, what ``int8wo`` runs on CPUs with
 * AMX): each thread widens two 16-channel blocks of int8 weights to bf16 at a time (exact,
 * int8_widen_bf16) into the B tile layout, then runs every 16-row tile of the bf16
 * activations against them with TDPBF16PS (16 x 32 bf16 A tile times 16 k-pairs x 16 channel
 * B tile into a 16 x 16 fp32 C tile; two row tiles by two blocks at a time), and scales the
 * sums by the channel scales in fp32.
 *
 * Why: on a CPU with AMX, oneDNN's bf16 GEMM runs on the tiles and the AVX-512 weight-only
 * kernels (int8.c) were 2.6x slower than bf16 at 64 rows; on the tiles the weight-only
 * product reads half of bf16's bytes and keeps up with its arithmetic.
 *
 * Numerics: every product of bf16 values is exact in fp32; each output sums its k-pairs in
 * k order in the fp32 C tile (TDPBF16PS in the Intel SDM), a row's sums never mix with
 * other rows', so a row's result does not depend on the batch, the tile or the thread (the
 * padding rows are zero and dropped). The order differs from vdpbf16ps's (k+1 before k), so
 * ``int8wo`` runs this kernel at every row count where it runs at all.
 *
 * AMX needs the process's permission for the tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
 * Linux 5.16+, asked once); without it rs_w8_amx_available() is 0.
 */
#include "int8.h"

#if HAVE_INT8 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int rs_w8_amx_available(void) {
    static _Atomic int state;  /* 0 not asked yet, 1 granted, -1 refused */
    int s = atomic_load(&state);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store(&state, s);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tiles 0-3: C (16 rows x 16 fp32; row tile i, block j in tile 2i+j); 4, 5: A (16 rows x 32
 * bf16); 6, 7: B (16 k-pairs x 16 channels x 2 bf16): every tile 16 rows of 64 bytes. Two row
 * tiles by two blocks: 4 tile loads feed 4 dot products. */
static void configure_tiles(void) {
    tile_config c = {0};
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

static inline __attribute__((always_inline)) void zero_c_tiles(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* C tiles 0-3 to c: 4 x 16 rows of 64 bytes (fp32 or int32 sums), tile t at c + 1024 t bytes. */
static inline __attribute__((always_inline)) void store_c_tiles(void *c) {
    _tile_stored(0, c, 64);
    _tile_stored(1, (char *)c + 1024, 64);
    _tile_stored(2, (char *)c + 2048, 64);
    _tile_stored(3, (char *)c + 3072, 64);
}

/* rs_bf16_amx_blocks prefetches its weight stream this many bytes ahead, into L2. At one row a
 * tile load seems to wait for the product reading the tile before it (no renaming), so the
 * stream runs at a third of the read bandwidth; measured on SmolLM2's linears at one row, 2
 * threads, against 32 KiB into L1: 1.10-1.15x (64 KiB into L2 or L3; 4 blocks a pass over 3
 * rotating B tiles was 0.88x; an AVX-512 path cannot give the tiles' bits: their internal sum
 * is not a sequence of fp32 adds). */
#ifndef BF16_AMX_PREFETCH
#define BF16_AMX_PREFETCH 65536
#endif
#ifndef BF16_AMX_HINT
#define BF16_AMX_HINT _MM_HINT_T1
#endif

/* C tiles 0-3 (zeroed first) = xa's row tile at m0 (and the next, rows2) times one 16-channel
 * block of bf16 k-pair rows at b (and the next, two, K * 32 bytes on), over all of K, in k order.
 * With pf: prefetches from *pf up to pf_end, 2 KiB a k step. */
static inline __attribute__((always_inline)) void bf16_tile_pass(const bf16_t *xa, int64_t m0, int64_t K,
                                                                const char *b, int two, int rows2, const char **pf,
                                                                const char *pf_end) {
    zero_c_tiles();
    for (int64_t k = 0; k < K; k += 32) {
        if (pf)
            for (int l = 0; l < 32 && *pf < pf_end; l++, *pf += 64) _mm_prefetch(*pf, BF16_AMX_HINT);
        _tile_loadd(4, xa + m0 * K + k, K * 2);
        _tile_loadd(6, b + k * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, b + K * 32 + k * 32, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (rows2) {
            _tile_loadd(5, xa + (m0 + 16) * K + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* Rows m0 .. min(M, m0 + 16) - 1 of the 16 channels from n0 on: y = c * ws + bias. */
static void amx_store(const float *c, int64_t m0, int64_t M, const float *ws, const float *bias, void *out,
                      int64_t ldo, int64_t n0, int64_t N, int out_bf16) {
    const __m512 s = _mm512_loadu_ps(ws + n0), b = load_bias(bias, n0, N);
    for (int64_t i = 0; i < 16 && m0 + i < M; i++)
        int8_store(_mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(c + i * 16), s), b), out, m0 + i, ldo, n0, N, out_bf16);
}

void rs_w8_amx_blocks(const bf16_t *xa, int64_t M, int64_t K, const int8_t *wp, const float *ws, const float *bias,
                      void *out, int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last) {
    configure_tiles();
    __m512i *wb = aligned_alloc(64, sizeof(__m512i) * K);  /* two blocks, K / 2 k-pair rows each */
    float *c = aligned_alloc(64, sizeof(float) * 16 * 16 * 4);
    for (int64_t nb = first; nb < last; nb += 2) {
        const int two = last - nb >= 2;
        int8_widen_bf16(int8_block(wp, K, nb), K, wb);
        if (two) int8_widen_bf16(int8_block(wp, K, nb + 1), K, wb + K / 2);
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const int rows2 = M - m0 > 16;  /* a second row tile (the padding makes it whole) */
            bf16_tile_pass(xa, m0, K, (const char *)wb, two, rows2, NULL, NULL);
            store_c_tiles(c);
            for (int i = 0; i <= rows2; i++)
                for (int j = 0; j <= two; j++)
                    amx_store(c + (2 * i + j) * 256, m0 + 16 * i, M, ws, bias, out, ldo, (nb + j) * 16, N, out_bf16);
        }
    }
    free(wb);
    free(c);
    _tile_release();
}

/* bf16 weights on AMX-BF16 (layers/cpu_linear.py's AmxBf16Linear, the CPU's bf16 linears where
 * AMX is there): the weights are packed once into the B tile layout, block-major -- 16-channel
 * block nb's k-pair row r (channel j's inputs 2r, 2r+1 in dword j) at wp + (nb * K / 2 + r) * 32
 * elements -- so a B tile is 16 consecutive 64-byte rows and a thread's blocks one stream. The
 * loop is rs_w8_amx_blocks' without the widening; the first row tile's pass prefetches the
 * stream BF16_AMX_PREFETCH bytes ahead. Numerics as there: a row's sums do not depend on the
 * batch, the tile or the thread, so the linear is batch-invariant at every row count. */
static void bf16_amx_store(const float *c, int64_t m0, int64_t M, const float *bias, void *out, int64_t ldo,
                           int64_t n0, int64_t N, int out_bf16) {
    const __m512 b = load_bias(bias, n0, N);
    for (int64_t i = 0; i < 16 && m0 + i < M; i++)
        int8_store(_mm512_add_ps(_mm512_load_ps(c + i * 16), b), out, m0 + i, ldo, n0, N, out_bf16);
}

/* Rows of xa in chunks of this many bytes (a multiple of 32 rows, at least 32): every block pass
 * of a chunk re-reads its rows from L2, where a prefill of thousands of rows would stream them. */
#ifndef BF16_AMX_CHUNK_BYTES
#define BF16_AMX_CHUNK_BYTES 393216
#endif

void rs_bf16_amx_blocks(const bf16_t *xa, int64_t M, int64_t K, const bf16_t *wp, const float *bias, void *out,
                        int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last) {
    configure_tiles();
    float *c = aligned_alloc(64, sizeof(float) * 16 * 16 * 4);
    const char *pf = (const char *)(wp + first * K * 16) + BF16_AMX_PREFETCH;
    const char *pf_end = (const char *)(wp + last * K * 16);
    int64_t chunk = BF16_AMX_CHUNK_BYTES / (K * 2) / 32 * 32;
    chunk = chunk < 32 ? 32 : chunk;
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t c1 = M - c0 < chunk ? M : c0 + chunk;
        for (int64_t nb = first; nb < last; nb += 2) {
            const int two = last - nb >= 2;
            const bf16_t *b0 = wp + nb * K * 16;
            for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                const int rows2 = c1 - m0 > 16;
                bf16_tile_pass(xa, m0, K, (const char *)b0, two, rows2, m0 == 0 ? &pf : NULL, pf_end);
                store_c_tiles(c);
                for (int i = 0; i <= rows2; i++)
                    for (int j = 0; j <= two; j++)
                        bf16_amx_store(c + (2 * i + j) * 256, m0 + 16 * i, M, bias, out, ldo, (nb + j) * 16, N,
                                       out_bf16);
            }
        }
    }
    free(c);
    _tile_release();
}

/* W8A8 on AMX-INT8 (``w8a8`` from W8A8_AMX_MIN_ROWS rows on CPUs with AMX): TDPBUSD multiplies
 * the u8 activation rows (quantize_rows' q + 128, a 16 x 64-byte A tile) by the s8 weights and
 * sums in int32 -- the same exact sums as int8.c's vpdpbusd tiles, so the same bits at every row
 * count. The packed layout needs no repacking: block b's rows for input channels 4r .. 4r+3 are
 * 64 bytes each, 256 bytes apart (int8_block), which is a B tile of 16 such rows. Two row tiles
 * by two blocks at a time, the epilogue of int8.c's w8a8_tile. xq: [Mp, Kp] with Mp a multiple
 * of 16 (padding rows 128, dropped), Kp a multiple of 64. */
#if defined(__AMX_INT8__)
#ifndef W8A8_AMX_PREFETCH
#define W8A8_AMX_PREFETCH 32768
#endif
int rs_w8a8_amx_available(void) { return rs_w8_amx_available(); }

static void w8a8_amx_store(const int32_t *c, int64_t m0, int64_t M, const float *xs, const int32_t *comp,
                           const float *ws, const float *bias, void *out, int64_t ldo, int64_t n0, int64_t N,
                           int out_bf16) {
    const __m512i cn = _mm512_loadu_si512((const void *)(comp + n0));
    const __m512 s = _mm512_loadu_ps(ws + n0), b = load_bias(bias, n0, N);
    for (int64_t i = 0; i < 16 && m0 + i < M; i++) {
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c + i * 16), cn)), s);
        int8_store(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs[m0 + i])), b), out, m0 + i, ldo, n0, N, out_bf16);
    }
}

void rs_w8a8_amx_blocks(const uint8_t *xq, const float *xs, int64_t M, int64_t Kp, const int8_t *wp, const float *ws,
                        const int32_t *comp, const float *bias, void *out, int64_t N, int64_t ldo, int out_bf16,
                        int64_t first, int64_t last) {
    configure_tiles();
    int32_t *c = aligned_alloc(64, sizeof(int32_t) * 16 * 16 * 4);
    /* A tile load waits for its 16 lines: the first row tile's pass prefetches the thread's
     * weights (one contiguous stream) W8A8_AMX_PREFETCH bytes ahead, as many bytes a k step
     * as it reads. */
    const char *pf = (const char *)int8_block(wp, Kp, first) + W8A8_AMX_PREFETCH;
    const char *pf_end = (const char *)int8_block(wp, Kp, (last + 3) / 4 * 4);
    for (int64_t nb = first; nb < last; nb += 2) {
        const int two = last - nb >= 2;
        const int8_t *b0 = int8_block(wp, Kp, nb), *b1 = int8_block(wp, Kp, nb + 1);
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const int rows2 = M - m0 > 16;
            zero_c_tiles();
            for (int64_t k = 0; k < Kp; k += 64) {
                if (m0 == 0)
                    for (int l = 0; l < 32 && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
                _tile_loadd(4, xq + m0 * Kp + k, Kp);
                _tile_loadd(6, b0 + k * 64, 256);
                _tile_dpbusd(0, 4, 6);
                if (two) {
                    _tile_loadd(7, b1 + k * 64, 256);
                    _tile_dpbusd(1, 4, 7);
                }
                if (rows2) {
                    _tile_loadd(5, xq + (m0 + 16) * Kp + k, Kp);
                    _tile_dpbusd(2, 5, 6);
                    if (two) _tile_dpbusd(3, 5, 7);
                }
            }
            store_c_tiles(c);
            for (int i = 0; i <= rows2; i++)
                for (int j = 0; j <= two; j++)
                    w8a8_amx_store(c + (2 * i + j) * 256, m0 + 16 * i, M, xs, comp, ws, bias, out, ldo, (nb + j) * 16,
                                   N, out_bf16);
        }
    }
    free(c);
    _tile_release();
}
#else
int rs_w8a8_amx_available(void) { return 0; }
void rs_w8a8_amx_blocks(const uint8_t *xq, const float *xs, int64_t M, int64_t Kp, const int8_t *wp, const float *ws,
                        const int32_t *comp, const float *bias, void *out, int64_t N, int64_t ldo, int out_bf16,
                        int64_t first, int64_t last) { abort(); }
#endif
#else
int rs_w8_amx_available(void) { return 0; }
int rs_w8a8_amx_available(void) { return 0; }
#if HAVE_INT8
void rs_w8_amx_blocks(const bf16_t *xa, int64_t M, int64_t K, const int8_t *wp, const float *ws, const float *bias,
                      void *out, int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last) { abort(); }
void rs_bf16_amx_blocks(const bf16_t *xa, int64_t M, int64_t K, const bf16_t *wp, const float *bias, void *out,
                        int64_t N, int64_t ldo, int out_bf16, int64_t first, int64_t last) { abort(); }
void rs_w8a8_amx_blocks(const uint8_t *xq, const float *xs, int64_t M, int64_t Kp, const int8_t *wp, const float *ws,
                        const int32_t *comp, const float *bias, void *out, int64_t N, int64_t ldo, int out_bf16,
                        int64_t first, int64_t last) { abort(); }
#endif
#endif
