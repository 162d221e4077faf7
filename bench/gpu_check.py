"""GPU check: moecc against transformers + accelerate offloading on a Qwen3-30B-A3B-shaped
random-weight bf16 checkpoint, with the usable device memory capped at 24 GB, in one
time-boxed run (default budget 450 s, so the whole command ends within 8 minutes).

    bash bench/gpu_check.sh --vs-transformers                  # build the checkpoint, compile (OR-Tools), run
    bash bench/gpu_check.sh --vs-transformers --plan PLAN.pt   # a plan compiled elsewhere (see --compile-only)
    bash bench/gpu_check.sh --vs-transformers --ckpt DIR       # reuse (or build into) DIR
    bash bench/gpu_check.sh --vs-transformers --tiny           # 2 layers, 8 experts, hidden 256, CPU, < 1 min
    bash bench/gpu_check.sh --vs-transformers --compile-only [--plan OUT.pt]   # headers-only ckpt + plan, here
    (plain `bash bench/gpu_check.sh` is the first-contact check, bench/first_contact.py)

Phases, each time-boxed against the budget (a phase that cannot fit is skipped or stopped
with a printed reason, and what it had done is still reported):
  1. checkpoint: bench/make_random_checkpoint.py (published config, --layers, default 24:
     31 GB), or reuse --ckpt DIR when it already holds exactly that checkpoint;
  2. prompts: --prompts requests of random token ids, --min-prompt..--max-prompt tokens long,
     --new-tokens each (seeded; the checkpoint has no EOS, so every request makes all of them);
  3. plan: --plan, else `moecc compile CKPT --gpu-mem 24GB --hardware h200` (needs OR-Tools);
  4. moecc: `moecc exec PLAN PROMPTS --device cuda --stats ...` in a child process that first
     calls torch.cuda.set_per_process_memory_fraction(24e9 / device bytes) (the runtime has
     no option for it; its arena is bounded by the plan's --gpu-mem);
  5. transformers: AutoModelForCausalLM.from_pretrained(dtype=bfloat16, device_map="auto",
     max_memory={0: "22GiB", "cpu": "100GiB"}) in a child with the same cap, greedy
     generate(do_sample=False) over the first --hf-prompts prompts in left-padded batches of
     --hf-batch, stopped at the deadline (then reported as partial);
  6. a table (generated tok/s, peak device GB, overlap efficiency, ...), greedy agreement
     on the first --agree prompts, and JSON: $OUT/gpu_check.json when $OUT is set, else
     bench/results/gpu-check-vs-transformers-DATE.json (--tiny: bench/out/gpu_check-vs-hf-tiny/gpu_check.json);
     $OUT/gpu_check-vs-transformers.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()


def bootstrap() -> None:
    """Import this tree's `moecc` and its `runtime/` as `moecc_runtime`, installed or not."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import moecc_runtime

        ok = Path(moecc_runtime.__file__).resolve().parent == (ROOT / "runtime").resolve()
    except ImportError:
        ok = False
    if not ok:
        for k in [m for m in sys.modules if m == "moecc_runtime" or m.startswith("moecc_runtime.")]:
            del sys.modules[k]
        spec = importlib.util.spec_from_file_location(
            "moecc_runtime", ROOT / "runtime" / "__init__.py", submodule_search_locations=[str(ROOT / "runtime")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["moecc_runtime"] = mod
        spec.loader.exec_module(mod)


def cap_device_memory(cap_bytes: float) -> dict[str, Any]:
    """Limit this process's CUDA caching allocator to cap_bytes; {} without CUDA."""
    import torch

    if not torch.cuda.is_available() or cap_bytes <= 0:
        return {}
    total = torch.cuda.get_device_properties(0).total_memory
    frac = min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(frac, 0)
    return {"device": torch.cuda.get_device_name(0), "device_total_bytes": total, "cap_bytes": cap_bytes,
            "fraction": frac}


def device_peaks() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved()}


# -- child: the moecc command line, in a capped process ------------------------------------

def moecc_child(argv: list[str]) -> int:
    """`gpu_check.py moecc [--cap-bytes N] [--peak-out F] CLI-ARGS...`: run moecc's CLI here."""
    cap, peak_out = 0.0, None
    while argv and argv[0] in ("--cap-bytes", "--peak-out"):
        if argv[0] == "--cap-bytes":
            cap = float(argv[1])
        else:
            peak_out = Path(argv[1])
        argv = argv[2:]
    bootstrap()
    capped = cap_device_memory(cap)
    from moecc.cli import app

    rc = 0
    try:
        app(args=argv, prog_name="moecc")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if peak_out is not None:
            peak_out.write_text(json.dumps({**capped, **device_peaks()}) + "\n")
    return rc


# -- child: transformers + accelerate ------------------------------------------------------

def hf_child(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py _hf")
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--deadline", type=float, required=True, help="time.time() to stop generating by")
    ap.add_argument("--cap-bytes", type=float, default=0)
    ap.add_argument("--gpu-gib", type=float, default=22)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    res: dict[str, Any] = {"transformers": transformers.__version__, "torch": torch.__version__,
                           "prompts_requested": a.n, "batch": a.batch, "new_tokens": a.new_tokens}
    cuda = a.device.startswith("cuda")
    if cuda:
        res["cap"] = cap_device_memory(a.cap_bytes)

    def save() -> None:
        a.out.write_text(json.dumps(res) + "\n")

    reqs = [json.loads(line) for line in a.prompts.read_text().splitlines()[:a.n]]
    t0 = time.perf_counter()
    kw: dict[str, Any] = {"dtype": torch.bfloat16}
    if cuda:
        kw.update(device_map="auto", max_memory={0: f"{a.gpu_gib:g}GiB", "cpu": "100GiB"})
    print(f"loading {a.ckpt} with {kw}", file=sys.stderr, flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a.ckpt), **kw).eval()
    res["load_seconds"] = time.perf_counter() - t0
    dmap = getattr(model, "hf_device_map", None) or {}
    res["device_map_counts"] = {str(d): sum(1 for v in dmap.values() if v == d) for d in set(dmap.values())}
    res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    if cuda:
        res["allocated_after_load"] = torch.cuda.memory_allocated()
        res["peak_during_load"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    print(f"loaded in {res['load_seconds']:.1f} s; device map {res['device_map_counts']}", file=sys.stderr, flush=True)
    save()
    try:
        generate_all(a, res, model, reqs, save, cuda)
    except torch.OutOfMemoryError as e:  # report it with whatever was measured, rather than a traceback
        res["error"] = f"CUDA out of memory under the cap: {str(e).splitlines()[0]}"
        print(res["error"], file=sys.stderr, flush=True)
    res["partial"] = bool(res.get("error")) or res.get("partial", False) or res.get("prompts_done", 0) < len(reqs)
    save()
    return 0


def generate_all(a, res, model, reqs, save, cuda) -> None:
    import torch
    import transformers

    dev = model.device

    class Deadline(transformers.StoppingCriteria):
        hit = False

        def __call__(self, input_ids, scores, **kwargs):
            Deadline.hit = Deadline.hit or time.time() > a.deadline
            return torch.full((input_ids.shape[0],), Deadline.hit, dtype=torch.bool, device=input_ids.device)

    def batch_inputs(chunk):
        width = max(len(r["prompt"]) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
            mask[i, width - len(r["prompt"]):] = 1
        return ids.to(dev), mask.to(dev), width

    with torch.inference_mode():
        # warm-up (kernels, offload hooks): one short prompt, two tokens; not timed
        ids, mask, _ = batch_inputs(reqs[:1])
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       stopping_criteria=[Deadline()])
        res["warmup_seconds"] = time.perf_counter() - t
        outputs: list[list[int]] = []
        tokens, gen_s = 0, 0.0
        for s in range(0, len(reqs), a.batch):
            if Deadline.hit or time.time() > a.deadline:
                res.setdefault("stopped", f"deadline reached after {len(outputs)} prompts")
                break
            chunk = reqs[s:s + a.batch]
            ids, mask, width = batch_inputs(chunk)
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new_tokens, do_sample=False,
                                 pad_token_id=0, stopping_criteria=[Deadline()])
            if cuda:
                torch.cuda.synchronize()
            gen_s += time.perf_counter() - t
            new = out[:, width:].tolist()
            tokens += sum(len(x) for x in new)
            outputs += new
            if Deadline.hit:
                res["stopped"] = (f"deadline reached inside a batch: {len(new[0])} of {a.new_tokens} tokens "
                                  f"for prompts {s}..{s + len(chunk) - 1}")
            res.update(prompts_done=len(outputs), generated_tokens=tokens, generate_seconds=gen_s,
                       tokens_per_s=tokens / gen_s if gen_s else None, outputs=outputs, partial=bool(Deadline.hit))
            if cuda:
                res["peak_during_generate"] = torch.cuda.max_memory_allocated()
                res["max_memory_allocated"] = max(res["peak_during_load"], res["peak_during_generate"])
            save()
            print(f"  batch {s // a.batch + 1}: {len(chunk)} prompts, {len(new[0])} new tokens each, "
                  f"{tokens / gen_s:.1f} tok/s so far", file=sys.stderr, flush=True)


# -- the parent ----------------------------------------------------------------------------

class Clock:
    def __init__(self, budget: float):
        self.t0 = time.time()
        self.deadline = self.t0 + budget
        self.phases: dict[str, float] = {}

    def left(self) -> float:
        return self.deadline - time.time()

    def elapsed(self) -> float:
        return time.time() - self.t0


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_child(cmd: list[str], timeout: float, log: Path, tail: int = 12) -> tuple[int | None, float, bool]:
    """Run cmd with output to `log`; kill its process group at `timeout`. (rc, seconds, timed_out)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                             start_new_session=True)
        timed_out = False
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
    secs = time.perf_counter() - t0
    lines = log.read_text(errors="replace").splitlines()
    keep = [ln for ln in lines[1:] if ln.strip() and "Warning" not in ln][-tail:]
    for ln in keep:
        print(f"    | {ln[:200]}", flush=True)
    if timed_out:
        print(f"    killed at its time limit ({timeout:.0f} s)", flush=True)
    return rc, secs, timed_out


def write_prompts(path: Path, n: int, lo: int, hi: int, new_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": p, "max_tokens": new_tokens}) + "\n")
    return prompts


def have_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def fmt(x: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x / scale if scale != 1.0 else x, spec)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--tiny", "--dry-run-cpu", action="store_true", dest="tiny",
                    help="2 layers, 8 experts, hidden 256, on the CPU (a smoke test, < 1 min)")
    ap.add_argument("--compile-only", action="store_true",
                    help="build a headers-only checkpoint (unless --ckpt holds one) and compile the plan for "
                         "the device run, here; then exit")
    ap.add_argument("--plan", type=Path, default=None, help="a plan compiled elsewhere (with --compile-only: where "
                    "to write it; default WORK/plan-<L>L.pt)")
    ap.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory to reuse, or to build into")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the checkpoint (default 24: 31 GB; "
                    "published 48: 61 GB, more than the device machine's disk)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default bench/out/gpu_check[-tiny])")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 450; tiny 150)")
    ap.add_argument("--prompts", type=int, default=None, help="moecc's prompts (default 256; tiny 16)")
    ap.add_argument("--min-prompt", type=int, default=None, help="default 32 (tiny 8)")
    ap.add_argument("--max-prompt", type=int, default=None, help="default 64 (tiny 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default 32; tiny 8)")
    ap.add_argument("--hf-prompts", type=int, default=None, help="transformers' prompts, the first of moecc's "
                    "(default 64; tiny 8)")
    ap.add_argument("--hf-batch", type=int, default=None, help="transformers' static batch (default: --hf-prompts)")
    ap.add_argument("--agree", type=int, default=8, help="prompts to compare greedy tokens on")
    ap.add_argument("--gpu-mem-gb", type=float, default=24.0, help="the device memory cap, GB (1e9 bytes)")
    ap.add_argument("--hf-gpu-gib", type=float, default=22.0, help="accelerate's max_memory for GPU 0, GiB")
    ap.add_argument("--hardware", default=None, help="moecc compile --hardware (default h200; tiny cpu)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default cuda; tiny cpu)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="where to write the results JSON")
    a = ap.parse_args(argv)
    t = a.tiny
    d = {"budget": 150 if t else 450, "prompts": 16 if t else 256, "min_prompt": 8 if t else 32,
         "max_prompt": 16 if t else 64, "new_tokens": 8 if t else 32, "hf_prompts": 8 if t else 64,
         "hardware": "cpu" if t else "h200", "device": "cpu" if t else "cuda"}
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.hf_prompts = min(a.hf_prompts, a.prompts)
    a.hf_batch = a.hf_batch or a.hf_prompts
    a.work = a.work or ROOT / "bench" / "out" / ("gpu_check-vs-hf-tiny" if t else "gpu_check-vs-hf")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    clock = Clock(a.budget)
    sys.path.insert(0, str(HERE.parent))
    import make_random_checkpoint as mrc

    cfg = mrc.make_config(a.layers, a.tiny)
    L = cfg["num_hidden_layers"]
    a.work.mkdir(parents=True, exist_ok=True)
    out_env = os.environ.get("OUT")
    out_dir = Path(out_env) if out_env else None
    logs = (out_dir or a.work) / "gpu_check_logs"
    logs.mkdir(parents=True, exist_ok=True)
    ckpt = a.ckpt or a.work / ("qwen3-moe-tiny" if a.tiny else f"qwen3-30b-a3b-{L}L")
    ckpt_bytes = sum(mrc._nbytes(s) for _, s in mrc.tensor_specs(cfg))
    py = sys.executable
    res: dict[str, Any] = {
        "what": "moecc vs transformers+accelerate offloading, random-weight Qwen3-30B-A3B shape, device capped",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {"layers": L, "published_layers": 48, "tiny": a.tiny, "hidden": cfg["hidden_size"],
                   "experts": cfg["num_experts"], "top_k": cfg["num_experts_per_tok"], "vocab": cfg["vocab_size"],
                   "checkpoint_bytes": ckpt_bytes},
        "cap": {"gpu_mem_gb": a.gpu_mem_gb, "hf_gpu_gib": a.hf_gpu_gib},
        "budget_s": a.budget,
    }
    print(f"== gpu_check: {'TINY (cpu smoke test) ' if a.tiny else ''}{L} layers, "
          f"{ckpt_bytes / 1e9:.2f} GB bf16, device {'(none: compile only)' if a.compile_only else a.device}, cap {a.gpu_mem_gb:g} GB, budget {a.budget:.0f} s",
          flush=True)
    import torch

    res["machine"]["torch"] = torch.__version__
    # no CUDA context in this process (the children measure the device): availability only
    res["machine"]["cuda_available"] = torch.cuda.is_available()
    for mod in ("ortools", "accelerate", "transformers"):
        res["machine"][mod] = have_module(mod)
    print(f"   torch {torch.__version__}, cuda {torch.cuda.is_available()}, ortools "
          f"{res['machine']['ortools']}, accelerate {res['machine']['accelerate']}, {os.cpu_count()} cpus", flush=True)
    if a.device.startswith("cuda") and not torch.cuda.is_available() and not a.compile_only:
        print("error: --device cuda but no CUDA device; use --tiny (or --device cpu)", flush=True)
        return 2

    # 1. checkpoint
    t = time.time()
    have = mrc.state(ckpt, cfg)
    want = "headers" if a.compile_only else "full"
    if have == "full" or have == want:
        print(f"[1] checkpoint: reusing {ckpt} ({have})", flush=True)
        res["checkpoint"] = {"dir": str(ckpt), "reused": True, "kind": have}
    else:
        print(f"[1] checkpoint: writing {ckpt} ({'headers only' if a.compile_only else 'random weights'}; "
              f"{clock.left():.0f} s left)", flush=True)
        cmd = [py, str(HERE.parent / "make_random_checkpoint.py"), str(ckpt), "--seed", str(a.seed), "--force"]
        cmd += ["--tiny"] if a.tiny else []
        cmd += ["--layers", str(L)] if a.layers is not None else []
        cmd += ["--headers-only"] if a.compile_only else []
        rc, secs, to = run_child(cmd, clock.left() - (10 if a.tiny else 60), logs / "checkpoint.log")
        res["checkpoint"] = {"dir": str(ckpt), "reused": False, "kind": want, "seconds": secs, "rc": rc}
        if rc != 0:
            print(f"error: building the checkpoint failed (rc {rc}{', out of time' if to else ''}); "
                  f"see {logs / 'checkpoint.log'}", flush=True)
            return finish(a, res, clock, out_dir, logs, 1)
    clock.phases["checkpoint"] = time.time() - t

    # 2. prompts
    prompts_path = a.work / "prompts.jsonl"
    prompts = write_prompts(prompts_path, a.prompts, a.min_prompt, a.max_prompt, a.new_tokens, cfg["vocab_size"],
                            a.seed)
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    res["workload"] = {"prompts": a.prompts, "prompt_tokens": [a.min_prompt, a.max_prompt],
                       "mean_prompt_tokens": mean_prompt, "new_tokens": a.new_tokens,
                       "hf_prompts": a.hf_prompts, "hf_batch": a.hf_batch, "greedy": True}
    print(f"[2] prompts: {a.prompts} of {a.min_prompt}-{a.max_prompt} tokens (mean {mean_prompt:.1f}), "
          f"{a.new_tokens} new tokens each; transformers runs the first {a.hf_prompts}", flush=True)

    # 3. plan
    t = time.time()
    plan = a.plan
    compile_it = a.compile_only or plan is None
    if compile_it:
        plan = plan or a.work / ("plan-tiny.pt" if a.tiny else f"plan-{L}L.pt")
        if not res["machine"]["ortools"]:
            print("[3] plan: SKIPPED moecc: OR-Tools is not importable here, so `moecc compile` cannot run; "
                  "compile on a machine with it (`bash bench/gpu_check.sh --vs-transformers --compile-only`) and pass --plan",
                  flush=True)
            res["plan"] = {"error": "ortools not importable and no --plan"}
            plan = None
        else:
            print(f"[3] plan: moecc compile {ckpt} --gpu-mem {a.gpu_mem_gb:g}GB --hardware {a.hardware} -> {plan}",
                  flush=True)
            cmd = [py, str(HERE), "moecc", "compile", str(ckpt), "--gpu-mem", f"{a.gpu_mem_gb:g}GB",
                   "--hardware", a.hardware, "--prompt-tokens", str(round(mean_prompt)),
                   "--output-tokens", str(a.new_tokens), "--max-batch", str(a.prompts), "-o", str(plan)]
            rc, secs, to = run_child(cmd, clock.left() - (5 if a.compile_only else 30), logs / "compile.log")
            res["plan"] = {"path": str(plan), "compiled_here": True, "seconds": secs, "rc": rc}
            if rc != 0:
                print(f"    compile failed (rc {rc}); see {logs / 'compile.log'}", flush=True)
                plan = None
    else:
        res["plan"] = {"path": str(plan), "compiled_here": False}
    if plan is not None:
        plan_ok = check_plan(plan, ckpt, res["plan"])
        if not plan_ok:
            plan = None
    clock.phases["plan"] = time.time() - t
    if a.compile_only:
        if plan is None:
            return finish(a, res, clock, out_dir, logs, 1)
        inside = plan.resolve().is_relative_to(ROOT)
        rel = os.path.relpath(plan.resolve(), ROOT) if inside else str(plan)
        print(f"\nplan for the device run: {plan}\n  take it to the device machine"
              + (f" (run tool: carry=[\"{rel}\"])" if inside else "")
              + f" and run there:\n  bash bench/gpu_check.sh --vs-transformers --plan {rel}" + (f" --layers {L}" if a.layers else ""),
              flush=True)
        return 0

    # 4. moecc
    t = time.time()
    cap = a.gpu_mem_gb * 1e9
    moecc = res["moecc"] = {}
    if plan is not None:
        stats, results = a.work / "moecc_stats.json", a.work / "moecc_results.jsonl"
        peak = a.work / "moecc_device_peak.json"
        for p in (stats, results, peak):
            p.unlink(missing_ok=True)
        reserve = 5 if a.tiny else 20
        print(f"[4] moecc exec on {a.device} ({clock.left():.0f} s left; time limit {clock.left() - reserve:.0f} s)",
              flush=True)
        cmd = [py, str(HERE), "moecc", "--cap-bytes", str(cap if a.device.startswith("cuda") else 0),
               "--peak-out", str(peak), "exec", str(plan), str(prompts_path), "-o", str(results), "--stats", str(stats),
               "--device", a.device, "--model", str(ckpt), "--max-tokens", str(a.new_tokens)]
        rc, secs, to = run_child(cmd, clock.left() - reserve, logs / "moecc_exec.log")
        moecc.update(rc=rc, wall_seconds=secs, timed_out=to)
        moecc.update(read_moecc(stats, peak, results))
        if rc != 0:
            print(f"    moecc exec failed (rc {rc}{', out of time' if to else ''}); see {logs / 'moecc_exec.log'}",
                  flush=True)
    else:
        moecc["skipped"] = "no plan"
    clock.phases["moecc"] = time.time() - t

    # 5. transformers
    t = time.time()
    hf = res["transformers"] = {}
    min_needed = 10 if a.tiny else 60
    hf_out = a.work / "hf.json"
    hf_out.unlink(missing_ok=True)
    if a.skip_hf:
        hf["skipped"] = "--skip-hf"
    elif a.device.startswith("cuda") and not res["machine"]["accelerate"]:
        hf["skipped"] = "accelerate is not installed (device_map='auto' needs it)"
    elif clock.left() < min_needed:
        hf["skipped"] = (f"only {clock.left():.0f} s of the budget left; loading {ckpt_bytes / 1e9:.0f} GB and "
                         f"generating needs at least {min_needed} s")
    else:
        stop_by = clock.deadline - (3 if a.tiny else 15)  # leave time to write results after the last step
        print(f"[5] transformers generate on {a.device}: {a.hf_prompts} prompts in batches of {a.hf_batch} "
              f"({clock.left():.0f} s left; generation stops at the deadline)", flush=True)
        cmd = [py, str(HERE), "_hf", "--ckpt", str(ckpt), "--prompts", str(prompts_path), "--n", str(a.hf_prompts),
               "--batch", str(a.hf_batch), "--new-tokens", str(a.new_tokens), "--deadline", str(stop_by),
               "--cap-bytes", str(cap), "--gpu-gib", str(a.hf_gpu_gib), "--device", a.device, "--out", str(hf_out)]
        rc, secs, to = run_child(cmd, clock.left() - 2, logs / "transformers.log")
        hf.update(rc=rc, wall_seconds=secs, timed_out=to)
        if hf_out.is_file():
            hf.update(json.loads(hf_out.read_text()))
        if to and "load_seconds" not in hf:
            hf["skipped"] = "killed at the deadline while loading the model"
        elif rc != 0 and not to:
            hf["error"] = f"rc {rc}; see {logs / 'transformers.log'}"
    if "skipped" in hf:
        print(f"[5] transformers: SKIPPED: {hf['skipped']}", flush=True)
    clock.phases["transformers"] = time.time() - t
    res["agreement"] = agreement(moecc.pop("outputs", None), hf.pop("outputs", None), a.agree)
    return finish(a, res, clock, out_dir, logs, 0 if moecc.get("rc") == 0 else 1)


def check_plan(plan: Path, ckpt: Path, info: dict[str, Any]) -> bool:
    bootstrap()
    from moecc_runtime.plan import PlanError, check_checkpoint, describe, load_plan

    try:
        p = load_plan(plan)
        check_checkpoint(p, ckpt)
    except PlanError as e:
        print(f"    plan {plan} cannot run on {ckpt}: {e}", flush=True)
        info["error"] = str(e)
        return False
    info["describe"] = describe(p)
    info["predicted"] = {k: v for k, v in p.get("predicted", {}).items() if isinstance(v, (int, float, str))}
    info["memory"] = p.get("memory")
    print(f"    {info['describe']}", flush=True)
    return True


def read_moecc(stats: Path, peak: Path, results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if peak.is_file():
        out["device"] = json.loads(peak.read_text())
    if stats.is_file():
        s = json.loads(stats.read_text())
        eng = s.get("engine") or {}
        secs = s.get("seconds") or 0
        out.update(requests=s.get("requests"), succeeded=s.get("succeeded"), failed=s.get("failed"),
                   prompt_tokens=s.get("prompt_tokens"), generated_tokens=s.get("completion_tokens"),
                   seconds=secs, tokens_per_s=(s.get("completion_tokens") or 0) / secs if secs else None,
                   engine={k: v for k, v in eng.items() if k != "records"},
                   steps_recorded=len(eng.get("records") or []))
    if results.is_file():
        outs = {}
        for line in results.read_text().splitlines():
            r = json.loads(line)
            outs[int(r["custom_id"][1:])] = r["token_ids"]
        out["outputs"] = outs
    return out


def agreement(moecc_out: dict[int, list[int]] | None, hf_out: list[list[int]] | None, k: int) -> dict[str, Any]:
    if not moecc_out or not hf_out:
        return {"compared": 0, "note": "needs both systems' outputs"}
    idx = [i for i in range(min(k, len(hf_out))) if i in moecc_out]
    rows = []
    for i in idx:
        m, h = moecc_out[i], hf_out[i]
        n = min(len(m), len(h))
        prefix = next((j for j in range(n) if m[j] != h[j]), n)
        rows.append({"prompt": i, "moecc_tokens": len(m), "hf_tokens": len(h), "common_prefix": prefix,
                     "identical": m[:n] == h[:n] and n > 0})
    return {"compared": len(rows), "identical": sum(r["identical"] for r in rows),
            "first_token_equal": sum(r["common_prefix"] > 0 for r in rows),
            "mean_common_prefix": sum(r["common_prefix"] for r in rows) / len(rows) if rows else None,
            "per_prompt": rows}


def finish(a, res: dict[str, Any], clock: Clock, out_dir: Path | None, logs: Path, rc: int) -> int:
    res["phases_s"] = clock.phases
    res["total_s"] = clock.elapsed()
    print_table(res)
    if a.json:
        path = a.json
    elif out_dir is not None:
        path = out_dir / ("gpu_check-vs-transformers-tiny.json" if a.tiny else "gpu_check-vs-transformers.json")
    elif a.tiny:
        path = a.work / "gpu_check.json"
    else:
        path = ROOT / "bench" / "results" / f"gpu-check-vs-transformers-{time.strftime('%Y-%m-%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    if out_dir is not None:  # the small artifacts too, for a look afterwards
        for name in ("moecc_stats.json", "moecc_results.jsonl", "moecc_device_peak.json", "hf.json"):
            if (a.work / name).is_file() and (a.work / name).stat().st_size < 20e6:
                shutil.copy(a.work / name, out_dir / name)
    print(f"\nwrote {path} (logs in {logs}); total {res['total_s']:.0f} s of a {a.budget:.0f} s budget", flush=True)
    return rc


def print_table(r: dict[str, Any]) -> None:
    m, hf, wl = r.get("moecc") or {}, r.get("transformers") or {}, r.get("workload") or {}
    GB = 1e9
    rows = [("system", "gen tok/s", "tokens", "seconds", "peak dev GB", "engine peak GB", "overlap eff",
             "copy s", "wait s", "notes")]
    if m and "skipped" not in m:
        eng = m.get("engine") or {}
        dev = m.get("device") or {}
        note = f"{m.get('succeeded')}/{m.get('requests')} requests; seconds include engine set-up"
        if m.get("rc") != 0:
            note = f"FAILED rc {m.get('rc')}" + (" (time limit)" if m.get("timed_out") else "") + "; " + note
        rows.append(("moecc exec", fmt(m.get("tokens_per_s")), fmt(m.get("generated_tokens"), "d"),
                     fmt(m.get("seconds")), fmt(dev.get("max_memory_allocated"), ".2f", GB),
                     fmt(eng.get("peak_device_bytes"), ".2f", GB), fmt(eng.get("overlap_efficiency"), ".2f"),
                     fmt(eng.get("copy_seconds")), fmt(eng.get("wait_seconds")), note))
    else:
        rows.append(("moecc exec", "-", "-", "-", "-", "-", "-", "-", "-", f"skipped: {m.get('skipped')}"))
    if hf and "skipped" not in hf and hf.get("generated_tokens"):
        note = (f"{hf.get('prompts_done')} prompts, batch {hf.get('batch')}; load {hf.get('load_seconds', 0):.0f} s "
                f"excluded; map {hf.get('device_map_counts')}")
        if hf.get("partial"):
            note = "PARTIAL (" + str(hf.get("error") or hf.get("stopped", "deadline")) + "); " + note
        rows.append(("transformers+accelerate", fmt(hf.get("tokens_per_s")), fmt(hf.get("generated_tokens"), "d"),
                     fmt(hf.get("generate_seconds")), fmt(hf.get("max_memory_allocated"), ".2f", GB), "n/a", "n/a",
                     "n/a", "n/a", note))
    else:
        why = (f"skipped: {hf['skipped']}" if hf.get("skipped") else
               f"not measured: {hf.get('error') or 'no tokens generated'}")
        rows.append(("transformers+accelerate", "-", "-", "-", "-", "-", "-", "-", "-", why))
    print(f"\n== results ({r['config']['layers']} of 48 layers, {r['config']['checkpoint_bytes'] / GB:.2f} GB bf16; "
          f"device capped at {r['cap']['gpu_mem_gb']:g} GB; greedy, {wl.get('new_tokens')} new tokens per prompt; "
          f"moecc ran {wl.get('prompts')} prompts, transformers the first {wl.get('hf_prompts')}: compare tokens/s, "
          f"not totals)")
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    if m.get("tokens_per_s") and hf.get("tokens_per_s") and "skipped" not in hf:
        print(f"moecc / transformers: {m['tokens_per_s'] / hf['tokens_per_s']:.2f}x generated tokens/s")
    ag = r.get("agreement") or {}
    if ag.get("compared"):
        print(f"greedy agreement on the first {ag['compared']} prompts: {ag['identical']} identical, first token equal "
              f"in {ag['first_token_equal']}, mean common prefix {ag['mean_common_prefix']:.1f} tokens "
              f"(random weights make near-ties, so bf16 rounding differences can fork a sequence)")
    else:
        print(f"greedy agreement: {ag.get('note', 'n/a')}")
    print("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.get("phases_s", {}).items()))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if len(sys.argv) > 1 and sys.argv[1] == "moecc":
        sys.exit(moecc_child(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_hf":
        sys.exit(hf_child(sys.argv[2:]))
    sys.exit(main())
