"""Starts `colibri serve` (the bundled demo model) on free loopback ports."""

import os
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

BIN = os.environ.get("COLIBRI_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "target", "release", "colibri"))
API_KEY = "test-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args):
        self.port = free_port()
        self.cache = tempfile.TemporaryDirectory()
        env = dict(os.environ, XDG_CACHE_HOME=self.cache.name, RUST_LOG="warn")
        self.proc = subprocess.Popen([BIN, "serve", "--port", str(self.port), "--threads", "2", *args],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"colibri serve exited: {self.proc.stderr.read().decode()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("colibri serve did not become healthy")

    def metric(self, name, key=API_KEY):
        req = urllib.request.Request(self.base + "/metrics", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(f"colibri_{name} "):
                    return float(line.split()[1])
        raise KeyError(name)

    def stop(self):
        self.proc.terminate()
        code = self.proc.wait(timeout=30)
        self.cache.cleanup()
        return code


@pytest.fixture(scope="session")
def server():
    s = Server("--api-key", API_KEY)
    yield s
    assert s.stop() == 0, "colibri serve must exit 0 on SIGTERM"


@pytest.fixture(scope="session")
def tiny_server():
    """One running sequence, no queue: the second request gets 429."""
    s = Server("--api-key", API_KEY, "--max-batch", "1", "--max-queue", "0")
    yield s
    assert s.stop() == 0
