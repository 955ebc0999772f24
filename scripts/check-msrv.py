#!/usr/bin/env python3
"""Checks the declared minimum Rust version (`rust-version` in Cargo.toml) against every normal
dependency's own `rust-version`, with all features on. Our own code is checked by clippy's
`incompatible_msrv` lint (std APIs newer than `rust-version`), which `.ci/run` runs with
`-D warnings`; edition 2021 rules out newer language features such as let chains. Exit 1 when
a dependency needs a newer compiler than the crate declares."""

import json
import subprocess
import sys
import tomllib


def version(v):
    return tuple(int(x) for x in v.split("."))


def main():
    with open("Cargo.toml", "rb") as f:
        declared = tomllib.load(f)["package"]["rust-version"]
    tree = subprocess.run(
        ["cargo", "tree", "-q", "-e", "normal", "--all-features", "--prefix", "none", "--format", "{p}"],
        check=True, capture_output=True, text=True,
    ).stdout
    normal = {(line.split()[0], line.split()[1].lstrip("v")) for line in tree.splitlines() if line.strip()}
    meta = json.loads(subprocess.run(["cargo", "metadata", "-q", "--format-version", "1"], check=True, capture_output=True, text=True).stdout)
    needs = sorted(
        ((version(p["rust_version"]), p["name"], p["version"]) for p in meta["packages"]
         if p.get("rust_version") and (p["name"], p["version"]) in normal),
        reverse=True,
    )
    top = needs[0] if needs else ((0,), "-", "-")
    print(f"declared rust-version {declared}; newest needed by a dependency: {'.'.join(map(str, top[0]))} ({top[1]} {top[2]})")
    too_new = [n for n in needs if n[0] > version(declared)]
    for v, name, ver in too_new:
        print(f"  {name} {ver} needs Rust {'.'.join(map(str, v))}")
    return 1 if too_new else 0


if __name__ == "__main__":
    sys.exit(main())
