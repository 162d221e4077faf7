"""Run one job across many devices and machines with Ray (`moecc exec --ray`).

The driver (the `moecc exec` process) reads and validates the requests as a local run does
(bad lines fail there, a resumed job skips what is done), cuts the rest into shards of a
few requests as actors come free for them (the input is read a shard at a time, never held
whole), and hands them to a pool of Ray actors. Each actor holds one device (a GPU
when the job runs on CUDA, else `cpus_per_worker` CPU cores) and runs the same runtime on
the same plan; the checkpoint must sit at a path every node sees (the plan records it, or
pass `model_dir`). A shard's results come back when the shard finishes and the driver
writes them to the one output file, in the same format and with the same resume rules as a
local run.

A shard is the unit of recovery: if its actor dies (node lost, process killed), the shard's
results were never written, so it is simply queued again and a fresh actor takes over the
dead one's place. Each request therefore lands in the output exactly once. A shard that
fails because of its own content (an exception raised inside the actor, not a lost actor)
is retried once, then its requests fail alone with that error.

Ray is an optional dependency (`pip install 'moecc[ray]'`); nothing here imports it at
module import time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sized
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from moecc_runtime.scheduler.sequence import GenRequest, GenResult

INSTALL_HINT = "moecc exec --ray needs Ray: pip install 'moecc[ray]' (or pip install 'ray>=2.9')"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    return ray


@dataclass
class RayOptions:
    address: str | None = None  # None: start (or join) a local cluster; "auto": the running one
    workers: int | None = None  # actors; None: one per GPU (CUDA) or per cpus_per_worker cores
    cpus_per_worker: int = 1  # CPU cores each actor takes when the job runs on CPU
    shard_size: int | None = None  # requests per shard; None: about 4 shards per worker
    max_restarts: int = 8  # dead actors replaced before the job gives up
    on_shard: Callable[[Any, int], None] | None = None  # called after each finished shard (tests)
    share_prefixes: bool = True  # the actors' engines share KV blocks of common prompt prefixes


class ShardRunner:
    """The body of one Ray actor: an engine on the plan, running shards one at a time."""

    def __init__(self, plan: dict[str, Any], model_dir: str, device: str, max_batch: int | None, threads: int,
                 plan_path: str | None = None, share_prefixes: bool = True):
        import torch

        from moecc_runtime.engine import Engine
        from moecc_runtime.structured import Grammars
        from moecc_runtime.tokenizer import Tokenizer

        if device == "cpu":
            torch.set_num_threads(max(1, threads))
        self.engine = Engine(plan, Path(model_dir), torch.device(device), plan_path=plan_path,
                             share_prefixes=share_prefixes)
        self.tok = Tokenizer(Path(model_dir))
        self.max_batch = max_batch
        self.grammars = Grammars(self.tok, self.engine.plan)  # this actor's structured outputs (built on first use)

    def run(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        """Run a shard's requests to completion: {"results": [...], "errors": [[key, message]]}."""
        from moecc_runtime.engine import generate

        reqs = [GenRequest(**r) for r in requests]
        results: list[dict[str, Any]] = []
        errors: list[list[str]] = []

        def done(r: GenResult) -> None:
            results.append({**_plain_result(r), "choices": [_plain_result(c) for c in r.choices]})

        generate(self.engine, reqs, done, max_batch=self.max_batch, on_error=lambda r, m: errors.append([r.key, m]),
                 stop_check=self.tok.stop_check, grammar=self.grammars)
        return {"results": results, "errors": errors, "steps": self.engine.stats.steps}


def run_on_ray(job: Any, requests: Iterable[GenRequest], plan: dict[str, Any], model_dir: Path, *, device: str,
               max_batch: int | None, options: RayOptions, control: Callable[[], str],
               total: int | None = None) -> str:
    """Run `requests` on a pool of Ray actors, writing results through `job` (exec.Job: its
    on_finish / on_error, which drop each request's bookkeeping once it is written) as
    shards finish. `requests` is read lazily, a shard when an actor is free for it (a list,
    or an iterable with `total`, about how many it holds, for the shard size); a shard is
    held only until its results are written. `control()` as for generate ("drain": no new
    shards; "stop": return now). `options.on_shard(pool, shard index)` is called after each
    finished shard (tests use it to kill an actor mid-job). Returns "done", "drained" or
    "stopped"."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=options.address, ignore_reinit_error=True, log_to_driver=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    workers = _workers(ray, device == "cuda", options)
    n = len(requests) if isinstance(requests, Sized) else (total or 0)
    size = options.shard_size or max(1, math.ceil(n / (4 * workers)))
    source = iter(requests)
    shards: dict[int, list[GenRequest]] = {}  # read and not yet written
    retry: list[int] = []  # a stack of shards to run again, taken before new ones
    counter = itertools.count()  # shard indices, in input order

    def take() -> int | None:
        """The next shard to run: one to retry, else the next `size` requests, else None."""
        if retry:
            return retry.pop()
        chunk = list(itertools.islice(source, size))
        if not chunk:
            return None
        s = next(counter)
        shards[s] = chunk
        return s

    plan_path = getattr(job, "plan_path", None)  # its quantized weights, if any, lie beside it
    pool = _Pool(ray, plan, str(model_dir), device, max_batch, workers, options,
                 None if plan_path is None else str(Path(plan_path).resolve()))
    inflight: dict[Any, tuple[int, Any]] = pool.inflight  # future -> (shard, actor)
    retried: set[int] = set()
    try:
        while True:
            mode = control()
            if mode == "stop":
                return "stopped"
            if mode == "run":
                for actor in pool.idle():
                    s = take()
                    if s is None:
                        break
                    inflight[actor.run.remote([asdict(r) for r in shards[s]])] = (s, actor)
            if not inflight:
                break
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for fut in ready:
                s, actor = inflight.pop(fut)
                try:
                    out = ray.get(fut)
                except ray.exceptions.RayActorError:  # the actor died (ActorDiedError is one)
                    pool.replace(actor)  # lost with its actor: nothing of it was written
                    retry.append(s)
                    continue
                except ray.exceptions.RayTaskError as e:
                    if s not in retried:
                        retried.add(s)
                        retry.append(s)
                        continue
                    for r in shards.pop(s):
                        job.on_error(r, f"worker error: {e.cause if hasattr(e, 'cause') else e}")
                    continue
                _write_shard(job, out, shards.pop(s), len(inflight))
                if options.on_shard is not None:
                    options.on_shard(pool, s)
        if retry:
            return "drained"
        nxt = next(source, None)  # drained with requests left to read, or done
        return "done" if nxt is None else "drained"
    finally:
        pool.close()


def _workers(ray: Any, cuda: bool, options: RayOptions) -> int:
    """Actors to start: as asked, else one per GPU (CUDA) or per cpus_per_worker cores."""
    if options.workers is not None:
        return max(1, options.workers)
    res = ray.cluster_resources()
    return max(1, int(res.get("GPU", 0)) if cuda else int(res.get("CPU", 1)) // max(1, options.cpus_per_worker))


def _plain_result(r: GenResult) -> dict[str, Any]:
    """A result as plain data for the trip back from the actor (its choices apart)."""
    return {"key": r.key, "prompt_ids": r.prompt_ids, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
            "logprobs": r.logprobs, "prompt_logprobs": r.prompt_logprobs}


def _gen_result(res: dict[str, Any]) -> GenResult:
    """The GenResult of `_plain_result`'s data, with its choices."""
    return GenResult(res["key"], res["prompt_ids"], res["token_ids"], res["finish_reason"],
                     logprobs=res.get("logprobs"), choices=[_gen_result(c) for c in res.get("choices", [])],
                     prompt_logprobs=res.get("prompt_logprobs"))


def _write_shard(job: Any, out: dict[str, Any], shard: list[GenRequest], inflight: int) -> None:
    """A finished shard's results and errors, written through `job` (exec.Job)."""
    for res in out["results"]:
        job.on_finish(_gen_result(res))
    by_key = {r.key: r for r in shard}
    for key, message in out["errors"]:
        job.on_error(by_key[key], message)
    if job.prog is not None:
        job.prog.step(sum(len(res["token_ids"]) for res in out["results"]), inflight)


class _Pool:
    """The actors; a dead one is replaced (up to options.max_restarts times)."""

    def __init__(self, ray: Any, plan: dict[str, Any], model_dir: str, device: str, max_batch: int | None,
                 workers: int, options: RayOptions, plan_path: str | None = None):
        self.ray = ray
        cuda = device == "cuda"
        cpus = 0 if cuda else max(1, options.cpus_per_worker)
        self.cls = ray.remote(num_gpus=1 if cuda else 0, num_cpus=cpus, max_restarts=0)(ShardRunner)
        self.plan_ref = ray.put(plan)
        self.args = (model_dir, device, max_batch, max(1, cpus), plan_path, options.share_prefixes)
        self.restarts_left = options.max_restarts
        self.actors = [self._new() for _ in range(workers)]
        self.inflight: dict[Any, tuple[int, Any]] = {}  # future -> (shard, actor running it)
        self.replaced = 0

    def _new(self) -> Any:
        return self.cls.remote(self.plan_ref, *self.args)

    def idle(self) -> list[Any]:
        busy = {a for _, a in self.inflight.values()}
        return [a for a in self.actors if a not in busy]

    def busy(self) -> list[Any]:
        """Actors running a shard now."""
        return [a for _, a in self.inflight.values()]

    def replace(self, dead: Any) -> None:
        if dead not in self.actors:
            return
        self.actors.remove(dead)
        if self.restarts_left <= 0:
            if not self.actors:
                raise RuntimeError("every Ray worker died and the restart budget is spent; the finished "
                                   "results are written, rerun with --resume")
            return
        self.restarts_left -= 1
        self.replaced += 1
        self.actors.append(self._new())

    def kill(self, actor: Any) -> None:
        """Kill an actor (for tests: a worker lost mid-job)."""
        self.ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
