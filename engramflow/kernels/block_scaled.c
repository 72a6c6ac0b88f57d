/* engramflow: DeepSeek V4.1's block-scaled quantised linear, y = x @ W^T, on the CPU.
 *
 * The arithmetic, bit for bit that of kernels/quant.py `quant_linear_reference`:
 *  1. x is quantised per 32 values: amax (NaN propagates), floored at 1e-4f; the scale
 *     sa = 2^ceil(log2(amax * fp32(1/448))) from the bits of that fp32 product; q = e4m3(clamp(x / sa)),
 *     rounded to nearest even as torch's float8_e4m3fn cast does.
 *  2. Per 32-wide K block, the 32 products q_j * w_j are summed in fp32. Each product is exact
 *     (two significands of at most 4 bits; magnitudes between 2^-18 and 2^18, far from fp32
 *     subnormals and overflow), so an FMA and a multiply-then-add give the same bits, and only
 *     the order of the 31 additions matters. It is the order of torch's bmm (MKL): j = 0..31 in
 *     order for two or more rows; for one row (gemv_order) the tree of gemv_tree_sum below for
 *     the first N - N mod 16 columns and j in order for the rest (found by probing which
 *     products meet first: 2^24 + 1 + 1 rounds to 2^24 unless the ones meet first).
 *  3. acc += (p * sa) * sw, blocks in K order, acc starting at +0; the result rounded to bf16
 *     (nearest even, every NaN 0xFFFF: torch's .to(torch.bfloat16), kernel_common.h) or kept in fp32.
 * Every row's result depends on that row's x only: the kernel is batch-invariant by construction.
 *
 * The vector path holds q * 256 and w * 2^-8 (the fp16 trick that decodes E4M3 exactly): every
 * product and every partial sum is then the same real number as q * w and its sums, none is
 * subnormal, so every rounding is the same. The portable path uses the same scaled values.
 * The file is compiled with -ffp-contract=off, the policy of every kernel library
 * (kernel_common.h): (p * sa) * sw and the add after it must not be fused (a fused form differs
 * where p * sa * sw would be subnormal).
 *
 * Variants (kernel_common.h): `generic` (the portable reference path), `avx512` and
 * `avx512bf16` (avx512 with its FP8 and FP4 tiles on VDPBF16PS, two in-order products per
 * instruction: see ebs_bf16_exact), each a compile of this file (-DEK_VARIANT=<name>), plus the dispatcher
 * (-DEK_DISPATCH: the exported entry points, activation quantisation, the thread pool) choosing
 * the best the CPU supports when the library loads; all give the same bits. ebs_set_variant
 * forces one.
 *
 * Weights come packed by kernels/block_scaled.py: 32 output columns per group, [G][K][32] E4M3
 * bytes (fp8) or [G][K/2][32] bytes of two E2M1 codes, the even k in the low nibble (fp4), and
 * E8M0 scale bytes [G][K/32][32] (1..254 only: the packer declines 0 and 255).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#include <time.h>
#include "kernel_common.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define EBS_AVX512 1 /* the avx512 variant's compile (and avx512bf16's) */
#else
#define EBS_AVX512 0
#endif
#if EBS_AVX512 && defined(__AVX512BF16__)
#define EBS_BF16 1 /* the avx512bf16 variant's compile: the avx512 one with FP8/FP4 tiles on VDPBF16PS */
#else
#define EBS_BF16 0
#endif

#define EBS_ABI_VERSION 5
#ifndef EK_SOURCE_HASH
#define EK_SOURCE_HASH "unknown"
#endif
#define GROUP 32   /* output columns per weight group: two 16-float vectors */
#define BLOCK 32   /* K values per scale */
#define KC 256     /* K values decoded per group and chunk in the portable path: 32 KiB of fp32 */
#define TILE_T 10  /* rows per register tile: 10 x 2 block sums in registers (11 and 12 measured slower) */
#define MAX_NG 4   /* groups in one tile: DIRECT_NG(1) */
#ifndef RAW_ROWS
#define RAW_ROWS 4 /* FP8 calls of at most this many rows run the raw-bits tiles (e4m3_raw16) */
#endif

enum { FMT_FP8 = 0, FMT_FP4 = 1 };

#define bits_to_float ek_bits_to_float
#define float_to_bits ek_float_to_bits
#define float_to_bf16 ek_float_to_bf16 /* torch's rounding, NaN included (kernel_common.h) */

#define DR 4          /* rows per register tile */
#define DC 4          /* columns per register tile */
#define DENSE_ROWS 64 /* rows per work item */
#define DENSE_PANEL 8 /* columns every row tile of an item passes before the next ones */
#define DENSE_COLS 64 /* columns per work item: 64 x k of w stays in L2 while the rows pass */

/* one call of ebs_linear: what every thread's share of the column groups needs */
typedef struct {
    int fmt;
    const float *qs, *sa;
    const uint32_t *qp; /* [t, k/2] bf16 pairs of qs, q_k in the high half, q_k+1 in the low, for the
                         * bf16 tiles; NULL: a q is NaN, the fp32 tiles run (bf16_pairs) */
    const float *qh;    /* [t, k] qs * 2^104 = q * 2^112, for the raw-bits FP8 tiles (e4m3_raw16) */
    int64_t t, k, n;
    const uint8_t *w, *ws;
    void *y;
    int y_bf16;
    int gemv_order; /* one row: MKL's GEMV tree (see gemv_tree_sum) */
    int64_t g0, g1;  /* the column groups being computed now: claimed from *next */
    int64_t groups, claim, *next;
    float *scratch; /* per thread: KC x 32 decoded weights (portable path) + MAX_NG x t x 32 totals */
} job_t;

typedef struct {
    const void *x, *w;
    int x_bf16, w_bf16;
    int64_t m, k, n;
    float *y;
    int64_t items, col_items, *next;
} dense_job_t;

#define PROBE_CHAINS 16 /* independent FMA chains per probe thread */
typedef struct { int64_t iters; double sink; } probe_t;

#ifndef EK_DISPATCH /* ---- the kernels of one variant ------------------------------------------- */

/* ---- weights ------------------------------------------------------------------------------ */

static float E4M3_SCALED[256]; /* e4m3(code) * 2^-8, exact */
static const float E2M1_SCALED[16] = {
    0.0f, 0x1p-9f, 0x1p-8f, 0x1.8p-8f, 0x1p-7f, 0x1.8p-7f, 0x1p-6f, 0x1.8p-6f,
    -0.0f, -0x1p-9f, -0x1p-8f, -0x1.8p-8f, -0x1p-7f, -0x1.8p-7f, -0x1p-6f, -0x1.8p-6f};
/* E2M1_SCALED as bf16 bits (its values' top halves), padded to vpermw's 32 entries */
static const uint16_t E2M1_BF16[32] = {
    0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C40, 0x3C80, 0x3CC0,
    0x8000, 0xBB00, 0xBB80, 0xBBC0, 0xBC00, 0xBC40, 0xBC80, 0xBCC0};
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void fill_e4m3_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float mag = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        E4M3_SCALED[c] = ldexpf((c & 0x80) ? -mag : mag, -8); /* codes 0x7F/0xFF: declined by the packer */
    }
}

/* the decoded weights of one group over K values [k0, k0 + kn): buf[kk * 32 + c] */
static void decode_chunk_portable(int fmt, const uint8_t *wg, int64_t k0, int64_t kn, float *buf) {
    for (int64_t kk = 0; kk < kn; kk++) {
        int64_t k = k0 + kk;
        for (int c = 0; c < GROUP; c++) {
            if (fmt == FMT_FP8) buf[kk * GROUP + c] = E4M3_SCALED[wg[k * GROUP + c]];
            else buf[kk * GROUP + c] = E2M1_SCALED[(wg[(k >> 1) * GROUP + c] >> ((k & 1) * 4)) & 15];
        }
    }
}

static inline float e8m0(uint8_t s) { return bits_to_float((uint32_t)s << 23); }

/* ---- the portable path: one group, all rows, K in chunks ------------------------------------ */

static void store_group(const job_t *j, int64_t g, const float *tot) {
    int64_t c0 = g * GROUP, cn = j->n - c0 < GROUP ? j->n - c0 : GROUP;
    for (int64_t r = 0; r < j->t; r++)
        for (int64_t c = 0; c < cn; c++) {
            float v = tot[r * GROUP + c];
            if (j->y_bf16) ((uint16_t *)j->y)[r * j->n + c0 + c] = float_to_bf16(v);
            else ((float *)j->y)[r * j->n + c0 + c] = v;
        }
}

static const uint8_t *group_weights(const job_t *j, int64_t g) {
    return j->w + g * (j->fmt == FMT_FP8 ? j->k : j->k / 2) * GROUP;
}

/* MKL's GEMV order for one block's 32 exact products p: the first 8 as
 * ((p0+p2)+(p1+p3)) + ((p4+p6)+(p5+p7)), then each next 8 (p relative to it) as
 * s += p6; s += p4; s += p5+p7; s += (p0+p2)+(p1+p3). */
static inline float gemv_tree_sum(const float *p) {
    float s = ((p[0] + p[2]) + (p[1] + p[3])) + ((p[4] + p[6]) + (p[5] + p[7]));
    for (int c = 8; c < BLOCK; c += 8) {
        const float *q = p + c;
        s = s + q[6];
        s = s + q[4];
        s = s + (q[5] + q[7]);
        s = s + ((q[0] + q[2]) + (q[1] + q[3]));
    }
    return s;
}

static void run_portable(const job_t *j) {
    const int64_t nb = j->k / BLOCK;
    float *buf = j->scratch, *tot = j->scratch + KC * GROUP;
    for (int64_t g = j->g0; g < j->g1; g++) {
        const uint8_t *wg = group_weights(j, g), *sg = j->ws + g * nb * GROUP;
        memset(tot, 0, sizeof(float) * j->t * GROUP);
        for (int64_t k0 = 0; k0 < j->k; k0 += KC) {
            int64_t kn = j->k - k0 < KC ? j->k - k0 : KC;
            decode_chunk_portable(j->fmt, wg, k0, kn, buf);
            for (int64_t r = 0; r < j->t; r++)
                for (int64_t b = k0 / BLOCK; b < (k0 + kn) / BLOCK; b++) {
                    float blk[GROUP] = {0};
                    const float *a = j->qs + r * j->k + b * BLOCK, *wb = buf + (b * BLOCK - k0) * GROUP;
                    if (j->gemv_order) {
                        for (int c = 0; c < GROUP; c++) {
                            float p[BLOCK];
                            for (int jj = 0; jj < BLOCK; jj++) p[jj] = a[jj] * wb[jj * GROUP + c];
                            blk[c] = gemv_tree_sum(p);
                        }
                    } else {
                        for (int jj = 0; jj < BLOCK; jj++)
                            for (int c = 0; c < GROUP; c++) blk[c] += a[jj] * wb[jj * GROUP + c]; /* exact product */
                    }
                    float s = j->sa[r * nb + b];
                    for (int c = 0; c < GROUP; c++)
                        tot[r * GROUP + c] += (blk[c] * s) * e8m0(sg[b * GROUP + c]);
                }
        }
        store_group(j, g, tot);
    }
}

/* One row, columns [c0, c1), every block summed j in order (MKL's GEMV tail columns). */
static void row_in_order(const job_t *j, int64_t c0, int64_t c1) {
    const int64_t nb = j->k / BLOCK;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t g = c / GROUP, lane = c % GROUP;
        const uint8_t *wg = group_weights(j, g), *sg = j->ws + g * nb * GROUP;
        float tot = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            float blk = 0.0f, w;
            for (int jj = 0; jj < BLOCK; jj++) {
                int64_t k = b * BLOCK + jj;
                if (j->fmt == FMT_FP8) w = E4M3_SCALED[wg[k * GROUP + lane]];
                else w = E2M1_SCALED[(wg[(k >> 1) * GROUP + lane] >> ((k & 1) * 4)) & 15];
                blk += j->qs[k] * w;
            }
            tot += (blk * j->sa[b]) * e8m0(sg[b * GROUP + lane]);
        }
        if (j->y_bf16) ((uint16_t *)j->y)[c] = float_to_bf16(tot);
        else ((float *)j->y)[c] = tot;
    }
}

/* ---- the AVX-512 path ---------------------------------------------------------------------- */
#if EBS_AVX512
#define AVX512 /* marks the avx512 variant's functions (compiled with its -m flags, kernel_common.h) */

/* 16 E4M3 codes -> e4m3 * 2^-8 exactly: sign-extend, shift left 7 (the fp16 encoding of
 * e4m3 * 2^-8), clear the duplicated sign bit 14, convert fp16 -> fp32. */
AVX512 static inline __m512 e4m3x16r(__m128i codes) {
    __m256i h = _mm256_cvtepi8_epi16(codes);
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
    return _mm512_cvtph_ps(h);
}
AVX512 static inline __m512 e4m3x16(const uint8_t *p) { return e4m3x16r(_mm_loadu_si128((const __m128i *)p)); }

AVX512 static inline __m512 e8m0x16(const uint8_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), 23));
}

/* acc + q[0] * w with q[0] broadcast by the FMA itself (an embedded-broadcast memory operand,
 * one rounding as _mm512_fmadd_ps(_mm512_set1_ps(*q), w, acc)): a separate broadcast per row
 * and k cost a vector uop next to every two FMAs. Measured on Zen 4, one thread, same run:
 * 0.62 -> 0.79 of the FMA rate at T = 8, 0.67 -> 0.81 at 16, 0.68 -> 0.75 at 64. Written in
 * asm because the compiler keeps a value used twice in a register. */
AVX512 static inline __attribute__((always_inline)) __m512 fma_q(const float *q, __m512 w, __m512 acc) {
    __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*q));
    return acc;
}

/* decoded weights of k (both 16-column halves) */
AVX512 static inline void weights_at(int fmt, const uint8_t *wg, int64_t k, __m512 lut, __m512 *w0, __m512 *w1) {
    if (fmt == FMT_FP8) {
        *w0 = e4m3x16(wg + k * GROUP);
        *w1 = e4m3x16(wg + k * GROUP + 16);
    } else {
        const uint8_t *p = wg + (k >> 1) * GROUP;
        int sh = (int)(k & 1) * 4;
        __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
        __m512i m = _mm512_set1_epi32(15);
        *w0 = _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(a, sh), m), lut);
        *w1 = _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(b, sh), m), lut);
    }
}

/* Software prefetch of the weight stream, PREFETCH_BYTES ahead of k. The loops are
 * dense in arithmetic, so few loads are in flight and the hardware prefetcher alone left a
 * core at 3-6 GB/s where a bare read loop gets 13: measured on Intel (AMX) at T = 1-6. Past
 * the end it touches nothing (a prefetch never faults). */
#define PREFETCH_BYTES 16384
#define PREFETCH(FMT, WG, K)                                                                             \
    _mm_prefetch((const char *)(WG) + ((FMT) == FMT_FP8 ? (K) : (K) >> 1) * GROUP + PREFETCH_BYTES, _MM_HINT_T0)

/* the decoded weights of k and k + 1 (k even): w[0], w[1] for k, w[2], w[3] for k + 1 */
#define FETCH2(FMT, WG, K, W)                                                                            \
    do { weights_at(FMT, WG, K, lut, &(W)[0], &(W)[1]); weights_at(FMT, WG, (K) + 1, lut, &(W)[2], &(W)[3]); } while (0)

/* after block b: tot (group gi's at tot + gi * tstride, row r at + r * 32) += (blk * sa) * sw */
#define SCALE_BLOCK(TT, NG)                                                                              \
    _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++) {                                            \
        __m512 s0 = e8m0x16(sg[gi] + b * GROUP), s1 = e8m0x16(sg[gi] + b * GROUP + 16);                  \
        _Pragma("GCC unroll 16") for (int r = 0; r < TT; r++) {                                           \
            __m512 a = _mm512_set1_ps(j->sa[(r0 + r) * nb + b]);                                         \
            float *t = tot + gi * tstride + r * GROUP;                                                   \
            _mm512_storeu_ps(t, _mm512_add_ps(_mm512_loadu_ps(t), _mm512_mul_ps(_mm512_mul_ps(blk[r][gi][0], a), s0))); \
            _mm512_storeu_ps(t + 16, _mm512_add_ps(_mm512_loadu_ps(t + 16),                              \
                                                   _mm512_mul_ps(_mm512_mul_ps(blk[r][gi][1], a), s1))); \
        }                                                                                                \
    }

/* One register tile: TT rows x NG groups (NG * 32 columns) over blocks [b0, b1), the block sums
 * in registers (2 * TT * NG independent FMA chains: the order inside each chain is the one the
 * bits need, so the chains, not a chain's order, feed the FMA units); after each block the
 * running totals in tot (group gi's at tot + gi * tstride, row r at + r * 32) take its scaled
 * sums. The weights are decoded in registers from the group's bytes (wg[gi]), each decoded
 * vector feeding TT rows. */
#define TILE_LOOP(TT, NG, FMT, QS, DECODE, POST)                                                         \
    const int64_t nb = j->k / BLOCK;                                                                     \
    for (int64_t b = b0; b < b1; b++) {                                                                  \
        __m512 blk[TT][NG][2];                                                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < TT; r++)                                            \
        _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++)                                         \
            blk[r][gi][0] = blk[r][gi][1] = _mm512_setzero_ps();                                         \
        const float *q = (QS) + r0 * j->k + b * BLOCK;                                                   \
        for (int jj = 0; jj < BLOCK; jj++) {                                                             \
            int64_t k = b * BLOCK + jj;                                                                  \
            __m512 w[NG][2];                                                                             \
            _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++) {                                   \
                PREFETCH(FMT, wg[gi], k);                                                                \
                DECODE(FMT, wg[gi], k, w[gi]);                                                           \
            }                                                                                            \
            _Pragma("GCC unroll 16") for (int r = 0; r < TT; r++) {                                      \
                _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++) {                               \
                    blk[r][gi][0] = fma_q(q + r * j->k + jj, w[gi][0], blk[r][gi][0]); /* exact product */\
                    blk[r][gi][1] = fma_q(q + r * j->k + jj, w[gi][1], blk[r][gi][1]);                   \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        POST(TT, NG);                                                                                    \
        SCALE_BLOCK(TT, NG);                                                                             \
    }
#define DECODE_LUT(FMT, WG, K, W) weights_at(FMT, WG, K, lut, &(W)[0], &(W)[1])
#define NO_POST(TT, NG) (void)0
#define TILE_BODY(TT, NG, FMT)                                                                  \
    const __m512 lut = _mm512_loadu_ps(E2M1_SCALED);                                                     \
    TILE_LOOP(TT, NG, FMT, j->qs, DECODE_LUT, NO_POST)

#define TILE_ARGS const job_t *j, const uint8_t *const *wg, const uint8_t *const *sg, int64_t r0, int64_t b0, \
                  int64_t b1, float *tot, int64_t tstride
#define DEFINE_TILE(NAME, TT, NG, FMT) AVX512 static void NAME(TILE_ARGS) { TILE_BODY(TT, NG, FMT) }
typedef void (*tile_fn)(TILE_ARGS);

/* the tiles, [fmt][rows - 1]: NG groups at once so that one row still has 8 chains */
#define DIRECT_NG(TT) ((TT) == 1 ? 4 : (TT) <= 3 ? 2 : 1)
#define DIRECT(FMT, TT) DEFINE_TILE(direct_##FMT##_##TT, TT, DIRECT_NG(TT), FMT)
#define TILES(M, A) M(A, 1) M(A, 2) M(A, 3) M(A, 4) M(A, 5) M(A, 6) M(A, 7) M(A, 8) M(A, 9) M(A, 10)
#define TILE_NAMES(P) {P##_1, P##_2, P##_3, P##_4, P##_5, P##_6, P##_7, P##_8, P##_9, P##_10}
TILES(DIRECT, 0) TILES(DIRECT, 1)
/* the same rows one group at a time (groups left over, row tiles of more rows) */
#define SINGLE(FMT, TT) DEFINE_TILE(single_##FMT##_##TT, TT, 1, FMT)
SINGLE(0, 1) SINGLE(0, 2) SINGLE(0, 3) SINGLE(1, 1) SINGLE(1, 2) SINGLE(1, 3)

#if EBS_BF16
/* The avx512bf16 variant's tiles: VDPBF16PS adds two products per lane and instruction,
 * acc + a[odd] * b[odd], rounded, then + a[even] * b[even], rounded (Intel's pseudocode: two
 * fp32 FMAs, round to nearest even, denormal inputs and outputs as zero). With q_k in the odd
 * (high) half and q_k+1 in the even one, that is acc + p_k + p_k+1, the two additions of the
 * in-order block sum: the same bits as two FMAs, for half the FMA-port instructions. Exact here
 * because q * 256 and w * 2^-8 fit bf16 (significands of 4 bits, 2 for E2M1), no input,
 * product or partial sum is subnormal (all are 0 or at least 2^-18), and the dispatcher runs
 * this variant only where a probe found the instruction doing just that (ebs_bf16_exact). */

/* k and k + 1 (k even) of 16 columns from p (row k; row k + 1 at p + 32): lane c holds
 * w_k(c) * 2^-8 in its high half and w_k+1(c) * 2^-8 in its low half, as bf16 (exact) */
AVX512 static inline __m512bh e4m3_pairs16(const uint8_t *p) {
    __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + GROUP));
    __m512 lo = e4m3x16r(_mm_unpacklo_epi8(b, a)), hi = e4m3x16r(_mm_unpackhi_epi8(b, a));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* The same pairs for FP4: a byte holds w_k (low nibble) and w_k+1 (high nibble) of one column;
 * lane c's index pair (low nibble in the high half, high nibble in the low) picks both bf16
 * values in one permute from E2M1_BF16 (E2M1_SCALED's top halves: exact, 2-bit significands). */
AVX512 static inline __m512bh e2m1_pairs16(const uint8_t *p, __m512i lut16) {
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i idx = _mm512_ternarylogic_epi32(_mm512_slli_epi32(x, 16), _mm512_set1_epi32(0xF0000),
                                            _mm512_srli_epi32(x, 4), 0xEA); /* (a & b) | c */
    return (__m512bh)_mm512_permutexvar_epi16(idx, lut16);
}

/* the pairs of k and k + 1 (k even) for half H (0 or 16) of a group's 32 columns */
#define PAIRS16(FMT, WG, K, H)                                                                           \
    ((FMT) == FMT_FP8 ? e4m3_pairs16((WG) + (K) * GROUP + (H)) : e2m1_pairs16((WG) + ((K) >> 1) * GROUP + (H), lut16))

/* acc + q_k * w_k + q_k+1 * w_k+1 (see above), the pair *q broadcast by the instruction itself
 * (as fma_q, and in asm for the same reason) */
AVX512 static inline __attribute__((always_inline)) __m512 dp_q(const uint32_t *q, __m512bh w, __m512 acc) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*q));
    return acc;
}

/* TILE_BODY with the pairs of k: the same tile, block sums and scale step */
#define TILE_BODY_BF16(TT, NG, FMT)                                                                      \
    const int64_t nb = j->k / BLOCK, kp = j->k / 2;                                                      \
    const __m512i lut16 = _mm512_loadu_si512(E2M1_BF16);                                                 \
    (void)lut16;                                                                                         \
    for (int64_t b = b0; b < b1; b++) {                                                                  \
        __m512 blk[TT][NG][2];                                                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < TT; r++)                                             \
        _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++)                                          \
            blk[r][gi][0] = blk[r][gi][1] = _mm512_setzero_ps();                                         \
        const uint32_t *q = j->qp + r0 * kp + b * (BLOCK / 2);                                           \
        for (int jj = 0; jj < BLOCK; jj += 2) {                                                          \
            int64_t k = b * BLOCK + jj;                                                                  \
            __m512bh w[NG][2];                                                                           \
            _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++) {                                   \
                PREFETCH(FMT, wg[gi], k);                                                                \
                w[gi][0] = PAIRS16(FMT, wg[gi], k, 0);                                                   \
                w[gi][1] = PAIRS16(FMT, wg[gi], k, 16);                                                  \
            }                                                                                            \
            _Pragma("GCC unroll 16") for (int r = 0; r < TT; r++) {                                      \
                _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++) {                               \
                    blk[r][gi][0] = dp_q(q + r * kp + jj / 2, w[gi][0], blk[r][gi][0]);                  \
                    blk[r][gi][1] = dp_q(q + r * kp + jj / 2, w[gi][1], blk[r][gi][1]);                  \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        SCALE_BLOCK(TT, NG);                                                                             \
    }
#define DEFINE_TILE_BF16(NAME, TT, NG, FMT) AVX512 static void NAME(TILE_ARGS) { TILE_BODY_BF16(TT, NG, FMT) }
#define DIRECT_BF16(FMT, TT) DEFINE_TILE_BF16(direct_bf##FMT##_##TT, TT, DIRECT_NG(TT), FMT)
#define SINGLE_BF16(FMT, TT) DEFINE_TILE_BF16(single_bf##FMT##_##TT, TT, 1, FMT)
TILES(DIRECT_BF16, 0) TILES(DIRECT_BF16, 1)
SINGLE_BF16(0, 1) SINGLE_BF16(0, 2) SINGLE_BF16(0, 3) SINGLE_BF16(1, 1) SINGLE_BF16(1, 2) SINGLE_BF16(1, 3)
#endif

#if EBS_BF16
/* Whether VDPBF16PS here is what the tiles above need: acc + odd product first, each addition
 * rounded (to nearest even). Each case has one answer per reading: odd or even product first,
 * two roundings or one, nearest-even or toward zero. The dispatcher runs this variant only if
 * all hold. */
static float dp_one(float acc, float q_odd, float w_odd, float q_even, float w_even) {
    uint32_t q = (float_to_bits(q_odd) & 0xFFFF0000u) | (float_to_bits(q_even) >> 16);
    uint32_t w = (float_to_bits(w_odd) & 0xFFFF0000u) | (float_to_bits(w_even) >> 16);
    __m512 r = _mm512_dpbf16_ps(_mm512_set1_ps(acc), (__m512bh)_mm512_set1_epi32((int)q),
                                (__m512bh)_mm512_set1_epi32((int)w));
    return _mm512_cvtss_f32(r);
}

EK_KERNEL int EK_NAME(ebs_bf16_exact)(void) {
    const float big = 0x1p24f; /* big + 1 is a tie: nearest even gives big */
    return dp_one(1.0f, big, 1.0f, 1.0f, 1.0f) == big          /* odd first: (1 + 2^24) + 1 */
        && dp_one(1.0f, 1.0f, 1.0f, big, 1.0f) == big + 2.0f   /* (1 + 1) + 2^24 */
        && dp_one(big, 1.0f, 1.0f, 1.0f, 1.0f) == big          /* two roundings, not one */
        && dp_one(big, 3.0f, 1.0f, 0.0f, 1.0f) == big + 4.0f   /* nearest even, not toward zero */
        && dp_one(0x1p-17f, 0x1p-1f, 0x1p-17f, -0x1p-1f, 0x1p-17f) == 0x1p-17f; /* small products kept */
}
#endif

/* The FP8 tiles for few rows, where each decoded weight vector feeds only a few FMAs and the
 * decode's conversion (vcvtph2ps) takes FMA-port time: the E4M3 byte becomes fp32 by integer
 * ops alone. Sign-extended and shifted left 20, the magnitude bits land on the fp32 exponent's
 * low 4 bits and the mantissa's top 3; clearing the copies of the sign leaves e4m3 * 2^-120
 * exactly (the subnormals, e = 0, become fp32 subnormals of the same scale). With q * 2^112,
 * each product is q * w * 2^-8 exactly (between 2^-26 and 2^10: no subnormal, no overflow),
 * so every partial sum of a block is the fp32 one's times 2^-8, rounded alike; the block sum
 * times 2^8 (exact) is the same sum. Needs subnormal inputs read as such (MXCSR.DAZ clear:
 * run_avx512 checks), and runs only on AMD CPUs (the dispatcher leaves qh NULL elsewhere):
 * Zen 4 multiplies subnormals at full speed, while some Intel cores take a microcode assist
 * for them. Measured on Zen 4 at T = 4, one thread, same run: 15.5 -> 14.5 ms. */
AVX512 static inline __m512 e4m3_raw16(const uint8_t *p) {
    __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(d, 20), _mm512_set1_epi32((int)0x87F00000u)));
}

#define DECODE_RAW(FMT, WG, K, W)                                                                        \
    do { (W)[0] = e4m3_raw16((WG) + (K) * GROUP); (W)[1] = e4m3_raw16((WG) + (K) * GROUP + 16); } while (0)
#define TIMES_TWO8(TT, NG) /* the raw products' 2^-8 undone, exactly */                                  \
    _Pragma("GCC unroll 16") for (int r = 0; r < TT; r++)                                                \
    _Pragma("GCC unroll 16") for (int gi = 0; gi < NG; gi++) {                                           \
        blk[r][gi][0] = _mm512_mul_ps(blk[r][gi][0], two8);                                              \
        blk[r][gi][1] = _mm512_mul_ps(blk[r][gi][1], two8);                                              \
    }
#define TILE_BODY_RAW(TT, NG)                                                                            \
    const __m512 two8 = _mm512_set1_ps(0x1p8f);                                                          \
    TILE_LOOP(TT, NG, FMT_FP8, j->qh, DECODE_RAW, TIMES_TWO8)
#define DEFINE_TILE_RAW(NAME, TT, NG) AVX512 static void NAME(TILE_ARGS) { TILE_BODY_RAW(TT, NG) }
/* groups per raw tile: two at four rows (16 FMA chains, two weight streams; one thread, same
 * run: 6 % faster than one group) */
#define RAW_NG(TT) ((TT) == 4 ? 2 : DIRECT_NG(TT))
DEFINE_TILE_RAW(raw_1, 1, RAW_NG(1)) DEFINE_TILE_RAW(raw_2, 2, RAW_NG(2)) DEFINE_TILE_RAW(raw_3, 3, RAW_NG(3))
DEFINE_TILE_RAW(raw_4, 4, RAW_NG(4))
DEFINE_TILE_RAW(raw_s1, 1, 1) DEFINE_TILE_RAW(raw_s2, 2, 1) DEFINE_TILE_RAW(raw_s3, 3, 1) DEFINE_TILE_RAW(raw_s4, 4, 1)
static const tile_fn RAW_DIRECT[4] = {raw_1, raw_2, raw_3, raw_4};
static const tile_fn RAW_SINGLE[4] = {raw_s1, raw_s2, raw_s3, raw_s4};

/* One row in MKL's GEMV order (gemv_tree_sum), one group: each 8 products are formed, then
 * added in that tree; the rest as in TILE_BODY. */
#define GEMV_TILE(FMT)                                                                                   \
AVX512 static void gemv_##FMT(TILE_ARGS) {                                                                \
    (void)r0; (void)tstride;                                                                             \
    const __m512 lut = _mm512_loadu_ps(E2M1_SCALED);                                                     \
    for (int64_t b = b0; b < b1; b++) {                                                                  \
        const float *q = j->qs + b * BLOCK;                                                              \
        __m512 s[2];                                                                                     \
        for (int ch = 0; ch < BLOCK / 8; ch++) {                                                         \
            __m512 p[8][2];                                                                              \
            _Pragma("GCC unroll 4") for (int jj = 0; jj < 8; jj += 2) {                                  \
                __m512 w[4], a0 = _mm512_set1_ps(q[ch * 8 + jj]), a1 = _mm512_set1_ps(q[ch * 8 + jj + 1]); \
                PREFETCH(FMT, wg[0], b * BLOCK + ch * 8 + jj);                                           \
                FETCH2(FMT, wg[0], b * BLOCK + ch * 8 + jj, w);                                     \
                p[jj][0] = _mm512_mul_ps(a0, w[0]); /* exact */                                          \
                p[jj][1] = _mm512_mul_ps(a0, w[1]);                                                      \
                p[jj + 1][0] = _mm512_mul_ps(a1, w[2]);                                                  \
                p[jj + 1][1] = _mm512_mul_ps(a1, w[3]);                                                  \
            }                                                                                            \
            for (int v = 0; v < 2; v++) {                                                                \
                __m512 lo = _mm512_add_ps(_mm512_add_ps(p[0][v], p[2][v]), _mm512_add_ps(p[1][v], p[3][v])); \
                if (ch == 0) {                                                                           \
                    s[v] = _mm512_add_ps(lo, _mm512_add_ps(_mm512_add_ps(p[4][v], p[6][v]),              \
                                                           _mm512_add_ps(p[5][v], p[7][v])));            \
                } else {                                                                                 \
                    s[v] = _mm512_add_ps(s[v], p[6][v]);                                                 \
                    s[v] = _mm512_add_ps(s[v], p[4][v]);                                                 \
                    s[v] = _mm512_add_ps(s[v], _mm512_add_ps(p[5][v], p[7][v]));                         \
                    s[v] = _mm512_add_ps(s[v], lo);                                                      \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        __m512 a = _mm512_set1_ps(j->sa[b]);                                                             \
        __m512 s0 = e8m0x16(sg[0] + b * GROUP), s1 = e8m0x16(sg[0] + b * GROUP + 16);                    \
        _mm512_storeu_ps(tot, _mm512_add_ps(_mm512_loadu_ps(tot), _mm512_mul_ps(_mm512_mul_ps(s[0], a), s0))); \
        _mm512_storeu_ps(tot + 16, _mm512_add_ps(_mm512_loadu_ps(tot + 16),                              \
                                                 _mm512_mul_ps(_mm512_mul_ps(s[1], a), s1)));            \
    }                                                                                                    \
}
GEMV_TILE(0) GEMV_TILE(1)
static const tile_fn GEMV_TILES[2] = {gemv_0, gemv_1};
static const tile_fn DIRECT_TILES[2][TILE_T] = {TILE_NAMES(direct_0), TILE_NAMES(direct_1)};
#define SINGLES(FMT) {single_##FMT##_1, single_##FMT##_2, single_##FMT##_3, direct_##FMT##_4, direct_##FMT##_5, \
                      direct_##FMT##_6, direct_##FMT##_7, direct_##FMT##_8, direct_##FMT##_9, direct_##FMT##_10}
static const tile_fn SINGLE_TILES[2][TILE_T] = {SINGLES(0), SINGLES(1)};
#if EBS_BF16
static const tile_fn DIRECT_BF16_TILES[2][TILE_T] = {TILE_NAMES(direct_bf0), TILE_NAMES(direct_bf1)};
#define SINGLES_BF16(FMT) {single_bf##FMT##_1, single_bf##FMT##_2, single_bf##FMT##_3, direct_bf##FMT##_4,       \
                           direct_bf##FMT##_5, direct_bf##FMT##_6, direct_bf##FMT##_7, direct_bf##FMT##_8,        \
                           direct_bf##FMT##_9, direct_bf##FMT##_10}
static const tile_fn SINGLE_BF16_TILES[2][TILE_T] = {SINGLES_BF16(0), SINGLES_BF16(1)};
#endif
/* rows [0, t) in tiles of at most TILE_T, as even as can be (T = 11 runs 6 + 5, not 10 + 1) */
static inline int64_t tile_rows_at(int64_t t, int64_t r0) {
    int64_t left = t - r0, tiles = (left + TILE_T - 1) / TILE_T;
    return (left + tiles - 1) / tiles;
}

/* Column groups in turn (NG at a time for one to three rows). A group's rows run in tiles of at
 * most TILE_T, each tile decoding the group's weights again in registers: the first tile streams
 * them from memory, the next ones find them in L2 (K x 32 bytes of FP8: 192 KiB for the real-size
 * wkv), so W is read from memory once for every T. Measured on Intel (AMX) against decoding each
 * chunk once into an fp32 buffer that all row tiles read: faster at T = 13-64, within noise at
 * 128-512, with less code. */
AVX512 static void run_avx512(const job_t *j) {
    const int64_t nb = j->k / BLOCK, tstride = j->t * GROUP;
    float *tot = j->scratch + KC * GROUP;
    /* FP8 at few rows: the raw-bits tiles where they may run (e4m3_raw16; 0x40: MXCSR.DAZ) */
    const int raw = j->fmt == FMT_FP8 && j->t <= RAW_ROWS && j->qh && !j->gemv_order && !(_mm_getcsr() & 0x40);
    for (int64_t g = j->g0; g < j->g1;) {
        int64_t ng = j->gemv_order || j->t > TILE_T ? 1 : raw ? RAW_NG(j->t) : DIRECT_NG(j->t);
        if (ng > j->g1 - g) ng = 1;
        const uint8_t *wg[MAX_NG], *sg[MAX_NG];
        for (int64_t gi = 0; gi < ng; gi++) {
            wg[gi] = group_weights(j, g + gi);
            sg[gi] = j->ws + (g + gi) * nb * GROUP;
        }
        memset(tot, 0, sizeof(float) * ng * tstride);
        const tile_fn *direct = DIRECT_TILES[j->fmt], *single = SINGLE_TILES[j->fmt];
        if (raw)
            direct = RAW_DIRECT, single = RAW_SINGLE;
#if EBS_BF16
        else if (j->qp) direct = DIRECT_BF16_TILES[j->fmt], single = SINGLE_BF16_TILES[j->fmt];
#endif
        if (j->gemv_order) {
            GEMV_TILES[j->fmt](j, wg, sg, 0, 0, nb, tot, tstride);
        } else if (ng > 1) {
            direct[j->t - 1](j, wg, sg, 0, 0, nb, tot, tstride);
        } else {
            for (int64_t r0 = 0; r0 < j->t;) {
                int64_t tt = tile_rows_at(j->t, r0);
                single[tt - 1](j, wg, sg, r0, 0, nb, tot + r0 * GROUP, tstride);
                r0 += tt;
            }
        }
        for (int64_t gi = 0; gi < ng; gi++) store_group(j, g + gi, tot + gi * tstride);
        g += ng;
    }
}

#endif /* EBS_AVX512 */

/* column groups [j->g0, j->g1) of one call (the variant's path) */
EK_KERNEL void EK_NAME(ebs_run)(const job_t *j) {
    pthread_once(&table_once, fill_e4m3_table);
#if EBS_AVX512
    run_avx512(j);
#else
    run_portable(j);
#endif
}

/* one row (gemv_order), columns [c0, c1) summed j in order: MKL's GEMV tail columns */
EK_KERNEL void EK_NAME(ebs_tail)(const job_t *j, int64_t c0, int64_t c1) {
    pthread_once(&table_once, fill_e4m3_table);
    row_in_order(j, c0, c1);
}

/* ---- the row-invariant dense linear ----------------------------------------------------------
 *
 * y [m, n] = x [m, k] @ w [n, k]^T in fp32, x and w each fp32 or bf16 (bf16 widened exactly).
 * Every output is one fixed sequence of operations whatever m is and wherever its row sits in
 * the call: 16 lanes, lane l accumulating the products of k = l, l + 16, ... by FMAs in K order
 * from +0 (the tail past k read as zeros: fma(0, 0, a) leaves a, up to the sign of a zero),
 * then the lanes added as a fixed tree: l + (l + 8), then + 4, + 2, + 1. No reduction is split
 * across threads (threads take whole tiles), so a row's bits depend on that row's x alone: the
 * dense ops of the default ("batched") numerics are batch- and chunk-invariant. The portable
 * path runs the same operations one lane at a time (fmaf), so both paths give the same bits. */


static inline float dense_at(const void *p, int bf16, int64_t i) {
    return bf16 ? bits_to_float((uint32_t)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

static inline float lanes_tree(float *a) {
    for (int l = 0; l < 8; l++) a[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) a[l] = a[l] + a[l + 4];
    for (int l = 0; l < 2; l++) a[l] = a[l] + a[l + 2];
    return a[0] + a[1];
}

static void dense_tile_portable(const dense_job_t *j, int64_t r0, int64_t c0, int64_t rn, int64_t cn) {
    for (int64_t r = r0; r < r0 + rn; r++)
        for (int64_t c = c0; c < c0 + cn; c++) {
            float acc[16] = {0};
            for (int64_t k0 = 0; k0 < j->k; k0 += 16)
                for (int l = 0; l < 16; l++) {
                    int64_t k = k0 + l;
                    float a = k < j->k ? dense_at(j->x, j->x_bf16, r * j->k + k) : 0.0f;
                    float b = k < j->k ? dense_at(j->w, j->w_bf16, c * j->k + k) : 0.0f;
                    acc[l] = fmaf(a, b, acc[l]);
                }
            j->y[r * j->n + c] = lanes_tree(acc);
        }
}

#if EBS_AVX512
AVX512 static inline __m512 dense_load(const void *p, int bf16, int64_t i, int64_t left) {
    __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
}

/* The 16 accumulators of a tile reduced together, each by the lanes tree (l + (l + 8), then + 4,
 * + 2, + 1): at every level two vectors' halves meet, so 15 shuffle-add pairs do the work of 16
 * separate reductions. Output lane 4b + a holds accumulator a * 4 + b (row a, column b). */
AVX512 static inline __m512 dense_reduce16(const __m512 *v) {
    __m512 w[8], u[4], p[2];
    for (int i = 0; i < 8; i++)  /* lanes l + (l + 8): [v2i: 0-7 | v2i+1: 0-7] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* + 4: a 128-bit lane per accumulator */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* + 2 */
        p[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x88), _mm512_shuffle_ps(p[0], p[1], 0xDD)); /* + 1 */
}

/* 16 values at p + i (fp32, or bf16 widened exactly), all of them or the first `left` */
#define DENSE_FULL(BF16, P, I)                                                                           \
    ((BF16) ? _mm512_castsi512_ps(_mm512_slli_epi32(                                                     \
                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(P) + (I)))), 16)) \
            : _mm512_loadu_ps((const float *)(P) + (I)))

/* One K step of a tile: DR x rows and DC w columns at k, their DR * DC products added */
#define DENSE_STEP(LOAD_X, LOAD_W)                                                                       \
    do {                                                                                                 \
        __m512 xv[DR], wv[DC];                                                                           \
        _Pragma("GCC unroll 4") for (int a = 0; a < DR; a++) xv[a] = LOAD_X(xr[a] + k);                   \
        _Pragma("GCC unroll 4") for (int b = 0; b < DC; b++) {                                           \
            wv[b] = LOAD_W(wc[b] + k);                                                                   \
            _mm_prefetch((const char *)j->w + (wc[b] + k) * (wb ? 2 : 4) + 4096, _MM_HINT_T0);            \
        }                                                                                                \
        _Pragma("GCC unroll 4") for (int a = 0; a < DR; a++)                                              \
        _Pragma("GCC unroll 4") for (int b = 0; b < DC; b++)                                              \
            acc[a * DC + b] = _mm512_fmadd_ps(xv[a], wv[b], acc[a * DC + b]);                            \
    } while (0)

/* A DR x DC tile; rows and columns past the call's end repeat its last one (computed, not
 * stored). One compile per operand type pair (XB, WB: bf16 x, bf16 w), so that the K loop holds
 * no test of them; whole 16-wide steps unmasked, the tail once with a mask (zeros past k). */
#define DENSE_TILE(XB, WB)                                                                               \
AVX512 static void dense_tile_##XB##WB(const dense_job_t *j, int64_t r0, int64_t c0, int64_t rn, int64_t cn) { \
    const int xb = XB, wb = WB; /* constants: the loads below fold to one kind */                   \
    int64_t xr[DR], wc[DC];                                                                              \
    for (int i = 0; i < DR; i++) xr[i] = (r0 + (i < rn ? i : rn - 1)) * j->k;                            \
    for (int i = 0; i < DC; i++) wc[i] = (c0 + (i < cn ? i : cn - 1)) * j->k;                            \
    __m512 acc[DR * DC];                                                                                 \
    for (int i = 0; i < DR * DC; i++) acc[i] = _mm512_setzero_ps();                                      \
    const int64_t whole = j->k & ~(int64_t)15;                                                           \
    int64_t k = 0;                                                                                       \
    for (; k < whole; k += 16) {                                                                         \
        DENSE_STEP(X_FULL, W_FULL);                                                                      \
    }                                                                                                    \
    if (k < j->k) {                                                                                      \
        const int64_t left = j->k - k;                                                                   \
        DENSE_STEP(X_TAIL, W_TAIL);                                                                      \
    }                                                                                                    \
    float out[16];                                                                                       \
    _mm512_storeu_ps(out, dense_reduce16(acc));                                                          \
    for (int a = 0; a < rn; a++)                                                                         \
        for (int b = 0; b < cn; b++) j->y[(r0 + a) * j->n + c0 + b] = out[4 * b + a];                    \
}
#define X_FULL(I) DENSE_FULL(xb, j->x, I)
#define W_FULL(I) DENSE_FULL(wb, j->w, I)
#define X_TAIL(I) dense_load(j->x, xb, I, left)
#define W_TAIL(I) dense_load(j->w, wb, I, left)
DENSE_TILE(0, 0) DENSE_TILE(0, 1) DENSE_TILE(1, 0) DENSE_TILE(1, 1)
typedef void (*dense_tile_fn)(const dense_job_t *, int64_t, int64_t, int64_t, int64_t);
static const dense_tile_fn DENSE_TILES[2][2] = {{dense_tile_00, dense_tile_01}, {dense_tile_10, dense_tile_11}};
#endif

EK_KERNEL void EK_NAME(ebs_dense_item)(const dense_job_t *j, int64_t item) {
    int64_t r0 = (item / j->col_items) * DENSE_ROWS, c0 = (item % j->col_items) * DENSE_COLS;
    int64_t r1 = r0 + DENSE_ROWS < j->m ? r0 + DENSE_ROWS : j->m, c1 = c0 + DENSE_COLS < j->n ? c0 + DENSE_COLS : j->n;
    /* DENSE_PANEL columns at a time, every row tile passing over them before the next panel.
     * Measured on Zen 4, 2 threads, bf16 16,160 x 5,120 at 16 / 64 rows: one tile's 4 columns at
     * a time 28.4 / 109 ms, panels of 8 16.2 / 55.0, of 16 19.0 / 64.6, of 32 18.6 / 63.3. */
    for (int64_t p = c0; p < c1; p += DENSE_PANEL) {
        const int64_t pe = p + DENSE_PANEL < c1 ? p + DENSE_PANEL : c1;
        for (int64_t r = r0; r < r1; r += DR)
            for (int64_t c = p; c < pe; c += DC) {
                const int64_t rn = r1 - r < DR ? r1 - r : DR, cn = pe - c < DC ? pe - c : DC;
#if EBS_AVX512
                DENSE_TILES[j->x_bf16 != 0][j->w_bf16 != 0](j, r, c, rn, cn);
#else
                dense_tile_portable(j, r, c, rn, cn);
#endif
            }
    }
}

/* ---- the roof of this arithmetic ------------------------------------------------------------- */

/* The machine's fp32 FMA rate in GFLOP/s on `threads` threads (16 independent register chains
 * each, the widest vectors the path uses). Every product of this kernel needs its own fp32
 * rounding add, in order, so this, not the best BF16 matmul, is the rate its compute can reach;
 * the benchmarks measure it in the same run. */

#if EBS_AVX512
AVX512 static void probe_avx512(probe_t *p) {
    __m512 c[PROBE_CHAINS], x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < PROBE_CHAINS; i++) c[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < p->iters; it++)
        _Pragma("GCC unroll 16") for (int i = 0; i < PROBE_CHAINS; i++) c[i] = _mm512_fmadd_ps(c[i], x, y);
    for (int i = 0; i < PROBE_CHAINS; i++) p->sink += _mm512_reduce_add_ps(c[i]);
}
#endif

/* runs p->iters steps of PROBE_CHAINS FMA chains; returns the lanes per FMA */
EK_KERNEL int EK_NAME(ebs_probe)(probe_t *p) {
#if EBS_AVX512
    probe_avx512(p);
    return 16;
#else
    float c[PROBE_CHAINS];
    for (int i = 0; i < PROBE_CHAINS; i++) c[i] = (float)i;
    for (int64_t it = 0; it < p->iters; it++)
        for (int i = 0; i < PROBE_CHAINS; i++) c[i] = fmaf(c[i], 0.999999f, 1e-7f);
    for (int i = 0; i < PROBE_CHAINS; i++) p->sink += c[i];
    return 1;
#endif
}

#else /* EK_DISPATCH: the exported entry points -------------------------------------------------- */

int ebs_abi_version(void) { return EBS_ABI_VERSION; }
const char *ebs_source_hash(void) { return EK_SOURCE_HASH; }

#define EBS_DECLARE(V)                                                                                    \
    void ebs_run_##V(const job_t *);                                                                     \
    void ebs_tail_##V(const job_t *, int64_t, int64_t);                                                  \
    void ebs_dense_item_##V(const dense_job_t *, int64_t);                                               \
    int ebs_probe_##V(probe_t *);
#define EBS_ENTRY(V, SUPPORTED) {#V, SUPPORTED, ebs_run_##V, ebs_tail_##V, ebs_dense_item_##V, ebs_probe_##V}
typedef struct {
    const char *name;
    int (*supported)(void);
    void (*run)(const job_t *);
    void (*tail)(const job_t *, int64_t, int64_t);
    void (*dense_item)(const dense_job_t *, int64_t);
    int (*probe)(probe_t *);
} ebs_kernels;

EBS_DECLARE(generic)
#ifdef EK_HAVE_AVX512
EBS_DECLARE(avx512)
#endif
#ifdef EK_HAVE_AVX512BF16
EBS_DECLARE(avx512bf16)
int ebs_bf16_exact_avx512bf16(void);
/* AVX512_BF16, and its VDPBF16PS doing two in-order fp32 additions (ebs_bf16_exact) */
static int cpu_avx512bf16(void) { return ek_cpu_avx512() && ek_cpu_avx512bf16() && ebs_bf16_exact_avx512bf16(); }
#endif
static const ebs_kernels variants[] = { /* best first */
#ifdef EK_HAVE_AVX512BF16
    EBS_ENTRY(avx512bf16, cpu_avx512bf16),
#endif
#ifdef EK_HAVE_AVX512
    EBS_ENTRY(avx512, ek_cpu_avx512),
#endif
    EBS_ENTRY(generic, ek_always),
};
EK_DISPATCHER(ebs, ebs_kernels)

/* ---- activation quantisation (one scalar implementation for every path) -------------------- */

/* fp32 -> the nearest E4M3 value (ties to even), for |v| <= 448 or NaN, as c10's cast does:
 * below 2^-6 a multiple of 2^-9 (added to 2^14 and subtracted: one RNE rounding), above it
 * 3 mantissa bits. */
static inline float e4m3_round(float v) {
    if (v != v) return v;
    uint32_t u = float_to_bits(v), sign = u & 0x80000000u;
    float a = bits_to_float(u & 0x7FFFFFFFu), r;
    if (a < 0x1p-6f) {
        volatile float big = a + 0x1p14f; /* volatile: keep the rounding add, no reassociation */
        r = big - 0x1p14f;
    } else {
        uint32_t b = float_to_bits(a);
        b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
        r = bits_to_float(b);
    }
    return bits_to_float(float_to_bits(r) | sign);
}

static inline float load_x(const void *x, int x_bf16, int64_t i) {
    if (x_bf16) return bits_to_float((uint32_t)((const uint16_t *)x)[i] << 16);
    return ((const float *)x)[i];
}

/* x [t, k] (fp32 or bf16) -> qs [t, k] = e4m3 values * 256 and sa [t, k/32] fp32 scales. */
void ebs_act_quant(const void *x, int x_bf16, int64_t t, int64_t k, float *qs, float *sa) {
    const float inv_max = (float)(1.0 / 448.0);
    for (int64_t r = 0; r < t; r++)
        for (int64_t b = 0; b < k / BLOCK; b++) {
            int64_t base = r * k + b * BLOCK;
            float amax = 0.0f;
            int nan = 0;
            for (int j = 0; j < BLOCK; j++) {
                float a = fabsf(load_x(x, x_bf16, base + j));
                if (a != a) nan = 1;
                else if (a > amax) amax = a;
            }
            if (nan) amax = bits_to_float(0x7FC00000u);
            else if (amax < 1e-4f) amax = 1e-4f;
            uint32_t bits = float_to_bits(amax * inv_max);
            uint32_t e = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0);
            float s = bits_to_float(e << 23);
            sa[r * (k / BLOCK) + b] = s;
            for (int j = 0; j < BLOCK; j++) {
                float v = load_x(x, x_bf16, base + j) / s;
                if (v > 448.0f) v = 448.0f;
                if (v < -448.0f) v = -448.0f;
                qs[base + j] = e4m3_round(v) * 256.0f;
            }
        }
}

/* whether the raw-bits FP8 tiles may run (e4m3_raw16): on AMD, asked once (cpuid traps in a VM) */
static int raw_tiles_cpu(void) {
#if EK_X86
    static int amd = -1;
    if (__atomic_load_n(&amd, __ATOMIC_RELAXED) < 0) __atomic_store_n(&amd, ek_cpu_amd(), __ATOMIC_RELAXED);
    return __atomic_load_n(&amd, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

/* qs -> the bf16 pairs of the avx512bf16 tiles: qp[i] = q[2i] (high half) and q[2i + 1] (low),
 * each the top half of its fp32 bits: exact, as q * 256 has a 4-bit significand. Returns 0 if
 * some q is NaN (x held a NaN or an infinity): bf16 may drop its payload, and which of several
 * NaNs an FMA chain passes on is the fp32 tiles' business, so those calls run them. */
static int bf16_pairs(const float *q, int64_t count, uint32_t *qp) {
    for (int64_t i = 0; i < count; i++)
        if (q[i] != q[i]) return 0;
    for (int64_t i = 0; i < count / 2; i++)
        qp[i] = (float_to_bits(q[2 * i]) & 0xFFFF0000u) | (float_to_bits(q[2 * i + 1]) >> 16);
    return 1;
}

/* ---- threads, entry point ------------------------------------------------------------------ */

/* Threads claim column groups a few at a time until none are left, so a thread that the OS (or
 * a VM's host) stalls holds up only its last claim, not a fixed share of the work. A claim is at
 * most 8 groups and at most a quarter of a thread's share, so small matrices still split
 * across the threads. A group's result does not depend on which thread computes it, so
 * neither do the bits. */
static int64_t claim_size(int64_t groups, int threads) {
    int64_t c = groups / (4 * (int64_t)threads);
    return c < 1 ? 1 : c > 8 ? 8 : c;
}

typedef struct {
    const ebs_kernels *k;
    const job_t *jobs; /* one per index: its own scratch */
} linear_call;

static void linear_task(void *ctx, int index) {
    const linear_call *c = ctx;
    job_t j = c->jobs[index];
    for (;;) {
        j.g0 = __atomic_fetch_add(j.next, j.claim, __ATOMIC_RELAXED);
        if (j.g0 >= j.groups) return;
        j.g1 = j.g0 + j.claim < j.groups ? j.g0 + j.claim : j.groups;
        c->k->run(&j);
    }
}

/* y [t, n] = x [t, k] @ W^T, W packed as described at the top. gemv_order: with t = 1, sum each
 * block in MKL's GEMV order (what torch gives one row) instead of j in order (what it gives two
 * or more rows, and what every row gets without it: the batch-invariant choice). threads: at
 * most that many (the caller and the library's pool, kernel_common.h). 0 ok, 1 bad shape, 2 out
 * of memory. */
int ebs_linear(int fmt, const void *x, int x_bf16, int64_t t, int64_t k, const uint8_t *w, const uint8_t *ws,
               int64_t n, void *y, int y_bf16, int gemv_order, int threads) {
    if (t < 0 || k <= 0 || k % BLOCK || n <= 0 || (fmt != FMT_FP8 && fmt != FMT_FP4)) return 1;
    if (t == 0) return 0;
    const ebs_kernels *kern = kernels();
    const int64_t groups = (n + GROUP - 1) / GROUP;
    if (threads < 1) threads = 1;
    if (threads > EK_POOL_MAX) threads = EK_POOL_MAX;
    if (threads > groups) threads = (int)groups;
    float *qs = malloc(sizeof(float) * (size_t)(2 * t * k + t * (k / BLOCK) + t * k / 2));
    int64_t per_thread = KC * GROUP + MAX_NG * t * GROUP;
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * threads));
    job_t jobs[EK_POOL_MAX];
    if (!qs || !scratch) {
        free(qs); free(scratch);
        return 2;
    }
    ebs_act_quant(x, x_bf16, t, k, qs, qs + t * k);
    uint32_t *qp = (uint32_t *)(qs + t * k + t * (k / BLOCK));
    float *qh = (float *)(qp + t * k / 2);
    if (!bf16_pairs(qs, t * k, qp)) qp = NULL; /* the fp32 tiles then (run_avx512) */
    if (fmt == FMT_FP8 && t <= RAW_ROWS && raw_tiles_cpu())
        for (int64_t i = 0; i < t * k; i++) qh[i] = qs[i] * 0x1p104f; /* exact: |qs| <= 448 * 256 */
    else
        qh = NULL; /* no raw-bits tiles (e4m3_raw16) */
    int64_t next = 0;
    for (int i = 0; i < threads; i++)
        jobs[i] = (job_t){fmt, qs, qs + t * k, qp, qh, t, k, n, w, ws, y, y_bf16, gemv_order && t == 1,
                          0, 0, groups, claim_size(groups, threads), &next, scratch + per_thread * i};
    linear_call call = {kern, jobs};
    ek_parallel(threads, linear_task, &call);
    if (jobs[0].gemv_order) kern->tail(&jobs[0], n - n % 16, n); /* MKL's GEMV tail columns */
    free(qs); free(scratch);
    return 0;
}

typedef struct { const ebs_kernels *k; const dense_job_t *job; } dense_call;

static void dense_task(void *ctx, int index) {
    const dense_call *c = ctx;
    (void)index;
    for (;;) {
        int64_t item = __atomic_fetch_add(c->job->next, 1, __ATOMIC_RELAXED);
        if (item >= c->job->items) return;
        c->k->dense_item(c->job, item);
    }
}

/* y [m, n] fp32 = x [m, k] @ w [n, k]^T (see the kernels' part). 0 ok, 1 bad shape. */
int ebs_dense(const void *x, int x_bf16, int64_t m, int64_t k, const void *w, int w_bf16, int64_t n, float *y,
              int threads) {
    if (m < 0 || k < 0 || n < 0) return 1;
    if (m == 0 || n == 0) return 0;
    if (k == 0) { memset(y, 0, sizeof(float) * (size_t)(m * n)); return 0; }
    int64_t next = 0, col_items = (n + DENSE_COLS - 1) / DENSE_COLS;
    dense_job_t job = {x, w, x_bf16, w_bf16, m, k, n, y, col_items * ((m + DENSE_ROWS - 1) / DENSE_ROWS), col_items, &next};
    if (threads > job.items) threads = (int)job.items;
    dense_call call = {kernels(), &job};
    ek_parallel(threads, dense_task, &call);
    return 0;
}

/* The machine's fp32 FMA rate in GFLOP/s on `threads` threads (PROBE_CHAINS independent register
 * chains each, the widest vectors the variant uses): the roof of the exact block sums (see the
 * kernels' part). Timed from the call to the last thread's end, pool wake-up included. */
typedef struct { const ebs_kernels *k; probe_t probes[EK_POOL_MAX]; int lanes; } probe_call;

static void probe_task(void *ctx, int index) {
    probe_call *c = ctx;
    int lanes = c->k->probe(&c->probes[index]);
    if (index == 0) c->lanes = lanes;
}

double ebs_fma_gflops(int threads, int64_t iters) {
    if (threads < 1) threads = 1;
    if (threads > EK_POOL_MAX) threads = EK_POOL_MAX;
    probe_call call;
    memset(&call, 0, sizeof call);
    call.k = kernels();
    for (int i = 0; i < threads; i++) call.probes[i].iters = iters;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ek_parallel(threads, probe_task, &call);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double sec = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return 2.0 * call.lanes * PROBE_CHAINS * (double)iters * threads / sec / 1e9;
}
#endif /* EK_DISPATCH */
