// Host emulation of the CUDA built-ins kernels/transfer.cu uses, for tests/kernel_emu.rs:
//
//     g++ -O1 -std=c++17 -shared -fPIC -DHICACHE_HOST_EMULATION -x c++ kernels/transfer.cu
//
// compiles the device code for the CPU (transfer.cu includes this header under the macro).
// `hicache_emu_launch` takes a kernel, a grid and the kernel parameters as cuLaunchKernel takes
// them (an array of pointers to each argument) and walks the grid block by block, thread by
// thread, with threadIdx / blockIdx / blockDim / gridDim set. Running the threads one after the
// other is exact for these kernels: their threads never synchronize or share data.
//
// Every global load and store goes through a check against the ranges the caller registers:
// in bounds, readable (loads) or writable (stores), and naturally aligned (the GPU faults on a
// misaligned 8-byte access). A bad access is counted and skipped, never performed, so a wrong
// launch description fails the test instead of corrupting its memory.

#pragma once

#ifndef HICACHE_HOST_EMULATION
#error "host_emulation.h is for host builds with -DHICACHE_HOST_EMULATION"
#endif

#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)

// The largest block the kernels accept (their __launch_bounds__).
#define HICACHE_EMU_MAX_THREADS 1024u

struct hicache_emu_dim3 {
    unsigned int x, y, z;
};

// Per calling thread, so that test threads can run launches side by side.
static thread_local hicache_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

// A memory range the kernel may touch: [start, start + len) as the kernel addresses it, with
// access flags, backed by host memory at `host` (equal to `start` when the kernel's addresses are
// host addresses; the simulated driver's device addresses are not, so that a device pointer used
// as a host pointer faults instead of reading something).
enum { HICACHE_EMU_READ = 1, HICACHE_EMU_WRITE = 2 };
struct hicache_emu_range {
    uint64_t start;
    uint64_t len;
    uint64_t flags;
    uint64_t host;
};

// What one launch did. `first_fault_*` describe the first bad access, when `faults > 0`.
struct hicache_emu_report {
    uint64_t faults;
    uint64_t first_fault_addr;
    uint64_t first_fault_size;
    uint64_t first_fault_flags;  // HICACHE_EMU_READ (load) or HICACHE_EMU_WRITE (store)
    uint64_t bytes_loaded;
    uint64_t bytes_stored;
};

struct hicache_emu_state {
    const hicache_emu_range* ranges;
    int n_ranges;
    int last;  // the range the previous access hit: consecutive accesses mostly hit it again
    hicache_emu_report report;
};
static thread_local hicache_emu_state hicache_emu;

// The host address behind kernel address `p`, or null for a bad access (counted).
static inline char* hicache_emu_check(const void* p, uint64_t size, uint64_t need) {
    const uint64_t a = (uint64_t)(uintptr_t)p;
    if (a % size == 0) {
        const int n = hicache_emu.n_ranges;
        for (int k = 0; k < n; ++k) {
            const int i = (hicache_emu.last + k) % n;
            const hicache_emu_range& r = hicache_emu.ranges[i];
            if ((r.flags & need) && a >= r.start && r.len >= size && a - r.start <= r.len - size) {
                hicache_emu.last = i;
                return (char*)(uintptr_t)(r.host + (a - r.start));
            }
        }
    }
    hicache_emu_report& rep = hicache_emu.report;
    if (rep.faults++ == 0) {
        rep.first_fault_addr = a;
        rep.first_fault_size = size;
        rep.first_fault_flags = need;
    }
    return nullptr;
}

template <typename T>
static inline T hicache_emu_load(const char* p) {
    T v{};
    if (const char* h = hicache_emu_check(p, sizeof(T), HICACHE_EMU_READ)) {
        std::memcpy(&v, h, sizeof(T));
        hicache_emu.report.bytes_loaded += sizeof(T);
    }
    return v;
}

template <typename T>
static inline void hicache_emu_store(char* p, T v) {
    if (char* h = hicache_emu_check(p, sizeof(T), HICACHE_EMU_WRITE)) {
        std::memcpy(h, &v, sizeof(T));
        hicache_emu.report.bytes_stored += sizeof(T);
    }
}

// CUDA's atomicMin on global words, for one thread at a time (the launcher runs threads one
// after the other).
static inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = hicache_emu_load<unsigned long long>((const char*)p);
    if (v < old) hicache_emu_store<unsigned long long>((char*)p, v);
    return old;
}
static inline unsigned int atomicMin(unsigned int* p, unsigned int v) {
    const unsigned int old = hicache_emu_load<unsigned int>((const char*)p);
    if (v < old) hicache_emu_store<unsigned int>((char*)p, v);
    return old;
}

// CUDA's 64-bit atomicAdd, as atomicMin above.
static inline void hicache_emu_atomic_add(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = hicache_emu_load<unsigned long long>((const char*)p);
    hicache_emu_store<unsigned long long>((char*)p, old + v);
}

// A kernel's host entry point (transfer.cu's hicache_emu_* thunks): the parameters as
// cuLaunchKernel takes them, an array of pointers to each argument.
typedef void (*hicache_emu_kernel)(void** params);

// Runs `kernel` over a grid of `grid` blocks of `block` threads. Pointers the kernels read
// without the checked loads (the gathers' table and index lists) must be host addresses (the
// simulated driver translates them first). Returns 0, or -1 for a launch the driver would refuse
// (an empty grid or block, or more threads than the kernels' launch bounds).
extern "C" __attribute__((visibility("default"))) int hicache_emu_launch(hicache_emu_kernel kernel, unsigned int grid, unsigned int block,
                                                                         void** params, const hicache_emu_range* ranges, int n_ranges,
                                                                         hicache_emu_report* report) {
    if (grid == 0 || block == 0 || block > HICACHE_EMU_MAX_THREADS) return -1;
    hicache_emu = hicache_emu_state{ranges, n_ranges, 0, hicache_emu_report{}};
    gridDim = hicache_emu_dim3{grid, 1, 1};
    blockDim = hicache_emu_dim3{block, 1, 1};
    for (unsigned int b = 0; b < grid; ++b) {
        for (unsigned int t = 0; t < block; ++t) {
            blockIdx = hicache_emu_dim3{b, 0, 0};
            threadIdx = hicache_emu_dim3{t, 0, 0};
            kernel(params);
        }
    }
    *report = hicache_emu.report;
    return 0;
}
