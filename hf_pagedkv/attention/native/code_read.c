/* The quantized decode read of "hf_pagedkv" (`fused_code_read`'s contract) as one C function: attention of a few
 * query rows over int8/int4 codes and fp16 scales read where they lie, one block of codes decoded at a time into a
 * small fp32 tile, one softmax over the read. Built at first use by `hf_pagedkv.attention.native_read` (the
 * machine's C compiler, cached per CPU), called through ctypes: no Python or torch headers.
 *
 * Layouts (strides in elements; the last dimension of every array is contiguous):
 *   q      [H, B, R, D] float32: the scaled query rows of each key/value head
 *   kc, vc [H, B, n, code] uint8: keys per channel, values per token (one group per head); int8 codes are the
 *          two's complement bytes; int4 codes hold token t (bits 0-3) and t + bs/2 (bits 4-7) of byte (t, d)
 *   ks, vs [H, B, n, scale] fp16: int8 [scale per channel | per token], int4 [scales | minimums]
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

#define NEGLIGIBLE (-64.0f * 0.6931471805599453f)
#define MAX_DIM 256
#define MAX_BLOCK 256

typedef _Float16 half;
/* 16 floats (gcc's vector extension: AVX-512, two AVX2 or four SSE/NEON registers); loads need no alignment */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define LANES 16

typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

/* exp(x) for x in [NEGLIGIBLE, 0], 16 at a time: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-7 expf
 * polynomial (Moshier, Cephes Math Library; about 1 ulp), times 2**n built in the exponent bits (n >= -64: no
 * denormals). Scalar expf on every probability was a third of the read. */
static inline v16 exp16(v16 x) {
    v16 fx = x * 1.44269504088896341f + 0.5f;
    v16i n = __builtin_convertvector(fx, v16i); /* toward zero, then down to the floor */
    v16 fn = __builtin_convertvector(n, v16);
    v16i above = fn > fx;
    n += above; /* true is -1 */
    fn = __builtin_convertvector(n, v16);
    v16 r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    v16 y = r * 0.0f + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    v16i bits = (n + 127) << 23;
    return y * (v16)bits;
}

typedef _Float16 v16h __attribute__((vector_size(32), aligned(2)));

static inline float hsum(v16 v) { /* four halving steps */
    v += __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16 load16h(const half *p) {
    v16h v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, v16);
}

/* one block of codes -> bs x D integer values in fp32 (int8: signed; int4: 0..15) */
static void decode_block(const uint8_t *c, int bits, int64_t bs, int64_t D, float *tile) {
    if (bits == 8) {
        for (int64_t i = 0; i < bs * D; i++) tile[i] = (float)(int8_t)c[i];
        return;
    }
    const int64_t half_bs = bs / 2;
    for (int64_t i = 0; i < half_bs * D; i++) {
        tile[i] = (float)(c[i] & 15);
        tile[half_bs * D + i] = (float)(c[i] >> 4);
    }
}

/* one (key/value head, row) pair's read: pointers at its first element, strides along its last dims */
typedef struct {
    const float *q, *fk, *fv, *bias;
    const uint8_t *kc, *vc;
    const half *ks, *vs;
    float *out;
    int64_t q_sr, kc_sn, ks_sn, vc_sn, vs_sn, fk_sm, fv_sm, bi_sr, R, n, m, bs, sink;
    int kbits, vbits;
} Pair;

/* the read of one pair, every query row of it; `D` a constant where the callers below specialise it */
static inline __attribute__((always_inline)) int read_pair(const Pair *a, const int64_t D) {
    const float *q = a->q, *fk = a->fk, *fv = a->fv, *bias = a->bias;
    const uint8_t *kc = a->kc, *vc = a->vc;
    const half *ks = a->ks, *vs = a->vs;
    float *out = a->out;
    const int64_t q_sr = a->q_sr, kc_sn = a->kc_sn, ks_sn = a->ks_sn, vc_sn = a->vc_sn, vs_sn = a->vs_sn;
    const int64_t fk_sm = a->fk_sm, fv_sm = a->fv_sm, bi_sr = a->bi_sr, R = a->R, n = a->n, m = a->m, bs = a->bs;
    const int64_t sink = a->sink;
    const int kbits = a->kbits, vbits = a->vbits;
    const int64_t T = n * bs, W = T + m, width = W - sink;
    float *scores = malloc(sizeof(float) * R * W);
    float *tile = malloc(sizeof(float) * bs * D);
    if (!scores || !tile) {
        free(scores);
        free(tile);
        return 1;
    }
    const int64_t C = D / LANES; /* vectors per head_dim row */
    v16 qs[MAX_DIM / LANES];
    float l[64];
    /* scores of the encoded blocks: q . (s_d c + z_d) = (q * s) . c + q . z */
    for (int64_t j = 0; j < n; j++) {
        decode_block(kc + j * kc_sn, kbits, bs, D, tile);
        const half *s = ks + j * ks_sn, *z = kbits == 4 ? s + D : NULL;
        for (int64_t r = 0; r < R; r++) {
            const float *qr = q + r * q_sr;
            v16 zq16 = (v16){0};
            for (int64_t c = 0; c < C; c++) {
                const v16 qc = load16(qr + c * LANES);
                qs[c] = qc * load16h(s + c * LANES);
                if (z) zq16 += qc * load16h(z + c * LANES);
            }
            const float zq = z ? hsum(zq16) : 0.0f;
            float *sr = scores + r * W + j * bs;
            for (int64_t t = 0; t < bs; t++) {
                const v16 *kt = (const v16 *)(tile + t * D);
                v16 acc = qs[0] * kt[0];
                for (int64_t c = 1; c < C; c++) acc += qs[c] * kt[c];
                sr[t] = hsum(acc) + zq;
            }
        }
    }
    /* full-precision columns, the sink's -inf, the mask, the softmax */
    for (int64_t r = 0; r < R; r++) {
        const float *qr = q + r * q_sr;
        float *sr = scores + r * W;
        for (int64_t c = 0; c < m; c++) {
            const float *k = fk + c * fk_sm;
            float acc = 0.0f;

            for (int64_t d = 0; d < D; d++) acc += qr[d] * k[d];
            sr[T + c] = acc;
        }
        for (int64_t c = 0; c < sink && c < W; c++) sr[c] = -INFINITY;
        if (bias) {
            const float *br = bias + r * bi_sr;
            for (int64_t c = 0; c < width; c++) sr[c] += br[c];
            for (int64_t c = 0; c < sink; c++) sr[width + c] += br[c];
        }
        float mx = -INFINITY;
        for (int64_t c = 0; c < W; c++) mx = sr[c] > mx ? sr[c] : mx;
        float sum = 0.0f;
        int64_t c0 = 0;
        if (isfinite(mx)) { /* else (a row masked everywhere) NaN from expf below, as the torch read */
            v16 vsum = (v16){0};
            for (; c0 + LANES <= W; c0 += LANES) {
                v16 dlt;
                memcpy(&dlt, sr + c0, sizeof dlt);
                dlt -= mx;
                const v16i keep = dlt >= NEGLIGIBLE; /* the others: exp16(0), then 0 */
                const v16 p = (v16)(keep & (v16i)exp16((v16)(keep & (v16i)dlt)));
                memcpy(sr + c0, &p, sizeof p);
                vsum += p;
            }
            sum = hsum(vsum);
        }
        for (int64_t c = c0; c < W; c++) {
            const float dlt = sr[c] - mx;
            sr[c] = dlt < NEGLIGIBLE ? 0.0f : expf(dlt);
            sum += sr[c];
        }
        l[r] = sum;
        float *o = out + r * D;
        memset(o, 0, sizeof(float) * D);
        for (int64_t c = 0; c < m; c++) {
            const float p = sr[T + c], *v = fv + c * fv_sm;
            if (p == 0.0f) continue;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
    /* values of the encoded blocks: sum_t p_t (s_t c_t + z_t) */
    for (int64_t j = 0; j < n; j++) {
        const half *s = vs + j * vs_sn, *z = vbits == 4 ? s + bs : NULL;
        int any = 0;
        for (int64_t r = 0; r < R && !any; r++)
            for (int64_t t = 0; t < bs; t++) any |= scores[r * W + j * bs + t] != 0.0f;
        if (!any) continue;
        decode_block(vc + j * vc_sn, vbits, bs, D, tile);
        for (int64_t r = 0; r < R; r++) {
            const float *p = scores + r * W + j * bs;
            float pz = 0.0f;
            v16 acc[MAX_DIM / LANES]; /* the block's sum, in registers; added to the output once */
            for (int64_t c = 0; c < C; c++) acc[c] = (v16){0};
            for (int64_t t = 0; t < bs; t++) {
                const float w = p[t] * (float)s[t];
                const v16 *vt = (const v16 *)(tile + t * D);
                if (z) pz += p[t] * (float)z[t];
                for (int64_t c = 0; c < C; c++) acc[c] += w * vt[c];
            }
            v16 *o = (v16 *)(out + r * D);
            for (int64_t c = 0; c < C; c++) o[c] += acc[c] + pz;
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) out[r * D + d] /= l[r];
    free(scores);
    free(tile);
    return 0;
}

static int read_pair_64(const Pair *a) { return read_pair(a, 64); }
static int read_pair_128(const Pair *a) { return read_pair(a, 128); }
static int read_pair_any(const Pair *a, int64_t D) { return read_pair(a, D); }

/* pair `hb` (= h * B + b) of the call's arrays (see below) */
static int read_one(void **ptr, const int64_t *meta, int64_t hb) {
    const int64_t B = meta[1], R = meta[2], D = meta[3], *st = meta + 11;
    const int64_t h = hb / B, b = hb % B;
    const float *bias = ptr[7];
    const Pair a = {(const float *)ptr[0] + h * st[0] + b * st[1], (const float *)ptr[5] + h * st[15] + b * st[16],
                    (const float *)ptr[6] + h * st[18] + b * st[19], bias ? bias + b * st[21] : NULL,
                    (const uint8_t *)ptr[1] + h * st[3] + b * st[4], (const uint8_t *)ptr[3] + h * st[9] + b * st[10],
                    (const half *)ptr[2] + h * st[6] + b * st[7], (const half *)ptr[4] + h * st[12] + b * st[13],
                    (float *)ptr[8] + hb * R * D, st[2], st[5], st[8], st[11], st[14], st[17], st[20], st[22], R,
                    meta[4], meta[5], meta[8], meta[9], (int)meta[6], (int)meta[7]};
    return D == 64 ? read_pair_64(&a) : D == 128 ? read_pair_128(&a) : read_pair_any(&a, D);
}

/* ptr: q, kc, ks, vc, vs, fk, fv, bias (or NULL), out.
 * meta: H, B, R, D, n, m, kbits, vbits, bs, sink, nthreads, then the strides of dims 0..2 of q, kc, ks, vc, vs,
 * fk, fv and of the bias's dims 1..2 (h stride: none, it is shared by every head).
 * Returns 0, or 1 for unsupported sizes / no memory (nothing written that the caller keeps). */
int hf_pagedkv_code_read(void **ptr, const int64_t *meta) {
    const int64_t H = meta[0], B = meta[1], R = meta[2], D = meta[3], bs = meta[8];
    const int kbits = (int)meta[6], vbits = (int)meta[7], nthreads = (int)meta[10];
    if (D > MAX_DIM || D % LANES || R > 64 || bs > MAX_BLOCK || bs % 2 || (kbits != 8 && kbits != 4)
        || (vbits != 8 && vbits != 4))
        return 1;
    int failed = 0;
    if (nthreads > 1 && H * B > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : failed)
        for (int64_t hb = 0; hb < H * B; hb++) failed |= read_one(ptr, meta, hb);
    } else { /* one thread: no OpenMP region at all */
        for (int64_t hb = 0; hb < H * B; hb++) failed |= read_one(ptr, meta, hb);
    }
    return failed;
}
