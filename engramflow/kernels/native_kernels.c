/* engramflow native CPU kernels: MXFP8 row gather+decode and FP8/BF16-weight GEMV.
 *
 * Built and loaded with ctypes by engramflow/kernels/native_build.py (the one loader of every
 * kernel library; native.py holds this one's signatures): at install time (setup.py) or, failing
 * that, once into a per-user cache. Dispatch, floating-point policy, threads and shared helpers
 * follow kernel_common.h: variants generic, avx2 (AVX2+FMA+F16C) and avx512 (that plus AVX-512
 * F/DQ/BW/VL), each a compile of this file with -DEK_VARIANT=<name>, plus the dispatcher
 * (-DEK_DISPATCH) with the exported entry points and the thread pool. -O3 -ffp-contract=off:
 * every FMA is written out. Plain C plus GCC vector extensions, so the generic variant builds
 * anywhere.
 *
 * E4M3 -> float32 is exact by moving bits (docs/v41.md, "Formats"): sign to bit 31, the 7 low bits to
 * bits 20..26; read as float that is e4m3 * 2^-120 (an fp32 subnormal for e4m3 subnormals,
 * so denormals must not be flushed), and multiplying by 2^120 is exact. On CPUs where a
 * subnormal multiply input costs a microcode assist, the GEMVs decode "safe" instead (2^16
 * higher, subnormal codes fixed by one FMA; see subnormal_safe), with the same output bits.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <pthread.h>
#include <time.h>
#include "kernel_common.h"

/* Bump whenever an exported function's name, arguments or meaning changes; native.py refuses a
 * library whose ef_abi_version() differs from its ABI_VERSION (a stale build). */
#define EF_ABI_VERSION 3

/* The kernels of variant V are exported as ef_<name>_<V> (hidden: only the dispatcher below
 * calls them). */
#define EF_NAME(name) EK_NAME(name)
#define EF_KERNEL EK_KERNEL
#define MAX_TOKENS 64

#ifndef EK_DISPATCH /* the kernels; the dispatcher is at the end of the file */

#define TWO_POW_120 0x1p120f
#define KC 512          /* weight columns decoded per chunk: 4 rows x 512 x 4 B = 8 KiB, L1 */
#define PREFETCH_BYTES 4096 /* GEMV read-ahead per weight row stream */   /* GEMV accumulators live on the stack: T * 4 rows * 32 B */

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4))); /* unaligned loads */

#define bits_to_float ek_bits_to_float
#define float_to_bits ek_float_to_bits

/* e4m3(code) * 2^-120, exact (an fp32 subnormal for E4M3 subnormals). The T = 1 FP8 GEMV
 * (gemv1_fp8_bits) uses the same bits in vector form, with x pre-scaled so that no product
 * is subnormal; the other vector paths go through fp16 (e4m3x16_to_f32). */
static inline float e4m3_scaled_down(uint32_t b) {
    return bits_to_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20));
}

/* 2^(s-127) for an E8M0 byte, exact (s = 0 is the fp32 subnormal 2^-127); 255 is NaN */
static inline float e8m0_to_float(uint32_t s) {
    if (s == 255) return bits_to_float(0x7FC00000u);
    if (s == 0) return bits_to_float(0x00400000u);
    return bits_to_float(s << 23);
}

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_VECTOR_DECODE 1
/* 16 E4M3 codes -> 16 floats equal to e4m3 * 2^-8, exactly, without subnormal arithmetic:
 * sign-extend to 16 bits and shift left by 7, which is the fp16 encoding of e4m3 * 2^-8
 * (E4M3 subnormals become fp16 subnormals); clear the duplicated sign bit 14; convert.
 * With nan_check, codes 0x7F/0xFF become the fp16 quiet NaN 0x7E00 (-> fp32 0x7FC00000). */
static inline void e4m3x16_to_f32(const uint8_t *src, int nan_check, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
    if (nan_check) {
        __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x3F80));
        __m256i is_nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3F80));
        h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), is_nan);
    }
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* 16 floats -> 16 bfloat16, round to nearest even; canonical NaNs stay NaN (low bits zero) */
static inline void store_bf16x16(uint16_t *dst, __m256 lo, __m256 hi) {
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    __m256i a = _mm256_castps_si256(lo), b = _mm256_castps_si256(hi);
    a = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(a, 16), one))), 16);
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256((__m256i *)dst, packed);
}
#else
#define HAVE_VECTOR_DECODE 0
#endif

#define float_to_bf16 ek_float_to_bf16 /* torch's rounding (kernel_common.h) */

/* Returns the index of the first out-of-range address, or -1 when all are valid. */
static int64_t first_bad_address(const int64_t *addr, int64_t n, int64_t rows) {
    for (int64_t i = 0; i < n; i++)
        if (addr[i] < 0 || addr[i] >= rows) return i;
    return -1;
}

/* Decode one MXFP8 row of d values (d/32 scales). Exact: e4m3 * 2^-8 and * 2^8 are exact,
 * and e4m3 * 2^(s-127) has at most 4 significant bits at or above 2^-136, so the scale product
 * is exact too unless it overflows (then inf, as rounding says). out_bf16 selects the dtype. */
static inline void decode_row(const uint8_t *code, const uint8_t *scale, int64_t d, void *out, int out_bf16) {
    for (int64_t j = 0; j < d / 32; j++) {
        float f = e8m0_to_float(scale[j]);
        const uint8_t *c = code + j * 32;
#if HAVE_VECTOR_DECODE
        const __m256 up = _mm256_set1_ps(256.0f), fv = _mm256_set1_ps(f);
        for (int k = 0; k < 32; k += 16) {
            __m256 lo, hi;
            e4m3x16_to_f32(c + k, 1, &lo, &hi);
            lo = _mm256_mul_ps(_mm256_mul_ps(lo, up), fv);
            hi = _mm256_mul_ps(_mm256_mul_ps(hi, up), fv);
            if (out_bf16) {
                store_bf16x16((uint16_t *)out + j * 32 + k, lo, hi);
            } else {
                _mm256_storeu_ps((float *)out + j * 32 + k, lo);
                _mm256_storeu_ps((float *)out + j * 32 + k + 8, hi);
            }
        }
#else
        for (int k = 0; k < 32; k++) {
            uint32_t b = c[k];
            float v = e4m3_scaled_down(b) * TWO_POW_120 * f;
            if ((b & 0x7Fu) == 0x7Fu) v = bits_to_float(0x7FC00000u);
            /* the gathers' NaN is the canonical 0x7FC0 (mxfp8.py), as the vector path's rounding makes it */
            if (out_bf16) ((uint16_t *)out)[j * 32 + k] = v != v ? 0x7FC0 : float_to_bf16(v);
            else ((float *)out)[j * 32 + k] = v;
        }
#endif
    }
}

static int64_t gather_decode(const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                             int64_t scale_stride, int64_t rows, const int64_t *addr, int64_t n,
                             int64_t d, void *out, int out_bf16) {
    int64_t bad = first_bad_address(addr, n, rows);
    if (bad >= 0) return bad;
    /* touch every row first so the cache misses of all rows are in flight together */
    for (int64_t i = 0; i < n; i++) {
        __builtin_prefetch(scales + addr[i] * scale_stride);
        for (int64_t k = 0; k < d; k += 64) __builtin_prefetch(codes + addr[i] * code_stride + k);
    }
    size_t esize = out_bf16 ? 2 : 4;
    for (int64_t i = 0; i < n; i++)
        decode_row(codes + addr[i] * code_stride, scales + addr[i] * scale_stride, d,
                   (char *)out + i * d * esize, out_bf16);
    return -1;
}

/* out[i, :] = decode(codes[addr[i]], scales[addr[i]]) for n addresses; -1, or the index of
 * the first out-of-range address (nothing written then). */
EF_KERNEL int64_t EF_NAME(ef_gather_decode_f32)(const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                             int64_t scale_stride, int64_t rows, const int64_t *addr, int64_t n,
                             int64_t d, float *out) {
    return gather_decode(codes, code_stride, scales, scale_stride, rows, addr, n, d, out, 0);
}

EF_KERNEL int64_t EF_NAME(ef_gather_decode_bf16)(const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                              int64_t scale_stride, int64_t rows, const int64_t *addr, int64_t n,
                              int64_t d, uint16_t *out) {
    return gather_decode(codes, code_stride, scales, scale_stride, rows, addr, n, d, out, 1);
}

/* ---------------------------------------------------------------------------------------
 * FP8 weight layouts. g = 1: row-major [R, ldw]. g > 1 ("packed", built once at load by
 * projection.pack_rows): rows in groups of g, and within a group the 32-byte pieces of its g
 * rows interleaved column block by column block, [R/g][C/32][g][32]. The T = 1 GEMV decodes g
 * rows at a time, so it then reads one sequential stream instead of g short row streams that
 * cross a page every 4 KiB (the hardware prefetcher stops at page boundaries): measured
 * 29.7 -> 36 GB/s on 2 cores here. Code c of row r lives at fp8_at(fp8_row(w, ldw, g, r), c, g);
 * for g = 1 that is w + r*ldw + c.
 */
#ifndef PACKED_PREFETCH_BYTES
#define PACKED_PREFETCH_BYTES 4096 /* read-ahead of the packed stream (2-8 KiB measured alike) */
#endif
static inline const uint8_t *fp8_row(const void *w, int64_t ldw, int64_t g, int64_t r) {
    return (const uint8_t *)w + (r / g) * g * ldw + (r % g) * 32;
}
static inline const uint8_t *fp8_at(const uint8_t *row, int64_t c, int64_t g) {
    return row + (c & ~(int64_t)31) * g + (c & 31);
}

/* ---------------------------------------------------------------------------------------
 * Weight decode: rows [r, r+nr) x columns [c0, c0+kc) of the wkv weight into buf[4][KC]
 * fp32, block scales applied. kind 0: FP8 E4M3 codes with fp32 block scales pre-multiplied
 * by 2^8 (scale[r/br, c/bc], see projection.folded_scale); kind 1: BF16 (no scale). Rows past nr are zero so the 4-row micro-kernel can run.
 * The caller guarantees no NaN codes (0x7F/0xFF) for kind 0.
 */
static void decode_weight_chunk(int kind, const void *w, int64_t ldw, int64_t g, const float *scale,
                                int64_t lds, int64_t br, int64_t bc, int64_t r, int nr,
                                int64_t c0, int64_t kc, float *buf) {
    for (int i = 0; i < 4; i++) {
        float *o = buf + i * KC;
        if (i >= nr) { memset(o, 0, sizeof(float) * kc); continue; }
        if (kind == 1) {
            const uint16_t *src = (const uint16_t *)w + (r + i) * ldw + c0;
            for (int64_t k = 0; k < kc; k++) o[k] = bits_to_float((uint32_t)src[k] << 16);
            continue;
        }
        const uint8_t *src = fp8_row(w, ldw, g, r + i);
        const float *srow = scale + ((r + i) / br) * lds;
        for (int64_t c = c0; c < c0 + kc;) {
            int64_t end = (c / bc + 1) * bc;
            if (end > c0 + kc) end = c0 + kc;
            float f = srow[c / bc];
#if HAVE_VECTOR_DECODE
            /* scales arrive pre-multiplied by 2^8 (folded_scale), matching e4m3 * 2^-8 */
            const __m256 fv = _mm256_set1_ps(f);
            for (; c + 16 <= end; c += 16) {
                __m256 lo, hi;
                e4m3x16_to_f32(fp8_at(src, c, g), 0, &lo, &hi);
                _mm256_storeu_ps(o + (c - c0), _mm256_mul_ps(lo, fv));
                _mm256_storeu_ps(o + (c - c0) + 8, _mm256_mul_ps(hi, fv));
            }
#endif
            for (; c < end; c++)
                o[c - c0] = e4m3_scaled_down(*fp8_at(src, c, g)) * TWO_POW_120 * 0x1p-8f * f;
        }
    }
}

/* a * b + c, lane by lane: one rounding where the variant has FMA instructions (as
 * -ffp-contract=fast made of `c += a * b` before the policy of kernel_common.h), two elsewhere */
static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__AVX2__) && defined(__FMA__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__FP_FAST_FMAF) || defined(__ARM_FEATURE_FMA)
    v8f r;
    for (int l = 0; l < 8; l++) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
#else
    return a * b + c;
#endif
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* acc[t][i] += buf[i, :kc] * x[t, c0:c0+kc] for NT tokens t0.. and 4 rows, 8 lanes wide.
 * NT is a compile-time constant after inlining: 4*NT accumulators + NT x vectors + 1 weight
 * vector fit the 16 AVX2 registers for NT = 3, so each FMA needs no extra load of x. */
static inline __attribute__((always_inline)) void
micro_kernel(const int NT, const float *buf, const float *x, int64_t ldx, int64_t t0, int64_t c0,
             int64_t kc, v8f *acc) {
    v8f a[3][4];
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < 4; i++) a[t][i] = acc[(t0 + t) * 4 + i];
    for (int64_t k = 0; k < kc; k += 8) {
        v8f xv[3];
        for (int t = 0; t < NT; t++) xv[t] = *(const v8f_u *)(x + (t0 + t) * ldx + c0 + k);
        for (int i = 0; i < 4; i++) {
            v8f wv = *(const v8f *)(buf + i * KC + k);
            for (int t = 0; t < NT; t++) a[t][i] = fma8(wv, xv[t], a[t][i]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < 4; i++) acc[(t0 + t) * 4 + i] = a[t][i];
}

#if HAVE_VECTOR_DECODE
/* T = 1, FP8: the memory-bound decode step. Decode 16 codes of each of 4 rows straight into
 * registers and FMA them with x; the block scale is applied once per (row, block) to the
 * block's partial sum, so there is no decoded buffer to store and reload. */
static void gemv1_fp8(const uint8_t *w, int64_t ldw, int64_t g, const float *scale, int64_t lds, int64_t br,
                      int64_t bc, const float *x, int64_t C, int64_t r0, int64_t r1, float *out) {
    for (int64_t r = r0; r < r1; r += 4) {
        int nr = (int)(r1 - r < 4 ? r1 - r : 4);
        const uint8_t *row[4];
        const float *srow[4];
        for (int i = 0; i < 4; i++) {
            int64_t ri = r + (i < nr ? i : 0); /* short group: repeat row 0, results dropped */
            row[i] = fp8_row(w, ldw, g, ri);
            srow[i] = scale + (ri / br) * lds;
        }
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t c0 = 0; c0 < C; c0 += bc) {
            /* two partial sums per row: 8 independent FMA chains hide the FMA latency */
            __m256 plo[4], phi[4];
            for (int i = 0; i < 4; i++) plo[i] = phi[i] = _mm256_setzero_ps();
            for (int64_t c = c0; c < c0 + bc; c += 16) {
                __m256 xlo = _mm256_loadu_ps(x + c), xhi = _mm256_loadu_ps(x + c + 8);
                for (int i = 0; i < 4; i++) {
                    /* 4 short (6 KiB) row streams at once outrun the hardware prefetcher */
                    if ((c & 63) == 0) _mm_prefetch((const char *)fp8_at(row[i], c, g) + PREFETCH_BYTES * g, _MM_HINT_T0);
                    __m256 lo, hi;
                    e4m3x16_to_f32(fp8_at(row[i], c, g), 0, &lo, &hi);
                    plo[i] = _mm256_fmadd_ps(lo, xlo, plo[i]);
                    phi[i] = _mm256_fmadd_ps(hi, xhi, phi[i]);
                }
            }
            for (int i = 0; i < 4; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_add_ps(plo[i], phi[i]), _mm256_set1_ps(srow[i][c0 / bc]), acc[i]);
        }
        for (int i = 0; i < nr; i++) out[r + i] = hsum((v8f)acc[i]);
    }
}

/* T = 1, FP8, the fast path (bc % 32 == 0): the E4M3 bit trick, E4M3 -> fp32 bits
 * (sign << 31 | low7 << 20) = e4m3 * 2^-120, with in-lane shifts only (no cvtph, no
 * lane-crossing sign extension). One 32-byte load holds 8 dwords of 4 codes b0..b3:
 *   srai16(v, 4) leaves b3 in bits 20..27 (sign copies above) and b1 in bits 4..11 (sign copies
 *   in 12..15); slli16(v, 8) then srai16(., 4) does the same for b2 and b0. A shift left by 16
 *   brings the low word up, and the mask 0x87F00000 keeps the sign (bit 31) and bits 20..26.
 * So the 8 floats of code k are columns 4j + k, j = 0..7: xs is x permuted to match
 * (xs[g + 8k + j] = x[g + 4j + k] * 2^a) and scaled by 2^a so that no product is an fp32
 * subnormal (e4m3 * 2^-120 alone can be); `post` = 2^(112 - a) undoes 2^a, 2^-120 and the
 * 2^8 in the folded scales, all exact. 8 rows at a time, one FMA chain per row. Row-major
 * (g = 1): 8 row streams keep more misses in flight than 4 (12+ and software prefetch were
 * slower). Packed (g = BITS_ROWS, rows r aligned to g): the 8 rows' bytes are one stream,
 * fetched PACKED_PREFETCH_BYTES ahead. Each 32-code step costs 9 integer ops + 4 FMAs; one
 * core decodes ~20 GB/s from cache, so on 2 cores the GEMV is bound by this arithmetic (the
 * stream runs at ~97 % of the from-cache rate), not by memory. Offset loads (4 shifts, 4 ANDs)
 * and multiplies in place of shifts measured no faster. */
#define BITS_ROWS 8

/* Where subnormal inputs to a multiply cost a microcode assist (Intel: ~100+ cycles each; about
 * one in 16 E4M3 codes is subnormal, so 40 % of 8-lane FMAs would hit one and the GEMV runs ~20x
 * slower), the lanes are decoded "safe": bit 27 set adds 16 to every exponent, so each lane is
 * e4m3 * 2^-104 and normal for normal codes; a subnormal code (exponent 0) then reads as
 * sign * 2^-111 * (1 + m/8) and is fixed with one FMA to 2 * f - sign * 2^-110 = e4m3 * 2^-104,
 * exact. Same values times 2^16, so after `post` (2^-16 more) the same bits. The choice is
 * measured once per process (subnormal multiply vs normal); ENGRAMFLOW_SUBNORMAL_SAFE=0/1
 * forces it (tests run both). */
#define SAFE_EXTRA_EXP 16
static int subnormal_safe_mode = -1;

static double probe_multiply_ns(float start) {
    volatile float one_v = 1.0f;
    float acc = start, one = one_v;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < 20000; i++) acc = acc * one; /* a dependent chain: latency, assists included */
    clock_gettime(CLOCK_MONOTONIC, &b);
    volatile float sink = acc;
    (void)sink;
    return (double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec);
}

static int subnormal_safe(void) {
    int mode = __atomic_load_n(&subnormal_safe_mode, __ATOMIC_RELAXED);
    if (mode >= 0) return mode;
    const char *env = getenv("ENGRAMFLOW_SUBNORMAL_SAFE");
    if (env && (env[0] == '0' || env[0] == '1') && !env[1]) {
        mode = env[0] == '1';
    } else {
        double normal = 1e300, sub = 1e300;
        for (int k = 0; k < 3; k++) { /* best of 3 each: a preempted run only looks slower */
            double n = probe_multiply_ns(1.0f), d = probe_multiply_ns(bits_to_float(0x00001234u));
            normal = n < normal ? n : normal;
            sub = d < sub ? d : sub;
        }
        mode = sub > 4.0 * normal;
    }
    __atomic_store_n(&subnormal_safe_mode, mode, __ATOMIC_RELAXED);
    return mode;
}

/* The 8 lanes of codes in bits 20..27 of each dword of u (sign copies above): e4m3 * 2^-120, or
 * with `safe` e4m3 * 2^-104 (see above) */
static inline __attribute__((always_inline)) __m256 e4m3_lanes(__m256i u, int safe) {
    const __m256i m = _mm256_set1_epi32((int)0x87F00000u);
    if (!safe) return _mm256_castsi256_ps(_mm256_and_si256(u, m));
    const __m256i exp4 = _mm256_set1_epi32(0x07800000), sign = _mm256_set1_epi32((int)0x80000000u);
    const __m256i off = _mm256_set1_epi32(SAFE_EXTRA_EXP << 23), c110 = _mm256_set1_epi32((127 - 110) << 23);
    const __m256 two = _mm256_set1_ps(2.0f);
#if defined(__AVX512VL__)
    const __m256 f = _mm256_castsi256_ps(_mm256_ternarylogic_epi32(u, m, off, 0xEA)); /* (u & m) | off */
    const __mmask8 sub = _mm256_testn_epi32_mask(u, exp4);
    const __m256 c = _mm256_castsi256_ps(_mm256_ternarylogic_epi32(u, sign, c110, 0xEA));
    return _mm256_mask_fmsub_ps(f, sub, two, c);
#else
    const __m256 f = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(u, m), off));
    const __m256 sub = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(u, exp4), _mm256_setzero_si256()));
    const __m256 c = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(u, sign), c110));
    return _mm256_blendv_ps(f, _mm256_fmsub_ps(f, two, c), sub);
#endif
}
/* One group of BITS_ROWS rows (nr valid). Compile-time flags after inlining:
 * packed: row[0] starts a whole packed group, so row i of column block c is at row[0] + 8c + 32i
 *   and the loads share one address register (8 row pointers at a runtime stride measured slower);
 * folded: xs already carries this row block's block scales (fold_block_scales), so products
 *   accumulate straight into one sum per row; otherwise each block's partial sum is scaled by
 *   its block scale (srow). Folding saves that step and frees 8 registers: +5 % streamed. */
static inline __attribute__((always_inline)) void
bits_group(const int packed, const int folded, const int safe, const uint8_t *const *row, const float *const *srow,
           int64_t g, int64_t bc, const float *xs, int64_t C, float *out, int nr, double post) {
    __m256 acc[BITS_ROWS], part[BITS_ROWS];
    for (int i = 0; i < BITS_ROWS; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c0 = 0, b = 0; c0 < C; c0 += bc, b++) {
        __m256 *p = folded ? acc : part;
        if (!folded)
            for (int i = 0; i < BITS_ROWS; i++) p[i] = _mm256_setzero_ps();
        for (int64_t c = c0; c < c0 + bc; c += 32) {
            const uint8_t *block = row[0] + c * BITS_ROWS;
            if (packed) /* the group's bytes are one stream: fetch ahead of it */
                for (int k = 0; k < 32 * BITS_ROWS; k += 64)
                    _mm_prefetch((const char *)block + PACKED_PREFETCH_BYTES + k, _MM_HINT_T0);
            for (int i = 0; i < BITS_ROWS; i++) {
                const uint8_t *src = packed ? block + 32 * i : row[i] + c * g;
                __m256i v = _mm256_loadu_si256((const __m256i *)src);
                __m256i u31 = _mm256_srai_epi16(v, 4), u20 = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4);
                __m256 f3 = e4m3_lanes(u31, safe), f1 = e4m3_lanes(_mm256_slli_epi32(u31, 16), safe);
                __m256 f2 = e4m3_lanes(u20, safe), f0 = e4m3_lanes(_mm256_slli_epi32(u20, 16), safe);
                p[i] = _mm256_fmadd_ps(f3, _mm256_load_ps(xs + c + 24), p[i]);
                p[i] = _mm256_fmadd_ps(f2, _mm256_load_ps(xs + c + 16), p[i]);
                p[i] = _mm256_fmadd_ps(f1, _mm256_load_ps(xs + c + 8), p[i]);
                p[i] = _mm256_fmadd_ps(f0, _mm256_load_ps(xs + c), p[i]);
            }
        }
        if (!folded)
            for (int i = 0; i < BITS_ROWS; i++)
                acc[i] = _mm256_fmadd_ps(p[i], _mm256_set1_ps(srow[i][b]), acc[i]);
    }
    for (int i = 0; i < nr; i++) out[i] = (float)((double)hsum((v8f)acc[i]) * post);
}

/* rows [r0, r1); folded: all of them in one row block and xs from fold_block_scales */
static void gemv1_fp8_bits(const uint8_t *w, int64_t ldw, int64_t g, const float *scale, int64_t lds, int64_t br,
                           int64_t bc, const float *xs, int64_t C, int64_t r0, int64_t r1, float *out,
                           double post, int folded) {
    for (int64_t r = r0; r < r1; r += BITS_ROWS) {
        int nr = (int)(r1 - r < BITS_ROWS ? r1 - r : BITS_ROWS);
        const uint8_t *row[BITS_ROWS];
        const float *srow[BITS_ROWS];
        for (int i = 0; i < BITS_ROWS; i++) {
            int64_t ri = r + (i < nr ? i : 0); /* short group: repeat row 0, results dropped */
            row[i] = fp8_row(w, ldw, g, ri);
            srow[i] = scale + (ri / br) * lds;
        }
        const int packed = g == BITS_ROWS && r % g == 0 && nr == BITS_ROWS;
#define BITS_GROUP(P, F) \
    (subnormal_safe() ? bits_group(P, F, 1, row, srow, g, bc, xs, C, out + r, nr, post) \
                      : bits_group(P, F, 0, row, srow, g, bc, xs, C, out + r, nr, post))
        if (packed && folded) BITS_GROUP(1, 1);
        else if (packed) BITS_GROUP(1, 0);
        else if (folded) BITS_GROUP(0, 1);
        else BITS_GROUP(0, 0);
#undef BITS_GROUP
    }
}

/* xf = xs * (block scale of its column block, this row block) * 2^k, k chosen so that
 * max |xf| <= 2^100 (as bits_prepare_x does for xs: no product is an fp32 subnormal unless
 * it is 2^-97 below the largest); bmax[b] = max |xs| in column block b. Returns 2^-k, which
 * the caller multiplies into post. Exact for power-of-two (E8M0) scales; fp32 scales round
 * once per product, as the unfolded path rounds once per block partial sum. */
static double fold_block_scales(const float *xs, const float *bmax, const float *srow, int64_t bc, int64_t C,
                                float *xf) {
    double top = 0.0;
    for (int64_t b = 0; b < C / bc; b++) {
        double v = (double)bmax[b] * fabs((double)srow[b]);
        top = v > top ? v : top;
    }
    int e = 0, k = 0; /* x holding inf/NaN: k = 0, the result is inf/NaN anyway */
    if (top > 0.0 && isfinite(top)) {
        frexp(top, &e);
        k = 100 - e; /* top * 2^k <= 2^100 */
    }
    for (int64_t b = 0; b < C / bc; b++) {
        const double fd = ldexp((double)srow[b], k);
        const float f = (float)fd;
        if (isnormal(f) || bmax[b] == 0.0f) { /* one fp32 multiply per value (0 * f: 0, NaN stays) */
            const __m256 fv = _mm256_set1_ps(isfinite(f) ? f : 0.0f);
            for (int64_t c = b * bc; c < (b + 1) * bc; c += 8)
                _mm256_store_ps(xf + c, _mm256_mul_ps(_mm256_load_ps(xs + c), fv));
        } else { /* factor outside fp32's normal range (tiny x, extreme scale): in double */
            for (int64_t c = b * bc; c < (b + 1) * bc; c++) xf[c] = (float)((double)xs[c] * fd);
        }
    }
    return ldexp(1.0, -k);
}

/* x [C] -> xs for gemv1_fp8_bits (32-byte aligned, caller frees), and post; NULL if no memory */
static float *bits_prepare_x(const float *x, int64_t C, float *post) {
    float *xs = aligned_alloc(32, (size_t)((C * 4 + 31) / 32 * 32));
    if (!xs) return NULL;
    float mx = 0.0f;
    for (int64_t c = 0; c < C; c++) { float a = fabsf(x[c]); mx = a > mx ? a : mx; }
    int e = 0, a = 0;
    if (mx > 0.0f && !isinf(mx)) { frexpf(mx, &e); a = 100 - e; } /* max |x| * 2^a <= 2^100 */
    a = a < 0 ? 0 : a > 120 ? 120 : a;
    const float up = ldexpf(1.0f, a);
    *post = ldexpf(1.0f, 112 - a - (subnormal_safe() ? SAFE_EXTRA_EXP : 0));
    for (int64_t g = 0; g < C; g += 32)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 8; j++) xs[g + 8 * k + j] = x[g + 4 * j + k] * up;
    return xs;
}

/* 2 <= T <= MAX_TOKENS, FP8 (bc % 32 == 0): gemv1_fp8_bits generalized to several tokens.
 * Each group of 32 codes of a row is decoded once per NT tokens (same bit trick, same column
 * order) and FMAed against each token's pre-permuted, pre-scaled x (bits_prepare_x per token,
 * so each token has its own 2^a and post). MR rows x NT tokens of per-block partial sums live
 * in registers; each partial is scaled by its block scale into acc (v8f per row and token, in
 * memory, touched once per block). Loop order keeps things in cache: row tiles of MT_ROWS,
 * column chunks of MT_KCOL, then token groups (the x chunk of a group, NT x MT_KCOL x 4 B,
 * is reused across the tile's rows from L1/L2), then row groups. Whole rows per chunk (MT_KCOL) measured best. */
#ifndef MT_ROWS
#define MT_ROWS 32
#endif
#ifndef MT_KCOL
#define MT_KCOL 8192
#endif
#ifndef MT_MR
#define MT_MR 2
#endif
_Static_assert(8 % MT_MR == 0, "gemvN_fp8_packed walks an 8-row group MT_MR rows at a time");
#ifndef MT_NT
#define MT_NT 4
#endif

static inline __attribute__((always_inline)) void
bitsN_kernel(const int MR, const int NT, const uint8_t *const *row, int64_t g, const uint8_t *pf,
             const float *const *srow, const float *xs, int64_t C, int64_t cb, int64_t ce, int64_t bc,
             __m256 *acc, int64_t T) {
    const int safe = subnormal_safe();
    for (int64_t c0 = cb; c0 < ce; c0 += bc) {
        __m256 p[MT_MR][MT_NT > 0 ? MT_NT : 1];
        for (int i = 0; i < MR; i++)
            for (int t = 0; t < NT; t++) p[i][t] = _mm256_setzero_ps();
        for (int64_t c = c0; c < c0 + bc; c += 32) {
            if (pf) /* packed, first pass over a group: bring all its rows' bytes in, ahead */
                for (int64_t k = 0; k < 32 * g; k += 64)
                    _mm_prefetch((const char *)pf + c * g + PACKED_PREFETCH_BYTES + k, _MM_HINT_T0);
            __m256i u[MT_MR];
            for (int i = 0; i < MR; i++) u[i] = _mm256_srai_epi16(_mm256_loadu_si256((const __m256i *)(row[i] + c * g)), 4);
            for (int i = 0; i < MR; i++) {
                __m256 f = e4m3_lanes(u[i], safe);
                for (int t = 0; t < NT; t++) p[i][t] = _mm256_fmadd_ps(f, _mm256_load_ps(xs + t * C + c + 24), p[i][t]);
            }
            for (int i = 0; i < MR; i++) {
                __m256 f = e4m3_lanes(_mm256_slli_epi32(u[i], 16), safe);
                for (int t = 0; t < NT; t++) p[i][t] = _mm256_fmadd_ps(f, _mm256_load_ps(xs + t * C + c + 8), p[i][t]);
            }
            for (int i = 0; i < MR; i++)
                u[i] = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_loadu_si256((const __m256i *)(row[i] + c * g)), 8), 4);
            for (int i = 0; i < MR; i++) {
                __m256 f = e4m3_lanes(u[i], safe);
                for (int t = 0; t < NT; t++) p[i][t] = _mm256_fmadd_ps(f, _mm256_load_ps(xs + t * C + c + 16), p[i][t]);
            }
            for (int i = 0; i < MR; i++) {
                __m256 f = e4m3_lanes(_mm256_slli_epi32(u[i], 16), safe);
                for (int t = 0; t < NT; t++) p[i][t] = _mm256_fmadd_ps(f, _mm256_load_ps(xs + t * C + c), p[i][t]);
            }
        }
        const int64_t b = c0 / bc;
        for (int i = 0; i < MR; i++) {
            const __m256 sv = _mm256_set1_ps(srow[i][b]);
            for (int t = 0; t < NT; t++) acc[i * T + t] = _mm256_fmadd_ps(p[i][t], sv, acc[i * T + t]);
        }
    }
}

#define BITSN_CASE(MR_, N_, RW, PF, SR, A) \
    case N_: if (N_ <= MT_NT) bitsN_kernel(MR_, N_ <= MT_NT ? N_ : 1, RW, g, PF, SR, xs + t0 * C, C, cb, ce, bc, A, T); break;
#define BITSN_DISPATCH(MR_, RW, PF, SR, A) \
    switch (nt) { \
    BITSN_CASE(MR_, 8, RW, PF, SR, A) BITSN_CASE(MR_, 7, RW, PF, SR, A) BITSN_CASE(MR_, 6, RW, PF, SR, A) \
    BITSN_CASE(MR_, 5, RW, PF, SR, A) BITSN_CASE(MR_, 4, RW, PF, SR, A) BITSN_CASE(MR_, 3, RW, PF, SR, A) \
    BITSN_CASE(MR_, 2, RW, PF, SR, A) default: bitsN_kernel(MR_, 1, RW, g, PF, SR, xs + t0 * C, C, cb, ce, bc, A, T); break; \
    }

/* rows [r0, r1) (any count), row-major weight (g = 1); xs [T][C] and post [T] from
 * bits_prepare_x, acc: MT_ROWS * T vectors of scratch */
static void gemvN_fp8_bits(const uint8_t *w, int64_t ldw, int64_t g, const float *scale, int64_t lds, int64_t br,
                           int64_t bc, const float *xs, const float *post, int64_t T, int64_t C,
                           int64_t r0, int64_t r1, float *out, int64_t ldo, __m256 *acc) {
    const int64_t kcol = bc >= MT_KCOL ? bc : MT_KCOL / bc * bc;
    for (int64_t rt = r0; rt < r1; rt += MT_ROWS) {
        const int64_t nrt = r1 - rt < MT_ROWS ? r1 - rt : MT_ROWS;
        for (int64_t k = 0; k < nrt * T; k++) acc[k] = _mm256_setzero_ps();
        for (int64_t cb = 0; cb < C; cb += kcol) {
            const int64_t ce = cb + kcol < C ? cb + kcol : C;
            for (int64_t t0 = 0; t0 < T; t0 += MT_NT) {
                const int nt = (int)(T - t0 < MT_NT ? T - t0 : MT_NT);
                for (int64_t r = rt; r < rt + nrt; r += MT_MR) {
                    const int nr = (int)(rt + nrt - r < MT_MR ? rt + nrt - r : MT_MR);
                    const uint8_t *row[MT_MR];
                    const float *srow[MT_MR];
                    for (int i = 0; i < MT_MR; i++) {
                        int64_t ri = r + (i < nr ? i : 0);
                        row[i] = fp8_row(w, ldw, g, ri);
                        srow[i] = scale + (ri / br) * lds;
                    }
                    __m256 *a = acc + (r - rt) * T + t0;
                    /* packed (g > 1): a group's first row pair, in the first token group, fetches
                     * the whole group ahead (the other pairs then read it from cache) */
                    const uint8_t *pf = g > 1 && t0 == 0 && r % g == 0 ? fp8_row(w, ldw, g, r) : NULL;
                    if (nr < MT_MR) { /* process the short group one row at a time */
                        for (int i = 0; i < nr; i++) {
                            const uint8_t *r1p[1] = {row[i]};
                            const float *s1p[1] = {srow[i]};
                            __m256 *ai = a + i * T;
                            BITSN_DISPATCH(1, r1p, pf, s1p, ai);
                        }
                        continue;
                    }
                    BITSN_DISPATCH(MT_MR, row, pf, srow, a);
                }
            }
        }
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < nrt; i++) out[t * ldo + rt + i] = hsum((v8f)acc[i * T + t]) * post[t];
    }
}
/* Few tokens (T <= 2 * MT_NT), packed layout (g = BITS_ROWS; r0, r1 multiples of g): group by
 * group and scale block by scale block, so the weight is one sequential stream (prefetched ahead
 * by the first row pair) and each block (bc x g bytes, 1 KiB) is reused from L1 by every token
 * group and row pair; acc: g * T vectors of scratch. Measured at full size on 2 cores: T = 2
 * 7.6 ms vs 8.8 for the row tiles of gemvN_fp8_bits; from T = 8 on the row tiles are as fast
 * or faster (T = 32: 78 vs 84 ms), so they take over there (they read packed rows as well). */
static void gemvN_fp8_packed(const uint8_t *w, int64_t ldw, const float *scale, int64_t lds, int64_t br,
                             int64_t bc, const float *xs, const float *post, int64_t T, int64_t C,
                             int64_t r0, int64_t r1, float *out, int64_t ldo, __m256 *acc) {
    const int64_t g = BITS_ROWS;
    for (int64_t r = r0; r < r1; r += g) {
        const uint8_t *group = fp8_row(w, ldw, g, r);
        for (int64_t k = 0; k < g * T; k++) acc[k] = _mm256_setzero_ps();
        for (int64_t cb = 0; cb < C; cb += bc) {
            const int64_t ce = cb + bc;
            for (int64_t t0 = 0; t0 < T; t0 += MT_NT) {
                const int nt = (int)(T - t0 < MT_NT ? T - t0 : MT_NT);
                for (int64_t i = 0; i < g; i += MT_MR) {
                    const uint8_t *row[MT_MR];
                    const float *srow[MT_MR];
                    for (int j = 0; j < MT_MR; j++) {
                        row[j] = group + (i + j) * 32;
                        srow[j] = scale + ((r + i + j) / br) * lds;
                    }
                    const uint8_t *pf = t0 == 0 && i == 0 ? group : NULL;
                    __m256 *a = acc + i * T + t0;
                    BITSN_DISPATCH(MT_MR, row, pf, srow, a);
                }
            }
        }
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < g; i++) out[t * ldo + r + i] = hsum((v8f)acc[i * T + t]) * post[t];
    }
}
#endif

/* out[t, r - out_row0] = sum_c W[r, c] * x[t, c] for rows [r0, r1), T tokens (T <= MAX_TOKENS).
 * Each weight byte is read once per call; x (T x C fp32) stays in cache. C % 8 == 0. */
static void gemv_rows(int kind, const void *w, int64_t ldw, int64_t g, const float *scale, int64_t lds,
                      int64_t br, int64_t bc, const float *x, int64_t ldx, int64_t T, int64_t C,
                      int64_t r0, int64_t r1, float *out, int64_t ldo, int64_t out_row0) {
#if HAVE_VECTOR_DECODE
    if (T == 1 && kind == 0 && bc % 16 == 0) {
        gemv1_fp8((const uint8_t *)w, ldw, g, scale, lds, br, bc, x, C, r0, r1, out - out_row0);
        return;
    }
#endif
    float buf[4 * KC] __attribute__((aligned(32)));
    v8f acc[MAX_TOKENS * 4];
    for (int64_t r = r0; r < r1; r += 4) {
        int nr = (int)(r1 - r < 4 ? r1 - r : 4);
        memset(acc, 0, sizeof(v8f) * 4 * T);
        for (int64_t c0 = 0; c0 < C; c0 += KC) {
            int64_t kc = C - c0 < KC ? C - c0 : KC;
            decode_weight_chunk(kind, w, ldw, g, scale, lds, br, bc, r, nr, c0, kc, buf);
            int64_t t = 0;
            for (; t + 3 <= T; t += 3) micro_kernel(3, buf, x, ldx, t, c0, kc, acc);
            if (T - t == 2) micro_kernel(2, buf, x, ldx, t, c0, kc, acc);
            if (T - t == 1) micro_kernel(1, buf, x, ldx, t, c0, kc, acc);
        }
        for (int64_t t = 0; t < T; t++)
            for (int i = 0; i < nr; i++) out[t * ldo + (r + i - out_row0)] = hsum(acc[t * 4 + i]);
    }
}

/* The GEMV over rows [0, R), shared by every thread that calls it with the same *next_row
 * (set to 0 first): each claims `grain` rows at a time (a multiple of 4), so a thread slowed
 * by a neighbour on its core just claims fewer. Returns nonzero on bad arguments. */
EF_KERNEL int EF_NAME(ef_gemv)(int kind, const void *w, int64_t ldw, int64_t g, const float *scale, int64_t lds, int64_t br,
            int64_t bc, const float *x, int64_t ldx, int64_t T, int64_t C, int64_t R,
            float *out, int64_t ldo, int64_t *next_row, int64_t grain) {
    if (T < 1 || T > MAX_TOKENS || C % 8 || grain < 4 || grain % 4 || g < 1) return 1;
    if (g > 1 && (kind != 0 || C % 32 || bc % 32 || R % g || grain % g)) return 1; /* packed: whole groups, 32-code pieces */
#if HAVE_VECTOR_DECODE
    if (T == 1 && kind == 0 && bc % 32 == 0 && C % bc == 0) {
        float post;
        float *xs = bits_prepare_x(x, C, &post);
        /* fold block scales into x per row block when a row group never spans two row blocks and
         * a row block is tall enough to repay the fold (C multiplies per block: ~1.4 % at 64 rows) */
        int fold = br % BITS_ROWS == 0 && br >= 64;
        float *xf = fold ? aligned_alloc(32, (size_t)C * 4) : NULL, *bmax = fold ? malloc(sizeof(float) * (size_t)(C / bc)) : NULL;
        if (xs && (!fold || (xf && bmax))) {
            for (int64_t b = 0; fold && b < C / bc; b++) {
                float mx = 0.0f;
                for (int64_t c = b * bc; c < (b + 1) * bc; c++) mx = fabsf(xs[c]) > mx ? fabsf(xs[c]) : mx;
                bmax[b] = mx;
                /* an inf in x: folding could overflow other blocks to infs of either sign (NaN
                 * where the exact result is +-inf); the unfolded path keeps IEEE's answer */
                if (isinf(mx)) fold = 0;
            }
            for (;;) {
                int64_t r0 = __atomic_fetch_add(next_row, grain, __ATOMIC_RELAXED);
                if (r0 >= R) break;
                int64_t r1 = r0 + grain < R ? r0 + grain : R;
                if (!fold) {
                    gemv1_fp8_bits((const uint8_t *)w, ldw, g, scale, lds, br, bc, xs, C, r0, r1, out, post, 0);
                    continue;
                }
                for (int64_t rs = r0, re; rs < r1; rs = re) { /* one row block at a time */
                    re = (rs / br + 1) * br < r1 ? (rs / br + 1) * br : r1;
                    double p2 = fold_block_scales(xs, bmax, scale + (rs / br) * lds, bc, C, xf);
                    gemv1_fp8_bits((const uint8_t *)w, ldw, g, scale, lds, br, bc, xf, C, rs, re, out, post * p2, 1);
                }
            }
            free(xs); free(xf); free(bmax);
            return 0;
        }
        free(xs); free(xf); free(bmax);
    }
    if (T >= 2 && kind == 0 && bc % 32 == 0 && C % bc == 0 && C % 32 == 0) {
        float *xs = aligned_alloc(32, (size_t)(T * C * 4 + 31) / 32 * 32);
        float *post = malloc(sizeof(float) * (size_t)T);
        __m256 *acc = aligned_alloc(32, sizeof(__m256) * (MT_ROWS > BITS_ROWS ? MT_ROWS : BITS_ROWS) * (size_t)T);
        int ok = xs && post && acc;
        for (int64_t t = 0; ok && t < T; t++) {
            float *xt = bits_prepare_x(x + t * ldx, C, post + t);
            if (!xt) { ok = 0; break; }
            memcpy(xs + t * C, xt, sizeof(float) * (size_t)C);
            free(xt);
        }
        if (ok) {
            for (;;) {
                int64_t r0 = __atomic_fetch_add(next_row, grain, __ATOMIC_RELAXED);
                if (r0 >= R) break;
                int64_t r1 = r0 + grain < R ? r0 + grain : R;
                if (g == BITS_ROWS && T <= 2 * MT_NT)
                    gemvN_fp8_packed((const uint8_t *)w, ldw, scale, lds, br, bc, xs, post, T, C, r0, r1, out, ldo, acc);
                else
                    gemvN_fp8_bits((const uint8_t *)w, ldw, g, scale, lds, br, bc, xs, post, T, C, r0, r1, out, ldo, acc);
            }
        }
        free(xs); free(post); free(acc);
        if (ok) return 0;
    }
#endif
    for (;;) {
        int64_t r0 = __atomic_fetch_add(next_row, grain, __ATOMIC_RELAXED);
        if (r0 >= R) return 0;
        int64_t r1 = r0 + grain < R ? r0 + grain : R;
        gemv_rows(kind, w, ldw, g, scale, lds, br, bc, x, ldx, T, C, r0, r1, out, ldo, 0);
    }
}

/* Dequantize rows [r0, r1) of the weight to fp32 [r1-r0, C] (the prefill tile); nonzero on bad
 * arguments (a packed layout needs 32-code blocks). */
EF_KERNEL int EF_NAME(ef_dequant_rows)(int kind, const void *w, int64_t ldw, int64_t g, const float *scale, int64_t lds,
                    int64_t br, int64_t bc, int64_t C, int64_t r0, int64_t r1, float *out) {
    if (g < 1 || (g > 1 && (kind != 0 || C % 32 || bc % 32))) return 1;
    float buf[4 * KC] __attribute__((aligned(32)));
    for (int64_t r = r0; r < r1; r += 4) {
        int nr = (int)(r1 - r < 4 ? r1 - r : 4);
        for (int64_t c0 = 0; c0 < C; c0 += KC) {
            int64_t kc = C - c0 < KC ? C - c0 : KC;
            decode_weight_chunk(kind, w, ldw, g, scale, lds, br, bc, r, nr, c0, kc, buf);
            for (int i = 0; i < nr; i++) memcpy(out + (r - r0 + i) * C + c0, buf + i * KC, sizeof(float) * kc);
        }
    }
    return 0;
}

#endif /* !EK_DISPATCH */

/* ---------------------------------------------------------------------------------------
 * The dispatcher (-DEK_DISPATCH, plus -DEK_HAVE_<V>=1 for each variant object linked in): the
 * exported entry points forward to the variant chosen when the library loads, the best one
 * the CPU and OS support (kernel_common.h); ef_set_variant overrides it (tests, benchmarks).
 * The variants give identical bits wherever they share a code path: avx2 and avx512 run the
 * same intrinsics and the same FMAs (avx512 only adds registers and encodings).
 */
#ifdef EK_DISPATCH
#ifndef EK_SOURCE_HASH
#define EK_SOURCE_HASH ""
#endif

#define EF_DECLARE(V) \
    int64_t ef_gather_decode_f32_##V(const uint8_t *, int64_t, const uint8_t *, int64_t, int64_t, const int64_t *, \
                                     int64_t, int64_t, float *); \
    int64_t ef_gather_decode_bf16_##V(const uint8_t *, int64_t, const uint8_t *, int64_t, int64_t, const int64_t *, \
                                      int64_t, int64_t, uint16_t *); \
    int ef_gemv_##V(int, const void *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, const float *, \
                    int64_t, int64_t, int64_t, int64_t, float *, int64_t, int64_t *, int64_t); \
    int ef_dequant_rows_##V(int, const void *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, int64_t, \
                            int64_t, int64_t, float *);
#define EF_ENTRY(V, SUPPORTED) \
    {#V, SUPPORTED, ef_gather_decode_f32_##V, ef_gather_decode_bf16_##V, ef_gemv_##V, ef_dequant_rows_##V}

typedef struct {
    const char *name;
    int (*supported)(void);
    int64_t (*gather_f32)(const uint8_t *, int64_t, const uint8_t *, int64_t, int64_t, const int64_t *, int64_t,
                          int64_t, float *);
    int64_t (*gather_bf16)(const uint8_t *, int64_t, const uint8_t *, int64_t, int64_t, const int64_t *, int64_t,
                           int64_t, uint16_t *);
    int (*gemv)(int, const void *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, const float *,
                int64_t, int64_t, int64_t, int64_t, float *, int64_t, int64_t *, int64_t);
    int (*dequant)(int, const void *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                   int64_t, float *);
} ef_kernels;

EF_DECLARE(generic)
#ifdef EK_HAVE_AVX2
EF_DECLARE(avx2)
#endif
#ifdef EK_HAVE_AVX512
EF_DECLARE(avx512)
#endif

/* best first */
static const ef_kernels variants[] = {
#ifdef EK_HAVE_AVX512
    EF_ENTRY(avx512, ek_cpu_avx512),
#endif
#ifdef EK_HAVE_AVX2
    EF_ENTRY(avx2, ek_cpu_avx2),
#endif
    EF_ENTRY(generic, ek_always),
};
EK_DISPATCHER(ef, ef_kernels)

int ef_abi_version(void) { return EF_ABI_VERSION; }
const char *ef_source_hash(void) { return EK_SOURCE_HASH; }

/* n float32 -> bfloat16 bits with the one rounding every kernel uses (ek_float_to_bf16) */
void ef_to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = ek_float_to_bf16(x[i]);
}

int64_t ef_gather_decode_f32(const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                             int64_t scale_stride, int64_t rows, const int64_t *addr, int64_t n,
                             int64_t d, float *out) {
    return kernels()->gather_f32(codes, code_stride, scales, scale_stride, rows, addr, n, d, out);
}

int64_t ef_gather_decode_bf16(const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                              int64_t scale_stride, int64_t rows, const int64_t *addr, int64_t n,
                              int64_t d, uint16_t *out) {
    return kernels()->gather_bf16(codes, code_stride, scales, scale_stride, rows, addr, n, d, out);
}

int ef_gemv(int kind, const void *w, int64_t ldw, int64_t g, const float *scale, int64_t lds, int64_t br,
            int64_t bc, const float *x, int64_t ldx, int64_t T, int64_t C, int64_t R,
            float *out, int64_t ldo, int64_t *next_row, int64_t grain) {
    return kernels()->gemv(kind, w, ldw, g, scale, lds, br, bc, x, ldx, T, C, R, out, ldo, next_row, grain);
}

/* ef_gemv on n threads: the caller and n - 1 workers of the library's thread pool
 * (kernel_common.h), all claiming rows from one counter, so a slow or missing thread's share
 * is done by the others. A Python thread pool cost ~90 us a call (GIL hand-offs), starting
 * threads per call ~20 us; the pool wakes spinning or sleeping workers. */
typedef struct {
    int (*gemv)(int, const void *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, const float *,
                int64_t, int64_t, int64_t, int64_t, float *, int64_t, int64_t *, int64_t);
    int kind; const void *w; int64_t ldw, g; const float *scale; int64_t lds, br, bc;
    const float *x; int64_t ldx, T, C, R; float *out; int64_t ldo, next_row, grain; int rc;
} gemv_call;

static void gemv_task(void *ctx, int index) {
    gemv_call *c = ctx;
    (void)index;
    int rc = c->gemv(c->kind, c->w, c->ldw, c->g, c->scale, c->lds, c->br, c->bc, c->x, c->ldx, c->T, c->C, c->R,
                     c->out, c->ldo, &c->next_row, c->grain);
    if (rc) __atomic_or_fetch(&c->rc, rc, __ATOMIC_RELAXED);
}

int ef_gemv_threads(int n, int kind, const void *w, int64_t ldw, int64_t g, const float *scale, int64_t lds,
                    int64_t br, int64_t bc, const float *x, int64_t ldx, int64_t T, int64_t C, int64_t R,
                    float *out, int64_t ldo, int64_t grain) {
    if (n < 1) return 1;
    gemv_call c = {kernels()->gemv, kind, w, ldw, g, scale, lds, br, bc, x, ldx, T, C, R, out, ldo, 0, grain, 0};
    ek_parallel(n, gemv_task, &c);
    return c.rc;
}

int ef_dequant_rows(int kind, const void *w, int64_t ldw, int64_t g, const float *scale, int64_t lds,
                    int64_t br, int64_t bc, int64_t C, int64_t r0, int64_t r1, float *out) {
    return kernels()->dequant(kind, w, ldw, g, scale, lds, br, bc, C, r0, r1, out);
}
#endif /* EK_DISPATCH */
