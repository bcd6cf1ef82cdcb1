/* The quantized decode read of "hf_pagedkv" (`fused_code_read`'s contract) as one C function: attention of a few
 * query rows over int8/int4/int3/int2/fp8 codes and fp16 scales read where they lie, one block of codes decoded at a
 * time into a small fp32 tile, one softmax over the read. Built at first use by `hf_pagedkv.attention.native_read` (the
 * machine's C compiler, cached per CPU), called through ctypes: no Python or torch headers.
 *
 * Layouts (strides in elements; the last dimension of every array is contiguous):
 *   q      [H, B, R, D] float32: the scaled query rows of each key/value head
 *   kc, vc [H, B, n, code] uint8: keys per channel, values per token (one group per head), in one of the
 *          `Format`s: int8 codes are the two's complement bytes; int4 codes hold token t (bits 0-3) and t + bs/2
 *          (bits 4-7) of byte (t, d); int2 codes tokens t + i bs/4 in bits 2i, 2i + 1 of byte (t, d); int3 codes an
 *          int2 plane of the low two bits ([bs/4, D] bytes), then a plane of the high bit (token t + i bs/8 in bit
 *          i of byte (t, d) of [bs/8, D] bytes); fp8 codes the bytes of float8_e4m3fn / float8_e5m2, token-major
 *   ks, vs [H, B, n, scale] fp16: int8 and fp8 [scale per channel | per token], int4/int3/int2 [scales | minimums]
 *   fk, fv [H, B, m, D] float32: the full-precision tail, then the `sink` sink tokens
 *   bias   [B, R | 1, width] float32 (optional): additive mask over columns 0 .. width - 1, width = n*bs + m - sink
 *   out    [H, B, R, D] float32, contiguous
 * Columns: n*bs encoded tokens, then the m full-precision ones; columns 0 .. sink - 1 are read from the last `sink`
 * full-precision rows instead of their codes (their encoded columns get -inf). Probabilities below 2**-64 of a row's
 * largest are 0 (the Python side's NEGLIGIBLE).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NEGLIGIBLE (-64.0f * 0.6931471805599453f)
#define MAX_DIM 256
#define MAX_BLOCK 256

typedef _Float16 half;
/* LANES floats a vector (gcc's vector extension; loads need no alignment): 16 where AVX-512 gives 32 registers of
 * 16, else 8 (AVX2's 16 registers of 8, two NEON registers). 16-float vectors on AVX2 spilled: the 16 key-score
 * accumulators and their lane-crossing folds did not fit its registers (a 2,048-token read 3x slower on a Zen 3) */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(4 * LANES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * LANES), aligned(4)));
typedef _Float16 vh __attribute__((vector_size(2 * LANES), aligned(2)));

/* exp(x) for x in [NEGLIGIBLE, 0], a vector at a time: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes'
 * degree-7 expf polynomial (Moshier, Cephes Math Library; about 1 ulp), times 2**n built in the exponent bits
 * (n >= -64: no denormals). Scalar expf on every probability was a third of the read. */
static inline vf expv(vf x) {
    vf fx = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(fx, vi); /* toward zero, then down to the floor */
    vf fn = __builtin_convertvector(n, vf);
    vi above = fn > fx;
    n += above; /* true is -1 */
    fn = __builtin_convertvector(n, vf);
    vf r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    vf y = r * 0.0f + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    vi bits = (n + 127) << 23;
    return y * (vf)bits;
}

/* Loads and max by the instruction set's own intrinsics where it has them: gcc lowered the generic forms to two
 * 16-byte copies through the stack (a failed store-to-load forwarding per load) and to one `vpinsrw` + scalar
 * `vcvtph2ps` per fp16 lane: together about a fifth of a 2,048-token read on a Zen 3 (perf annotate). */
static inline vf loadv(const float *p) {
#if LANES == 16
    return (vf)_mm512_loadu_ps(p);
#elif defined(__AVX__)
    return (vf)_mm256_loadu_ps(p);
#else
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
#endif
}

static inline void storev(float *p, vf v) {
#if LANES == 16
    _mm512_storeu_ps(p, (__m512)v);
#elif defined(__AVX__)
    _mm256_storeu_ps(p, (__m256)v);
#else
    memcpy(p, &v, sizeof v);
#endif
}

static inline vf loadvh(const half *p) { /* LANES fp16 values -> fp32 */
#if LANES == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vh v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vf);
#endif
}

static inline vf maxv(vf x, vf m) { /* lane-wise max; a NaN in x keeps m (as `x > m ? x : m`) */
#if LANES == 16
    return (vf)_mm512_max_ps((__m512)x, (__m512)m);
#elif defined(__AVX__)
    return (vf)_mm256_max_ps((__m256)x, (__m256)m);
#else
    const vi gt = x > m;
    return (vf)((gt & (vi)x) | (~gt & (vi)m));
#endif
}

/* fold(x, y, w): lanes in groups of w; x's and y's groups 2k and 2k + 1 added pairwise, x's before y's */
#define FOLD(x, y, ...) (__builtin_shuffle(x, y, (vi){__VA_ARGS__}) + \
                         __builtin_shuffle(x, y, (vi){__VA_ARGS__} + w))
#if LANES == 16
static inline vf fold8(vf x, vf y) {
    const int w = 8;
    return FOLD(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
}
static inline vf fold4(vf x, vf y) {
    const int w = 4;
    return FOLD(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
}
static inline vf fold2(vf x, vf y) {
    const int w = 2;
    return FOLD(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
}
static inline vf fold1(vf x, vf y) {
    const int w = 1;
    return FOLD(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
}

/* lane t of the result = the sum of a[t]'s lanes, for LANES vectors: log2(LANES) levels of folds (LANES - 1 in
 * all, against LANES separate `hsum`s); the folds leave the vectors in bit-reversed order, so they go in
 * bit-reversed */
static inline vf hsum_lanes(const vf *a) {
    vf b0 = fold8(a[0], a[8]), b1 = fold8(a[4], a[12]), b2 = fold8(a[2], a[10]), b3 = fold8(a[6], a[14]);
    vf b4 = fold8(a[1], a[9]), b5 = fold8(a[5], a[13]), b6 = fold8(a[3], a[11]), b7 = fold8(a[7], a[15]);
    vf c0 = fold4(b0, b1), c1 = fold4(b2, b3), c2 = fold4(b4, b5), c3 = fold4(b6, b7);
    return fold1(fold2(c0, c1), fold2(c2, c3));
}
#else
static inline vf fold4(vf x, vf y) {
    const int w = 4;
    return FOLD(x, y, 0, 1, 2, 3, 8, 9, 10, 11);
}
static inline vf fold2(vf x, vf y) {
    const int w = 2;
    return FOLD(x, y, 0, 1, 8, 9, 4, 5, 12, 13);
}
static inline vf fold1(vf x, vf y) {
    const int w = 1;
    return FOLD(x, y, 0, 8, 2, 10, 4, 12, 6, 14);
}

static inline vf hsum_lanes(const vf *a) { /* as above, for 8 vectors */
    vf b0 = fold4(a[0], a[4]), b1 = fold4(a[2], a[6]), b2 = fold4(a[1], a[5]), b3 = fold4(a[3], a[7]);
    return fold1(fold2(b0, b1), fold2(b2, b3));
}
#endif

static inline float hsum(vf v) { /* the sum of one vector's lanes: log2(LANES) halving steps */
#if LANES == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* one row of scores -> exp(score - max) in place, the terms below 2**-64 of the max set to 0; returns their sum. A
 * row masked everywhere (max -inf: a padding query position) becomes 0 and sums to 0; its output is then 0, as
 * torch's `sdpa` gives (`row_output`) */
static inline float softmax_row(float *sr, const int64_t W) {
    float mx = -INFINITY;
    int64_t c1 = 0;
    if (W >= LANES) { /* LANES running maxima (a scalar chain of maxss was 6% of the read) */
        vf vm = loadv(sr);
        for (c1 = LANES; c1 + LANES <= W; c1 += LANES) vm = maxv(loadv(sr + c1), vm);
        float lanes[LANES];
        memcpy(lanes, &vm, sizeof vm);
        for (int i = 0; i < LANES; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    }
    for (int64_t c = c1; c < W; c++) mx = sr[c] > mx ? sr[c] : mx;
    if (mx == -INFINITY) {
        memset(sr, 0, sizeof(float) * W);
        return 0.0f;
    }
    float sum = 0.0f;
    int64_t c0 = 0;
    if (isfinite(mx)) { /* else (+inf: an overflowing score) NaN from expf below, as the torch read */
        vf vsum = (vf){0};
        for (; c0 + LANES <= W; c0 += LANES) {
            const vf dlt = loadv(sr + c0) - mx;
            const vi keep = dlt >= NEGLIGIBLE; /* the others: expv(0), then 0 */
            const vf p = (vf)(keep & (vi)expv((vf)(keep & (vi)dlt)));
            storev(sr + c0, p);
            vsum += p;
        }
        sum = hsum(vsum);
    }
    for (int64_t c = c0; c < W; c++) {
        const float dlt = sr[c] - mx;
        sr[c] = dlt < NEGLIGIBLE ? 0.0f : expf(dlt);
        sum += sr[c];
    }
    return sum;
}

/* a row's output divided by its softmax sum; a row masked everywhere (sum 0) is 0 */
static inline void row_output(float *o, float l, const int64_t D) {
    if (l == 0.0f) {
        memset(o, 0, sizeof(float) * D);
        return;
    }
    for (int64_t d = 0; d < D; d++) o[d] /= l;
}

/* dst[t] = q . k_t + add for the n key rows k_t = k + t * D (D floats each), q as C = D / LANES vectors: LANES
 * tokens' dot products at a time, summed across lanes together (`hsum_lanes`), the rest one by one */
static inline __attribute__((always_inline)) void score_rows(const vf *q, const float *k, int64_t n, const int64_t D,
                                                             float add, float *dst) {
    const int64_t C = D / LANES;
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) {
        vf acc[LANES];
        for (int64_t u = 0; u < LANES; u++) {
            const float *kt = k + (t + u) * D;
            acc[u] = q[0] * loadv(kt);
            for (int64_t c = 1; c < C; c++) acc[u] += q[c] * loadv(kt + c * LANES);
        }
        storev(dst + t, hsum_lanes(acc) + add);
    }
    for (; t < n; t++) {
        const float *kt = k + t * D;
        vf acc = q[0] * loadv(kt);
        for (int64_t c = 1; c < C; c++) acc += q[c] * loadv(kt + c * LANES);
        dst[t] = hsum(acc) + add;
    }
}

/* every (key/value head, batch row) pair `hb` of a call through `one(ptr, meta, hb)`, on `nthreads` OpenMP threads
 * when there are several pairs; nonzero if any failed */
static int for_each_pair(int (*one)(void **, const int64_t *, int64_t), void **ptr, const int64_t *meta,
                         int64_t pairs, int nthreads) {
    int failed = 0;
    if (nthreads > 1 && pairs > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : failed)
        for (int64_t hb = 0; hb < pairs; hb++) failed |= one(ptr, meta, hb);
    } else { /* one thread: no OpenMP region at all */
        for (int64_t hb = 0; hb < pairs; hb++) failed |= one(ptr, meta, hb);
    }
    return failed;
}

/* the code formats (`native_read.FORMATS`): the integer codecs by their bits, the fp8 ones by their own numbers */
typedef enum { INT2 = 2, INT3 = 3, INT4 = 4, INT8 = 8, E4M3 = 43, E5M2 = 52 } Format;

/* whether `f` is a format read here, in blocks of `bs` tokens (its packing's tokens per byte divide it) */
static int known_format(int f, int64_t bs) {
    switch (f) {
    case INT8: case E4M3: case E5M2: return 1;
    case INT4: return bs % 2 == 0;
    case INT3: return bs % 8 == 0;
    case INT2: return bs % 4 == 0;
    default: return 0;
    }
}

/* asymmetric formats: a minimum per group after the scales (x = s c + z); the others are x = s c */
static inline int has_minimums(int f) { return f == INT4 || f == INT3 || f == INT2; }

typedef uint8_t vb __attribute__((vector_size(LANES), aligned(1)));
typedef uint16_t vu16 __attribute__((vector_size(2 * LANES), aligned(2)));

static inline vf halfv(vu16 h) { /* LANES fp16 bit patterns -> fp32, exactly (subnormals included) */
#if LANES == 16
    return (vf)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps((__m128i)h);
#else
    return __builtin_convertvector((vh)h, vf);
#endif
}

/* the factor between a format's code values as `decode_block` writes them and their values: e4m3 is decoded 2**-8
 * too small (`decode_fp8`), so its scales are taken 2**8 larger (exact: a power of two) */
static inline float code_unit(int f) { return f == E4M3 ? 256.0f : 1.0f; }

static inline vb loadb(const uint8_t *p) { /* LANES bytes */
    vb v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vu16 wordsv(const uint8_t *p) { /* LANES unsigned bytes -> 16-bit lanes (gcc: in halves, joined) */
#if LANES == 16
    return (vu16)_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vu16)_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(loadb(p), vu16);
#endif
}

static inline vf bytesv(vb b) { /* LANES unsigned bytes -> fp32, through int32 (gcc converted bytes lane by lane) */
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}

#if LANES == 16
typedef uint8_t vb64 __attribute__((vector_size(64), aligned(1)));

static inline void widen64(float *o, vb64 b) { /* 64 unsigned bytes -> fp32 at o[0 .. 63] */
    const __m512i x = (__m512i)b;
#if defined(__AVX512VBMI__) /* bytes 16k .. 16k + 15 to the low bytes of 16 int32 lanes, the others 0: one `vpermb` */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int k = 0; k < 4; k++)
        _mm512_storeu_ps(o + 16 * k, _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(
                                         0x1111111111111111ull, _mm512_add_epi32(lane, _mm512_set1_epi32(16 * k)), x)));
#else
    _mm512_storeu_ps(o, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(x))));
    _mm512_storeu_ps(o + 16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(x, 1))));
    _mm512_storeu_ps(o + 32, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(x, 2))));
    _mm512_storeu_ps(o + 48, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(x, 3))));
#endif
}
#endif

/* `N` fp8 bytes (a multiple of LANES) -> fp32 through the fp16 bit pattern that holds each one, exactly: e5m2 is the
 * upper byte of fp16 (its value); e4m3's sign, exponent and mantissa moved to fp16's places read as its value
 * times 2**-8 (`code_unit`), normal and subnormal alike (the biases differ by 8); its NaN (S.1111.111) made fp16's */
static inline void decode_fp8(const uint8_t *c, int fmt, int64_t N, float *o) {
    for (int64_t i = 0; i < N; i += LANES) {
        const vu16 b = wordsv(c + i);
        if (fmt == E5M2) {
            storev(o + i, halfv(b << 8));
        } else {
            const vu16 x = b << 7; /* the sign at bit 14: added to itself, it carries to bit 15 */
            const vu16 nan = (vu16)((b & 0x7F) == 0x7F) & 0x7C00;
            storev(o + i, halfv((x + (x & 0x4000)) | nan));
        }
    }
}

/* one block of codes -> bs x D code values in fp32 (int8: signed; int4 0..15, int3 0..7, int2 0..3; fp8: the 8-bit
 * float's value, over `code_unit`) */
static void decode_block(const uint8_t *c, int fmt, int64_t bs, int64_t D, float *tile) {
    if (fmt == INT8) {
        for (int64_t i = 0; i < bs * D; i++) tile[i] = (float)(int8_t)c[i];
        return;
    }
    if (fmt == E4M3 || fmt == E5M2) {
        decode_fp8(c, fmt, bs * D, tile);
        return;
    }
    const int64_t q4 = bs / 4, q8 = bs / 8;
    if (fmt == INT2) { /* row i of the plane: tokens i + k q4 in bits 2k, 2k + 1 */
        for (int64_t i = 0; i < q4; i++) {
            int64_t d = 0;
#if LANES == 16
            for (; d + 64 <= D; d += 64) { /* 64 codes of a row a step, as int3 below */
                vb64 lo;
                memcpy(&lo, c + i * D + d, 64);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) widen64(tile + (i + k * q4) * D + d, (lo >> (2 * k)) & 3);
            }
#endif
            for (; d < D; d += LANES) {
                const vb lo = loadb(c + i * D + d);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) /* (unrolled: constant shifts; a variable one ran lane by lane) */
                    storev(tile + (i + k * q4) * D + d, bytesv((lo >> (2 * k)) & 3));
            }
        }
        return;
    }
    if (fmt == INT3) { /* row i of the high plane: tokens i + j q8 (bit j); their low bits: rows i, i + q8 of the
                        * 2-bit plane, bits 2 (j / 2) */
        const uint8_t *high = c + q4 * D;
        for (int64_t i = 0; i < q8; i++) {
            int64_t d = 0;
#if LANES == 16
            for (; d + 64 <= D; d += 64) { /* 64 codes of a row a step: the bit operations on 64 bytes at once */
                vb64 hb, l0, l1;
                memcpy(&hb, high + i * D + d, 64);
                memcpy(&l0, c + i * D + d, 64);
                memcpy(&l1, c + (i + q8) * D + d, 64);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                    const vb64 top = j < 2 ? (hb << (2 - j)) & 4 : (hb >> (j - 2)) & 4;
                    widen64(tile + (i + j * q8) * D + d, (((j & 1 ? l1 : l0) >> (2 * (j >> 1))) & 3) | top);
                }
            }
#endif
            for (; d < D; d += LANES) {
                const vb hb = loadb(high + i * D + d), l0 = loadb(c + i * D + d), l1 = loadb(c + (i + q8) * D + d);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                    const vb code = (((j & 1 ? l1 : l0) >> (2 * (j >> 1))) & 3) | (((hb >> j) & 1) << 2);
                    storev(tile + (i + j * q8) * D + d, bytesv(code));
                }
            }
        }
        return;
    }
    const int64_t half_bs = bs / 2;
    for (int64_t i = 0; i < half_bs * D; i++) {
        tile[i] = (float)(c[i] & 15);
        tile[half_bs * D + i] = (float)(c[i] >> 4);
    }
}

/* full-precision tokens of one pair: `n` rows of keys and of values, `ks` / `vs` floats apart */
typedef struct {
    const float *k, *v;
    int64_t n, ks, vs;
} Segment;

#define SEGMENTS 3

/* a pool's storage segment (`SegmentedTensor`): its first block id, then for key codes, key scales, value codes and
 * value scales the address of its element 0 and its head stride (elements) */
#define SEG_WIDTH 9

/* one (key/value head, row) pair's read: pointers at its first element, strides along its last dims. Encoded
 * block j: `kc_sn` (...) elements on from `kc` (...) per block, or with `ids`, block `ids[j]` of head `h` of the
 * pool whose `nseg` segments `segs` describes. The full-precision columns are the segments' rows one after another
 * (the tail, the step's tokens, the sink tokens). With `rot` (rotated keys: their codes are of keys @ rot, [D, D]
 * row-major) the codes are scored with the query rows turned (q @ rot), the full-precision keys with `q` as it is */
typedef struct {
    const float *q, *rot, *bias;
    const uint8_t *kc, *vc;
    const half *ks, *vs;
    const int64_t *ids, *segs;
    float *out;
    Segment seg[SEGMENTS];
    int64_t q_sr, kc_sn, ks_sn, vc_sn, vs_sn, bi_sr, R, n, bs, sink, nseg, h;
    int kfmt, vfmt; /* `Format`s */
} Pair;

/* where encoded block j of a pair lies: its codes and its scales, keys (`half_` 0) or values (1) */
static inline void locate(const Pair *a, int64_t j, int half_, const uint8_t **codes, const half **scales) {
    if (!a->ids) {
        *codes = (half_ ? a->vc : a->kc) + j * (half_ ? a->vc_sn : a->kc_sn);
        *scales = (half_ ? a->vs : a->ks) + j * (half_ ? a->vs_sn : a->ks_sn);
        return;
    }
    const int64_t id = a->ids[j];
    int64_t s = a->nseg - 1;
    while (s > 0 && a->segs[s * SEG_WIDTH] > id) s--;
    const int64_t *e = a->segs + s * SEG_WIDTH + 1 + 4 * half_, local = id - a->segs[s * SEG_WIDTH];
    *codes = (const uint8_t *)(intptr_t)e[0] + a->h * e[1] + local * (half_ ? a->vc_sn : a->kc_sn);
    *scales = (const half *)(intptr_t)e[2] + a->h * e[3] + local * (half_ ? a->vs_sn : a->ks_sn);
}

/* the bytes of one block's codes in format `f` */
static inline int64_t code_bytes(int f, int64_t bs, int64_t D) {
    return f == INT4 ? bs * D / 2 : f == INT3 ? 3 * bs * D / 8 : f == INT2 ? bs * D / 4 : bs * D;
}

/* encoded block j's codes and scales (keys: `half_` 0, values 1), `nbytes` and `sbytes` of them, fetched into the
 * caches ahead of their read: the blocks lie apart in the pool, so the hardware's prefetchers learn each one anew
 * (int3's three rows per row group came from memory as it decoded them: a 2,048-token k3v3 read 20% -> 8% slower
 * than k4v4's on a Zen 5) */
static inline void prefetch_block_of(const Pair *a, int64_t j, int half_, int64_t nbytes, int64_t sbytes) {
    const uint8_t *codes;
    const half *s;
    locate(a, j, half_, &codes, &s);
    for (int64_t i = 0; i < nbytes; i += 64) __builtin_prefetch(codes + i, 0, 3);
    for (int64_t i = 0; i < sbytes; i += 64) __builtin_prefetch((const uint8_t *)s + i, 0, 3);
}

/* the read of one pair, every query row of it; `D` a constant where the callers below specialise it */
static inline __attribute__((always_inline)) int read_pair(const Pair *a, const int64_t D) {
    const float *q = a->q, *bias = a->bias, *qm = a->q; /* qm: the query of the full-precision keys */
    float *out = a->out;
    int64_t q_sr = a->q_sr;
    const int64_t qm_sr = a->q_sr, bi_sr = a->bi_sr, R = a->R, n = a->n, bs = a->bs, sink = a->sink;
    const Segment *seg = a->seg;
    const int64_t m = seg[0].n + seg[1].n + seg[2].n;
    const int kfmt = a->kfmt, vfmt = a->vfmt;
    const int64_t T = n * bs, W = T + m, width = W - sink;
    float *scores = malloc(sizeof(float) * R * W);
    float *tile = malloc(sizeof(float) * (bs + (a->rot ? R : 0)) * D); /* (then R turned query rows after it) */
    if (!scores || !tile) {
        free(scores);
        free(tile);
        return 1;
    }
    const int64_t C = D / LANES; /* vectors per head_dim row */
    if (a->rot) { /* the query rows turned into the codes' basis: row r of q @ rot, a vector of columns at a time */
        float *qt = tile + bs * D;
        for (int64_t r = 0; r < R; r++) {
            const float *qr = q + r * q_sr;
            vf acc[MAX_DIM / LANES];
            for (int64_t c = 0; c < C; c++) acc[c] = (vf){0};
            for (int64_t d = 0; d < D; d++)
                for (int64_t c = 0; c < C; c++) acc[c] += qr[d] * loadv(a->rot + d * D + c * LANES);
            for (int64_t c = 0; c < C; c++) storev(qt + r * D + c * LANES, acc[c]);
        }
        q = qt;
        q_sr = D;
    }
    const int64_t kbytes = code_bytes(kfmt, bs, D), vbytes = code_bytes(vfmt, bs, D); /* a block's codes, scales */
    const int64_t ksbytes = 2 * D * (has_minimums(kfmt) ? 2 : 1), vsbytes = 2 * bs * (has_minimums(vfmt) ? 2 : 1);
    vf qs[MAX_DIM / LANES], sv[MAX_DIM / LANES], zv[MAX_DIM / LANES];
    float l[64], sf[MAX_BLOCK], zf[MAX_BLOCK]; /* a block's value scales and minimums in fp32 */
    /* scores of the encoded blocks: q . (s_d c + z_d) = (q * s) . c + q . z */
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *codes;
        const half *s;
        locate(a, j, 0, &codes, &s);
        if (j + 1 < n) prefetch_block_of(a, j + 1, 0, kbytes, ksbytes);
        decode_block(codes, kfmt, bs, D, tile);
        const int zk = has_minimums(kfmt); /* int4/int3/int2: minimums after the scales */
        const float ku = code_unit(kfmt);
        for (int64_t c = 0; c < C; c++) {
            sv[c] = loadvh(s + c * LANES) * ku;
            if (zk) zv[c] = loadvh(s + D + c * LANES);
        }
        for (int64_t r = 0; r < R; r++) {
            const float *qr = q + r * q_sr;
            vf zqv = (vf){0};
            for (int64_t c = 0; c < C; c++) {
                const vf qc = loadv(qr + c * LANES);
                qs[c] = qc * sv[c];
                if (zk) zqv += qc * zv[c];
            }
            score_rows(qs, tile, bs, D, zk ? hsum(zqv) : 0.0f, scores + r * W + j * bs);
        }
    }
    /* full-precision columns, the sink's -inf, the mask, the softmax */
    for (int64_t r = 0; r < R; r++) {
        const float *qr = qm + r * qm_sr;
        float *sr = scores + r * W;
        for (int64_t i = 0, c = T; i < SEGMENTS; i++)
            for (int64_t t = 0; t < seg[i].n; t++, c++) {
                const float *k = seg[i].k + t * seg[i].ks;
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc += qr[d] * k[d];
                sr[c] = acc;
            }
        for (int64_t c = 0; c < sink && c < W; c++) sr[c] = -INFINITY;
        if (bias) {
            const float *br = bias + r * bi_sr;
            for (int64_t c = 0; c < width; c++) sr[c] += br[c];
            for (int64_t c = 0; c < sink; c++) sr[width + c] += br[c];
        }
        const float sum = softmax_row(sr, W);
        l[r] = sum;
        float *o = out + r * D;
        memset(o, 0, sizeof(float) * D);
        for (int64_t i = 0, c = T; i < SEGMENTS; i++)
            for (int64_t t = 0; t < seg[i].n; t++, c++) {
                const float p = sr[c], *v = seg[i].v + t * seg[i].vs;
                if (p == 0.0f) continue;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
            }
    }
    /* values of the encoded blocks: sum_t p_t (s_t c_t + z_t) */
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *codes;
        const half *s;
        locate(a, j, 1, &codes, &s);
        const half *z = has_minimums(vfmt) ? s + bs : NULL;
        int any = 0;
        for (int64_t r = 0; r < R && !any; r++)
            for (int64_t t = 0; t < bs; t++) any |= scores[r * W + j * bs + t] != 0.0f;
        if (!any) continue;
        if (j + 1 < n) prefetch_block_of(a, j + 1, 1, vbytes, vsbytes);
        decode_block(codes, vfmt, bs, D, tile);
        int64_t t0 = 0; /* once per block, not per row; LANES at a time (one scalar conversion per scale, through
                         * the stack, was a tenth of a k4v4 read on a Xeon) */
        const float vu = code_unit(vfmt);
        for (; t0 + LANES <= bs; t0 += LANES) {
            storev(sf + t0, loadvh(s + t0) * vu);
            if (z) storev(zf + t0, loadvh(z + t0));
        }
        for (int64_t t = t0; t < bs; t++) {
            sf[t] = (float)s[t] * vu;
            if (z) zf[t] = (float)z[t];
        }
        for (int64_t r = 0; r < R; r++) {
            const float *p = scores + r * W + j * bs;
            float pz = 0.0f;
            vf acc[MAX_DIM / LANES]; /* the block's sum, in registers; added to the output once */
            for (int64_t c = 0; c < C; c++) acc[c] = (vf){0};
            for (int64_t t = 0; t < bs; t++) {
                const float w = p[t] * sf[t];
                const vf *vt = (const vf *)(tile + t * D);
                if (z) pz += p[t] * zf[t];
                for (int64_t c = 0; c < C; c++) acc[c] += w * vt[c];
            }
            vf *o = (vf *)(out + r * D);
            for (int64_t c = 0; c < C; c++) o[c] += acc[c] + pz;
        }
    }
    for (int64_t r = 0; r < R; r++) row_output(out + r * D, l[r], D);
    free(scores);
    free(tile);
    return 0;
}

static int read_pair_64(const Pair *a) { return read_pair(a, 64); }
static int read_pair_128(const Pair *a) { return read_pair(a, 128); }
static int read_pair_any(const Pair *a, int64_t D) { return read_pair(a, D); }
static int dispatch(const Pair *a, int64_t D) {
    return D == 64 ? read_pair_64(a) : D == 128 ? read_pair_128(a) : read_pair_any(a, D);
}

/* pair `hb` (= h * B + b) of the call's arrays (see below) */
static int read_one(void **ptr, const int64_t *meta, int64_t hb) {
    const int64_t B = meta[1], R = meta[2], D = meta[3], *st = meta + 11;
    const int64_t h = hb / B, b = hb % B;
    const float *bias = ptr[7];
    const Pair a = {.q = (const float *)ptr[0] + h * st[0] + b * st[1], .bias = bias ? bias + b * st[21] : NULL,
                    .kc = (const uint8_t *)ptr[1] + h * st[3] + b * st[4],
                    .vc = (const uint8_t *)ptr[3] + h * st[9] + b * st[10],
                    .ks = (const half *)ptr[2] + h * st[6] + b * st[7], .vs = (const half *)ptr[4] + h * st[12] + b * st[13],
                    .ids = NULL, .out = (float *)ptr[8] + hb * R * D,
                    .seg = {{(const float *)ptr[5] + h * st[15] + b * st[16], (const float *)ptr[6] + h * st[18] + b * st[19],
                             meta[5], st[17], st[20]}},
                    .q_sr = st[2], .kc_sn = st[5], .ks_sn = st[8], .vc_sn = st[11], .vs_sn = st[14], .bi_sr = st[22],
                    .R = R, .n = meta[4], .bs = meta[8], .sink = meta[9], .kfmt = (int)meta[6], .vfmt = (int)meta[7]};
    return dispatch(&a, D);
}

/* ptr: q, kc, ks, vc, vs, fk, fv, bias (or NULL), out.
 * meta: H, B, R, D, n, m, kfmt, vfmt (`Format`s), bs, sink, nthreads, then the strides of dims 0..2 of q, kc, ks,
 * vc, vs, fk, fv and of the bias's dims 1..2 (h stride: none, it is shared by every head).
 * Returns 0, or 1 for unsupported sizes / no memory (nothing written that the caller keeps). */
int hf_pagedkv_code_read(void **ptr, const int64_t *meta) {
    const int64_t H = meta[0], B = meta[1], R = meta[2], D = meta[3], bs = meta[8];
    const int kfmt = (int)meta[6], vfmt = (int)meta[7], nthreads = (int)meta[10];
    if (D > MAX_DIM || D % LANES || R > 64 || bs > MAX_BLOCK || bs % 2 || !known_format(kfmt, bs)
        || !known_format(vfmt, bs))
        return 1;
    return for_each_pair(read_one, ptr, meta, H * B, nthreads);
}

/* pair `hb` of a read through block tables (see below) */
static int read_table_one(void **ptr, const int64_t *meta, int64_t hb) {
    const int64_t B = meta[1], R = meta[2], D = meta[3], n = meta[4], rest = meta[10], qn = meta[11], *st = meta + 12;
    const int64_t h = hb / B, b = hb % B, sink = meta[8];
    const float *bias = ptr[14];
    const int64_t *stage = ptr[6], *sink_row = ptr[11];
    const Pair a = {.q = (const float *)ptr[0] + h * st[0] + b * st[1], .bias = bias ? bias + b * st[25] : NULL,
                    .rot = ptr[2],
                    .segs = (const int64_t *)ptr[1], .nseg = meta[12 + 27], .h = h,
                    .ids = (const int64_t *)ptr[5] + b * n, .out = (float *)ptr[15] + hb * R * D,
                    .seg = {{rest ? (const float *)ptr[7] + h * st[11] + stage[b] * st[12] : NULL,
                             rest ? (const float *)ptr[8] + h * st[13] + stage[b] * st[14] : NULL, rest, st[12], st[14]},
                            {qn ? (const float *)ptr[9] + b * st[15] + h * st[16] : NULL,
                             qn ? (const float *)ptr[10] + b * st[18] + h * st[19] : NULL, qn, st[17], st[20]},
                            {sink ? (const float *)ptr[12] + h * st[21] + sink_row[b] * st[22] : NULL,
                             sink ? (const float *)ptr[13] + h * st[23] + sink_row[b] * st[24] : NULL, sink, st[22],
                             st[24]}},
                    .q_sr = st[2], .kc_sn = st[4], .ks_sn = st[6], .vc_sn = st[8], .vs_sn = st[10], .bi_sr = st[26],
                    .R = R, .n = n, .bs = meta[7], .sink = sink, .kfmt = (int)meta[5], .vfmt = (int)meta[6]};
    return dispatch(&a, D);
}

/* The same read, its encoded blocks found through each row's block ids and its full-precision tokens where they
 * lie (the row's staged partial block, the step's tokens, the row's sink stage): nothing gathered beforehand.
 * ptr: q [H, B, R, D], segs [nseg, SEG_WIDTH] int64 (the layer's pool: where its segments' key codes and scales
 *      and value codes and scales lie, `[H, blocks, size]` each), rot [D, D] (or NULL; contiguous: the matrix
 *      rotated keys' codes were turned by, q then in the model's basis: see `Pair`), two unused, ids [B, n] int64 (contiguous), stage [B] int64
 *      (each row's staged partial block: its first slot), staged
 *      keys and values ([H, slots, D]), the step's keys and values ([B, H, qn, D]), sink [B] int64 (each row's
 *      first sink slot read), sink keys and values ([H, slots, D]), bias (or NULL), out [H, B, R, D].
 * meta: H, B, R, D, n, kfmt, vfmt (`Format`s), bs, sink (sink tokens read), nthreads, rest (staged tokens per
 *       row), qn, then the strides of q (3 dims), of the four pool arrays (heads: unused, blocks), of the staged
 *       keys and values (heads, slots), of the step's keys and values (3 dims), of the sink keys and values (heads,
 *       slots), of the bias (dims 1..2), then nseg.
 * Returns 0, or 1 for unsupported sizes / no memory. */
int hf_pagedkv_code_table_read(void **ptr, const int64_t *meta) {
    const int64_t H = meta[0], B = meta[1], R = meta[2], D = meta[3], bs = meta[7];
    const int kfmt = (int)meta[5], vfmt = (int)meta[6], nthreads = (int)meta[9];
    if (D > MAX_DIM || D % LANES || R > 64 || bs > MAX_BLOCK || bs % 2 || !known_format(kfmt, bs)
        || !known_format(vfmt, bs))
        return 1;
    return for_each_pair(read_table_one, ptr, meta, H * B, nthreads);
}

/* ---- full-precision pools ------------------------------------------------------------------------------------ */

/* a full-precision pool's storage segment (`SegmentedTensor` of slots): its first block id, then the address of
 * element 0 of its keys and their head stride, of its values and theirs (elements; a slot is D floats) */
#define FP_SEG_WIDTH 5
/* blocks fetched ahead of the one read: 1 and 2 measured alike, 0 and 4+ slower (a 2,048-token read from memory, not
 * cache, on a Xeon: 347 / 348 against 370 / 386+ us) */
#define AHEAD 1

/* the keys (`half_` 0) or values (1) of block `id` of head `h`: bs rows of D floats */
static inline const float *fp_block(const int64_t *segs, int64_t nseg, int64_t id, int half_, int64_t h,
                                    int64_t bs, int64_t D) {
    int64_t s = nseg - 1;
    while (s > 0 && segs[s * FP_SEG_WIDTH] > id) s--;
    const int64_t *e = segs + s * FP_SEG_WIDTH + 1 + 2 * half_;
    return (const float *)(intptr_t)e[0] + h * e[1] + (id - segs[s * FP_SEG_WIDTH]) * bs * D;
}

static inline void prefetch_block(const float *p, int64_t floats) { /* into the caches, ahead of its read */
    for (int64_t i = 0; i < floats; i += 64 / sizeof(float)) __builtin_prefetch(p + i, 0, 3);
}

/* one (key/value head, row) pair of a full-precision read: `nb` blocks `ids`, columns from token `skip` of the
 * first block, `width` in all */
typedef struct {
    const float *q, *bias;
    const int64_t *ids, *segs;
    float *out;
    int64_t q_sr, bi_sr, R, nb, bs, skip, width, nseg, h;
} FpPair;

static inline __attribute__((always_inline)) int read_fp_pair(const FpPair *a, const int64_t D) {
    const int64_t R = a->R, nb = a->nb, bs = a->bs, skip = a->skip, width = a->width, C = D / LANES;
    float *scores = malloc(sizeof(float) * R * width);
    if (!scores) return 1;
    float l[64];
    vf qv[MAX_DIM / LANES];
    /* scores, block by block: the next block's keys fetched while this one is scored */
    for (int64_t j = 0; j < nb; j++) {
        const float *kb = fp_block(a->segs, a->nseg, a->ids[j], 0, a->h, bs, D);
        if (j + AHEAD < nb) prefetch_block(fp_block(a->segs, a->nseg, a->ids[j + AHEAD], 0, a->h, bs, D), bs * D);
        const int64_t t0 = j ? 0 : skip, t1 = skip + width - j * bs < bs ? skip + width - j * bs : bs;
        for (int64_t r = 0; r < R; r++) {
            const float *qr = a->q + r * a->q_sr;
            for (int64_t c = 0; c < C; c++) qv[c] = loadv(qr + c * LANES);
            /* (column of token t of the block: scores + r * width + j * bs - skip + t) */
            score_rows(qv, kb + t0 * D, t1 - t0, D, 0.0f, scores + r * width + j * bs - skip + t0);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *sr = scores + r * width;
        if (a->bias) {
            const float *br = a->bias + r * a->bi_sr;
            for (int64_t c = 0; c < width; c++) sr[c] += br[c];
        }
        l[r] = softmax_row(sr, width);
        memset(a->out + r * D, 0, sizeof(float) * D);
    }
    /* values: each block's sum in registers, added to the output once */
    for (int64_t j = 0; j < nb; j++) {
        const float *vb = fp_block(a->segs, a->nseg, a->ids[j], 1, a->h, bs, D);
        if (j + AHEAD < nb) prefetch_block(fp_block(a->segs, a->nseg, a->ids[j + AHEAD], 1, a->h, bs, D), bs * D);
        const int64_t t0 = j ? 0 : skip, t1 = skip + width - j * bs < bs ? skip + width - j * bs : bs;
        for (int64_t r = 0; r < R; r++) {
            const float *p = scores + r * width + j * bs - skip;
            int any = 0;
            for (int64_t t = t0; t < t1; t++) any |= p[t] != 0.0f;
            if (!any) continue; /* (a peaked softmax: most blocks of most rows) */
            vf acc[MAX_DIM / LANES];
            for (int64_t c = 0; c < C; c++) acc[c] = (vf){0};
            for (int64_t t = t0; t < t1; t++) {
                const float w = p[t], *v = vb + t * D;
                for (int64_t c = 0; c < C; c++) acc[c] += w * loadv(v + c * LANES);
            }
            float *o = a->out + r * D;
            for (int64_t c = 0; c < C; c++) storev(o + c * LANES, loadv(o + c * LANES) + acc[c]);
        }
    }
    for (int64_t r = 0; r < R; r++) row_output(a->out + r * D, l[r], D);
    free(scores);
    return 0;
}

static int read_fp_pair_64(const FpPair *a) { return read_fp_pair(a, 64); }
static int read_fp_pair_128(const FpPair *a) { return read_fp_pair(a, 128); }
static int read_fp_pair_any(const FpPair *a, int64_t D) { return read_fp_pair(a, D); }

static int read_fp_one(void **ptr, const int64_t *meta, int64_t hb) {
    const int64_t B = meta[1], R = meta[2], D = meta[3], nb = meta[4], *st = meta + 9;
    const int64_t h = hb / B, b = hb % B;
    const float *bias = ptr[3];
    const FpPair a = {.q = (const float *)ptr[0] + h * st[0] + b * st[1], .bias = bias ? bias + b * st[3] : NULL,
                      .segs = (const int64_t *)ptr[1], .ids = (const int64_t *)ptr[2] + b * nb,
                      .out = (float *)ptr[4] + hb * R * D, .q_sr = st[2], .bi_sr = st[4], .R = R, .nb = nb,
                      .bs = meta[5], .skip = meta[6], .width = meta[7], .nseg = meta[14], .h = h};
    return D == 64 ? read_fp_pair_64(&a) : D == 128 ? read_fp_pair_128(&a) : read_fp_pair_any(&a, D);
}

/* Attention of the query rows over full-precision (fp32) K/V read through the block table, in place: per (key/value
 * head, row) pair the scores of its blocks, one softmax, the values' sum; nothing gathered.
 * ptr: q [H, B, R, D], segs [nseg, FP_SEG_WIDTH] int64 (the layer's pool), ids [B, nb] int64 (contiguous; each row's
 *      blocks, in token order), bias [B, R | 1, width] (or NULL), out [H, B, R, D] (contiguous).
 * meta: H, B, R, D, nb, bs, skip (tokens of the first block before column 0), width (columns), nthreads, the strides
 *       of q (3 dims), of the bias (dims 1..2), then nseg.
 * Returns 0, or 1 for unsupported sizes / no memory. */
int hf_pagedkv_fp_table_read(void **ptr, const int64_t *meta) {
    const int64_t H = meta[0], B = meta[1], R = meta[2], D = meta[3], nb = meta[4], bs = meta[5], skip = meta[6];
    const int64_t width = meta[7];
    const int nthreads = (int)meta[8];
    if (D > MAX_DIM || D % LANES || R > 64 || skip < 0 || skip >= bs || width < 1 || nb * bs < skip + width
        || (nb - 1) * bs >= skip + width)
        return 1;
    return for_each_pair(read_fp_one, ptr, meta, H * B, nthreads);
}
