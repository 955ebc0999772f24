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
// index pairs with a negative entry are skipped. The 32 lanes of a warp walk the item's words
// across every (layer, component) and head chunk as one sequence, so a lane keeps UNROLL loads
// in flight before their stores whatever the chunk size (a 256-byte head chunk alone would give
// each lane one load). Words are 16 bytes (ld.global.nc.v2.u64) when every base and stride is
// 16-byte aligned, else 8 or 4 bytes; non-coherent loads and L2-cached stores
// (ld.global.nc / st.global.cg). Host memory is pinned and mapped (UVA).
//
// Item checksums: hicache_gather_sum_w{16,8,4} copy exactly as the plain kernels do and add each
// 32-bit word's term key_i * word_i (mod 2^64; i = the word's position in its item, all head
// chunks in order; key_i computed from i in registers, no key table) into the item's entry of `sums` (zeroed before the launch), one 64-bit atomic
// add per lane and (layer, component); the host settles the entries once they are copied back.
//
// CUDA index lists are checked on the device (hicache_check_indices, three launches on the same
// stream before the copies): the gathers read the call's status word first and copy nothing
// unless every check passed, so an invalid list moves no byte without a host round trip.
//
// No #include for NVRTC: it needs no CUDA headers.
//
// Host emulation (tests/kernel_emu.rs, the simulated driver): with HICACHE_HOST_EMULATION
// defined, g++ compiles this file for the CPU. kernels/host_emulation.h supplies threadIdx /
// blockIdx / blockDim / gridDim as variables its launcher sets while it walks the grid, and
// checked plain loads, stores and atomics in place of the inline PTX below.

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

// A 16-byte word.
struct alignas(16) V16 {
    u64 lo;
    u64 hi;
};

// Loads each lane keeps in flight before its stores.
#define UNROLL 4
#ifdef HICACHE_HOST_EMULATION
#define UNROLLED
#else
#define UNROLLED _Pragma("unroll")
#endif

__device__ __forceinline__ char* address(const Side& s, u64 idx, u64 head) {
    // page == 1 (every layout but page_head / page_first_direct): no 64-bit division.
    const u64 paged = s.page == 1 ? idx * s.page_stride : (idx / s.page) * s.page_stride + (idx % s.page) * s.row_stride;
    return (char*)(s.ptr + s.base + paged + head * s.head_stride);
}

// The copy words: non-coherent loads (sources are read-only for the kernel's lifetime) and
// stores cached in L2 only.
__device__ __forceinline__ V16 ld_nc(const V16* p) {
#ifdef HICACHE_HOST_EMULATION
    return hicache_emu_load<V16>((const char*)p);
#else
    V16 v;
    asm volatile("ld.global.nc.v2.u64 {%0, %1}, [%2];" : "=l"(v.lo), "=l"(v.hi) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ void st_cg(V16* p, V16 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_store<V16>((char*)p, v);
#else
    asm volatile("st.global.cg.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(v.lo), "l"(v.hi));
#endif
}

__device__ __forceinline__ u64 ld_nc(const u64* p) {
#ifdef HICACHE_HOST_EMULATION
    return hicache_emu_load<u64>((const char*)p);
#else
    u64 v;
    asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ void st_cg(u64* p, u64 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_store<u64>((char*)p, v);
#else
    asm volatile("st.global.cg.b64 [%0], %1;" ::"l"(p), "l"(v));
#endif
}

__device__ __forceinline__ u32 ld_nc(const u32* p) {
#ifdef HICACHE_HOST_EMULATION
    return hicache_emu_load<u32>((const char*)p);
#else
    u32 v;
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ void st_cg(u32* p, u32 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_store<u32>((char*)p, v);
#else
    asm volatile("st.global.cg.b32 [%0], %1;" ::"l"(p), "r"(v));
#endif
}

// Plain (coherent) accesses of the check's words, written by an earlier launch.
__device__ __forceinline__ u64 ld_u64(const u64* p) {
#ifdef HICACHE_HOST_EMULATION
    return hicache_emu_load<u64>((const char*)p);
#else
    return *(const volatile u64*)p;
#endif
}

__device__ __forceinline__ i64 ld_i64(const i64* p) { return (i64)ld_u64((const u64*)p); }

__device__ __forceinline__ u32 ld_u32(const u32* p) {
#ifdef HICACHE_HOST_EMULATION
    return hicache_emu_load<u32>((const char*)p);
#else
    return *(const volatile u32*)p;
#endif
}

__device__ __forceinline__ void st_u64(u64* p, u64 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_store<u64>((char*)p, v);
#else
    *(volatile u64*)p = v;
#endif
}

__device__ __forceinline__ void st_u32(u32* p, u32 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_store<u32>((char*)p, v);
#else
    *(volatile u32*)p = v;
#endif
}

// 64-bit atomic add (the checksum entries several lanes add into).
__device__ __forceinline__ void atomic_add(u64* p, u64 v) {
#ifdef HICACHE_HOST_EMULATION
    hicache_emu_atomic_add(p, v);
#else
    atomicAdd((unsigned long long*)p, (unsigned long long)v);
#endif
}

// Checksum key of 32-bit word `p` of an item: mix32(key_base ^ p) | 1 (lowbias32, a bijection of
// 32-bit words; odd so that every word value changes its term), computed in registers from the
// word's position, so checksums load nothing but the copy's own words. The crate computes the
// same stream (hicache_io::integrity::key).
__device__ __forceinline__ u32 key_at(u32 key_base, u32 p) {
    u32 x = key_base ^ p;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return (x ^ (x >> 16)) | 1u;
}

// Checksum terms of one copy word whose first 32-bit word is word `p` of its item:
// `Σ key_(p+j) · word_j` over its 32-bit words (little-endian halves of the 64-bit fields), each an
// exact 32 × 32 → 64-bit product, mod 2^64.
__device__ __forceinline__ u64 lo32(u64 x) { return x & 0xffffffffull; }
__device__ __forceinline__ u64 terms(u32 kb, u32 p, const V16& v) {
    return (u64)key_at(kb, p) * lo32(v.lo) + (u64)key_at(kb, p + 1) * (v.lo >> 32) + (u64)key_at(kb, p + 2) * lo32(v.hi) +
           (u64)key_at(kb, p + 3) * (v.hi >> 32);
}
__device__ __forceinline__ u64 terms(u32 kb, u32 p, u64 v) { return (u64)key_at(kb, p) * lo32(v) + (u64)key_at(kb, p + 1) * (v >> 32); }
__device__ __forceinline__ u64 terms(u32 kb, u32 p, u32 v) { return (u64)key_at(kb, p) * (u64)v; }

// One item (source index s, destination index d): the words of every (layer, component) and head
// chunk as one sequence; lane `lane` copies words lane, lane + 32, ... of it. The lane's cursor
// (launch l, head h, word w of that chunk) advances without division.
//
// SUM (the `_sum` kernels): the lane also adds each word's checksum terms (key of 32-bit word
// (h · chunk words + word) of the item, computed by key_at) into its running sum of the current launch,
// and adds that sum into `sums[l]` (the item's entry for address pair l, zeroed before the
// launch) when its cursor leaves the launch: a lane's words of one launch are consecutive in its
// sequence, so each lane adds at most once per launch. Summing after the stores keeps the loads
// in flight together, as in the plain kernel.
template <bool SUM>
struct Cursor {
    typedef u64 T;
};
template <>
struct Cursor<true> {
    typedef u32 T;
};

template <typename W, bool SUM>
__device__ __forceinline__ void copy_item(const Launch* __restrict__ launches, int n_launches, u64 s, u64 d,
                                          typename Cursor<SUM>::T heads, typename Cursor<SUM>::T words, u32 lane,
                                          u32 key_base, u64* sums) {
    // 32-bit words per copy word.
    constexpr u64 R = sizeof(W) / 4;
    // The cursor's head and word: 32-bit in the summing kernels (registers are short there; the
    // launch description keeps an item's words below 2^32).
    typedef typename Cursor<SUM>::T C;
    C w = lane, h = 0;
    int l = 0;
    while (w >= words) {
        w -= words;
        if (++h == heads) {
            h = 0;
            ++l;
        }
    }
    const char* sp = nullptr;
    char* dp = nullptr;
    int at_l = -1;
    C at_h = 0;
    u64 acc = 0;
    int acc_l = -1;
    while (l < n_launches) {
        W v[UNROLL];
        W* to[UNROLL];
        // Summing: copy word u's launch is l0 + an 8-bit step per word (a lane's cursor crosses
        // at most 32 launches per word), and its position among its launch's words is
        // q0 + 32·u less the words of the launches stepped over (registers are short in the
        // 16-byte kernel: no per-word key index is kept).
        const int l0 = l;
        const C q0 = h * words + w;
        u32 dl = 0;
UNROLLED
        for (int u = 0; u < UNROLL; ++u) {
            to[u] = nullptr;
            if (l < n_launches) {
                if (l != at_l || h != at_h) {
                    sp = address(launches[l].src, s, h);
                    dp = address(launches[l].dst, d, h);
                    at_l = l;
                    at_h = h;
                }
                v[u] = ld_nc((const W*)sp + w);
                to[u] = (W*)dp + w;
                if (SUM) {
                    dl |= (u32)(l - l0) << (8 * u);
                }
                w += 32;
                while (w >= words) {
                    w -= words;
                    if (++h == heads) {
                        h = 0;
                        ++l;
                    }
                }
            }
        }
UNROLLED
        for (int u = 0; u < UNROLL; ++u) {
            if (to[u] != nullptr) st_cg(to[u], v[u]);
        }
        if (SUM) {
UNROLLED
            for (int u = 0; u < UNROLL; ++u) {
                if (to[u] != nullptr) {
                    const u32 step = (dl >> (8 * u)) & 0xff;
                    const int lu = l0 + (int)step;
                    if (lu != acc_l) {
                        if (acc_l >= 0) atomic_add(sums + acc_l, acc);
                        acc = 0;
                        acc_l = lu;
                    }
                    const C q = q0 + 32 * (C)u - (C)step * heads * words;
                    acc += terms(key_base, (u32)(q * (C)R), v[u]);
                }
            }
        }
    }
    if (SUM && acc_l >= 0) atomic_add(sums + acc_l, acc);
}

// `status`: null, or the call's check word (hicache_check_indices): anything but ~0 means an
// index failed a check, and nothing is copied. `key_base` / `sums`: the `_sum` kernels' key
// stream (its base in the low 32 bits) and their sums, `n_launches` u64 entries per index pair.
template <typename W, bool SUM>
__device__ __forceinline__ void gather_impl(const Launch* __restrict__ launches, int n_launches, const i64* __restrict__ src_idx,
                                            const i64* __restrict__ dst_idx, i64 n_items, u64 heads, u64 chunk_bytes,
                                            i64 items_per_warp, const u64* __restrict__ status, u64 key_base,
                                            u64* __restrict__ sums) {
    if (status != nullptr && ld_u64(status) != ~0ull) return;
    const u64 words = chunk_bytes / sizeof(W);
    if (words == 0 || heads == 0 || n_launches <= 0) return;
    const u32 lane = threadIdx.x & 31;
    const i64 warp_id = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 warp_num = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 i = 0; i < items_per_warp; ++i) {
        const i64 item = i * warp_num + warp_id;
        if (item >= n_items) break;
        const i64 s = src_idx[item];
        const i64 d = dst_idx[item];
        if (s < 0 || d < 0) continue;
        copy_item<W, SUM>(launches, n_launches, (u64)s, (u64)d, (typename Cursor<SUM>::T)heads, (typename Cursor<SUM>::T)words, lane, (u32)key_base,
                          SUM ? sums + (u64)item * (u64)n_launches : nullptr);
    }
}

// __launch_bounds__(1024): 32 warps per block (sglang's default) must always launch, so ptxas
// keeps to 64 registers per thread (65536 per SM on sm_80 / sm_90); the compile gate checks it.
// (Written out, not generated by a macro: ptxas 12.0 crashes on sm_90 line info of a kernel
// defined inside a macro expansion.)
extern "C" __global__ void __launch_bounds__(1024) hicache_gather_w16(const Launch* __restrict__ launches, int n_launches,
                                                                      const i64* __restrict__ src_idx, const i64* __restrict__ dst_idx,
                                                                      i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp,
                                                                      const u64* __restrict__ status) {
    gather_impl<V16, false>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp, status, 0, nullptr);
}

extern "C" __global__ void __launch_bounds__(1024) hicache_gather_w8(const Launch* __restrict__ launches, int n_launches,
                                                                      const i64* __restrict__ src_idx, const i64* __restrict__ dst_idx,
                                                                      i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp,
                                                                      const u64* __restrict__ status) {
    gather_impl<u64, false>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp, status, 0, nullptr);
}

extern "C" __global__ void __launch_bounds__(1024) hicache_gather_w4(const Launch* __restrict__ launches, int n_launches,
                                                                      const i64* __restrict__ src_idx, const i64* __restrict__ dst_idx,
                                                                      i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp,
                                                                      const u64* __restrict__ status) {
    gather_impl<u32, false>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp, status, 0, nullptr);
}

// The checksumming gathers: the plain kernels' arguments, then the key stream's base and the sums.
extern "C" __global__ void __launch_bounds__(1024)
    hicache_gather_sum_w16(const Launch* __restrict__ launches, int n_launches, const i64* __restrict__ src_idx,
                          const i64* __restrict__ dst_idx, i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp,
                          const u64* __restrict__ status, u64 key_base, u64* __restrict__ sums) {
    gather_impl<V16, true>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp, status, key_base, sums);
}

extern "C" __global__ void __launch_bounds__(1024)
    hicache_gather_sum_w8(const Launch* __restrict__ launches, int n_launches, const i64* __restrict__ src_idx,
                          const i64* __restrict__ dst_idx, i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp,
                          const u64* __restrict__ status, u64 key_base, u64* __restrict__ sums) {
    gather_impl<u64, true>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp, status, key_base, sums);
}

extern "C" __global__ void __launch_bounds__(1024)
    hicache_gather_sum_w4(const Launch* __restrict__ launches, int n_launches, const i64* __restrict__ src_idx,
                          const i64* __restrict__ dst_idx, i64 n_items, u64 heads, u64 chunk_bytes, i64 items_per_warp,
                          const u64* __restrict__ status, u64 key_base, u64* __restrict__ sums) {
    gather_impl<u32, true>(launches, n_launches, src_idx, dst_idx, n_items, heads, chunk_bytes, items_per_warp, status, key_base, sums);
}

// Checks of a call whose index lists are in device memory, in the planner's order: host indices
// in range, device indices in range, destinations unique among live pairs. The first failing
// (check, position) is the smallest key (check << 56 | position) in status[0] (~0: none), as
// the host checks would find it first. Three launches on one stream, over a grid-stride loop:
//   phase 0: range checks; each live in-range pair claims its destination in `owner` (a word
//            per destination slot, ~0 when free) with the smallest position;
//   phase 1: a pair that does not own its destination is a duplicate;
//   phase 2: the claims are released (owner back to ~0 for the next call), and one thread
//            writes the failing entry's values: status[1] = the index, status[2] = for a
//            duplicate the position that wrote it first — its claim, which that thread alone
//            reads and releases (every other thread reads the same status key and skips it).
//   phase 3 (after phase 2, once per layer table the call was planned from): `host_idx` is the
//            caller's table of layer addresses, `dev_idx` the copy taken when it was planned,
//            `host_bound` the position of its first entry among the call's tables; an entry
//            that differs is check 3 (the table was rewritten: nothing moves). `owner` unused.
// `n` < 2^32 - 1 (positions fit `owner`'s words).
extern "C" __global__ void __launch_bounds__(1024)
    hicache_check_indices(const i64* __restrict__ host_idx, const i64* __restrict__ dev_idx, i64 n, u64 host_bound, u64 dev_bound,
                          int dst_is_host, u32* __restrict__ owner, u64* __restrict__ status, int phase) {
    if (phase == 3) {
        const i64 stride = (i64)gridDim.x * blockDim.x;
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            if (ld_i64(host_idx + i) != ld_i64(dev_idx + i)) atomicMin(status, (3ull << 56) | (host_bound + (u64)i));
        }
        return;
    }
    const i64* dsts = dst_is_host ? host_idx : dev_idx;
    // Phase 2: the destination of a failed uniqueness check (-1: none), the same for every thread.
    i64 kept = -1;
    u64 key = ~0ull;
    if (phase == 2) {
        key = ld_u64(status);
        if (key != ~0ull && (key >> 56) == 2) kept = ld_i64(dsts + (i64)(key & ((1ull << 56) - 1)));
    }
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const i64 h = ld_i64(host_idx + i);
        const i64 v = ld_i64(dev_idx + i);
        const i64 dst = dst_is_host ? h : v;
        const bool claims = h >= 0 && v >= 0 && (u64)dst < (dst_is_host ? host_bound : dev_bound);
        if (phase == 0) {
            if (h >= 0 && (u64)h >= host_bound) atomicMin(status, (0ull << 56) | (u64)i);
            if (v >= 0 && (u64)v >= dev_bound) atomicMin(status, (1ull << 56) | (u64)i);
            if (claims) atomicMin(owner + dst, (u32)i);
        } else if (phase == 1) {
            if (claims && ld_u32(owner + dst) != (u32)i) atomicMin(status, (2ull << 56) | (u64)i);
        } else if (claims && dst != kept) {
            st_u32(owner + dst, ~0u);
        }
    }
    if (phase == 2 && blockIdx.x == 0 && threadIdx.x == 0 && key != ~0ull) {
        const u64 check = key >> 56;
        const i64 at = (i64)(key & ((1ull << 56) - 1));
        st_u64(status + 1, (u64)ld_i64((check == 0 ? host_idx : check == 1 ? dev_idx : dsts) + at));
        if (check == 2) {
            st_u64(status + 2, (u64)ld_u32(owner + kept));
            st_u32(owner + kept, ~0u);
        }
    }
}

#ifdef HICACHE_HOST_EMULATION
// Host entry points: each takes the kernel's parameters as cuLaunchKernel does (an array of
// pointers to the arguments) and calls the kernel for the current (block, thread).
#define P(i, T) (*(T*)params[i])
#define GATHER_THUNK(name, kernel)                                                                                           \
    extern "C" __attribute__((visibility("default"))) void name(void** params) {                                            \
        kernel(P(0, const Launch*), P(1, int), P(2, const i64*), P(3, const i64*), P(4, i64), P(5, u64), P(6, u64), P(7, i64), \
               P(8, const u64*));                                                                                           \
    }
GATHER_THUNK(hicache_emu_gather_w16, hicache_gather_w16)
GATHER_THUNK(hicache_emu_gather_w8, hicache_gather_w8)
GATHER_THUNK(hicache_emu_gather_w4, hicache_gather_w4)
#define GATHER_SUM_THUNK(name, kernel)                                                                                       \
    extern "C" __attribute__((visibility("default"))) void name(void** params) {                                            \
        kernel(P(0, const Launch*), P(1, int), P(2, const i64*), P(3, const i64*), P(4, i64), P(5, u64), P(6, u64), P(7, i64), \
               P(8, const u64*), P(9, u64), P(10, u64*));                                                            \
    }
GATHER_SUM_THUNK(hicache_emu_gather_sum_w16, hicache_gather_sum_w16)
GATHER_SUM_THUNK(hicache_emu_gather_sum_w8, hicache_gather_sum_w8)
GATHER_SUM_THUNK(hicache_emu_gather_sum_w4, hicache_gather_sum_w4)
extern "C" __attribute__((visibility("default"))) void hicache_emu_check_indices(void** params) {
    hicache_check_indices(P(0, const i64*), P(1, const i64*), P(2, i64), P(3, u64), P(4, u64), P(5, int), P(6, u32*), P(7, u64*),
                          P(8, int));
}
#undef P
#endif
