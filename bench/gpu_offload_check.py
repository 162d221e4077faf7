"""GPU offloading check: run one compiled plan on CUDA with attention on the host and on the
device, and report generated tokens/s, peak device memory, copy/compute overlap and whether
the offloading paths did what they should (values kept on the device between modules, no
pageable copies, copies on their own streams, no device-wide synchronize).

    python bench/gpu_offload_check.py --plan PLAN.pt --ckpt DIR     # on a CUDA machine
    python bench/gpu_offload_check.py --plan PLAN.pt --layers 4     # build/reuse the random
                                    # Qwen3-30B-A3B-shaped checkpoint bench/out/gpu_check-vs-hf/qwen3-30b-a3b-4L
    python bench/gpu_offload_check.py --dry-run-cpu                 # a tiny model compiled here
                                    # (needs OR-Tools) and run on the CPU: a smoke test, seconds
    bash bench/gpu_check.sh --offload ...                           # the same, through gpu_check.sh

The device machine has no OR-Tools: compile the plan beforehand where it is, e.g. for a
4-layer checkpoint (6.2 GB, written on the device by this script with --layers) with a
device budget that makes weights stream (4 GB: a 3.4 GB arena, the experts of layers 1-3
through two slots, decode attention split between host and device):

    bash bench/gpu_check.sh --vs-transformers --compile-only --layers 4 --gpu-mem-gb 4   # -> bench/out/gpu_check-vs-hf/plan-4L.pt
    (device, carry the plan) bash bench/gpu_check.sh --offload --plan bench/out/gpu_check-vs-hf/plan-4L.pt --layers 4

What it measures, per attention placement (`--attention host,device`; device needs a plan with
KV buffers, arena.kv_buffer_tokens > 0):
  * tok/s: generated tokens over the wall time of `generate` (engine set-up excluded, the
    first step, which learns the row shapes and keeps host buffers, included);
  * peak device memory: torch.cuda.max_memory_allocated (the arena plus the kernels'
    temporaries) against the arena and the plan's predicted device total;
  * engine overlap: the copy engine's device-timed busy seconds and the compute stream's
    stalls on copy events (EngineStats copy_seconds / wait_seconds; overlap_efficiency =
    1 - wait / copy), steps whose values stayed on the device, host-buffer writes, bytes
    copied device->host, the weight path the streamed weights took;
  * profiler overlap (--profile-steps N, on CUDA): a short second run under torch.profiler;
    on the GPU timeline, the share of host->device (and device->host) memcpy time during
    which a kernel ran, the memcpy count from pageable memory (should be ~0), the streams
    copies and kernels ran on, and the host's cudaDeviceSynchronize / cudaStreamSynchronize
    calls.
Results: a table on stdout, JSON in $OUT/gpu_offload_check.json when $OUT is set, else --json,
else bench/out/gpu_offload_check[-cpu].json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--plan", type=Path, default=None, help="a plan compiled with --gpu-mem (see above)")
    ap.add_argument("--ckpt", type=Path, default=None, help="its checkpoint directory (default: the plan's, or "
                    "bench/out/gpu_check-vs-hf/qwen3-30b-a3b-<L>L with --layers)")
    ap.add_argument("--layers", type=int, default=None, help="build (or reuse) the random Qwen3-30B-A3B-shaped "
                    "checkpoint of this many layers when --ckpt holds none (bench/make_random_checkpoint.py)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="compile a tiny model here and run it on the CPU")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (default with --dry-run-cpu)")
    ap.add_argument("--attention", default="host,device", help="placements to run, comma-separated: host, device")
    ap.add_argument("--prompts", type=int, default=None, help="requests (default 128; dry run 12)")
    ap.add_argument("--min-prompt", type=int, default=None, help="default 32 (dry run 4)")
    ap.add_argument("--max-prompt", type=int, default=None, help="default 64 (dry run 24)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 16; dry run 6)")
    ap.add_argument("--profile-steps", type=int, default=None, help="tokens of the profiled second run (default 3 "
                    "on CUDA; 0: no profiler)")
    ap.add_argument("--cap-gb", type=float, default=None, help="cap this process's CUDA allocator at this many GB "
                    "(torch.cuda.set_per_process_memory_fraction), as bench/gpu_check.py does")
    ap.add_argument("--keep-on-device", choices=("auto", "on", "off"), default="auto",
                    help="values between device modules in the arena (auto: on CUDA; the dry run compares on/off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="where to write the results JSON")
    a = ap.parse_args(argv)
    dry = a.dry_run_cpu
    for k, v in {"device": "cpu" if dry else "cuda", "prompts": 12 if dry else 128, "min_prompt": 4 if dry else 32,
                 "max_prompt": 24 if dry else 64, "new_tokens": 6 if dry else 16,
                 "profile_steps": 0 if dry else 3}.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.attention = [x.strip() for x in a.attention.split(",") if x.strip()]
    bad = [x for x in a.attention if x not in ("host", "device")]
    if bad:
        ap.error(f"--attention: {bad} (host, device)")
    if not dry and a.plan is None:
        ap.error("--plan is required (or --dry-run-cpu)")
    return a


def bootstrap() -> None:
    sys.path.insert(0, str(HERE.parent))
    from gpu_check import bootstrap as gc_bootstrap  # this tree's moecc and runtime/, installed or not

    gc_bootstrap()


# -- plan and checkpoint ---------------------------------------------------------------------

def dry_run_plan(work: Path) -> tuple[dict[str, Any], Path]:
    """A tiny Mixtral checkpoint and a plan streaming it through a 1.1 MB arena."""
    import inspect

    from moecc.compiler import compile_model
    from moecc.testing.checkpoints import write_checkpoint

    ckpt = write_checkpoint(work / "mixtral-tiny", "mixtral")
    kw: dict[str, Any] = {"gpu_mem": 1_100_000, "prompt_tokens": 16, "output_tokens": 6, "max_batch": 8}
    if "attention" in inspect.signature(compile_model).parameters:
        kw["attention"] = "device"  # KV buffers too, so both placements run
    plan, _ = compile_model(ckpt, **kw)
    return plan, Path(ckpt)


def checkpoint_for(a: argparse.Namespace, plan: dict[str, Any], log: dict[str, Any]) -> Path:
    from moecc_runtime.plan import check_checkpoint

    ckpt = a.ckpt
    if a.layers is not None:
        import make_random_checkpoint as mrc

        cfg = mrc.make_config(a.layers)
        ckpt = ckpt or ROOT / "bench" / "out" / "gpu_check-vs-hf" / f"qwen3-30b-a3b-{a.layers}L"
        have = mrc.state(ckpt, cfg)
        if have != "full":
            print(f"[ckpt] writing {ckpt} ({a.layers} layers, random bf16; was: {have or 'none'})", flush=True)
            t = time.perf_counter()
            log["checkpoint"] = mrc.build(ckpt, cfg, seed=a.seed)
            log["checkpoint"]["seconds"] = time.perf_counter() - t
        else:
            log["checkpoint"] = {"dir": str(ckpt), "reused": True}
    return Path(check_checkpoint(plan, ckpt, a.plan))


def make_requests(n: int, lo: int, hi: int, new_tokens: int, vocab: int, seed: int):
    from moecc_runtime.scheduler.sequence import GenRequest

    rng = random.Random(seed)
    return [GenRequest(f"r{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))], new_tokens)
            for i in range(n)]


# -- one run ---------------------------------------------------------------------------------

def run_once(plan, ckpt, device, attention: str, requests, keep: bool | None, profile_steps: int,
             trace_dir: Path) -> dict[str, Any]:
    import torch

    from moecc_runtime.engine import Engine, generate

    cuda = device.type == "cuda"
    res: dict[str, Any] = {"attention": attention, "keep_on_device": keep}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        res["allocated_before"] = torch.cuda.memory_allocated()
    t = time.perf_counter()
    eng = Engine(plan, ckpt, device, attention=attention, record_steps=True, keep_on_device=keep)
    res["setup_s"] = time.perf_counter() - t
    outs: dict[str, list[int]] = {}
    try:
        w = eng.worker
        res["weight_path"] = str(getattr(w.weights, "weight_path", None))  # the KV pool is never pinned now
        res["keep_on_device"] = w.keep_on_device
        t = time.perf_counter()
        generate(eng, requests, lambda r: outs.__setitem__(r.key, r.token_ids))
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t
        st = eng.stats
        gen = sum(len(v) for v in outs.values())
        res.update(seconds=secs, generated_tokens=gen, tokens_per_s=gen / secs if secs else None,
                   steps=st.steps, steps_on_device=w.steps_on_device, host_buffer_writes=w.host_buffer_writes,
                   arena_bytes=st.arena_bytes, peak_arena_bytes=eng.worker.arena.peak_bytes if eng.worker.arena else 0,
                   copy_seconds=st.copy_seconds, wait_seconds=st.wait_seconds, copy_bytes=st.copy_bytes,
                   overlap_efficiency=st.overlap_efficiency,
                   d2h_bytes=w.d2h.bytes if w.d2h is not None else None,
                   d2h_copies=w.d2h.copies if w.d2h is not None else None)
        if cuda:
            res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
            res["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        if profile_steps > 0 and cuda:
            res["profile"] = profile_run(eng, requests, profile_steps, trace_dir / f"trace-{attention}.json")
    finally:
        eng.close()
    res["outputs"] = outs
    return res


def profile_run(eng, requests, steps: int, path: Path) -> dict[str, Any]:
    """A short second run (the first B requests, `steps` tokens each) under torch.profiler;
    the GPU timeline's copies against its kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moecc_runtime.engine import generate
    from moecc_runtime.scheduler.sequence import GenRequest

    B = int(eng.plan["batch"]["decode"]["B"])
    reqs = [GenRequest(f"p{r.key}", r.prompt_ids, steps) for r in requests[:B]]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(eng, reqs, lambda r: None)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return timeline_overlap(json.loads(path.read_text()))


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_overlap(trace: dict[str, Any]) -> dict[str, Any]:
    """From a chrome trace of torch.profiler: memcpy vs kernel time on the GPU (seconds)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kern = [e for e in evs if e.get("cat") == "kernel"]
    copies = [e for e in evs if e.get("cat") == "gpu_memcpy"]
    K = _union([(e["ts"], e["ts"] + e["dur"]) for e in kern])
    out: dict[str, Any] = {"kernel_s": _length(K) / 1e6, "kernels": len(kern),
                           "kernel_streams": sorted({str((e.get("args") or {}).get("stream")) for e in kern})}
    for d in ("HtoD", "DtoH"):
        mine = [e for e in copies if d in e.get("name", "")]
        C = _union([(e["ts"], e["ts"] + e["dur"]) for e in mine])
        length = _length(C)
        out[d] = {"copies": len(mine), "seconds": length / 1e6,
                  "overlapped_with_kernels": _intersection(C, K) / length if length else None,
                  "pageable": sum("Pageable" in e.get("name", "") for e in mine),
                  "streams": sorted({str((e.get("args") or {}).get("stream")) for e in mine})}
    rt = [e.get("name", "") for e in evs if e.get("cat") == "cuda_runtime"]
    out["host_syncs"] = {n: rt.count(n) for n in ("cudaDeviceSynchronize", "cudaStreamSynchronize",
                                                   "cudaEventSynchronize") if n in rt}
    return out


# -- report ----------------------------------------------------------------------------------

def _label(r: dict[str, Any]) -> str:
    return f"{r['attention']}/keep_on_device={r['keep_on_device']}"


def fmt(x: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x / scale, spec)


def print_table(res: dict[str, Any]) -> None:
    GB = 1e9
    rows = [("attention", "keep", "tok/s", "tokens", "s", "peak alloc GB", "arena GB", "copy s", "wait s",
             "overlap", "steps on dev", "hb writes", "d2h GB", "weight path", "prof HtoD ovl", "pageable")]
    for r in res["runs"]:
        if "error" in r or "skipped" in r:
            rows.append((r["attention"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                         r.get("skipped") or f"ERROR {r['error'].splitlines()[-1][:80]}"))
            continue
        prof = r.get("profile") or {}
        h = prof.get("HtoD") or {}
        rows.append((r["attention"], str(r["keep_on_device"]), fmt(r["tokens_per_s"]), str(r["generated_tokens"]),
                     fmt(r["seconds"]), fmt(r.get("max_memory_allocated"), ".2f", GB), fmt(r["arena_bytes"], ".3f", GB),
                     fmt(r["copy_seconds"], ".2f"), fmt(r["wait_seconds"], ".2f"), fmt(r["overlap_efficiency"], ".2f"),
                     f"{r['steps_on_device']}/{r['steps']}", str(r["host_buffer_writes"]),
                     fmt(r["d2h_bytes"], ".3f", GB), str(r.get("weight_path")),
                     fmt(h.get("overlapped_with_kernels"), ".2f"),
                     str(h.get("pageable", "n/a")) + "/" + str(((prof.get("DtoH") or {}).get("pageable", "n/a")))))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    for r in res["runs"]:
        if r.get("profile"):
            p = r["profile"]
            print(f"  {r['attention']}: profiler: kernels {p['kernel_s']:.3f} s on streams {p['kernel_streams']}; "
                  f"HtoD {p['HtoD']['seconds']:.3f} s on {p['HtoD']['streams']}, DtoH {p['DtoH']['seconds']:.3f} s "
                  f"on {p['DtoH']['streams']} (overlapped {fmt(p['DtoH']['overlapped_with_kernels'], '.2f')}); "
                  f"host syncs {p['host_syncs']}")
    if res.get("agreement"):
        print(f"greedy outputs: {res['agreement']}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    bootstrap()
    import torch

    from moecc_runtime.plan import load_plan

    device = torch.device(a.device)
    res: dict[str, Any] = {"what": "moecc GPU offloading check", "argv": sys.argv[1:], "device": str(device),
                           "torch": torch.__version__, "runs": []}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda but no CUDA device here; use --dry-run-cpu", flush=True)
            return 2
        res["gpu"] = torch.cuda.get_device_name(device)
        res["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
        if a.cap_gb:
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gb * 1e9 / res["gpu_total_bytes"]), device)
            res["cap_gb"] = a.cap_gb
    work = Path(tempfile.mkdtemp(prefix="moecc-offload-"))
    out_env = os.environ.get("OUT")
    path = (Path(out_env) / "gpu_offload_check.json" if out_env else a.json
            or ROOT / "bench" / "out" / ("gpu_offload_check-cpu.json" if a.dry_run_cpu else "gpu_offload_check.json"))
    rc = 0
    try:
        if a.dry_run_cpu:
            plan, ckpt = dry_run_plan(work)
        else:
            plan = load_plan(a.plan)
            ckpt = checkpoint_for(a, plan, res)
        lay = plan.get("arena") or {}
        res["plan"] = {"path": str(a.plan) if a.plan else None, "arena": lay,
                       "batch": {k: v for k, v in plan["batch"].items() if k in ("decode", "prefill")},
                       "predicted_device": (plan.get("memory") or {}).get("device")}
        print(f"== gpu_offload_check on {device}{' (' + res.get('gpu', '') + ')' if 'gpu' in res else ''}: "
              f"arena {lay.get('bytes', 0) / 2**20:.1f} MiB, resident {len(lay.get('resident', []))} groups, "
              f"kv_buffer_tokens {lay.get('kv_buffer_tokens')}", flush=True)
        reqs = make_requests(a.prompts, a.min_prompt, a.max_prompt, a.new_tokens,
                             int(plan["model"]["info"]["vocab_size"]), a.seed)
        keeps: list[bool | None] = {"auto": [None], "on": [True], "off": [False]}[a.keep_on_device]
        if a.dry_run_cpu and a.keep_on_device == "auto":
            keeps = [True, False]
        for att in a.attention:
            for keep in keeps:
                if att == "device" and not lay.get("kv_buffer_tokens"):
                    res["runs"].append({"attention": att, "skipped": "the plan has no KV buffers "
                                        "(compile with --attention device or split)"})
                    break
                print(f"[run] attention {att}, keep_on_device {keep} ...", flush=True)
                try:
                    res["runs"].append(run_once(plan, ckpt, device, att, reqs, keep, a.profile_steps, work))
                except Exception as e:  # report it with what was measured
                    rc = 1
                    res["runs"].append({"attention": att, "keep_on_device": keep, "error": traceback.format_exc()})
                    print(f"    failed: {e}", flush=True)
        done = [r for r in res["runs"] if "outputs" in r]
        if len(done) > 1:  # greedy outputs of every run against the first's
            base = done[0]["outputs"]
            res["agreement"] = {"requests": len(base), "reference": _label(done[0])}
            for r in done[1:]:
                res["agreement"][_label(r)] = sum(r["outputs"].get(k) == v for k, v in base.items())
        if a.dry_run_cpu:  # on the CPU keep_on_device must change nothing, and keep values after step 1
            for att in a.attention:
                pair = [r for r in done if r["attention"] == att]
                on = [r for r in pair if r["keep_on_device"]]
                off = [r for r in pair if not r["keep_on_device"]]
                ok = bool(on and off) and on[0]["outputs"] == off[0]["outputs"] \
                    and on[0]["steps_on_device"] == on[0]["steps"] - 1 and off[0]["steps_on_device"] == 0
                res.setdefault("dry_run", {})[att] = "ok" if ok else "FAILED"
                print(f"dry run, attention {att}: values kept on the device after the first step and outputs "
                      f"identical to the host-buffer path: {'ok' if ok else 'FAILED'}", flush=True)
                rc = rc or (0 if ok else 1)
        for r in done:
            r.pop("outputs")
        print_table(res)
    except Exception:
        rc = 1
        res["error"] = traceback.format_exc()
        print(res["error"], flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return rc


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
