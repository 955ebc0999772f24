#!/usr/bin/env python3
"""What one sgl-kernel op call costs beyond its bytes: ``hicache_io.kvcacheio.transfer_kv_per_layer``
on the cpu executor over numpy arrays, 16 tokens of 128 B (K and V), median µs a call of five runs
of ``CALLS`` calls (after one warm-up run). The copy itself is a few hundred bytes: the figure is
the route (argument reading, checks, planning, the executor's queue).

    python3 scripts/bench-op-call.py [CALLS]
"""
import statistics
import sys
import time

import numpy as np

from hicache_io import kvcacheio as kv

TOKENS = 16
ITEM = 128  # bytes per token of K or V
SLOTS = 64


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    src_k = np.arange(SLOTS * ITEM, dtype=np.uint8).reshape(SLOTS, ITEM)
    src_v = src_k.copy()
    dst_k, dst_v = np.zeros_like(src_k), np.zeros_like(src_k)
    si = np.arange(TOKENS, dtype=np.int64)
    di = si + 32
    f = kv.transfer_kv_per_layer

    def once():
        t = time.perf_counter()
        for _ in range(calls):
            f(src_k, dst_k, src_v, dst_v, si, di, ITEM)
        return (time.perf_counter() - t) / calls * 1e6

    once()
    runs = [once() for _ in range(5)]
    assert (dst_k[32:48] == src_k[:16]).all() and (dst_v[32:48] == src_v[:16]).all()
    print(f"transfer_kv_per_layer {TOKENS} tokens x {ITEM} B: median {statistics.median(runs):.2f} us/call over {calls} calls (runs: {', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
