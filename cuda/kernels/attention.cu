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
// order, and the group sums are added in group order. (A decode step is
// one block per head: the more warps share a chunk, the shorter its serial
// chains of loads.)
//
// Not yet done (later work): splitting long contexts across blocks
// (flash-decoding) and sharing K/V loads between the heads of a group.
#include "common.cuh"

#define AT_THREADS 512
#define AT_WARPS (AT_THREADS / 32)
#define AT_CHUNK 256
#define AT_MAX_DQ 640
#define AT_MAX_DV 512
#define AT_KEYS 4
#define AT_VUNROLL 8

extern "C" __global__ void __launch_bounds__(AT_THREADS)
    attention(const float* __restrict__ q, u32 nh, u32 dA, u32 dB,
              const float* __restrict__ kA, u32 kA_tstride, u32 kA_hstride,
              const float* __restrict__ kB, u32 kB_tstride, u32 kB_hstride,
              const float* __restrict__ v, u32 v_tstride, u32 v_hstride, u32 dv, u32 group,
              const u32* __restrict__ pos, const u32* __restrict__ slot0, u32 capacity,
              u32 window, float scale, float* __restrict__ out) {
    pdl_entry();
    __shared__ float qs[AT_MAX_DQ];
    __shared__ float sc[AT_CHUNK];
    __shared__ float scratch[AT_WARPS];
    __shared__ float vpart[AT_THREADS];
    const u32 head = blockIdx.x, row = blockIdx.y;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 kvh = head / group;
    const u32 p = pos[row];
    const u64 s0 = slot0[row];
    const u32 first = (window != 0 && p + 1 > window) ? p + 1 - window : 0;
    const u32 dq = dA + dB;
    float* orow = out + ((u64)row * nh + head) * dv;
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

    // This thread's place in the Σ e·v pass: group kg, output dim d.
    const u32 dvp = (dv + 127) / 128 * 128;
    const u32 groups = AT_THREADS / dvp;
    const u32 kg = threadIdx.x / dvp, d = threadIdx.x % dvp;
    const bool owns = kg < groups && d < dv;
    float o = 0.0f;
    float m = -f32_inf(), l = 0.0f;

    for (u32 cb = first / AT_CHUNK * AT_CHUNK; cb <= p; cb += AT_CHUNK) {
        const u32 cstart = max(first, cb), cend = min(p + 1, cb + AT_CHUNK);
        const u32 len = cend - cstart;
        // Each warp scores AT_KEYS keys at a time (their loads in flight
        // together); every key's dot product is formed exactly as alone.
        for (u32 t0 = cstart + warp * AT_KEYS; t0 < cend; t0 += AT_WARPS * AT_KEYS) {
            float a[AT_KEYS], b[AT_KEYS];
#pragma unroll
            for (int j = 0; j < AT_KEYS; ++j) {
                a[j] = 0.0f;
                b[j] = 0.0f;
            }
            const float* ka = kA + (s0 + t0) * kA_tstride + (u64)kvh * kA_hstride;
            for (u32 i = lane; i < dA; i += 32) {
                const float qv = qs[i];
#pragma unroll
                for (int j = 0; j < AT_KEYS; ++j)
                    if (t0 + j < cend) a[j] = fmaf(qv, ka[(u64)j * kA_tstride + i], a[j]);
            }
            if (dB != 0) {
                const float* kb = kB + (s0 + t0) * kB_tstride + (u64)kvh * kB_hstride;
                for (u32 i = lane; i < dB; i += 32) {
                    const float qv = qs[dA + i];
#pragma unroll
                    for (int j = 0; j < AT_KEYS; ++j)
                        if (t0 + j < cend) b[j] = fmaf(qv, kb[(u64)j * kB_tstride + i], b[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < AT_KEYS; ++j) {
                if (t0 + j < cend) {
                    float s = warp_sum(a[j]);
                    if (dB != 0) s = __fadd_rn(s, warp_sum(b[j]));
                    if (lane == 0) sc[t0 + j - cstart] = __fmul_rn(s, scale);
                }
            }
        }
        __syncthreads();
        float mx = -f32_inf();
        for (u32 i = threadIdx.x; i < len; i += AT_THREADS) mx = fmaxf(mx, sc[i]);
        const float mc = block_max<AT_WARPS>(mx, scratch);
        float part = 0.0f;
        for (u32 i = threadIdx.x; i < len; i += AT_THREADS) {
            const float e = expf(__fsub_rn(sc[i], mc));
            sc[i] = e;
            part = __fadd_rn(part, e);
        }
        // block_sum's barriers also publish the exps written above.
        const float lc = block_sum<AT_WARPS>(part, scratch);
        const float mn = fmaxf(m, mc);
        const float a_old = expf(__fsub_rn(m, mn)), a_new = expf(__fsub_rn(mc, mn));
        const float* vb = v + (s0 + cstart) * v_tstride + (u64)kvh * v_hstride;
        // Group kg's slice of the chunk, in position order, AT_VUNROLL
        // values loaded ahead of use.
        float oc = 0.0f;
        if (owns) {
            const u32 per = (len + groups - 1) / groups;
            const u32 t1 = min(len, (kg + 1) * per);
            u32 t = min(len, kg * per);
            for (; t + AT_VUNROLL <= t1; t += AT_VUNROLL) {
                float vv[AT_VUNROLL];
#pragma unroll
                for (int u = 0; u < AT_VUNROLL; ++u) vv[u] = vb[(u64)(t + u) * v_tstride + d];
#pragma unroll
                for (int u = 0; u < AT_VUNROLL; ++u) oc = fmaf(sc[t + u], vv[u], oc);
            }
            for (; t < t1; ++t) oc = fmaf(sc[t], vb[(u64)t * v_tstride + d], oc);
            if (kg > 0) vpart[threadIdx.x] = oc;
        }
        __syncthreads();
        if (owns && kg == 0) {
            // The group sums in group order.
            for (u32 g = 1; g < groups; ++g) oc = __fadd_rn(oc, vpart[g * dvp + d]);
            o = __fadd_rn(__fmul_rn(o, a_old), __fmul_rn(oc, a_new));
        }
        l = __fadd_rn(__fmul_rn(l, a_old), __fmul_rn(lc, a_new));
        m = mn;
        // The next chunk overwrites sc.
        __syncthreads();
    }

    if (owns && kg == 0) orow[d] = __fdiv_rn(o, l);
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
