"""Runs sglang 0.5.23's ``Engine`` on CPU through a list of steps and writes what it saw as JSON.

``python sglang_driver.py SPEC.json OUT.json``. SPEC: ``{"model": DIR, "engine": {extra
sglang.Engine arguments}, "steps": [{"op": "generate", "name": N, "prompts": [[ids]],
"max_new_tokens": K} | {"op": "flush"}], "server": false}`` (``true``: sglang's HTTP server,
``python -m sglang.launch_server``, in place of ``Engine``). OUT: ``{"steps": [{"name", "tokens", "cached",
"details", "seconds"}], "start_s", "seconds"}``; per process, ``{"calls": {op: n}, "installed":
bool, "hook": [...]}`` in ``$HICACHE_ENGINE_TEST_COUNTS/<pid>.json``.

hicache-io reaches sglang's scheduler processes only through the wheel's hook
(``HICACHE_IO_SGLANG=1`` in the environment the test passes): this script never installs it.
sglang spawns its schedulers, and a spawned process imports this file again as
``__mp_main__``, so the top-level code below runs in every scheduler too, before sglang's
modules. It only observes and, for the negative control, breaks:

- every sgl_kernel.kvcacheio op hicache-io serves is wrapped to count its calls per process
  (written to ``$HICACHE_ENGINE_TEST_COUNTS/<pid>.json``), so the test sees that hicache-io
  moved the bytes, in which process, and that its hook had run there;
- ``HICACHE_ENGINE_TEST_BREAK_LOADS=1`` makes the host->device loads (the per-layer ops) move
  nothing: the prefix then comes back as whatever the device slots held, and the tokens must
  change (the comparison can fail);
- ``HICACHE_ENGINE_TEST_LINKER=1`` (runs with hicache-io's linker): the linker's copies are
  counted by direction, and ``HICACHE_ENGINE_TEST_BREAK_LOADS=1`` breaks only its loads."""

from __future__ import annotations

import json
import os
import sys
import time

COUNTS = os.environ.get("HICACHE_ENGINE_TEST_COUNTS")


def _instrument() -> None:
    import hicache_io.kvcacheio as kvcacheio
    from hicache_io.sglang import KVCACHEIO_OPS

    import threading

    calls: dict = {}
    path = os.path.join(COUNTS, f"{os.getpid()}.json")
    linker = os.environ.get("HICACHE_ENGINE_TEST_LINKER") == "1"
    broken = os.environ.get("HICACHE_ENGINE_TEST_BREAK_LOADS") == "1"
    # Ops run on several threads of a process (sglang's linker has its own): one count and one
    # file write at a time.
    lock = threading.Lock()

    def dump() -> None:
        from hicache_io import _sglang_hook

        done = _sglang_hook.report()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"calls": calls, "installed": "sglang" in done, "hook": sorted(done)}, f)
        os.replace(tmp, path)

    def wrap(name, fn):
        load = name.startswith("transfer_kv_per_layer")

        def counted(*args, **kwargs):
            with lock:
                calls[name] = calls.get(name, 0) + 1
                dump()
            if broken and load and not linker:
                return None
            return fn(*args, **kwargs)

        counted.__name__ = name
        counted.__doc__ = fn.__doc__
        return counted

    for name in KVCACHEIO_OPS:
        if name.startswith("transfer_"):
            setattr(kvcacheio, name, wrap(name, getattr(kvcacheio, name)))
    if linker:
        _instrument_linker(lock, calls, dump, broken)


def _instrument_linker(lock, calls: dict, dump, broken: bool) -> None:
    """The linker's copies counted by direction (``linker.load``: into the device slots,
    ``linker.offload``: out of them); with ``broken`` its loads copy nothing (its offloads still
    store every page)."""
    from hicache_io.sglang_linker import LinkerPages

    move = LinkerPages.move

    def counted(self, staged, idx, buffers, out):
        name = "linker.offload" if out else "linker.load"
        with lock:
            calls[name] = calls.get(name, 0) + 1
            dump()
        if broken and not out:
            return None
        return move(self, staged, idx, buffers, out)

    LinkerPages.move = counted


if COUNTS and os.environ.get("HICACHE_IO_SGLANG") == "1":
    _instrument()


def _flush(engine) -> None:
    # Right after a generate sglang may answer "pending requests": retry for a while.
    deadline = time.monotonic() + 30
    while True:
        result = engine.flush_cache()
        ok = getattr(result, "success", result)
        if ok or time.monotonic() > deadline:
            if not ok:
                raise RuntimeError(f"flush_cache did not succeed: {result}")
            return
        time.sleep(0.2)


class Server:
    """``python -m sglang.launch_server`` with the same arguments, on a free loopback port, as
    an engine with ``generate`` (over HTTP ``/generate``), ``flush_cache`` and ``shutdown``:
    sglang's server process and the schedulers it spawns get hicache-io from the hook alone
    (this driver is not their main module)."""

    def __init__(self, **args):
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(self.port)]
        for key, value in args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value is not False and value is not None:
                cmd += [flag, str(value)]
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 180
        while not self._get("/health"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sglang's server did not come up (exit {self.proc.poll()})")
            time.sleep(0.5)

    def _get(self, path: str) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def _post(self, path: str, body: dict) -> dict:
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read() or b"{}")

    def generate(self, input_ids, sampling_params):
        return self._post("/generate", {"input_ids": input_ids, "sampling_params": sampling_params})

    def flush_cache(self):
        return self._get("/flush_cache")

    def shutdown(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - it is killed with the driver's session then
            self.proc.kill()


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import sglang

    args = dict(
        model_path=spec["model"],
        device="cpu",
        attention_backend="torch_native",
        skip_tokenizer_init=True,
        page_size=16,
        dtype="bfloat16",
        mem_fraction_static=0.05,
        max_total_tokens=1024,
        disable_cuda_graph=True,
        disable_overlap_schedule=True,
        chunked_prefill_size=1024,
        enable_cache_report=True,
        random_seed=0,
        log_level="warning",
    )
    args.update(spec.get("engine", {}))
    t0 = time.monotonic()
    engine = Server(**args) if spec.get("server") else sglang.Engine(**args)
    out = {"steps": [], "start_s": round(time.monotonic() - t0, 1)}
    try:
        for step in spec["steps"]:
            if step["op"] == "flush":
                _flush(engine)
                continue
            params = {"temperature": 0, "max_new_tokens": step.get("max_new_tokens", 16), "ignore_eos": True}
            for prompt in step["prompts"]:
                t = time.perf_counter()
                r = engine.generate(input_ids=prompt, sampling_params=params)
                t = time.perf_counter() - t
                meta = r["meta_info"]
                out["steps"].append(
                    {
                        "name": step["name"],
                        "tokens": r["output_ids"],
                        "cached": meta.get("cached_tokens", 0),
                        "details": meta.get("cached_tokens_details"),
                        "seconds": t,
                    }
                )
    finally:
        engine.shutdown()
    out["seconds"] = round(time.monotonic() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
