"""`moecc exec --ray` on a local Ray cluster (ray.init(num_cpus=2)): a job split over 2
worker actors writes the same results as a single-process run (greedy); a worker killed
mid-job has its shard rerun elsewhere with nothing lost or duplicated; --resume works across
workers; without Ray, --ray says how to install it; and the Ray Data callable."""

from __future__ import annotations

import json
import sys

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'moecc[ray]'")

from moecc.compiler import compile_model  # noqa: E402
from moecc.testing.checkpoints import write_checkpoint  # noqa: E402
from moecc_runtime.job.distributed import INSTALL_HINT, RayOptions  # noqa: E402
from moecc_runtime.job.exec import run_job  # noqa: E402
from moecc_runtime.plan import save_plan  # noqa: E402

WORDS = "a pulley is a wheel on an axle that turns with a rope and the kettle clicked off".split()


pytestmark = pytest.mark.slow  # the whole file


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    ckpt = write_checkpoint(root / "mixtral", "mixtral", seed=5)
    plan, _ = compile_model(ckpt)
    save_plan(plan, root / "plan.pt")
    rows = [{"custom_id": f"q{i:02d}", "prompt": " ".join(WORDS[i % 5:i % 5 + 2 + i % 7]), "max_tokens": 6 + i % 5}
            for i in range(30)]
    rows.append({"custom_id": "bad", "prompt": ""})
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = root / "local.jsonl"
    run_job(root / "plan.pt", prompts, local, device="cpu", log=None, max_batch=4)
    return root / "plan.pt", prompts, {r["custom_id"]: r for r in read(local)}


def assert_same(out, ref: dict[str, dict]) -> None:
    rows = read(out)
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicated results"
    assert set(ids) == set(ref)
    for r in rows:
        assert r == ref[r["custom_id"]]


def test_two_workers_write_what_one_process_writes(cluster, job, tmp_path):
    plan, prompts, ref = job
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    s = run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, max_batch=4,
                ray=RayOptions(workers=2, shard_size=4))
    assert (s.succeeded, s.failed, s.status) == (30, 1, "done")
    assert_same(out, ref)
    assert [e["custom_id"] for e in read(errors)] == ["bad"]


def test_a_worker_killed_mid_job_has_its_shard_rerun(cluster, job, tmp_path):
    plan, prompts, ref = job
    killed = []

    def kill_a_busy_worker(pool, shard):
        if not killed and pool.busy():
            victim = pool.busy()[0]
            pool.kill(victim)
            killed.append(victim)

    opts = RayOptions(workers=2, shard_size=3, on_shard=kill_a_busy_worker)
    out = tmp_path / "out.jsonl"
    s = run_job(plan, prompts, out, errors_path=tmp_path / "e.jsonl", device="cpu", log=None, max_batch=4, ray=opts)
    assert killed, "no worker was busy when the first shard finished"
    assert s.succeeded == 30 and s.status == "done"
    assert_same(out, ref)


def test_resume_across_workers(cluster, job, tmp_path):
    plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    done = sorted(ref)[::3]
    out.write_text("".join(json.dumps(ref[k]) + "\n" for k in done) + '{"custom_id": "q0')  # torn tail
    s = run_job(plan, prompts, out, errors_path=tmp_path / "e.jsonl", device="cpu", log=None, max_batch=4,
                resume=True, ray=RayOptions(workers=2, shard_size=4))
    assert s.skipped == len(done) and s.succeeded == 30 - len(done)
    assert_same(out, ref)


def test_ray_data_callable(cluster, job):
    from moecc_runtime.job.ray_data import MoeccPredictor

    plan, prompts, ref = job
    rows = [json.loads(line) for line in prompts.read_text().splitlines()][:6] + [{"custom_id": "e", "prompt": ""}]
    pred = MoeccPredictor(plan, device="cpu")
    out = pred({"custom_id": [r["custom_id"] for r in rows], "prompt": [r["prompt"] for r in rows],
                "max_tokens": [r.get("max_tokens", 4) for r in rows]})
    for i, r in enumerate(rows[:6]):
        want = ref[r["custom_id"]]
        assert out["text"][i] == want["text"] and list(out["token_ids"][i]) == want["token_ids"]
        assert out["finish_reason"][i] == want["finish_reason"] and out["error"][i] is None
    assert out["text"][6] is None and "empty" in out["error"][6]
    try:
        import ray.data  # noqa: F401  (needs pyarrow)
    except ImportError:
        return
    ds = ray.data.from_items([{"prompt": r["prompt"], "max_tokens": r["max_tokens"], "custom_id": r["custom_id"]}
                              for r in rows[:6]])
    got = ds.map_batches(MoeccPredictor, fn_constructor_kwargs={"plan": str(plan), "device": "cpu"},
                         concurrency=2, batch_size=3, num_cpus=1).take_all()
    assert {g["custom_id"]: g["text"] for g in got} == {r["custom_id"]: ref[r["custom_id"]]["text"] for r in rows[:6]}


def test_without_ray_the_flag_says_how_to_install(job, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moecc.cli import app

    plan, prompts, _ = job
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    res = CliRunner().invoke(app, ["exec", str(plan), str(prompts), "-o", str(tmp_path / "o.jsonl"), "--ray"])
    assert res.exit_code == 1 and INSTALL_HINT in res.output
    res = CliRunner().invoke(app, ["exec", str(plan), str(prompts), "--workers", "2"])
    assert res.exit_code == 1 and "only apply with --ray" in res.output
