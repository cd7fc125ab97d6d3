// router.cu: MoE routers, one warp (one block) per token row.
//
// Selection follows the CPU tier's `ops::top_k` exactly: values ordered by
// f32::total_cmp, largest first, ties to the lower index. Each round every
// lane proposes its best unchosen candidate and a butterfly keeps the best
// by (key, index), a total order, so every lane agrees and the choice never
// depends on timing. Sums (softmax denominator) use a fixed lane order and
// butterfly; the per-expert arithmetic is the CPU tier's, step by step.
#include "common.cuh"

#define RT_MAX_E 1024
#define RT_MAX_K 64
#define RT_NONE 0xffffffffu

// Best (largest key, then smallest index) of every lane's candidate.
__device__ __forceinline__ void warp_argmax(int& key, u32& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const int ok = __shfl_xor_sync(FULL_MASK, key, o);
        const u32 oi = __shfl_xor_sync(FULL_MASK, idx, o);
        if (oi != RT_NONE && (idx == RT_NONE || ok > key || (ok == key && oi < idx))) {
            key = ok;
            idx = oi;
        }
    }
}

// Top-k of vals[0..n) (n ≤ RT_MAX_E) into sel[0..k), largest first. Lane l
// owns indices l, l + 32, ...; `taken` is its bitmask of chosen ones.
__device__ __forceinline__ void warp_top_k(const float* vals, u32 n, u32 k, u32* sel) {
    const u32 lane = threadIdx.x & 31;
    u32 taken = 0;
    for (u32 r = 0; r < k; ++r) {
        int key = 0;
        u32 idx = RT_NONE;
        for (u32 j = 0, i = lane; i < n; ++j, i += 32) {
            if ((taken >> j) & 1u) continue;
            const int kk = total_order_key(vals[i]);
            if (idx == RT_NONE || kk > key) {
                key = kk;
                idx = i;
            }
        }
        warp_argmax(key, idx);
        if (idx != RT_NONE && (idx & 31) == lane) taken |= 1u << (idx >> 5);
        if (lane == 0) sel[r] = idx;
    }
    __syncwarp();
}

// Softmax over the E logits of each row, then top-k, then (norm) the chosen
// probabilities divided by their sum. Writes ids and weights [rows][k].
extern "C" __global__ void __launch_bounds__(32)
    router_softmax_topk(const float* __restrict__ logits, u32 E, u32 k, u32 norm,
                        u32* __restrict__ out_idx, float* __restrict__ out_w) {
    pdl_entry();
    __shared__ float p[RT_MAX_E];
    __shared__ u32 sel[RT_MAX_K];
    const u32 lane = threadIdx.x;
    const u64 row = blockIdx.x;
    const float* lr = logits + row * E;
    float mx = -f32_inf();
    for (u32 i = lane; i < E; i += 32) {
        const float v = lr[i];
        p[i] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float s = 0.0f;
    for (u32 i = lane; i < E; i += 32) {
        const float e = expf(__fsub_rn(p[i], mx));
        p[i] = e;
        s = __fadd_rn(s, e);
    }
    s = warp_sum(s);
    const float inv = __fdiv_rn(1.0f, s);
    for (u32 i = lane; i < E; i += 32) p[i] = __fmul_rn(p[i], inv);
    __syncwarp();
    warp_top_k(p, E, k, sel);
    if (lane == 0) {
        float sum = 0.0f;
        if (norm)
            for (u32 r = 0; r < k; ++r) sum = __fadd_rn(sum, p[sel[r]]);
        for (u32 r = 0; r < k; ++r) {
            const float wv = p[sel[r]];
            out_idx[row * k + r] = sel[r];
            out_w[row * k + r] = norm ? __fdiv_rn(wv, sum) : wv;
        }
    }
}

// DeepSeek-V3's router: scores = sigmoid(logits); choice = scores + bias
// (bias may be null); groups of E / n_group experts are ranked by the sum of
// their two best choices; the best topk_group groups stay, every other
// expert's choice becomes -inf; top-k of the choices; weights are the
// unbiased scores, (norm) divided by their sum + 1e-20, times `scaling`.
extern "C" __global__ void __launch_bounds__(32)
    router_sigmoid_grouped_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                                u32 E, u32 n_group, u32 topk_group, u32 k, u32 norm,
                                float scaling, u32* __restrict__ out_idx,
                                float* __restrict__ out_w) {
    pdl_entry();
    __shared__ float sc[RT_MAX_E];
    __shared__ float ch[RT_MAX_E];
    __shared__ float gs[32];
    __shared__ u32 gsel[32];
    __shared__ u32 sel[RT_MAX_K];
    const u32 lane = threadIdx.x;
    const u64 row = blockIdx.x;
    const float* lr = logits + row * E;
    for (u32 i = lane; i < E; i += 32) {
        const float s = sigmoid_f32(lr[i]);
        sc[i] = s;
        ch[i] = bias != nullptr ? __fadd_rn(s, bias[i]) : s;
    }
    __syncwarp();
    const u32 per = E / n_group;
    if (lane < n_group) {
        // The two best choices of this group, by the same order as top_k.
        const float* g = ch + lane * per;
        u32 b0 = 0;
        for (u32 i = 1; i < per; ++i)
            if (total_order_key(g[i]) > total_order_key(g[b0])) b0 = i;
        u32 b1 = b0 == 0 ? 1 : 0;
        for (u32 i = 0; i < per; ++i)
            if (i != b0 && total_order_key(g[i]) > total_order_key(g[b1])) b1 = i;
        gs[lane] = __fadd_rn(g[b0], g[b1]);
    }
    __syncwarp();
    warp_top_k(gs, n_group, topk_group, gsel);
    u32 keep = 0;
    for (u32 r = 0; r < topk_group; ++r) keep |= 1u << gsel[r];
    // Every lane rewrites only its own indices, the ones it read above.
    for (u32 i = lane; i < E; i += 32)
        if (!((keep >> (i / per)) & 1u)) ch[i] = -f32_inf();
    __syncwarp();
    warp_top_k(ch, E, k, sel);
    if (lane == 0) {
        float sum = 0.0f;
        if (norm) {
            for (u32 r = 0; r < k; ++r) sum = __fadd_rn(sum, sc[sel[r]]);
            sum = __fadd_rn(sum, 1e-20f);
        }
        for (u32 r = 0; r < k; ++r) {
            float wv = sc[sel[r]];
            if (norm) wv = __fdiv_rn(wv, sum);
            out_idx[row * k + r] = sel[r];
            out_w[row * k + r] = __fmul_rn(wv, scaling);
        }
    }
}
