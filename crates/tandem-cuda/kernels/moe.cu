// ---------------------------------------------------------------------------------------------------
// Mixture-of-experts layers (appended to llama.cu; uses its helpers).
//
// A layer's routed experts run as one grouped GEMM per projection over every expert the step uses:
//   moe_route   router logits -> each token's top-k experts and weights (+ the shared expert's gate)
//   moe_align   the (token, k) slots grouped by expert into row blocks of MOE_BM rows, padded per
//               expert, with the expert of each row block (vLLM's fused-MoE layout)
//   moe_gemm_*  per row block, rows x W[expert]^T on tensor cores: gate/up, then down
//   moe_combine each token's weighted sum of its slots (+ the shared expert) added into the residual
// Every launch size depends on the step's token count only, so decode steps capture into graphs.
// A row block reads its expert's weights once: a decode step of one token reads only its k experts.

// Each token's top-k experts from its router logits (one warp per token). logits rows are `ld`
// floats: E expert logits, then (has_shared) the shared expert's gate logit. Softmax over the E
// experts; top-k by probability, ties to the lower index (torch.topk's order); renormalised to sum to
// one when norm != 0 (Qwen3-MoE), else the softmax weights (Qwen2-MoE). E <= 32 * MOE_MAX_PER_LANE.
// A real token (its KV slot inside the pool: graph padding rows write the scratch block past it) adds
// one to `counts[e]` for each chosen expert (the layer's tokens-per-expert metric).
#define MOE_MAX_PER_LANE 32
extern "C" __global__ void moe_route(const float* __restrict__ logits, int ld, int E, int k, int norm,
                                     int has_shared, int n_tokens, const int* __restrict__ kv_slots, int pool_slots,
                                     int* __restrict__ ids, float* __restrict__ weights, float* __restrict__ shared_w,
                                     unsigned long long* __restrict__ counts) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= n_tokens) return;
    const float* row = logits + (u64)t * ld;
    float v[MOE_MAX_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < MOE_MAX_PER_LANE; j++) {
        const int e = lane + 32 * j;
        v[j] = e < E ? row[e] : NEG_INF;
        mx = fmaxf(mx, v[j]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < MOE_MAX_PER_LANE; j++) {
        v[j] = (lane + 32 * j) < E ? __expf(v[j] - mx) : -1.f;
        sum += fmaxf(v[j], 0.f);
    }
    sum = warp_sum(sum);
    u32 taken = 0;
    float chosen_sum = 0.f, mine = 0.f;
    int mine_id = 0;
    for (int i = 0; i < k; i++) {
        float best = -1.f;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < MOE_MAX_PER_LANE; j++) {
            if (!(taken >> j & 1u) && v[j] > best) {
                best = v[j];
                best_e = lane + 32 * j;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
        const float p = best / sum;
        chosen_sum += p;
        if (lane == i) {
            mine = p;
            mine_id = best_e;
        }
    }
    if (lane < k) {
        ids[(u64)t * k + lane] = mine_id;
        weights[(u64)t * k + lane] = norm ? mine / chosen_sum : mine;
        if (kv_slots[t] < pool_slots) atomicAdd(&counts[mine_id], 1ull);
    }
    if (has_shared && lane == 0) shared_w[t] = 1.f / (1.f + __expf(-row[E]));
}

// Groups the n = tokens * k slots by expert (one block of 1024 threads). Expert e's slots fill
// ceil(count_e / bm) row blocks of bm rows from row block first_e (experts in index order);
// `sorted[row]` is the slot of each row (-1: padding), `slot_row[slot]` its row, `block_expert[b]`
// the expert of row block b (-1 past the used ones, up to `max_blocks`). E <= 1024.
extern "C" __global__ void __launch_bounds__(1024) moe_align(const int* __restrict__ ids, int n, int E, int bm,
                                                             int max_blocks, int* __restrict__ sorted,
                                                             int* __restrict__ slot_row,
                                                             int* __restrict__ block_expert) {
    __shared__ int cnt[1024], first[1024], fill[1024], warp_tot[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    cnt[tid] = 0;
    fill[tid] = 0;
    for (int r = tid; r < max_blocks * bm; r += blockDim.x) sorted[r] = -1;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = ids[i];
        atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    // Exclusive scan of the experts' row-block counts.
    const int nb = tid < E ? (cnt[tid] + bm - 1) / bm : 0;
    int incl = nb;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = warp_tot[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        warp_tot[lane] = w;
    }
    __syncthreads();
    const int start = incl - nb + (warp > 0 ? warp_tot[warp - 1] : 0);
    const int used = warp_tot[31];
    first[tid] = start;
    if (tid < E) {
        for (int b = 0; b < nb; b++) block_expert[start + b] = tid;
    }
    for (int b = used + tid; b < max_blocks; b += blockDim.x) block_expert[b] = -1;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = ids[i];
        const int row = first[e] * bm + atomicAdd(&fill[e], 1);
        sorted[row] = i;
        slot_row[i] = row;
    }
}

// Grouped GEMM: for row block b (expert e = block_expert[b]; -1: nothing to do) and a 64-column tile,
// out[row][n] = sum_k A[arow][k] * W[e][n][k] in bf16 with fp32 accumulation (mma.sync m16n8k16).
// A's row is sorted[row] / a_div when a_div > 0 (the token of a slot: gate/up reads the normalised
// hidden state), else the row itself (down reads the sorted activations). Padding rows are neither
// read nor written. W is [E][N][K] row-major; K % 8 == 0 (16-byte loads; the tail is zero-filled).
// Tiles of MOE_BK keys pass through shared memory in two cp.async stages. BM = 16 (decode: the warps
// split the 64 columns) or 64 (prefill: the warps split the rows).
#define MOE_BN 64
#define MOE_BK 64
#define MOE_PITCH (MOE_BK + 8)
template <int BM>
__device__ __forceinline__ void moe_gemm_body(const bf16* __restrict__ A, const int* __restrict__ sorted, int a_div,
                                              const bf16* __restrict__ W, const int* __restrict__ block_expert,
                                              bf16* __restrict__ out, int N, int K) {
    constexpr int WARPS_M = BM / 16;
    constexpr int WARPS_N = 4 / WARPS_M;
    constexpr int WN = MOE_BN / WARPS_N;
    constexpr int NT = WN / 8;
    __shared__ __align__(16) bf16 As[2][BM][MOE_PITCH];
    __shared__ __align__(16) bf16 Bs[2][MOE_BN][MOE_PITCH];
    __shared__ int arow[BM];
    const int b = blockIdx.x;
    const int e = block_expert[b];
    if (e < 0) return;
    const int n0 = blockIdx.y * MOE_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int wm = (warp / WARPS_N) * 16, wn = (warp % WARPS_N) * WN;
    if (tid < BM) {
        const int s = sorted[b * BM + tid];
        arow[tid] = s < 0 ? -1 : (a_div > 0 ? s / a_div : b * BM + tid);
    }
    __syncthreads();
    const bf16* We = W + (u64)e * N * K;
    const int nk = (K + MOE_BK - 1) / MOE_BK;
    auto load = [&](int kt, int st) {
        const int k0 = kt * MOE_BK;
        for (int c = tid; c < BM * (MOE_BK / 8); c += 128) {
            const int r = c / (MOE_BK / 8), kc = k0 + (c % (MOE_BK / 8)) * 8;
            const int ar = arow[r];
            const bool ok = ar >= 0 && kc < K;
            const bf16* src = ok ? A + (u64)ar * K + kc : A;
            cp_async16(smem_addr(&As[st][r][(c % (MOE_BK / 8)) * 8]), src, ok);
        }
        for (int c = tid; c < MOE_BN * (MOE_BK / 8); c += 128) {
            const int r = c / (MOE_BK / 8), kc = k0 + (c % (MOE_BK / 8)) * 8;
            const bool ok = n0 + r < N && kc < K;
            const bf16* src = ok ? We + (u64)(n0 + r) * K + kc : We;
            cp_async16(smem_addr(&Bs[st][r][(c % (MOE_BK / 8)) * 8]), src, ok);
        }
        cp_async_commit();
    };
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    load(0, 0);
    for (int kt = 0; kt < nk; kt++) {
        const int st = kt & 1;
        if (kt + 1 < nk) {
            load(kt + 1, st ^ 1);
            cp_async_wait1();
        } else {
            cp_async_wait0();
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MOE_BK; kk += 16) {
            const int ka = kk + tq * 2;
            const u32 a0 = *(const u32*)&As[st][wm + g][ka];
            const u32 a1 = *(const u32*)&As[st][wm + g + 8][ka];
            const u32 a2 = *(const u32*)&As[st][wm + g][ka + 8];
            const u32 a3 = *(const u32*)&As[st][wm + g + 8][ka + 8];
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int n = wn + j * 8 + g;
                const u32 b0 = *(const u32*)&Bs[st][n][ka];
                const u32 b1 = *(const u32*)&Bs[st][n][ka + 8];
                mma_bf16(acc[j], a0, a1, a2, a3, b0, b1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int n = n0 + wn + j * 8 + tq * 2;
        if (n >= N) continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = wm + g + 8 * h;
            if (arow[r] < 0) continue;
            *(u32*)(out + (u64)(b * BM + r) * N + n) = pack_bf2(acc[j][2 * h], acc[j][2 * h + 1]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) moe_gemm_16(const bf16* __restrict__ A, const int* __restrict__ sorted,
                                                              int a_div, const bf16* __restrict__ W,
                                                              const int* __restrict__ block_expert,
                                                              bf16* __restrict__ out, int N, int K) {
    moe_gemm_body<16>(A, sorted, a_div, W, block_expert, out, N, K);
}

extern "C" __global__ void __launch_bounds__(128) moe_gemm_64(const bf16* __restrict__ A, const int* __restrict__ sorted,
                                                              int a_div, const bf16* __restrict__ W,
                                                              const int* __restrict__ block_expert,
                                                              bf16* __restrict__ out, int N, int K) {
    moe_gemm_body<64>(A, sorted, a_div, W, block_expert, out, N, K);
}

// Decode's experts: the grouped GEMMs above pad each used expert to a row block of 16 rows, and a
// step of a few tokens reads every weight through tensor-core tiles built for many rows. These two
// stream each slot's expert rows through the dense GEMV's machinery (gv_run_x: persistent blocks,
// split-K, loads in flight across items) with the slot's own activation row, so a step reads only
// its tokens' k experts, at the GEMV's bandwidth. Slot s = token * k + j; an expert chosen by two
// tokens is read twice (from L2 when they run together). Rounding as the grouped path's.

// act[s][j] = silu(gate) * up for slot s's expert e = ids[s]: rows j and ffn + j of W[e] = [gate; up]
// over the token's normalised row xn[s / k]. One item per (slot, j).
extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, GV_MINB) moe_gemv_silu(
    const bf16* __restrict__ xn, const int* __restrict__ ids, int slots, int k, const bf16* __restrict__ w,
    bf16* __restrict__ act, int ffn, int K, int ks, int groups) {
    const int lane = threadIdx.x & 31;
    const int last = slots * ffn - 1;
    gv_run_x<1, false, WBf16>(
        w, WBf16{nullptr, 0}, K, ks, groups,
        [&](const GvItem& it, int& r0, int& r1) {
            const int p = min(it.pair, last);
            r0 = ids[p / ffn] * 2 * ffn + p % ffn;
            r1 = r0 + ffn;
        },
        [&](const GvItem& it) { return xn + (u64)(min(it.pair, last) / ffn / k) * K; }, [] {},
        [&](const GvItem& it, int, int, float (&a0)[1], float (&a1)[1]) {
            if (it.pair > last || lane != 0) return;
            const float g = round_bf(a0[0]), u = round_bf(a1[0]);
            act[it.pair] = f2bf(round_bf(g / (1.f + __expf(-g))) * u);
        });
}

// y[s][n] = act[s] . W[e][n] for slot s's expert e = ids[s] (the down projection, N = hidden rows of
// K = ffn values). One item per (slot, row pair).
extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, GV_MINB) moe_gemv_down(
    const bf16* __restrict__ act, const int* __restrict__ ids, int slots, const bf16* __restrict__ w,
    bf16* __restrict__ y, int N, int K, int ks, int groups) {
    const int lane = threadIdx.x & 31;
    const int pairs = (N + 1) / 2, last = slots * pairs - 1;
    gv_run_x<1, false, WBf16>(
        w, WBf16{nullptr, 0}, K, ks, groups,
        [&](const GvItem& it, int& r0, int& r1) {
            const int p = min(it.pair, last);
            const int base = ids[p / pairs] * N, n = 2 * (p % pairs);
            r0 = base + n;
            r1 = base + min(n + 1, N - 1);
        },
        [&](const GvItem& it) { return act + (u64)(min(it.pair, last) / pairs) * K; }, [] {},
        [&](const GvItem& it, int, int, float (&a0)[1], float (&a1)[1]) {
            if (it.pair > last || lane != 0) return;
            const int s = it.pair / pairs, n = 2 * (it.pair % pairs);
            y[(u64)s * N + n] = f2bf(a0[0]);
            if (n + 1 < N) y[(u64)s * N + n + 1] = f2bf(a1[0]);
        });
}

// x[t] += round_bf(sum_j w[t][j] * y[slot_row[t * k + j]] + shared_w[t] * shared[t]) (one block per
// token, eight columns per thread): the MoE block's output added into the residual as HF adds its
// bf16 MLP output. `shared` is 0 when the model has no shared expert; `slot_row` is 0 when y is
// already in slot order (the GEMV path).
extern "C" __global__ void moe_combine(bf16* __restrict__ x, const bf16* __restrict__ y,
                                       const int* __restrict__ slot_row, const float* __restrict__ w, int k,
                                       const bf16* __restrict__ shared, const float* __restrict__ shared_w,
                                       int h) {
    const int t = blockIdx.x;
    for (int c = 8 * threadIdx.x; c < h; c += 8 * blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, f[8];
        for (int j = 0; j < k; j++) {
            const float wj = w[(u64)t * k + j];
            const u64 row = slot_row ? slot_row[(u64)t * k + j] : (u64)t * k + j;
            unpack8(*(const uint4*)(y + row * h + c), f);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] += wj * f[i];
        }
        if (shared) {
            const float sw = shared_w[t];
            unpack8(*(const uint4*)(shared + (u64)t * h + c), f);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] += sw * f[i];
        }
        bf16* xr = x + (u64)t * h + c;
        unpack8(*(const uint4*)xr, f);
        uint4 pk;
        pk.x = pack_bf2(f[0] + round_bf(acc[0]), f[1] + round_bf(acc[1]));
        pk.y = pack_bf2(f[2] + round_bf(acc[2]), f[3] + round_bf(acc[3]));
        pk.z = pack_bf2(f[4] + round_bf(acc[4]), f[5] + round_bf(acc[5]));
        pk.w = pack_bf2(f[6] + round_bf(acc[6]), f[7] + round_bf(acc[7]));
        *(uint4*)xr = pk;
    }
}
