// tandem's CUDA kernels for the Llama-family forward pass, compiled at start-up by NVRTC for the
// device's compute capability. The host prepends the model's shape as #defines:
//   HEAD_DIM   width of one attention head (a multiple of 16)
//   GQA        query heads per key/value head
//   KV_BLOCK   tokens per paged KV block
//   DEC_PART   keys per split of the decode attention (flash-decoding partition)
// bf16 values travel as raw 16-bit patterns (no header dependency); arithmetic is in fp32.
//
// Paged KV layout per layer: block b holds [K|V][kv_head][slot][HEAD_DIM] contiguously, the layout the
// CPU backend and the KV transfer use. A "slot" below is block * KV_BLOCK + offset.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf2f(bf16 v) { return __uint_as_float(((u32)v) << 16); }

// Round to nearest even, NaN kept quiet: the same rounding as PyTorch's bf16 casts.
__device__ __forceinline__ bf16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }

__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
}

// The 8 bf16 values of a 16-byte load as floats, by bit operations (keeps everything in registers).
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; `red` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? red[lane] : 0.f;
    return warp_sum(v);
}

// ---------------------------------------------------------------------------------------------------
// Elementwise and normalisation

// Deterministic uniform bf16 values in [-scale, scale) from a hash of (seed, index): random weights
// generated on the device for speed runs, with no file behind them.
extern "C" __global__ void init_uniform(bf16* out, u64 n, u64 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
        float u = (float)(x >> 40) * (1.0f / 16777216.0f);
        out[i] = f2bf((2.f * u - 1.f) * scale);
    }
}

extern "C" __global__ void fill_bf16(bf16* out, u64 n, float value) {
    bf16 v = f2bf(value);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = v;
}

// x[t] = embed[tokens[t]] (one block per token).
extern "C" __global__ void embed_gather(const bf16* __restrict__ embed, const int* __restrict__ tokens,
                                        bf16* __restrict__ x, int hidden) {
    const bf16* src = embed + (u64)tokens[blockIdx.x] * hidden;
    bf16* dst = x + (u64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// residual += delta (rounded to bf16, as a bf16 model adds), then out = RMSNorm(residual) * w with
// HF's rounding: normalise in fp32, round to bf16, multiply by the bf16 weight, round again.
// delta may be null (the first layer's norm). One block per row.
extern "C" __global__ void add_rmsnorm(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                       const bf16* __restrict__ w, bf16* __restrict__ out, int hidden,
                                       float eps) {
    __shared__ float red[32];
    bf16* r = residual + (u64)blockIdx.x * hidden;
    const bf16* d = delta ? delta + (u64)blockIdx.x * hidden : 0;
    bf16* o = out + (u64)blockIdx.x * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = bf2f(r[i]);
        if (d) {
            v = round_bf(v + bf2f(d[i]));
            r[i] = f2bf(v);
        }
        ss += v * v;
    }
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = round_bf(bf2f(r[i]) * inv);
        o[i] = f2bf(v * bf2f(w[i]));
    }
}

// out[i] = x[rows[i]]: the rows that want logits, gathered before the output head.
extern "C" __global__ void gather_rows(const bf16* __restrict__ x, const int* __restrict__ rows,
                                       bf16* __restrict__ out, int width) {
    const bf16* src = x + (u64)rows[blockIdx.x] * width;
    bf16* dst = out + (u64)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// act = silu(gate) * up over rows of [gate | up] (each ffn wide), rounded like HF's bf16 MLP.
// grid = (column blocks, rows); two columns per thread with 4-byte loads, no 64-bit index division.
extern "C" __global__ void silu_mul(const bf16* __restrict__ gu, bf16* __restrict__ act, int ffn) {
    const int row = blockIdx.y;
    const bf16* g = gu + (u64)row * 2 * ffn;
    const bf16* u = g + ffn;
    bf16* o = act + (u64)row * ffn;
    for (int c = 2 * (blockIdx.x * blockDim.x + threadIdx.x); c < ffn; c += 2 * gridDim.x * blockDim.x) {
        if (c + 1 < ffn) {
            u32 gv = *(const u32*)(g + c), uv = *(const u32*)(u + c);
            float g0 = __uint_as_float(gv << 16), g1 = __uint_as_float(gv & 0xffff0000u);
            float u0 = __uint_as_float(uv << 16), u1 = __uint_as_float(uv & 0xffff0000u);
            float s0 = round_bf(g0 / (1.f + __expf(-g0))), s1 = round_bf(g1 / (1.f + __expf(-g1)));
            *(u32*)(o + c) = pack_bf2(s0 * u0, s1 * u1);
        } else {
            float g0 = bf2f(g[c]);
            o[c] = f2bf(round_bf(g0 / (1.f + __expf(-g0))) * bf2f(u[c]));
        }
    }
}

// Per token: optional q/k/v biases, RoPE on q (in place) and k, then k and v into the paged cache at
// slots[t]. qkv rows are [q | k | v] (n_heads, n_kv, n_kv heads). cos/sin tables are [pos][HEAD_DIM/2].
// neox != 0 rotates (i, i + d/2) pairs (HF weights), else adjacent pairs (GGUF's permuted weights).
// Rounding mirrors HF: cos and sin in bf16, each product and the sum rounded to bf16.
extern "C" __global__ void rope_kv_write(bf16* __restrict__ qkv, const bf16* __restrict__ bias,
                                         const int* __restrict__ positions, const int* __restrict__ slots,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         bf16* __restrict__ cache, int n_heads, int n_kv, int neox) {
    const int t = blockIdx.x;
    const int half = HEAD_DIM / 2;
    const int width = (n_heads + 2 * n_kv) * HEAD_DIM;
    bf16* row = qkv + (u64)t * width;
    const int pos = positions[t];
    const int slot = slots[t];
    const u64 blk = slot / KV_BLOCK, off = slot % KV_BLOCK;
    const float* cs = cos_t + (u64)pos * half;
    const float* sn = sin_t + (u64)pos * half;
    // Rotated pairs of q and k heads.
    const int pairs = (n_heads + n_kv) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / half, i = p % half;
        int i0 = neox ? i : 2 * i;
        int i1 = neox ? i + half : 2 * i + 1;
        int base = head * HEAD_DIM;
        float x0 = bf2f(row[base + i0]), x1 = bf2f(row[base + i1]);
        if (bias) {
            x0 = round_bf(x0 + bf2f(bias[base + i0]));
            x1 = round_bf(x1 + bf2f(bias[base + i1]));
        }
        float c = round_bf(cs[i]), s = round_bf(sn[i]);
        bf16 y0 = f2bf(round_bf(x0 * c) - round_bf(x1 * s));
        bf16 y1 = f2bf(round_bf(x1 * c) + round_bf(x0 * s));
        if (head < n_heads) {
            row[base + i0] = y0;
            row[base + i1] = y1;
        } else {
            int kh = head - n_heads;
            bf16* dst = cache + ((blk * 2 + 0) * n_kv + kh) * (u64)KV_BLOCK * HEAD_DIM + off * HEAD_DIM;
            dst[i0] = y0;
            dst[i1] = y1;
        }
    }
    // v, copied (with its bias) into the V plane.
    const int vbase = (n_heads + n_kv) * HEAD_DIM;
    for (int e = threadIdx.x; e < n_kv * HEAD_DIM; e += blockDim.x) {
        int kh = e / HEAD_DIM, d = e % HEAD_DIM;
        float v = bf2f(row[vbase + e]);
        if (bias) v = round_bf(v + bf2f(bias[vbase + e]));
        cache[((blk * 2 + 1) * n_kv + kh) * (u64)KV_BLOCK * HEAD_DIM + off * HEAD_DIM + d] = f2bf(v);
    }
}

// Index of each row's largest logit (greedy sampling on the device). One block per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* r = logits + (u64)blockIdx.x * vocab;
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = r[i];
        if (v > best) { best = v; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? bv[lane] : NEG_INF;
        idx = lane < nw ? bi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
        }
        if (lane == 0) out[blockIdx.x] = idx;
    }
}

// ---------------------------------------------------------------------------------------------------
// Attention. Sequences are described by small device arrays filled by the host planner:
//   seq_qrow  first row of the sequence's new tokens in the batch
//   seq_nq    number of new tokens
//   seq_pos   tokens already cached before them (the first new token's position)
//   seq_bt    offset of the sequence's block table in bt
// q rows live in the qkv buffer (row stride qkv_width); out is [tokens][n_heads * HEAD_DIM].

__device__ __forceinline__ const bf16* kv_row(const bf16* cache, const int* bt, int key, int plane, int n_kv,
                                              int kvh) {
    u64 blk = (u64)bt[key / KV_BLOCK];
    return cache + ((blk * 2 + plane) * n_kv + kvh) * (u64)KV_BLOCK * HEAD_DIM + (u64)(key % KV_BLOCK) * HEAD_DIM;
}

// Reference attention: one warp per (token, head), keys one at a time with an online softmax. Slow;
// kept as the check the fast kernels are compared against on the device (TANDEM_CUDA_ATTN=simple).
extern "C" __global__ void attn_simple(const bf16* __restrict__ qkv, int qkv_width, const int* __restrict__ seq_qrow,
                                       const int* __restrict__ seq_nq, const int* __restrict__ seq_pos,
                                       const int* __restrict__ seq_bt, const int* __restrict__ bt,
                                       const bf16* __restrict__ cache, bf16* __restrict__ out, int n_heads,
                                       int n_kv, float scale) {
    const int s = blockIdx.y;
    const int qi = blockIdx.x;
    const int h = threadIdx.y + blockDim.y * blockIdx.z;
    if (qi >= seq_nq[s] || h >= n_heads) return;
    const int lane = threadIdx.x;
    const int row = seq_qrow[s] + qi;
    const int kvh = h / GQA;
    const int* tbl = bt + seq_bt[s];
    const int last = seq_pos[s] + qi;
    const bf16* q = qkv + (u64)row * qkv_width + h * HEAD_DIM;
    const int PER = HEAD_DIM / 32 > 0 ? HEAD_DIM / 32 : 1;
    float qv[HEAD_DIM / 16 + 1], acc[HEAD_DIM / 16 + 1];
    for (int j = 0; j < PER; j++) {
        int d = lane + 32 * j;
        qv[j] = d < HEAD_DIM ? bf2f(q[d]) : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int key = 0; key <= last; key++) {
        const bf16* k = kv_row(cache, tbl, key, 0, n_kv, kvh);
        float dot = 0.f;
        for (int j = 0; j < PER; j++) {
            int d = lane + 32 * j;
            if (d < HEAD_DIM) dot += qv[j] * bf2f(k[d]);
        }
        dot = warp_sum(dot) * scale;
        float mn = fmaxf(m, dot);
        float a = __expf(m - mn), p = __expf(dot - mn);
        l = l * a + p;
        const bf16* v = kv_row(cache, tbl, key, 1, n_kv, kvh);
        for (int j = 0; j < PER; j++) {
            int d = lane + 32 * j;
            acc[j] = acc[j] * a + (d < HEAD_DIM ? p * bf2f(v[d]) : 0.f);
        }
        m = mn;
    }
    bf16* o = out + (u64)row * n_heads * HEAD_DIM + h * HEAD_DIM;
    for (int j = 0; j < PER; j++) {
        int d = lane + 32 * j;
        if (d < HEAD_DIM) o[d] = f2bf(acc[j] / l);
    }
}

// ---- Prefill: flash-attention style, tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate). ----
// Block = 4 warps = 64 query rows of one sequence and one head; each warp owns 16 rows. Key/value tiles
// of 64 keys are gathered from the paged cache into shared memory (V transposed), scores stay in
// registers, and the online softmax rescales the output accumulators per tile. Causal: query i of the
// chunk sees keys 0..pos+i.

#define PF_ROWS 64
#define PF_KEYS 64
#define K_PITCH (HEAD_DIM + 8)
#define V_PITCH (PF_KEYS + 8)

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// tile_seq[i], tile_q0[i]: the sequence and first chunk row of query tile i. grid = (tiles, n_heads).
extern "C" __global__ void __launch_bounds__(128) attn_prefill(
    const bf16* __restrict__ qkv, int qkv_width, const int* __restrict__ tile_seq,
    const int* __restrict__ tile_q0, const int* __restrict__ seq_qrow, const int* __restrict__ seq_nq,
    const int* __restrict__ seq_pos, const int* __restrict__ seq_bt, const int* __restrict__ bt,
    const bf16* __restrict__ cache, bf16* __restrict__ out, int n_heads, int n_kv, float scale_log2) {
    __shared__ __align__(16) bf16 ks[PF_KEYS * K_PITCH];
    __shared__ __align__(16) bf16 vt[HEAD_DIM * V_PITCH];
    const int s = tile_seq[blockIdx.x];
    const int q0 = tile_q0[blockIdx.x];
    const int h = blockIdx.y;
    const int kvh = h / GQA;
    const int nq = seq_nq[s], pos = seq_pos[s], qrow0 = seq_qrow[s];
    const int* tbl = bt + seq_bt[s];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int tile_end = min(q0 + PF_ROWS, nq);
    const int n_keys = pos + tile_end;  // keys any row of this tile may see
    // This warp's rows g and g + 8 (chunk-relative); rows past the chunk see the last row's keys and
    // are never written, which keeps their softmax finite.
    const int r_lo = q0 + warp * 16 + g, r_hi = r_lo + 8;
    const int lim_lo = pos + min(r_lo, nq - 1), lim_hi = pos + min(r_hi, nq - 1);

    // Q fragments for all HEAD_DIM/16 k-steps.
    u32 qa[HEAD_DIM / 16][4];
    {
        const bf16* qlo = qkv + (u64)(qrow0 + min(r_lo, nq - 1)) * qkv_width + h * HEAD_DIM;
        const bf16* qhi = qkv + (u64)(qrow0 + min(r_hi, nq - 1)) * qkv_width + h * HEAD_DIM;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
            int c = kk * 16 + tq * 2;
            qa[kk][0] = *(const u32*)(qlo + c);
            qa[kk][1] = *(const u32*)(qhi + c);
            qa[kk][2] = *(const u32*)(qlo + c + 8);
            qa[kk][3] = *(const u32*)(qhi + c + 8);
        }
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

    for (int k0 = 0; k0 < n_keys; k0 += PF_KEYS) {
        __syncthreads();
        // Gather K (row-major) and V (transposed) of keys k0..k0+63; keys past n_keys are zero.
        // K: consecutive threads take consecutive 16-byte chunks of a key row (coalesced loads,
        // conflict-free 16-byte stores). V: consecutive threads take consecutive keys of one chunk,
        // so that the transposed 2-byte stores of a warp land in consecutive shared-memory words.
        const int CH = HEAD_DIM / 8;  // 16-byte chunks per row
        for (int e = threadIdx.x; e < PF_KEYS * CH; e += blockDim.x) {
            int j = e / CH, c = (e % CH) * 8;
            int key = k0 + j;
            uint4 kv4 = make_uint4(0, 0, 0, 0);
            if (key < n_keys) kv4 = *(const uint4*)(kv_row(cache, tbl, key, 0, n_kv, kvh) + c);
            *(uint4*)(ks + j * K_PITCH + c) = kv4;
        }
        for (int e = threadIdx.x; e < PF_KEYS * CH; e += blockDim.x) {
            int j = e % PF_KEYS, c = (e / PF_KEYS) * 8;
            int key = k0 + j;
            uint4 vv4 = make_uint4(0, 0, 0, 0);
            if (key < n_keys) vv4 = *(const uint4*)(kv_row(cache, tbl, key, 1, n_kv, kvh) + c);
            const u32 vw[4] = {vv4.x, vv4.y, vv4.z, vv4.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                vt[(c + 2 * i) * V_PITCH + j] = (bf16)(vw[i] & 0xffffu);
                vt[(c + 2 * i + 1) * V_PITCH + j] = (bf16)(vw[i] >> 16);
            }
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 rows x 64 keys.
        float sc[PF_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; nt++) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
            const bf16* kr = ks + (nt * 8 + g) * K_PITCH + tq * 2;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
                u32 b0 = *(const u32*)(kr + kk * 16);
                u32 b1 = *(const u32*)(kr + kk * 16 + 8);
                mma_bf16(sc[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            }
        }
        // Mask, scale (log2 domain), tile row maxima.
        float tm_lo = NEG_INF, tm_hi = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = k0 + nt * 8 + tq * 2 + (e & 1);
                int lim = e < 2 ? lim_lo : lim_hi;
                float v = key <= lim ? sc[nt][e] * scale_log2 : NEG_INF;
                sc[nt][e] = v;
                if (e < 2) tm_lo = fmaxf(tm_lo, v); else tm_hi = fmaxf(tm_hi, v);
            }
        }
        tm_lo = fmaxf(tm_lo, __shfl_xor_sync(0xffffffffu, tm_lo, 1));
        tm_lo = fmaxf(tm_lo, __shfl_xor_sync(0xffffffffu, tm_lo, 2));
        tm_hi = fmaxf(tm_hi, __shfl_xor_sync(0xffffffffu, tm_hi, 1));
        tm_hi = fmaxf(tm_hi, __shfl_xor_sync(0xffffffffu, tm_hi, 2));
        float mn_lo = fmaxf(m_lo, tm_lo), mn_hi = fmaxf(m_hi, tm_hi);
        // A fully masked row so far keeps -inf; use 0 as the reference so exp2 gives 0, not NaN.
        float ref_lo = mn_lo == NEG_INF ? 0.f : mn_lo, ref_hi = mn_hi == NEG_INF ? 0.f : mn_hi;
        float a_lo = exp2f(m_lo - ref_lo), a_hi = exp2f(m_hi - ref_hi);
        m_lo = mn_lo;
        m_hi = mn_hi;
        l_lo *= a_lo;
        l_hi *= a_hi;
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 8; i++) {
            o[i][0] *= a_lo; o[i][1] *= a_lo; o[i][2] *= a_hi; o[i][3] *= a_hi;
        }
        // P = exp2(S - m), rounded to bf16 for the P V product (as flash attention does).
        u32 pa[PF_KEYS / 16][4];
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; nt++) {
            float p0 = exp2f(sc[nt][0] - ref_lo), p1 = exp2f(sc[nt][1] - ref_lo);
            float p2 = exp2f(sc[nt][2] - ref_hi), p3 = exp2f(sc[nt][3] - ref_hi);
            l_lo += p0 + p1;
            l_hi += p2 + p3;
            int kk = nt >> 1, hi = nt & 1;
            pa[kk][hi * 2 + 0] = pack_bf2(p0, p1);
            pa[kk][hi * 2 + 1] = pack_bf2(p2, p3);
        }
        // O += P V: A = P (16 x 64), B = V (64 keys x HEAD_DIM) read from the transposed tile.
#pragma unroll
        for (int dn = 0; dn < HEAD_DIM / 8; dn++) {
            const bf16* vr = vt + (dn * 8 + g) * V_PITCH + tq * 2;
#pragma unroll
            for (int kk = 0; kk < PF_KEYS / 16; kk++) {
                u32 b0 = *(const u32*)(vr + kk * 16);
                u32 b1 = *(const u32*)(vr + kk * 16 + 8);
                // pa[kk] = {row g keys 0-7 of the k-step, row g+8 keys 0-7, row g keys 8-15, row g+8 keys 8-15}
                mma_bf16(o[dn], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0, b1);
            }
        }
    }
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const int stride = n_heads * HEAD_DIM;
    if (r_lo < nq) {
        bf16* dst = out + (u64)(qrow0 + r_lo) * stride + h * HEAD_DIM + tq * 2;
        float inv = 1.f / l_lo;
#pragma unroll
        for (int dn = 0; dn < HEAD_DIM / 8; dn++) *(u32*)(dst + dn * 8) = pack_bf2(o[dn][0] * inv, o[dn][1] * inv);
    }
    if (r_hi < nq) {
        bf16* dst = out + (u64)(qrow0 + r_hi) * stride + h * HEAD_DIM + tq * 2;
        float inv = 1.f / l_hi;
#pragma unroll
        for (int dn = 0; dn < HEAD_DIM / 8; dn++) *(u32*)(dst + dn * 8) = pack_bf2(o[dn][2] * inv, o[dn][3] * inv);
    }
}

// ---- Decode: one new token per sequence, split over key partitions (flash-decoding), GQA-aware. ----
// Block = (sequence, kv head, partition of part_len <= DEC_PART keys), 128 threads; small batches use
// short partitions so that enough blocks fill the GPU. All GQA query heads of the kv
// head are scored together, so each K/V byte is read once per step. Partial results (max, sum,
// unnormalised output) go to part_* and attn_decode_reduce combines them.
#define DEC_THREADS 128
#define TPK (HEAD_DIM / 8)                // threads per key in the scoring pass (16-byte loads)
#define KPI (DEC_THREADS / TPK)           // keys scored per iteration
#define VCH (HEAD_DIM / 8)                // 16-byte chunks per V row
#define VLANES (DEC_THREADS / VCH)        // keys accumulated in parallel in the V pass

// Scores one key (this thread's 8 dims of it) against the GQA query heads; the TPK threads of the
// key reduce with shuffles and the first stores the score.
__device__ __forceinline__ void score_key(const uint4& raw, const float (&qf)[GQA][8], float (*sc)[DEC_PART], int j,
                                          int n, int t) {
    float kf[8];
    unpack8(raw, kf);
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) d += qf[g][e] * kf[e];
#pragma unroll
        for (int o = TPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (t % TPK == 0 && j < n) sc[g][j] = d;
    }
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode(
    const bf16* __restrict__ qkv, int qkv_width, const int* __restrict__ dec_row, const int* __restrict__ dec_ctx,
    const int* __restrict__ dec_bt, const int* __restrict__ bt, const bf16* __restrict__ cache,
    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_o, int n_heads, int n_kv,
    int max_parts, int part_len, float scale_log2) {
    __shared__ float sc[GQA][DEC_PART];
    __shared__ float red[VLANES][GQA][HEAD_DIM];
    const int i = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const int ctx = dec_ctx[i];
    const int start = part * part_len;  // part_len <= DEC_PART, the shared score buffer's size
    if (start >= ctx) return;
    const int end = min(ctx, start + part_len);
    const int n = end - start;
    const int* tbl = bt + dec_bt[i];
    const int t = threadIdx.x;

    // Scoring: thread t covers dims (t % TPK) * 8 .. +8 of key (t / TPK) + KPI * iteration.
    const int c = (t % TPK) * 8, kk = t / TPK;
    float qf[GQA][8];
    const bf16* qbase = qkv + (u64)dec_row[i] * qkv_width + (kvh * GQA) * HEAD_DIM + c;
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        uint4 raw = *(const uint4*)(qbase + g * HEAD_DIM);
        unpack8(raw, qf[g]);
#pragma unroll
        for (int e = 0; e < 8; e++) qf[g][e] *= scale_log2;
    }
    // Two keys per thread per iteration keep two 16-byte loads in flight. The loop bound is
    // block-uniform so that every lane reaches the shuffles; lanes past the end score a zero key and
    // do not store.
    for (int j0 = 0; j0 < n; j0 += 2 * KPI) {
        const int ja = j0 + kk, jb = ja + KPI;
        uint4 ra = make_uint4(0, 0, 0, 0), rb = make_uint4(0, 0, 0, 0);
        if (ja < n) ra = *(const uint4*)(kv_row(cache, tbl, start + ja, 0, n_kv, kvh) + c);
        if (jb < n) rb = *(const uint4*)(kv_row(cache, tbl, start + jb, 0, n_kv, kvh) + c);
        score_key(ra, qf, sc, ja, n, t);
        score_key(rb, qf, sc, jb, n, t);
    }
    __syncthreads();
    // Softmax statistics per head: warp w handles heads w, w + 4, ...
    const int warp = t >> 5, lane = t & 31;
    for (int g = warp; g < GQA; g += DEC_THREADS / 32) {
        float m = NEG_INF;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[g][j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = lane; j < n; j += 32) {
            float p = exp2f(sc[g][j] - m);
            sc[g][j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            u64 idx = ((u64)i * n_heads + kvh * GQA + g) * max_parts + part;
            part_m[idx] = m;
            part_l[idx] = l;
        }
    }
    __syncthreads();
    // V pass: thread t accumulates dims (t % VCH) * 8 .. +8 over keys (t / VCH) + VLANES * iteration.
    const int c8 = (t % VCH) * 8, vl = t / VCH;
    float acc[GQA][8];
#pragma unroll
    for (int g = 0; g < GQA; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
    for (int j = vl; j < n; j += VLANES) {
        uint4 raw = *(const uint4*)(kv_row(cache, tbl, start + j, 1, n_kv, kvh) + c8);
        float vf[8];
        unpack8(raw, vf);
#pragma unroll
        for (int g = 0; g < GQA; g++) {
            float p = sc[g][j];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] += p * vf[e];
        }
    }
#pragma unroll
    for (int g = 0; g < GQA; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) red[vl][g][c8 + e] = acc[g][e];
    __syncthreads();
    for (int e = t; e < GQA * HEAD_DIM; e += DEC_THREADS) {
        int g = e / HEAD_DIM, d = e % HEAD_DIM;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < VLANES; v++) s += red[v][g][d];
        part_o[(((u64)i * n_heads + kvh * GQA + g) * max_parts + part) * HEAD_DIM + d] = s;
    }
}

// Combines the partitions of each (sequence, head) into the attention output row. grid = (n, n_heads).
extern "C" __global__ void attn_decode_reduce(const int* __restrict__ dec_row, const int* __restrict__ dec_ctx,
                                              const float* __restrict__ part_m, const float* __restrict__ part_l,
                                              const float* __restrict__ part_o, bf16* __restrict__ out,
                                              int n_heads, int max_parts, int part_len) {
    const int i = blockIdx.x, h = blockIdx.y;
    const int parts = (dec_ctx[i] + part_len - 1) / part_len;
    const u64 base = ((u64)i * n_heads + h) * max_parts;
    float m = NEG_INF;
    for (int p = 0; p < parts; p++) m = fmaxf(m, part_m[base + p]);
    float l = 0.f;
    for (int p = 0; p < parts; p++) l += exp2f(part_m[base + p] - m) * part_l[base + p];
    float inv = 1.f / l;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float s = 0.f;
        for (int p = 0; p < parts; p++) s += exp2f(part_m[base + p] - m) * part_o[(base + p) * HEAD_DIM + d];
        out[(u64)dec_row[i] * n_heads * HEAD_DIM + h * HEAD_DIM + d] = f2bf(s * inv);
    }
}

// ---- Small-batch GEMV: y[m][n] = sum_k x[m][k] w[n][k] for M <= 8 rows (decode). ----
// One warp per output feature streams its weight row once with 16-byte loads, four in flight per
// lane; the M activation rows are re-read from L1/L2. This is the bandwidth-bound path of decode,
// where cuBLAS's GEMM reaches only part of the copy bandwidth.
template <int M>
__device__ __forceinline__ void gemv_body(const bf16* __restrict__ x, const bf16* __restrict__ w, void* __restrict__ y,
                                          int N, int K, int f32_out) {
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (n >= N) return;
    const bf16* wr = w + (u64)n * K;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.f;
    for (int k0 = lane * 8; k0 < K; k0 += 32 * 8 * 4) {
        uint4 wv[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int k = k0 + u * 256;
            wv[u] = k < K ? __ldg((const uint4*)(wr + k)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int k = k0 + u * 256;
            if (k >= K) break;
            float wf[8];
            unpack8(wv[u], wf);
#pragma unroll
            for (int m = 0; m < M; m++) {
                float xf[8];
                unpack8(__ldg((const uint4*)(x + (u64)m * K + k)), xf);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[m] += wf[e] * xf[e];
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        float v = warp_sum(acc[m]);
        if (lane == 0) {
            if (f32_out) ((float*)y)[(u64)m * N + n] = v;
            else ((bf16*)y)[(u64)m * N + n] = f2bf(v);
        }
    }
}

#define GEMV(MM) \
    extern "C" __global__ void __launch_bounds__(256) gemv_##MM(const bf16* __restrict__ x, const bf16* __restrict__ w, \
                                                               void* __restrict__ y, int N, int K, int f32_out) { \
        gemv_body<MM>(x, w, y, N, K, f32_out); \
    }
GEMV(1)
GEMV(2)
GEMV(3)
GEMV(4)
GEMV(5)
GEMV(6)
GEMV(7)
GEMV(8)
