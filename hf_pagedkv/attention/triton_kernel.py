"""The Triton kernel of `TritonCodeAttention` (`triton_read.py`), a plain function: `triton.jit` or Triton's
interpreter wraps it. Imports Triton: imported on first use only."""

import triton.language as tl


def code_table_read(q, q_sh, q_sb, q_sr, ids, n, segs, nseg, kc, ks, vc, vs, kc_sn, ks_sn, vc_sn, vs_sn,
                    stk, stv, stk_sh, stk_ss, stv_sh, stv_ss, stage, rest,
                    nk, nv, nk_sb, nk_sh, nk_st, nv_sb, nv_sh, nv_st, qn,
                    sk, sv, sk_sh, sk_ss, sv_sh, sv_ss, sink_slot, sink,
                    bias, b_sb, b_sr, width, out, B, R,
                    D: tl.constexpr, BS: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr, NEGLIGIBLE: tl.constexpr):
    # one program per (key/value head h, batch row b); an online softmax over the row's encoded blocks, then
    # over its full-precision parts (Milakov & Gimelshein 2018; Dao et al. 2023, flash-decoding)
    pid = tl.program_id(0)
    h = pid // B
    b = pid % B
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    rmask = r < R
    qt = tl.load(q + h * q_sh + b * q_sb + r[:, None] * q_sr + d[None, :], mask=rmask[:, None],
                 other=0.0).to(tl.float32)  # [BLOCK_R, D]
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    HALF = BS // 2
    nib = (t // HALF) * 4  # int4: token t lies in byte row t % HALF, bits nib .. nib + 3
    for j in range(0, n):
        bid = tl.load(ids + b * n + j)
        s = bid * 0  # the pool segment holding block `bid` (segs: one row of 9 per segment, see triton_read.py)
        for i in range(1, nseg):
            s = tl.where(bid >= tl.load(segs + i * 9), i, s)
        row = segs + s * 9
        local = bid - tl.load(row)
        kc_at = tl.load(row + 1) + h * tl.load(row + 2) + local * kc_sn
        ks_at = tl.load(row + 3) + h * tl.load(row + 4) + local * ks_sn
        vc_at = tl.load(row + 5) + h * tl.load(row + 6) + local * vc_sn
        vs_at = tl.load(row + 7) + h * tl.load(row + 8) + local * vs_sn
        # keys [BS, D]: per channel, k = s_d c + z_d (int4) or s_d c (int8)
        ksc = tl.load(ks + ks_at + d).to(tl.float32)
        if KBITS == 8:
            c = tl.load(kc + kc_at + t[:, None] * D + d[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
            k = c * ksc[None, :]
        else:
            byte = tl.load(kc + kc_at + (t % HALF)[:, None] * D + d[None, :]).to(tl.int32)
            c = ((byte >> nib[:, None]) & 15).to(tl.float32)
            k = c * ksc[None, :] + tl.load(ks + ks_at + D + d).to(tl.float32)[None, :]
        sc = tl.dot(qt, tl.trans(k), input_precision="ieee")  # [BLOCK_R, BS]
        col = j * BS + t
        sc = tl.where(col[None, :] < sink, float("-inf"), sc)  # sink columns: read in full precision below
        if HAS_BIAS:
            sc += tl.load(bias + b * b_sb + r[:, None] * b_sr + col[None, :], mask=rmask[:, None],
                          other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: no NaN from -inf - -inf
        dlt = sc - m_safe[:, None]
        p = tl.where(dlt < NEGLIGIBLE, 0.0, tl.exp(dlt))
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # values [BS, D]: per token, v = s_t c + z_t (int4) or s_t c (int8): sum_t p_t s_t c_t + sum_t p_t z_t
        vsc = tl.load(vs + vs_at + t).to(tl.float32)
        if VBITS == 8:
            c = tl.load(vc + vc_at + t[:, None] * D + d[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p * vsc[None, :], c, input_precision="ieee")
        else:
            byte = tl.load(vc + vc_at + (t % HALF)[:, None] * D + d[None, :]).to(tl.int32)
            c = ((byte >> nib[:, None]) & 15).to(tl.float32)
            pz = tl.sum(p * tl.load(vs + vs_at + BS + t).to(tl.float32)[None, :], 1)
            acc = acc * alpha[:, None] + tl.dot(p * vsc[None, :], c, input_precision="ieee") + pz[:, None]
        m_i = m_new
    # the full-precision parts: the staged partial block, the step's tokens, the sink tokens
    u = tl.arange(0, BLOCK_T)
    T = n * BS
    for part in tl.static_range(3):
        if part == 0:
            cnt = rest
            first = tl.load(stage + b)
            kp = stk + h * stk_sh + (first + u)[:, None] * stk_ss + d[None, :]
            vp = stv + h * stv_sh + (first + u)[:, None] * stv_ss + d[None, :]
            col = T + u
        elif part == 1:
            cnt = qn
            kp = nk + b * nk_sb + h * nk_sh + u[:, None] * nk_st + d[None, :]
            vp = nv + b * nv_sb + h * nv_sh + u[:, None] * nv_st + d[None, :]
            col = T + rest + u
        else:
            cnt = sink
            first = tl.load(sink_slot + b)
            kp = sk + h * sk_sh + (first + u)[:, None] * sk_ss + d[None, :]
            vp = sv + h * sv_sh + (first + u)[:, None] * sv_ss + d[None, :]
            col = u  # a sink token's mask column is its position
        if cnt > 0:
            umask = u < cnt
            k = tl.load(kp, mask=umask[:, None], other=0.0).to(tl.float32)  # [BLOCK_T, D]
            sc = tl.dot(qt, tl.trans(k), input_precision="ieee")  # [BLOCK_R, BLOCK_T]
            sc = tl.where(umask[None, :], sc, float("-inf"))
            if HAS_BIAS:
                sc += tl.load(bias + b * b_sb + r[:, None] * b_sr + col[None, :],
                              mask=rmask[:, None] & umask[None, :], other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            dlt = sc - m_safe[:, None]
            p = tl.where(dlt < NEGLIGIBLE, 0.0, tl.exp(dlt))
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vp, mask=umask[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row masked everywhere: its acc is 0, so 0, as `sdpa`
    tl.store(out + ((h * B + b) * R + r[:, None]) * D + d[None, :], o, mask=rmask[:, None])
