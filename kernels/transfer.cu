// hicache-io copy kernels: the `kernel` io backend on CUDA.
//
// One kernel for every address mode the planner emits. A side's byte address of item `idx`,
// head chunk `h` is
//     ptr + base + (idx / page) * page_stride + (idx % page) * row_stride + h * head_stride
// (layer_first, page_first, page_first_direct, page_head and per-head layer_first are this
// formula with different strides). `launches` is a device table of (src, dst) sides: one per
// (layer, component), K before V, so one launch covers every layer like sglang's all-layer ops.
//
// Warp per item, strided mapping (item = i * warp_num + warp_id) as in sglang's transfer.cu;
// index pairs with a negative entry are skipped. Lanes copy 8-byte words with non-coherent
// loads and L2-cached stores (ld.global.nc / st.global.cg); items whose chunk or addresses are
// not 8-byte aligned use the 4-byte variant. Host memory is pinned and mapped (UVA).
// No #include for NVRTC: it needs no CUDA headers.
//
// Host emulation (tests/kernel_emu.rs): with HICACHE_HOST_EMULATION defined, g++ compiles this
// file for the CPU. kernels/host_emulation.h supplies threadIdx / blockIdx / blockDim / gridDim
// as variables its launcher sets while it walks the grid, and checked plain loads and stores in
// place of the inline PTX below.

#ifdef HICACHE_HOST_EMULATION
#include "host_emulation.h"
#endif

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

struct Side {
    u64 ptr;
    u64 base;
    u64 page;
    u64 page_stride;
    u64 row_stride;
    u64 head_stride;
};

struct Launch {
    Side src;
    Side dst;
};

__device__ __forceinline__ char* address(const Side& s, u64 idx, u64 head) {
    // page == 1 (every layout but page_head / page_first_direct): no 64-bit division.
    const u64 paged = s.page == 1 ? idx * s.page_stride : (idx / s.page) * s.page_stride + (idx % s.page) * s.row_stride;
    return (char*)(s.ptr + s.base + paged + head * s.head_stride);
}

// The copy words: non-coherent loads (sources are read-only for the kernel's lifetime) and
// stores cached in L2 only.
__device__ __forceinline__ u64 ld_nc_b64(const char* p) {
#ifdef HICACHE_HOST_EMULATION
    return hicache_emu_load<u64>(p);
#else
    u64 v;
    asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ void st_cg_b64(char* p, u64 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_store<u64>(p, v);
#else
    asm volatile("st.global.cg.b64 [%0], %1;" ::"l"(p), "l"(v));
#endif
}

__device__ __forceinline__ u32 ld_nc_b32(const char* p) {
#ifdef HICACHE_HOST_EMULATION
    return hicache_emu_load<u32>(p);
#else
    u32 v;
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ void st_cg_b32(char* p, u32 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_store<u32>(p, v);
#else
    asm volatile("st.global.cg.b32 [%0], %1;" ::"l"(p), "r"(v));
#endif
}

// The two word sizes behind one name, so that one copy loop serves both.
__device__ __forceinline__ u64 ld_nc(const u64* p) { return ld_nc_b64((const char*)p); }
__device__ __forceinline__ u32 ld_nc(const u32* p) { return ld_nc_b32((const char*)p); }
__device__ __forceinline__ void st_cg(u64* p, u64 v) { st_cg_b64((char*)p, v); }
__device__ __forceinline__ void st_cg(u32* p, u32 v) { st_cg_b32((char*)p, v); }

// Lane `lane` of a warp copies words lane, lane + 32, ... of a chunk. Each lane keeps four loads
// in flight before their stores where the chunk is long enough (8448-byte DSA pages: 33 8-byte
// words per lane), then finishes one word at a time.
template <typename W>
__device__ __forceinline__ void copy_words(const char* src, char* dst, u64 bytes, u32 lane) {
    const W* s = (const W*)src;
    W* d = (W*)dst;
    const u64 words = bytes / sizeof(W);
    u64 j = lane;
    for (; j + 96 < words; j += 128) {
        const W a = ld_nc(s + j);
        const W b = ld_nc(s + j + 32);
        const W c = ld_nc(s + j + 64);
        const W e = ld_nc(s + j + 96);
        st_cg(d + j, a);
        st_cg(d + j + 32, b);
        st_cg(d + j + 64, c);
        st_cg(d + j + 96, e);
    }
    for (; j < words; j += 32) {
        st_cg(d + j, ld_nc(s + j));
    }
}

template <int WORD>
__device__ __forceinline__ void gather_impl(const Launch* __restrict__ launches, int n_launches, const i64* __restrict__ src_idx,
                                            const i64* __restrict__ dst_idx, i64 n_items, u64 heads, u64 chunk_bytes,
                                            i64 items_per_warp) {
    const u32 lane = threadIdx.x & 31;
    const i64 warp_id = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 warp_num = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 i = 0; i < items_per_warp; ++i) {
        const i64 item = i * warp_num + warp_id;
        if (item >= n_items) break;
        const i64 s = src_idx[item];
        const i64 d = dst_idx[item];
        if (s < 0 || d < 0) continue;
        for (int l = 0; l < n_launches; ++l) {
            const Launch L = launches[l];
            for (u64 h = 0; h < heads; ++h) {
                const char* sp = address(L.src, (u64)s, h);
                char* dp = address(L.dst, (u64)d, h);
                if (WORD == 8) {
                    copy_words<u64>(sp, dp, chunk_bytes, lane);
                } else {
                    copy_words<u32>(sp, dp, chunk_bytes, lane);
                }
            }
        }
    }
}

// __launch_bounds__(1024): 32 warps per block (sglang's default) must always launch, so ptxas
// keeps to 64 registers per thread (65536 per SM on sm_80 / sm_90); the compile gate checks it.
extern "C" __global__ void __launch_bounds__(1024) hicache_gather_w8(const Launch* __restrict__ launches, int n_launches,
                                                                     const i64* __restrict__ src_idx, const i64* __restrict__ dst_idx,
                                                                     i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp) {
    gather_impl<8>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp);
}

extern "C" __global__ void __launch_bounds__(1024) hicache_gather_w4(const Launch* __restrict__ launches, int n_launches,
                                                                     const i64* __restrict__ src_idx, const i64* __restrict__ dst_idx,
                                                                     i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp) {
    gather_impl<4>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp);
}
