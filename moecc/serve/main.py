"""`moecc serve`: start everything, serve until stopped, stop cleanly.

Needs: a checked ServeConfig (config.check). Does: takes the data directory (an exclusive
flock on `server.lock`: one server per directory), opens the store, sweeps what a crash
left half-made (blobs.sweep), starts the runner thread (whose worker process prepares each
model's plan, plans.prepare), binds the socket and runs uvicorn on it. Guarantees: on
SIGINT / SIGTERM the HTTP side stops, then the running job stops after its step (its
batch resumes at the next start); on SIGKILL the worker dies with the server and the next
start resumes.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from typing import Callable

from moecc.serve.auth import Auth
from moecc.serve.blobs import Blobs
from moecc.serve.config import ServeConfig, check
from moecc.serve.store import Store


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def lock_data_dir(cfg: ServeConfig) -> int:
    """Hold `server.lock` in the data directory for the process's life; RuntimeError naming
    the holder when another server has it."""
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.data_dir / "server.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        os.close(fd)
        raise RuntimeError(f"--data-dir {cfg.data_dir} is in use by another moecc serve ({holder or 'unknown'}); "
                           f"stop it or give another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": cfg.host, "port": cfg.port}).encode(), 0)
    return fd


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    return sock


def serve(cfg: ServeConfig, log: Callable[[str], None] = _say) -> None:
    """Run the server until it is stopped (see the module docstring)."""
    import uvicorn

    from moecc.serve.app import Server, make_app
    from moecc.serve.plans import ServedModel
    from moecc.serve.runner import Runner

    check(cfg)
    auth = Auth(cfg.keys)
    lock_fd = lock_data_dir(cfg)
    store = Store(cfg.data_dir / "server.db")
    blobs = Blobs(cfg.data_dir)
    gone = blobs.sweep(store.blobs(), store.active_ids())
    if gone:
        log(f"moecc serve: removed {len(gone)} half-written file(s) left by an earlier run")
    models = {m.name: ServedModel.of(m) for m in cfg.models}  # the runner prepares their plans
    runner = Runner(store, blobs, models, cfg, log)
    runner.recount()  # before the first answer: counts as the files on disk say
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    runner.start()
    config = uvicorn.Config(make_app(Server(cfg, store, blobs, models, runner, auth)), log_level="warning",
                            timeout_graceful_shutdown=5, access_log=False)
    log(f"moecc serve: listening on http://{cfg.host}:{port}/v1 ({', '.join(models)}; data in {cfg.data_dir}; "
        f"{'API keys required' if auth.enabled else 'no API key needed'}; status page http://{cfg.host}:{port}/)")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        log("moecc serve: stopping (a running batch resumes at the next start)")
        runner.shutdown()
        runner.join(timeout=60)
        store.close()
        os.close(lock_fd)
