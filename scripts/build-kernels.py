#!/usr/bin/env python3
"""Builds the embedded CUDA artifacts from kernels/*.cu, with pinned pip toolchains, no GPU.

    python3 scripts/build-kernels.py            # regenerate kernels/*.ptx and *.cubin
    python3 scripts/build-kernels.py --check    # compile gate: fail on errors, register spills,
                                                # more than 64 registers per thread, or
                                                # committed artifacts that differ

NVRTC 12.0 emits PTX ISA 8.0 (loads on drivers >= 525); ptxas 12.0 assembles sm_80 and sm_90
cubins from the same compute_80 PTX. Needs `pip install nvidia-cuda-nvrtc-cu12==12.0.140
nvidia-cuda-nvcc-cu12==12.0.140` in the running interpreter's environment.
"""
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
ARCHS = ["sm_80", "sm_90"]
# The kernels are __launch_bounds__(1024): 65536 registers per SM over 1024 threads.
MAX_REGISTERS = 64


def site_file(pattern):
    for path in sys.path:
        hits = glob.glob(os.path.join(path, pattern))
        if hits:
            return sorted(hits)[0]
    sys.exit(f"not found on sys.path: {pattern} (install nvidia-cuda-nvrtc-cu12 / nvidia-cuda-nvcc-cu12)")


def nvrtc_ptx(src, name):
    lib = ctypes.CDLL(site_file("nvidia/cuda_nvrtc/lib/libnvrtc.so*"))
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"nvrtc {what} failed: {rc}")
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None), "create")
    opts = [b"--gpu-architecture=compute_80", b"--std=c++17", b"-lineinfo"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"nvrtc compile of {name} failed:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def ptxas(ptx_path, arch, out):
    exe = site_file("nvidia/cuda_nvcc/bin/ptxas")
    r = subprocess.run([exe, "-v", f"-arch={arch}", "-O3", "-o", out, ptx_path], capture_output=True, text=True)
    report = r.stdout + r.stderr
    if r.returncode != 0:
        sys.exit(f"ptxas {arch} failed:\n{report}")
    spills = [m for m in re.findall(r"(\d+) bytes spill (?:stores|loads)", report) if int(m) != 0]
    if spills:
        sys.exit(f"ptxas {arch}: register spills:\n{report}")
    # One "Compiling entry function 'name' for 'sm_XX'" block per kernel, with its "Used N registers".
    entries = re.findall(r"^ptxas info\s*: Compiling entry function '(\w+)'", report, re.M)
    registers = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", report, re.S))
    if not entries or sorted(entries) != sorted(registers):
        sys.exit(f"ptxas {arch}: cannot read the register count of every kernel:\n{report}")
    over = [f"{name} uses {n}" for name, n in registers.items() if int(n) > MAX_REGISTERS]
    if over:
        sys.exit(f"ptxas {arch}: more than {MAX_REGISTERS} registers per thread ({', '.join(over)}):\n{report}")
    return {name: int(n) for name, n in registers.items()}


def build(out_dir):
    produced = {}
    for cu in sorted(glob.glob(os.path.join(KERNELS, "*.cu"))):
        stem = os.path.splitext(os.path.basename(cu))[0]
        # An absolute program name: NVRTC otherwise prefixes the working directory in the
        # -lineinfo `.file` entry, and the artifacts would depend on where the repo lives.
        ptx = nvrtc_ptx(open(cu).read(), "/hicache-io/kernels/" + os.path.basename(cu))
        ptx_path = os.path.join(out_dir, f"{stem}.compute_80.ptx")
        open(ptx_path, "w").write(ptx)
        produced[ptx_path] = os.path.basename(ptx_path)
        for arch in ARCHS:
            cubin = os.path.join(out_dir, f"{stem}.{arch}.cubin")
            registers = ptxas(ptx_path, arch, cubin)
            produced[cubin] = os.path.basename(cubin)
            for name, n in sorted(registers.items()):
                print(f"{stem} {arch} {name}: {n} registers (at most {MAX_REGISTERS}), no spills")
    return produced


def main():
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            produced = build(tmp)
            stale = [name for path, name in produced.items() if not os.path.exists(os.path.join(KERNELS, name)) or open(path, "rb").read() != open(os.path.join(KERNELS, name), "rb").read()]
            if stale:
                sys.exit(f"stale embedded CUDA artifacts (run python3 scripts/build-kernels.py): {', '.join(stale)}")
        print(f"cuda compile gate: ok (no errors, no spills, at most {MAX_REGISTERS} registers, artifacts fresh)")
    else:
        build(KERNELS)
        print("artifacts written to kernels/")


if __name__ == "__main__":
    main()
