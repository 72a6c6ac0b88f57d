/* engramflow native CPU kernels: MXFP8 row gather+decode and FP8/BF16-weight GEMV.
 *
 * Built on first use by engramflow/kernels/native.py with the system C compiler
 * (cc -O3 -march=native, no -ffast-math: NaNs and subnormals must survive).
 * Plain C plus GCC vector extensions, so it also builds where AVX2 is absent.
 *
 * E4M3 -> float32 is exact by moving bits (DESIGN §4): sign to bit 31, the 7 low bits to
 * bits 20..26; read as float that is e4m3 * 2^-120 (an fp32 subnormal for e4m3 subnormals,
 * so denormals must not be flushed), and multiplying by 2^120 is exact.
 */
#include <stdint.h>
#include <string.h>

#define TWO_POW_120 0x1p120f
#define KC 512          /* weight columns decoded per chunk: 4 rows x 512 x 4 B = 8 KiB, L1 */
#define MAX_TOKENS 64   /* GEMV accumulators live on the stack: T * 4 rows * 32 B */

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4))); /* unaligned loads */

static inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* e4m3(code) * 2^-120, exact */
static inline float e4m3_scaled_down(uint32_t b) {
    return bits_to_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20));
}

/* 2^(s-127) for an E8M0 byte, exact (s = 0 is the fp32 subnormal 2^-127); 255 is NaN */
static inline float e8m0_to_float(uint32_t s) {
    if (s == 255) return bits_to_float(0x7FC00000u);
    if (s == 0) return bits_to_float(0x00400000u);
    return bits_to_float(s << 23);
}

/* float32 -> bfloat16 bits, round to nearest even (the one rounding of an exact value) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* keep NaN quiet */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Returns the index of the first out-of-range address, or -1 when all are valid. */
static int64_t first_bad_address(const int64_t *addr, int64_t n, int64_t rows) {
    for (int64_t i = 0; i < n; i++)
        if (addr[i] < 0 || addr[i] >= rows) return i;
    return -1;
}

/* Decode one MXFP8 row of d values (d/32 scales) into fp32. Exact: e4m3 * 2^120 is exact,
 * and e4m3 * 2^(s-127) has at most 4 significant bits at or above 2^-136, so the second
 * product is exact too unless it overflows (then inf, as the rounding rule says). */
static inline void decode_row_f32(const uint8_t *code, const uint8_t *scale, int64_t d, float *out) {
    for (int64_t j = 0; j < d / 32; j++) {
        float f = e8m0_to_float(scale[j]);
        const uint8_t *c = code + j * 32;
        float *o = out + j * 32;
        for (int k = 0; k < 32; k++) {
            uint32_t b = c[k];
            float v = e4m3_scaled_down(b) * TWO_POW_120 * f;
            o[k] = ((b & 0x7Fu) == 0x7Fu) ? bits_to_float(0x7FC00000u) : v;
        }
    }
}

/* out[i, :] = decode(codes[addr[i]], scales[addr[i]]) for n addresses; fp32 output. */
int64_t ef_gather_decode_f32(const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                             int64_t scale_stride, int64_t rows, const int64_t *addr, int64_t n,
                             int64_t d, float *out) {
    int64_t bad = first_bad_address(addr, n, rows);
    if (bad >= 0) return bad;
    for (int64_t i = 0; i < n; i++)
        decode_row_f32(codes + addr[i] * code_stride, scales + addr[i] * scale_stride, d, out + i * d);
    return -1;
}

/* Same, rounding each exact value once into bfloat16. */
int64_t ef_gather_decode_bf16(const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                              int64_t scale_stride, int64_t rows, const int64_t *addr, int64_t n,
                              int64_t d, uint16_t *out) {
    int64_t bad = first_bad_address(addr, n, rows);
    if (bad >= 0) return bad;
    float row[4096];
    if (d > 4096) return n; /* caller checks d; never reached from Python */
    for (int64_t i = 0; i < n; i++) {
        decode_row_f32(codes + addr[i] * code_stride, scales + addr[i] * scale_stride, d, row);
        uint16_t *o = out + i * d;
        for (int64_t k = 0; k < d; k++) o[k] = float_to_bf16(row[k]);
    }
    return -1;
}

/* ---------------------------------------------------------------------------------------
 * Weight decode: rows [r, r+nr) x columns [c0, c0+kc) of the wkv weight into buf[4][KC]
 * fp32, block scales applied. kind 0: FP8 E4M3 codes with fp32 block scales (scale[r/br,
 * c/bc]); kind 1: BF16 (no scale). Rows past nr are zero so the 4-row micro-kernel can run.
 * The caller guarantees no NaN codes (0x7F/0xFF) for kind 0.
 */
static void decode_weight_chunk(int kind, const void *w, int64_t ldw, const float *scale,
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
        const uint8_t *src = (const uint8_t *)w + (r + i) * ldw;
        const float *srow = scale + ((r + i) / br) * lds;
        for (int64_t c = c0; c < c0 + kc;) {
            int64_t end = (c / bc + 1) * bc;
            if (end > c0 + kc) end = c0 + kc;
            float f = srow[c / bc];
            for (; c < end; c++)
                o[c - c0] = e4m3_scaled_down(src[c]) * TWO_POW_120 * f;
        }
    }
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* acc[t][i] += buf[i, :kc] * x[t, c0:c0+kc] for NT tokens t0.. and 4 rows, 8 lanes wide.
 * NT is a compile-time constant after inlining, so the 4*NT accumulators stay in registers. */
static inline __attribute__((always_inline)) void
micro_kernel(const int NT, const float *buf, const float *x, int64_t ldx, int64_t t0, int64_t c0,
             int64_t kc, v8f *acc) {
    v8f a[3][4];
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < 4; i++) a[t][i] = acc[(t0 + t) * 4 + i];
    for (int64_t k = 0; k < kc; k += 8) {
        v8f w0 = *(const v8f *)(buf + 0 * KC + k);
        v8f w1 = *(const v8f *)(buf + 1 * KC + k);
        v8f w2 = *(const v8f *)(buf + 2 * KC + k);
        v8f w3 = *(const v8f *)(buf + 3 * KC + k);
        for (int t = 0; t < NT; t++) {
            v8f xv = *(const v8f_u *)(x + (t0 + t) * ldx + c0 + k);
            a[t][0] += w0 * xv;
            a[t][1] += w1 * xv;
            a[t][2] += w2 * xv;
            a[t][3] += w3 * xv;
        }
    }
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < 4; i++) acc[(t0 + t) * 4 + i] = a[t][i];
}

/* out[t, r - out_row0] = sum_c W[r, c] * x[t, c] for rows [r0, r1), T tokens (T <= MAX_TOKENS).
 * Each weight byte is read once per call; x (T x C fp32) stays in cache. C % 8 == 0.
 * Row ranges from different threads never overlap, so calls run in parallel. */
int ef_gemv(int kind, const void *w, int64_t ldw, const float *scale, int64_t lds, int64_t br,
            int64_t bc, const float *x, int64_t ldx, int64_t T, int64_t C, int64_t r0, int64_t r1,
            float *out, int64_t ldo, int64_t out_row0) {
    if (T < 1 || T > MAX_TOKENS || C % 8) return 1;
    float buf[4 * KC] __attribute__((aligned(32)));
    v8f acc[MAX_TOKENS * 4];
    for (int64_t r = r0; r < r1; r += 4) {
        int nr = (int)(r1 - r < 4 ? r1 - r : 4);
        memset(acc, 0, sizeof(v8f) * 4 * T);
        for (int64_t c0 = 0; c0 < C; c0 += KC) {
            int64_t kc = C - c0 < KC ? C - c0 : KC;
            decode_weight_chunk(kind, w, ldw, scale, lds, br, bc, r, nr, c0, kc, buf);
            int64_t t = 0;
            for (; t + 3 <= T; t += 3) micro_kernel(3, buf, x, ldx, t, c0, kc, acc);
            if (T - t == 2) micro_kernel(2, buf, x, ldx, t, c0, kc, acc);
            if (T - t == 1) micro_kernel(1, buf, x, ldx, t, c0, kc, acc);
        }
        for (int64_t t = 0; t < T; t++)
            for (int i = 0; i < nr; i++) out[t * ldo + (r + i - out_row0)] = hsum(acc[t * 4 + i]);
    }
    return 0;
}

/* Dequantize rows [r0, r1) of the weight to fp32 [r1-r0, C] (the prefill tile). */
void ef_dequant_rows(int kind, const void *w, int64_t ldw, const float *scale, int64_t lds,
                     int64_t br, int64_t bc, int64_t C, int64_t r0, int64_t r1, float *out) {
    float buf[4 * KC] __attribute__((aligned(32)));
    for (int64_t r = r0; r < r1; r += 4) {
        int nr = (int)(r1 - r < 4 ? r1 - r : 4);
        for (int64_t c0 = 0; c0 < C; c0 += KC) {
            int64_t kc = C - c0 < KC ? C - c0 : KC;
            decode_weight_chunk(kind, w, ldw, scale, lds, br, bc, r, nr, c0, kc, buf);
            for (int i = 0; i < nr; i++) memcpy(out + (r - r0 + i) * C + c0, buf + i * KC, sizeof(float) * kc);
        }
    }
}
