"""A Mooncake master of this process's own, on loopback."""

import os
from typing import Any, Optional


class LocalMaster:
    """A ``mooncake_master`` of this process's own, on loopback only (its RPC and metrics ports;
    the built-in HTTP metadata server, which binds every interface, stays off): for tests,
    examples and one-machine use. ``with LocalMaster() as m: ... m.address``."""

    def __init__(self, port: Optional[int] = None, lease_ms: int = 5000, binary: Optional[str] = None):
        import shutil
        import socket
        import subprocess
        import sys
        import time

        def free_port() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        exe = binary or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        if not os.path.exists(exe):
            exe = shutil.which("mooncake_master") or exe
        self.port = port or free_port()
        args = [exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}", f"--default_kv_lease_ttl={lease_ms}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with status {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("mooncake_master did not start within 30 s")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "LocalMaster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
