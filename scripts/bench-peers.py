#!/usr/bin/env python3
"""hicache-io's cpu executor next to what a user would otherwise run, in one run.

The same shapes as `hicache-io bench` (quick subset: N = 4096 random items, L = 8 layers; load =
one layer host -> device, backup = every layer device -> host) with numpy fancy indexing
(`dst[di] = src[si]`, the way sglang's CPU references are written) and, when it is installed,
torch `index_copy_` / `index_select`, both on the widest integer element the item size allows.
Prints one table of GB/s of bytes moved: hicache-io with item checksums off (the same plain copy the
peers make) and on (every item also checksummed), measured alternately in one run, and each over
the faster peer.

    python3 scripts/bench-peers.py [--bin target/release/hicache-io] [--budget-ms 300]

Needs numpy (`pip install numpy`); torch is optional.
"""
import argparse
import json
import subprocess
import sys
import time

import numpy as np

try:
    import torch
except ImportError:  # optional peer
    torch = None


def median_time(fn, budget_s):
    fn()  # warm-up
    samples, start = [], time.perf_counter()
    # As many runs as `hicache-io bench` takes (MAX_SAMPLES in src/timing.rs): same rule both sides.
    while len(samples) < 3 or (time.perf_counter() - start < budget_s and len(samples) < 2000):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


def peers(spec, budget_s, rng):
    """numpy (and torch) GB/s for one bench cell of layout layer_first or page_first."""
    item, n, layers, op, layout = spec["item"], spec["items"], spec["layers"], spec["op"], spec["layout"]
    slots = n + n // 4 + 4
    hi = rng.choice(slots - 1, n, replace=False)
    di = rng.choice(slots - 1, n, replace=False)
    # The widest element the item allows: torch's index kernels move uint8 rows several times slower (3.6x at 1152 B here)
    # than 8-byte ones, so the peer is given its strongest form.
    dtype = next(np.dtype(t) for t in (np.int64, np.int32, np.int16, np.uint8) if item % np.dtype(t).itemsize == 0)
    width = item // dtype.itemsize
    dev = np.ones((layers, slots, width), dtype=dtype)
    host = np.full((slots, layers, width) if layout == "page_first" else (layers, slots, width), 2, dtype=dtype)
    mid = layers // 2
    if op == "load":
        nbytes = n * item
        if layout == "page_first":
            def run():
                dev[mid][di] = host[hi, mid]
        else:
            def run():
                dev[mid][di] = host[mid][hi]
    else:
        nbytes = n * item * layers
        if layout == "page_first":
            def run():
                host[hi] = dev[:, di].transpose(1, 0, 2)
        else:
            def run():
                host[:, hi] = dev[:, di]
    out = {"numpy": nbytes / median_time(run, budget_s) / 1e9}
    if torch is not None:
        tdev, thost = torch.from_numpy(dev), torch.from_numpy(host)
        thi, tdi = torch.from_numpy(hi), torch.from_numpy(di)
        if op == "load":
            src = (lambda: thost[:, mid].index_select(0, thi)) if layout == "page_first" else (lambda: thost[mid].index_select(0, thi))

            def trun():
                tdev[mid].index_copy_(0, tdi, src())
        else:
            if layout == "page_first":
                def trun():
                    thost.index_copy_(0, thi, tdev.index_select(1, tdi).transpose(0, 1))
            else:
                def trun():
                    thost.index_copy_(1, thi, tdev.index_select(1, tdi))
        out["torch"] = nbytes / median_time(trun, budget_s) / 1e9
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/hicache-io")
    ap.add_argument("--budget-ms", type=int, default=300)
    ap.add_argument("--items", default="8448,1152,128", help="item sizes, as `hicache-io bench --items` takes them")
    args = ap.parse_args()
    # Each cell both ways in one run (alternating): checksums off is the peers' work (a plain
    # copy); on, every item is also checksummed (recorded on backup, verified on load).
    res = subprocess.run([args.bin, "bench", "--backend", "cpu", "--checksums", "--items", args.items,
                          "--budget-ms", str(args.budget_ms), "--json"], check=True, capture_output=True, text=True)
    rows = json.loads(res.stdout)
    rng = np.random.default_rng(7)
    budget_s = args.budget_ms / 1000
    print(f"numpy {np.__version__}" + (f", torch {torch.__version__}" if torch is not None else ", torch not installed"))
    print("hicache-io: checksums off (the same copy the peers make); +sums: every item also checksummed")
    head = f"{'cell':<50} {'hicache-io':>10} {'+sums':>7} {'numpy':>7}"
    if torch is not None:
        head += f" {'torch':>7}"
    head += f" {'x best':>7} {'+sums x':>8}"
    print(head + "   (GB/s; x best: over the faster peer)")
    for r in rows:
        w, p0 = r["with"], r["without"]
        s = p0["spec"]
        if s["layout"] not in ("layer_first", "page_first") or s["io"] != "kernel":
            continue
        p = peers(s, budget_s, rng)
        best = max(p.values())
        cell = f"{s['op']} {s['layout']} kernel {s['item']}B random N={s['items']} L={s['layers']}"
        line = f"{cell:<50} {p0['gbps']:>10.2f} {w['gbps']:>7.2f} {p['numpy']:>7.2f}"
        if "torch" in p:
            line += f" {p['torch']:>7.2f}"
        line += f" {p0['gbps'] / best:>7.2f} {w['gbps'] / best:>8.2f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
