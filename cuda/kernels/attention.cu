// attention.cu: attention over a KV cache in device memory, for decode and
// prefill alike (each query row carries its own position, so a prefill batch
// is causal by construction), and the query absorption of MLA.
//
// One kernel serves grouped-query attention and DeepSeek's multi-head latent
// attention in absorbed form. A key is [A | B]: for GQA, A is the head's key
// and B is empty; for MLA, A is the cached latent (rank r, shared by all
// heads) and B the shared rotary key, and the value is the latent itself.
// score(t) = (dot(qA, A_t) + dot(qB, B_t)) * scale.
//
// Softmax runs online over fixed chunks of AT_CHUNK positions aligned to
// absolute position 0 (the first one may be cut by the sliding window): per
// chunk the scores, their max, exp(s − max), their sum and Σ e·v are formed,
// then merged into the running (max, sum, output) in ascending chunk order.
// Everything about one (row, head) is fixed by its position, window and the
// cache contents, never by the batch or the launch.
//
// Launch: block = AT_THREADS (16 warps), grid = (heads, rows). Warps take
// the keys of a chunk round-robin, AT_KEYS at a time (lanes over dims). For
// Σ e·v the threads form KG = AT_THREADS / dvp groups of dvp (dv rounded up
// to 128) threads, thread d of a group owning output dim d: group g sums
// the g-th of KG contiguous slices of the chunk's positions in position
// order, and the group sums are added in group order.
//
// `attention_split` (flash-decoding, for passes of few rows): grid =
// (heads, rows, S); block z forms chunks z, z + S, ... of its (row, head)
// exactly as above and stores each chunk's (max, sum, Σ e·v); the block that
// arrives last (a counter per (row, head), reset by that block) merges all
// chunks in ascending order with the same recurrence as `attention`. So
// both kernels give the same bits for every row; a row of one chunk is
// merged in place by its single block.
#include "common.cuh"

#define AT_THREADS 512
#define AT_WARPS (AT_THREADS / 32)
#define AT_CHUNK 256
#define AT_MAX_DQ 640
#define AT_MAX_DV 512
// How many loads a warp keeps in flight changes no bit, only registers
// and occupancy: `attention` (prefill: many blocks per SM) scores 4 keys
// a dim at a time and loads 8 values ahead; `attention_split` (decode: a
// few blocks, each worth its latency) 4 keys 4 dims at a time and 16
// values ahead (~100 registers: one block per SM).
#define AT_KEYS 4

struct AtArgs {
    const float* __restrict__ kA;
    u32 kA_tstride, kA_hstride;
    const float* __restrict__ kB;
    u32 kB_tstride, kB_hstride;
    const float* __restrict__ v;
    u32 v_tstride, v_hstride;
    u32 dA, dB, dv;
    float scale;
};

// One key batch's partial dot products over one key part, lanes over dims,
// DIMS dims of each key loaded before they are used, the FMAs in the order
// of increasing dim (that of a plain loop over i = lane, lane + 32, …).
template <int DIMS>
__device__ __forceinline__ void at_dots(const float* __restrict__ qs, const float* __restrict__ kp,
                                        u32 tstride, u32 dim, u32 lane, u32 nkeys,
                                        float (&acc)[AT_KEYS]) {
    for (u32 i0 = 0; i0 < dim; i0 += 32 * DIMS) {
        float kv[DIMS][AT_KEYS];
#pragma unroll
        for (int u = 0; u < DIMS; ++u) {
            const u32 i = i0 + 32 * u + lane;
#pragma unroll
            for (int j = 0; j < AT_KEYS; ++j)
                kv[u][j] = (i < dim && (u32)j < nkeys) ? kp[(u64)j * tstride + i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < DIMS; ++u) {
            const u32 i = i0 + 32 * u + lane;
            if (i < dim) {
                const float qv = qs[i];
#pragma unroll
                for (int j = 0; j < AT_KEYS; ++j)
                    if ((u32)j < nkeys) acc[j] = fmaf(qv, kv[u][j], acc[j]);
            }
        }
    }
}

// Asks L2 for the keys and values of positions [cstart, cend) (128-byte
// lines; a hint, read later exactly as without it): the key rounds and the
// value rounds of at_chunk then wait on L2 rather than on device memory,
// one after the other.
__device__ __forceinline__ void at_l2_ahead(const AtArgs& a, u64 s0, u32 kvh, u32 cstart,
                                            u32 cend) {
    const u32 len = cend - cstart;
    const u32 lk = (a.dA + 31) / 32, lv = (a.dv + 31) / 32;
    for (u32 i = threadIdx.x; i < len * (lk + lv); i += AT_THREADS) {
        const u32 t = i / (lk + lv), l = i % (lk + lv);
        const float* p =
            l < lk ? a.kA + (s0 + cstart + t) * a.kA_tstride + (u64)kvh * a.kA_hstride + 32 * l
                   : a.v + (s0 + cstart + t) * a.v_tstride + (u64)kvh * a.v_hstride +
                         32 * (l - lk);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
}

// One chunk [cstart, cend) of one (row, head), slots from s0, KV head kvh:
// its score max `mc`, Σ exp(s − mc) `lc`, and in the threads that own an
// output dim of group 0, Σ e·v of that dim `oc`. Ends with a barrier (sc
// and vpart free again).
template <int DIMS, int VUNROLL, bool L2AHEAD>
__device__ __forceinline__ void at_chunk(const AtArgs& a, const float* __restrict__ qs, u64 s0,
                                         u32 kvh, u32 cstart, u32 cend, float* sc,
                                         float* scratch, float* vpart, float& mc, float& lc,
                                         float& oc) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 len = cend - cstart;
    if (L2AHEAD) at_l2_ahead(a, s0, kvh, cstart, cend);
    // Each warp scores AT_KEYS keys at a time (their loads in flight
    // together); every key's dot product is formed exactly as alone.
    for (u32 t0 = cstart + warp * AT_KEYS; t0 < cend; t0 += AT_WARPS * AT_KEYS) {
        const u32 nkeys = min((u32)AT_KEYS, cend - t0);
        float sa[AT_KEYS], sb[AT_KEYS];
#pragma unroll
        for (int j = 0; j < AT_KEYS; ++j) {
            sa[j] = 0.0f;
            sb[j] = 0.0f;
        }
        at_dots<DIMS>(qs, a.kA + (s0 + t0) * a.kA_tstride + (u64)kvh * a.kA_hstride, a.kA_tstride,
                a.dA, lane, nkeys, sa);
        if (a.dB != 0)
            at_dots<DIMS>(qs + a.dA, a.kB + (s0 + t0) * a.kB_tstride + (u64)kvh * a.kB_hstride,
                    a.kB_tstride, a.dB, lane, nkeys, sb);
#pragma unroll
        for (int j = 0; j < AT_KEYS; ++j) {
            if ((u32)j < nkeys) {
                float s = warp_sum(sa[j]);
                if (a.dB != 0) s = __fadd_rn(s, warp_sum(sb[j]));
                if (lane == 0) sc[t0 + j - cstart] = __fmul_rn(s, a.scale);
            }
        }
    }
    __syncthreads();
    float mx = -f32_inf();
    for (u32 i = threadIdx.x; i < len; i += AT_THREADS) mx = fmaxf(mx, sc[i]);
    mc = block_max<AT_WARPS>(mx, scratch);
    float part = 0.0f;
    for (u32 i = threadIdx.x; i < len; i += AT_THREADS) {
        const float e = expf(__fsub_rn(sc[i], mc));
        sc[i] = e;
        part = __fadd_rn(part, e);
    }
    // block_sum's barriers also publish the exps written above.
    lc = block_sum<AT_WARPS>(part, scratch);
    const u32 dvp = (a.dv + 127) / 128 * 128;
    const u32 groups = AT_THREADS / dvp;
    const u32 kg = threadIdx.x / dvp, d = threadIdx.x % dvp;
    const bool owns = kg < groups && d < a.dv;
    const float* vb = a.v + (s0 + cstart) * a.v_tstride + (u64)kvh * a.v_hstride;
    // Group kg's slice of the chunk, in position order, VUNROLL values
    // loaded ahead of use.
    oc = 0.0f;
    if (owns) {
        const u32 per = (len + groups - 1) / groups;
        const u32 t1 = min(len, (kg + 1) * per);
        u32 t = min(len, kg * per);
        for (; t + VUNROLL <= t1; t += VUNROLL) {
            float vv[VUNROLL];
#pragma unroll
            for (int u = 0; u < VUNROLL; ++u) vv[u] = vb[(u64)(t + u) * a.v_tstride + d];
#pragma unroll
            for (int u = 0; u < VUNROLL; ++u) oc = fmaf(sc[t + u], vv[u], oc);
        }
        for (; t < t1; ++t) oc = fmaf(sc[t], vb[(u64)t * a.v_tstride + d], oc);
        if (kg > 0) vpart[threadIdx.x] = oc;
    }
    __syncthreads();
    // The group sums in group order.
    if (owns && kg == 0)
        for (u32 g = 1; g < groups; ++g) oc = __fadd_rn(oc, vpart[g * dvp + d]);
    __syncthreads();
}

// The online softmax's merge of one chunk into the running (m, l, o).
__device__ __forceinline__ void at_merge(float mc, float lc, float oc, float& m, float& l,
                                         float& o) {
    const float mn = fmaxf(m, mc);
    const float a_old = expf(__fsub_rn(m, mn)), a_new = expf(__fsub_rn(mc, mn));
    o = __fadd_rn(__fmul_rn(o, a_old), __fmul_rn(oc, a_new));
    l = __fadd_rn(__fmul_rn(l, a_old), __fmul_rn(lc, a_new));
    m = mn;
}

#define AT_PARAMS                                                                              \
    const float *__restrict__ q, u32 nh, u32 dA, u32 dB, const float *__restrict__ kA,         \
        u32 kA_tstride, u32 kA_hstride, const float *__restrict__ kB, u32 kB_tstride,          \
        u32 kB_hstride, const float *__restrict__ v, u32 v_tstride, u32 v_hstride, u32 dv,     \
        u32 group, const u32 *__restrict__ pos, const u32 *__restrict__ slot0, u32 capacity,   \
        u32 window, float scale, float *__restrict__ out

#define AT_ARGS_INIT                                                                           \
    const AtArgs args = {kA, kA_tstride, kA_hstride, kB, kB_tstride, kB_hstride, v,            \
                         v_tstride, v_hstride, dA, dB, dv, scale}

// The block's (row, head): its KV head, position, first slot, the first
// position its window sees, and where its output goes.
#define AT_ROW                                                                                 \
    const u32 head = blockIdx.x, row = blockIdx.y;                                             \
    const u32 kvh = head / group;                                                              \
    const u32 p = pos[row];                                                                    \
    const u64 s0 = slot0[row];                                                                 \
    const u32 first = (window != 0 && p + 1 > window) ? p + 1 - window : 0;                    \
    const u32 dq = dA + dB;                                                                    \
    float* orow = out + ((u64)row * nh + head) * dv

extern "C" __global__ void __launch_bounds__(AT_THREADS) attention(AT_PARAMS) {
    pdl_entry();
    __shared__ float qs[AT_MAX_DQ];
    __shared__ float sc[AT_CHUNK];
    __shared__ float scratch[AT_WARPS];
    __shared__ float vpart[AT_THREADS];
    AT_ARGS_INIT;
    AT_ROW;
    // The host cannot see positions (they live on the device). A row whose
    // keys would lie past the cache is answered with NaN, loudly wrong,
    // instead of reading outside it.
    if (s0 + p >= capacity) {
        for (u32 d = threadIdx.x; d < dv; d += AT_THREADS) orow[d] = __int_as_float(0x7fc00000);
        return;
    }
    const float* qr = q + ((u64)row * nh + head) * dq;
    for (u32 i = threadIdx.x; i < dq; i += AT_THREADS) qs[i] = qr[i];
    __syncthreads();

    const u32 dvp = (dv + 127) / 128 * 128;
    const bool out_dim = threadIdx.x < dvp && threadIdx.x < dv;  // group 0's owners
    float o = 0.0f, m = -f32_inf(), l = 0.0f;
    for (u32 cb = first / AT_CHUNK * AT_CHUNK; cb <= p; cb += AT_CHUNK) {
        float mc, lc, oc;
        at_chunk<1, 8, false>(args, qs, s0, kvh, max(first, cb), min(p + 1, cb + AT_CHUNK), sc, scratch,
                       vpart, mc, lc, oc);
        at_merge(mc, lc, oc, m, l, o);
    }
    if (out_dim) orow[threadIdx.x] = __fdiv_rn(o, l);
}

// This (row, head)'s output value in thread d < dv, stored; with outq
// (dv % 32 == 0, so each warp holds whole blocks or none) also quantized
// into the row's Q8 row (common.cuh): the head's dv values are blocks
// head·dv/32 .. of the row's nh·dv.
__device__ __forceinline__ void at_store_out(float* orow, u8* __restrict__ outq, u32 row, u32 nh,
                                             u32 head, u32 dv, float v) {
    if (threadIdx.x >= dv) return;
    orow[threadIdx.x] = v;
    if (outq != nullptr) {
        const u32 n = nh * dv;
        q8_store_block(v, outq + row * q8_row_bytes(n), n, (head * dv + threadIdx.x) / 32);
    }
}

// Chunk records of `attention_split`: [rows][heads][chunk_cap][2 + dv]
// floats (max, sum, Σ e·v by dim); `counters` [rows][heads], zero between
// launches. outq: when given, the output's rows quantized as well (see
// at_store_out).
extern "C" __global__ void __launch_bounds__(AT_THREADS, 1)
    attention_split(AT_PARAMS, u32 splits, u32 chunk_cap, float* __restrict__ part,
                    u32* __restrict__ counters, u8* __restrict__ outq) {
    __shared__ float qs[AT_MAX_DQ];
    __shared__ float sc[AT_CHUNK];
    __shared__ float scratch[AT_WARPS];
    __shared__ float vpart[AT_THREADS];
    __shared__ u32 ticket;
    AT_ARGS_INIT;
    // Positions and first slots are written before a pass's first launch
    // (the host's upload), never by a launch of the pass: read before the
    // wait, so this block's first chunk is asked of L2 while the launch
    // before it (the step that appends the new key and value) still runs.
    // A prefetch is a hint: the loads below read what is there after the
    // wait, whatever L2 held.
    AT_ROW;
    const u32 z = blockIdx.z;
    const u32 c0 = first / AT_CHUNK, chunks = p / AT_CHUNK - c0 + 1;
    if (s0 + p < capacity && chunks <= chunk_cap && z < chunks) {
        const u32 cb = (c0 + z) * AT_CHUNK;
        at_l2_ahead(args, s0, kvh, max(first, cb), min(p + 1, cb + AT_CHUNK));
    }
    pdl_entry(PDL_REL_ATTENTION);
    // As `attention` (and NaN too where the records would not fit).
    if (s0 + p >= capacity || chunks > chunk_cap) {
        // (dv ≤ AT_THREADS: one value per thread.)
        if (z == 0) at_store_out(orow, outq, row, nh, head, dv, __int_as_float(0x7fc00000));
        return;
    }
    if (z >= chunks) return;
    const float* qr = q + ((u64)row * nh + head) * dq;
    for (u32 i = threadIdx.x; i < dq; i += AT_THREADS) qs[i] = qr[i];
    __syncthreads();

    const u32 dvp = (dv + 127) / 128 * 128;
    const bool out_dim = threadIdx.x < dvp && threadIdx.x < dv;
    const u32 rec = 2 + dv;
    float* base = part + ((u64)row * nh + head) * chunk_cap * rec;
    if (chunks == 1) {
        float mc, lc, oc, o = 0.0f, m = -f32_inf(), l = 0.0f;
        at_chunk<4, 16, true>(args, qs, s0, kvh, first, p + 1, sc, scratch, vpart, mc, lc, oc);
        at_merge(mc, lc, oc, m, l, o);
        at_store_out(orow, outq, row, nh, head, dv, __fdiv_rn(o, l));
        return;
    }
    for (u32 c = z; c < chunks; c += splits) {
        const u32 cb = (c0 + c) * AT_CHUNK;
        float mc, lc, oc;
        at_chunk<4, 16, true>(args, qs, s0, kvh, max(first, cb), min(p + 1, cb + AT_CHUNK), sc, scratch,
                        vpart, mc, lc, oc);
        float* r = base + (u64)c * rec;
        if (threadIdx.x == 0) {
            r[0] = mc;
            r[1] = lc;
        }
        if (out_dim) r[2 + threadIdx.x] = oc;
    }
    // Publish the records, then count this block in; the last one merges.
    __threadfence();
    __syncthreads();
    u32* counter = counters + (u64)row * nh + head;
    if (threadIdx.x == 0) ticket = atomicAdd(counter, 1u);
    __syncthreads();
    if (ticket != min(splits, chunks) - 1) return;
    __threadfence();
    float o = 0.0f, m = -f32_inf(), l = 0.0f;
    for (u32 c = 0; c < chunks; ++c) {
        const float* r = base + (u64)c * rec;
        const float mc = __ldcg(r), lc = __ldcg(r + 1);
        const float oc = out_dim ? __ldcg(r + 2 + threadIdx.x) : 0.0f;
        at_merge(mc, lc, oc, m, l, o);
    }
    at_store_out(orow, outq, row, nh, head, dv, __fdiv_rn(o, l));
    if (threadIdx.x == 0) *counter = 0;
}

// Element (row, col) of a weight matrix in any format, exactly as the CPU
// tier dequantizes it.
__device__ __forceinline__ float weight_elem(const u8* __restrict__ w, u32 fmt, u64 row, u32 col,
                                             u32 cols, const float* __restrict__ scales,
                                             u32 s_block, u32 s_cols) {
    switch (fmt) {
        case FMT_F32: return ((const float*)w)[row * cols + col];
        case FMT_F16: return f16_bits_to_f32(((const u16*)w)[row * cols + col]);
        case FMT_BF16: return bf16_bits_to_f32(((const u16*)w)[row * cols + col]);
        case FMT_F8E4M3:
            return __fmul_rn(fp8e4m3_to_f32(w[row * cols + col]),
                             scales[(row / s_block) * s_cols + col / s_block]);
        case FMT_Q8_0: {
            const u8* b = w + row * (cols / 32) * 34 + (col / 32) * 34;
            const float d = f16_bits_to_f32(*(const u16*)b);
            return __fmul_rn(d, (float)(signed char)b[2 + col % 32]);
        }
        case FMT_Q6_K: {
            // ggml's layout (model/src/quant.rs `q6_k_code`); d · sc · q is
            // exact in f32.
            const u8* b = w + row * (cols / 256) * 210 + (col / 256) * 210;
            const u32 e = col % 256, n = e / 128, k = (e % 128) / 32, l = e % 32;
            const u32 ql = b[64 * n + 32 * (k % 2) + l];
            const u32 nib = k < 2 ? (ql & 15u) : (ql >> 4);
            const u32 hi = (b[128 + 32 * n + l] >> (2 * k)) & 3u;
            const float d = f16_bits_to_f32((u32)b[208] | ((u32)b[209] << 8));
            const float sc = (float)(signed char)b[192 + e / 16];
            return __fmul_rn(__fmul_rn(d, sc), (float)((int)(nib | (hi << 4)) - 32));
        }
        case FMT_Q4_K:
        case FMT_Q5_K: {
            // ggml's layouts (model/src/quant.rs `q4_k_code`, `q5_k_code`,
            // `k4_scale_min`): (d · sc) · code is exact in f32, and the
            // subtraction of dmin · m rounds once, as the CPU's does.
            const bool five = fmt == FMT_Q5_K;
            const u32 size = five ? 176 : 144;
            const u8* b = w + row * (cols / 256) * size + (col / 256) * size;
            const u32 e = col % 256, j = e / 32, l = e % 32;
            const u32 byte = b[(five ? 48 : 16) + 32 * (j / 2) + l];
            u32 code = j % 2 ? (byte >> 4) : (byte & 15u);
            if (five) code |= ((b[16 + l] >> j) & 1u) << 4;
            const u8* s = b + 4;
            const u32 sc = j < 4 ? (s[j] & 63u) : ((s[j + 4] & 15u) | ((s[j - 4] >> 6) << 4));
            const u32 m = j < 4 ? (s[j + 4] & 63u) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
            const float d = f16_bits_to_f32((u32)b[0] | ((u32)b[1] << 8));
            const float dmin = f16_bits_to_f32((u32)b[2] | ((u32)b[3] << 8));
            return fmaf(__fmul_rn(d, (float)sc), (float)code, -__fmul_rn(dmin, (float)m));
        }
        case FMT_Q4_1:
        case FMT_Q5_0:
        case FMT_Q5_1: {
            // ggml's layouts (model/src/quant.rs `dequantize_q4_1`, `_q5_0`,
            // `_q5_1`): d · code is exact in f32, the min's addition rounds.
            const bool min = fmt != FMT_Q5_0, five = fmt != FMT_Q4_1;
            const u32 size = fmt == FMT_Q4_1 ? 20 : fmt == FMT_Q5_0 ? 22 : 24;
            const u8* b = w + row * (cols / 32) * size + (col / 32) * size;
            const u32 j = col % 32, qh = min ? 4 : 2, qs = qh + (five ? 4 : 0);
            const u32 byte = b[qs + j % 16];
            u32 code = j < 16 ? (byte & 15u) : (byte >> 4);
            if (five) code |= ((b[qh + j / 8] >> (j % 8)) & 1u) << 4;
            const float d = f16_bits_to_f32((u32)b[0] | ((u32)b[1] << 8));
            if (!min) return __fmul_rn(d, (float)((int)code - 16));
            const float m = f16_bits_to_f32((u32)b[2] | ((u32)b[3] << 8));
            return fmaf(d, (float)code, m);
        }
        case FMT_Q2_K: {
            // ggml's layout (matvec.cu `Group<FMT_Q2_K>`): dl · code exact,
            // the subtraction of ml rounds once.
            const u8* b = w + row * (cols / 256) * 84 + (col / 256) * 84;
            const u32 e = col % 256, n = e / 128, k = (e % 128) / 32, l = e % 32;
            const u32 code = (b[16 + 32 * n + l] >> (2 * k)) & 3u;
            const u32 sc = b[e / 16];
            const float d = f16_bits_to_f32((u32)b[80] | ((u32)b[81] << 8));
            const float dmin = f16_bits_to_f32((u32)b[82] | ((u32)b[83] << 8));
            return fmaf(__fmul_rn(d, (float)(sc & 15u)), (float)code,
                        -__fmul_rn(dmin, (float)(sc >> 4)));
        }
        case FMT_Q3_K: {
            // ggml's layout (matvec.cu `Group<FMT_Q3_K>`), exact in f32.
            const u8* b = w + row * (cols / 256) * 110 + (col / 256) * 110;
            const u32 e = col % 256, n = e / 128, k = (e % 128) / 32, l = e % 32;
            const u32 code = ((b[32 + 32 * n + l] >> (2 * k)) & 3u) | (((b[l] >> (e / 32)) & 1u) << 2);
            const u32 i = e / 16;
            const u32 sc = ((b[96 + i % 8] >> (4 * (i / 8))) & 15u) | (((b[104 + i % 4] >> (2 * (i / 4))) & 3u) << 4);
            const float d = f16_bits_to_f32((u32)b[108] | ((u32)b[109] << 8));
            return __fmul_rn(__fmul_rn(d, (float)((int)sc - 32)), (float)((int)code - 4));
        }
        case FMT_IQ4_NL:
        case FMT_IQ4_XS: {
            // ggml's layouts and table (matvec.cu `GroupIq4`), exact in f32.
            const bool xs = fmt == FMT_IQ4_XS;
            const u8* b = xs ? w + row * (cols / 256) * 136 + (col / 256) * 136
                             : w + row * (cols / 32) * 18 + (col / 32) * 18;
            const u32 e = xs ? col % 256 : col % 32, ib = e / 32, j = e % 32;
            const u32 byte = b[(xs ? 8 + 16 * ib : 2) + j % 16];
            const u32 code = j < 16 ? (byte & 15u) : (byte >> 4);
            float dl = f16_bits_to_f32((u32)b[0] | ((u32)b[1] << 8));
            if (xs) {
                const u32 sh = (u32)b[2] | ((u32)b[3] << 8);
                const u32 sc = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15u) | (((sh >> (2 * ib)) & 3u) << 4);
                dl = __fmul_rn(dl, (float)((int)sc - 32));
            }
            return __fmul_rn(dl, (float)(signed char)(iq4_values(code) & 0xffu));
        }
        default: {
            const u8* b = w + row * (cols / 32) * 18 + (col / 32) * 18;
            const float d = f16_bits_to_f32(*(const u16*)b);
            const u32 j = col % 32;
            const u32 byte = b[2 + j % 16];
            const u32 nib = j < 16 ? (byte & 15u) : (byte >> 4);
            return __fmul_rn(d, (float)((int)nib - 8));
        }
    }
}

#define AB_THREADS 256
#define AB_MAX_DN 512

// MLA query absorption: qa[row][head][c] = Σ_j q_nope[row][head][j] ·
// W[head·head_rows + j][c] for j < dn, c < cols, where W is kv_b (rows of
// `cols` = kv_lora_rank elements, `head_rows` = dn + dv rows per head). The
// sum runs over j in increasing order with a rounded product and a rounded
// add per step, the CPU tier's `row_axpy` order.
// grid = (ceil(cols / 256), heads, rows).
extern "C" __global__ void __launch_bounds__(AB_THREADS)
    mla_absorb(const u8* __restrict__ w, u32 fmt, u32 cols, const float* __restrict__ scales,
               u32 s_block, u32 s_cols, u32 head_rows, u32 dn, const float* __restrict__ q,
               u32 q_head_stride, u32 q_row_stride, float* __restrict__ qa, u32 qa_head_stride,
               u32 qa_row_stride) {
    pdl_entry();
    __shared__ float qn[AB_MAX_DN];
    const u32 head = blockIdx.y, row = blockIdx.z;
    const float* qh = q + (u64)row * q_row_stride + (u64)head * q_head_stride;
    for (u32 j = threadIdx.x; j < dn; j += AB_THREADS) qn[j] = qh[j];
    __syncthreads();
    const u32 c = blockIdx.x * AB_THREADS + threadIdx.x;
    if (c >= cols) return;
    const u64 base = (u64)head * head_rows;
    float acc = 0.0f;
    for (u32 j = 0; j < dn; ++j)
        acc = __fadd_rn(acc, __fmul_rn(qn[j], weight_elem(w, fmt, base + j, c, cols, scales, s_block, s_cols)));
    qa[(u64)row * qa_row_stride + (u64)head * qa_head_stride + c] = acc;
}
