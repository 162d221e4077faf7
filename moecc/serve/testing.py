"""A `moecc serve` process for tests and benches: started on a free loopback port, waited
ready, stopped or killed.

Needs: model directories and a data directory. Does: runs `python -m moecc.cli serve` as a
child process on 127.0.0.1 (never another address), polls `GET /v1/models` until it
answers. Guarantees: `kill` sends SIGKILL (the crash tests), `stop` SIGTERM then SIGKILL;
either way the process is reaped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, models: list[str], data_dir: Path, *args: str, key: str | None = None,
                 env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.models, self.data_dir, self.args, self.key = models, data_dir, list(args), key
        self.env = {**os.environ, **(env or {})}
        self.log = log or (data_dir.parent / f"{data_dir.name}.serve.log")
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        """Start and wait until it answers; RuntimeError with its log when it does not."""
        self.port = free_port()
        cmd = [sys.executable, "-m", "moecc.cli", "serve", *self.models, "--data-dir", str(self.data_dir),
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moecc serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self._answers():
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"moecc serve did not answer in {timeout}s:\n{self.log.read_text()}")

    def _answers(self) -> bool:
        req = urllib.request.Request(self.url + "/v1/models")
        if self.key:
            req.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(req, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answers (401 without a key)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL (a crash), and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, wait: float = 30.0) -> None:
        """SIGTERM (a clean stop), SIGKILL after `wait` seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.wait()


_PLANS: dict[str, Path] = {}


def cached_plans(model_dir: Path, root: Path) -> Path:
    """A `plans/` directory holding `model_dir`'s plan as a default `moecc serve` caches it,
    compiled once per process (later calls return the first one's): copy it into a data
    directory and the server starts without compiling."""
    key = str(model_dir.resolve())
    if key not in _PLANS:
        from moecc.serve.config import ServeConfig, parse_model
        from moecc.serve.plans import prepare

        verify = os.environ.pop("MOECC_VERIFY", None)  # the passes are not what serve's tests check
        try:
            prepare(parse_model(str(model_dir)), ServeConfig([], root), root / "plans", lambda m: None)
        finally:
            if verify is not None:
                os.environ["MOECC_VERIFY"] = verify
        _PLANS[key] = root / "plans"
    return _PLANS[key]


def data_dir_with_plans(plans: Path, data_dir: Path) -> Path:
    """`data_dir` (created) with a copy of `plans` as its plan cache."""
    import shutil

    data_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(plans, data_dir / "plans")
    return data_dir
