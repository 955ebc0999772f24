#!/usr/bin/env python3
"""Fetch vLLM's own offloading tests from its release sdist, at test time, into a folder.

    python scripts/fetch-vllm-tests.py 0.33.0 DEST

The sdist file is taken from the package index pip is configured with (its simple page for
vllm, PEP 691 JSON), checked against the sha256 the page lists, and only `tests/` is unpacked.
`pip download --no-binary` cannot be used: it runs vLLM's setup.py, which builds kernels.
Nothing fetched here is kept in this repository.
"""

import hashlib
import json
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path


def index_url() -> str:
    """The index pip uses here: its configuration, else pip's default."""
    for key in ("global.index-url", "install.index-url"):
        out = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    from pip._internal.models.index import PyPI

    return PyPI.simple_url


def main() -> None:
    version, dest = sys.argv[1], Path(sys.argv[2])
    name = f"vllm-{version}.tar.gz"
    base = index_url().rstrip("/") + "/vllm/"
    req = urllib.request.Request(base, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        page = json.load(resp)
    files = [f for f in page["files"] if f["filename"] == name]
    if not files:
        sys.exit(f"{name} is not on {base}")
    entry = files[0]
    url = urllib.parse.urljoin(base, entry["url"])
    dest.mkdir(parents=True, exist_ok=True)
    sdist = dest / name
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=600) as resp, open(sdist, "wb") as out:
        while chunk := resp.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    want = entry.get("hashes", {}).get("sha256")
    if want and digest.hexdigest() != want:
        sys.exit(f"{name}: sha256 {digest.hexdigest()} != {want} (the index's)")
    prefix = f"vllm-{version}/tests/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        tar.extractall(dest, members=members, filter="data")
    sdist.unlink()
    print(f"{name}: sha256 {digest.hexdigest()}; {len(members)} entries of tests/ in {dest / f'vllm-{version}'}")


if __name__ == "__main__":
    main()
