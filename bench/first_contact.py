"""First contact with a GPU (issue 29 item 9): one time-boxed run (default budget 420 s, so
the whole command ends within 8 minutes) that says whether moecc's CUDA path is right and
how fast it streams, as JSON in $OUT/gpu_check.json and a table of every figure against its
target.

    bash bench/gpu_check.sh --prepare        # here (needs OR-Tools): bench/out/gpu_check/, a few MB
    bash bench/gpu_check.sh                  # on the CUDA machine (carry bench/out/gpu_check)
    bash bench/gpu_check.sh --dry-run-cpu    # the whole logic on this CPU, tiny shapes, < ~60 s

Phases (each time-boxed; one that cannot fit is skipped with the reason, and what it did is
reported):
  setup:        the native host-attention kernel built in place when a C compiler exists;
  correctness:  a tiny fp32 Mixtral (moecc.testing.checkpoints) on the device against the CPU,
                host / device / split attention, keep_on_device on and off: tokens identical,
                logits within 1e-4 (generate(record_logits=True));
  race:         the same plan under MOECC_RACE_AMPLIFY=1 (spin kernels on the copy streams) and
                in a CUDA_LAUNCH_BLOCKING=1 child: logits bit-equal to the unperturbed run;
  perf:         a 4-layer Mixtral-shaped bf16 model (hidden 4096, 8 experts top-2, intermediate
                14336; random weights written here, matching the prepared headers) at
                --gpu-mem 4GB, 64 prompts: tok/s per placement, the true device peak against
                the budget, streamed host->device GB/s against a measured pinned DMA rate,
                overlap efficiency, host syncs per step by call site (HostReads, and
                torch.cuda.set_sync_debug_mode("warn") warnings by runtime file:line), the
                weight path taken and whether the native kernel ran.

The device machine has no OR-Tools and no network: --prepare compiles every plan here, against
the tiny checkpoint and a headers-only build of the 4-layer model (a plan depends only on
config.json, the safetensors headers and the file sizes), and writes them with the config,
tokenizer and shard headers under bench/out/gpu_check/ (git-ignored, carried to the device).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
from gpu_check import Clock  # noqa: E402  (the run's budget: seconds left, each phase's time)
PREPARED = ROOT / "bench" / "out" / "gpu_check"
TOL = 1e-4
PLACEMENTS = ("host", "device", "split")
SHARD_BYTES = int(4e9)
GB = 1e9

#: The perf model: Mixtral-8x7B's layer shape, 4 layers (11.8 GB bf16); --dry-run-cpu: tiny.
BIG: dict[str, Any] = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                       "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768}
TINY_BIG: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
                            "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 2048}


def bootstrap() -> None:
    """This tree's moecc and runtime/ (as moecc_runtime), installed or not."""
    sys.path.insert(0, str(HERE.parent))
    from gpu_check import bootstrap as gc_bootstrap

    gc_bootstrap()


# -- the 4-layer Mixtral-shaped checkpoint: config, headers, random shards ---------------------

def mixtral_config(shape: dict[str, Any]) -> dict[str, Any]:
    """A MixtralForCausalLM config.json of `shape`, bf16, no EOS (every request runs to max_tokens)."""
    return {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
            "dtype": "bfloat16", "eos_token_id": None, "head_dim": None, "hidden_act": "silu",
            "initializer_range": 0.02, "model_type": "mixtral", "output_router_logits": False, "pad_token_id": 0,
            "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "sliding_window": None,
            "tie_word_embeddings": False, "use_cache": True, **shape}


def mixtral_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, save_pretrained's per-expert names, in model order."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg["vocab_size"], H))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", (H, H)),
                  (p + "self_attn.k_proj.weight", (kv, H)), (p + "self_attn.v_proj.weight", (kv, H)),
                  (p + "self_attn.o_proj.weight", (H, H)), (p + "post_attention_layernorm.weight", (H,)),
                  (p + "block_sparse_moe.gate.weight", (cfg["num_local_experts"], H))]
        for e in range(cfg["num_local_experts"]):
            q = f"{p}block_sparse_moe.experts.{e}."
            specs += [(q + "w1.weight", (I, H)), (q + "w2.weight", (H, I)), (q + "w3.weight", (I, H))]
    return specs + [("model.norm.weight", (H,)), ("lm_head.weight", (cfg["vocab_size"], H))]


def shard_layout(cfg: dict[str, Any]) -> list[tuple[str, bytes, list[tuple[str, tuple[int, ...]]], int]]:
    """[(file, header bytes, tensors in data order, data bytes)]: shards of <= 4 GB, the headers
    byte for byte safetensors' (bench/make_random_checkpoint.py's writer)."""
    import make_random_checkpoint as mrc

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in mixtral_specs(cfg):
        n = mrc._nbytes(shape)
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    out = []
    for k, tensors in enumerate(shards):
        header, order, data = mrc.shard_header(tensors)
        out.append((f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", header, order, data))
    return out


def write_side_files(d: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json, generation config, tokenizer (the tests' 384-token BPE), index, headers.json."""
    from moecc.testing.checkpoints import build_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "pad_token_id": 0}) + "\n")
    build_tokenizer(d, model_max_length=cfg["max_position_embeddings"])
    layout = shard_layout(cfg)
    wmap = {name: f for f, _, order, _ in layout for name, _ in order}
    index = {"metadata": {"total_size": sum(x[3] for x in layout)}, "weight_map": dict(sorted(wmap.items()))}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    heads = [{"file": f, "header_sha256": hashlib.sha256(h).hexdigest(), "size": len(h) + n} for f, h, _, n in layout]
    (d / "headers.json").write_text(json.dumps(heads, indent=1) + "\n")
    return {"files": len(layout), "bytes": index["metadata"]["total_size"]}


def write_shards(meta: Path, out: Path, headers_only: bool, seed: int = 0, device: str = "cpu",
                 deadline: float | None = None) -> dict[str, Any]:
    """The checkpoint of `meta`'s config.json into `out` (side files copied): sparse files with
    the real headers, or random weights (normal * 0.02, norms 1) drawn on `device`; refuses
    headers that differ from the prepared headers.json."""
    import torch

    cfg = json.loads((meta / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json"):
        shutil.copyfile(meta / name, out / name)
    want = {h["file"]: h for h in json.loads((meta / "headers.json").read_text())}
    gen = torch.Generator(device=device).manual_seed(seed)
    t0, done = time.perf_counter(), 0
    for fname, header, order, data in shard_layout(cfg):
        w = want.get(fname)
        if w is None or w["header_sha256"] != hashlib.sha256(header).hexdigest() or w["size"] != len(header) + data:
            raise RuntimeError(f"{fname}: its header differs from the prepared headers.json (another torch or "
                               f"writer?); the prepared plan would not match")
        with open(out / fname, "wb") as f:
            f.write(header)
            if headers_only:
                f.truncate(len(header) + data)
                continue
            for name, shape in order:
                if deadline is not None and time.time() > deadline:
                    raise TimeoutError(f"out of time writing {fname} ({done / GB:.1f} GB written)")
                f.write(_random_bytes(name, shape, gen, device))
                done += 2 * _numel(shape)
    return {"dir": str(out), "bytes_written": done, "seconds": time.perf_counter() - t0, "random_on": device,
            "gb_per_s": done / GB / max(time.perf_counter() - t0, 1e-9), "headers_only": headers_only}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _random_bytes(name: str, shape: tuple[int, ...], gen: Any, device: str) -> memoryview:
    import torch

    if name.endswith("norm.weight"):
        t = torch.ones(shape, dtype=torch.bfloat16)
    else:
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
        t = t.to(torch.bfloat16).cpu()
    return t.reshape(-1).view(torch.uint8).numpy().data


# -- prepare: checkpoints and plans (needs the compiler, OR-Tools) ------------------------------

def workload(dry: bool) -> dict[str, Any]:
    """The prompts of each phase (seeded random token ids)."""
    return {"tiny": {"prompts": 3, "min": 3, "max": 20, "new": 3} if dry else
            {"prompts": 6, "min": 3, "max": 28, "new": 5},
            "perf": {"prompts": 4, "min": 8, "max": 16, "new": 3} if dry else
            {"prompts": 64, "min": 32, "max": 64, "new": 16},
            "census": {"prompts": 2, "new": 2} if dry else {"prompts": 16, "new": 4},
            "gpu_mem": 6_000_000 if dry else 4_000_000_000}


def prepare(work: Path, dry: bool, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Write the tiny checkpoint, its plans, the perf model's side files and its plans (compiled
    against a sparse headers-only build, in a temporary directory) into `work`; return the
    manifest (also work/manifest.json)."""
    from moecc.compiler import compile_model
    from moecc.testing.checkpoints import write_checkpoint
    from moecc_runtime.plan import save_plan

    wl = workload(dry)
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("*.pt"):  # a plan left by an earlier prepare would be taken for this one's
        old.unlink()
    t = time.time()
    tiny = write_checkpoint(work / "mixtral-tiny", "mixtral", dtype="float32")
    kw = {"prompt_tokens": 16, "output_tokens": wl["tiny"]["new"], "max_batch": 8, "gpu_mem": 1_100_000,
          "device_reserve": 0}
    man: dict[str, Any] = {"dry_run": dry, "tiny_ckpt": tiny.name, "plans": {}}
    for att in ("auto", "device"):
        plan, _ = compile_model(tiny, attention=att, **kw)
        save_plan(plan, work / f"tiny-{att}.pt")
        man["plans"][f"tiny-{att}"] = _plan_summary(plan)
    log(f"  tiny checkpoint and plans: {time.time() - t:.1f} s")
    t = time.time()
    meta = work / "mixtral-big.meta"
    man["big"] = write_side_files(meta, mixtral_config(TINY_BIG if dry else BIG))
    p = wl["perf"]
    kw = {"prompt_tokens": (p["min"] + p["max"]) // 2, "output_tokens": p["new"], "max_batch": p["prompts"],
          "gpu_mem": wl["gpu_mem"], "hardware": "cpu" if dry else "h200"}
    if dry:
        kw["device_reserve"] = 0
    with tempfile.TemporaryDirectory(prefix="moecc-sparse-") as tmp:  # sparse shards: nothing to keep
        sparse = Path(tmp) / "mixtral-big"
        write_shards(meta, sparse, headers_only=True)
        for att in ("auto", "device"):
            if att == "device" and man["plans"]["big-auto"]["kv_buffer_tokens"]:
                break  # the planner's plan has KV buffers: every placement runs on it
            plan, _ = compile_model(sparse, attention=att, **kw)
            save_plan(plan, work / f"big-{att}.pt")
            man["plans"][f"big-{att}"] = _plan_summary(plan)
    log(f"  perf model headers and plans: {time.time() - t:.1f} s")
    man["workload"] = wl
    (work / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    return man


def _plan_summary(plan: dict[str, Any]) -> dict[str, Any]:
    lay = plan.get("arena") or {}
    return {"placement": {ph: plan["batch"][ph].get("attention") for ph in ("decode", "prefill")},
            "B": plan["batch"]["decode"]["B"], "arena_bytes": lay.get("bytes"),
            "kv_buffer_tokens": lay.get("kv_buffer_tokens"), "resident": lay.get("resident")}


def placed(plan: dict[str, Any], where: str, fraction: float) -> dict[str, Any]:
    """A copy of `plan` with both phases' attention placed `where` (tests/runtime/worker/test_host_attention.py)."""
    p = copy.copy(plan)
    p["batch"] = copy.deepcopy(plan["batch"])
    for phase in ("decode", "prefill"):
        p["batch"][phase]["attention"] = {"where": where, "host_fraction": fraction}
    return p


Placed = tuple[dict[str, Any], str | None, str]  # (plan, Engine(attention=...), how it was made)


def placement_plans(auto: dict[str, Any], dev: dict[str, Any] | None) -> dict[str, Placed]:
    """placement -> (plan, Engine attention=, how): host and device forced on the plan with KV
    buffers; split: the planner's own where its plan has one, else half of each step's sequences."""
    buffered = auto if (auto.get("arena") or {}).get("kv_buffer_tokens") or dev is None else dev
    own = [auto["batch"][ph].get("attention") or {} for ph in ("decode", "prefill")]
    if any(o.get("where") == "split" for o in own) and buffered is auto:
        split = (auto, None, "the plan's own split " + ", ".join(f"{o.get('host_fraction'):.2f}" for o in own))
    else:
        split = (placed(buffered, "split", 0.5), None, "derived: host_fraction 0.5 (the plan has no split)")
    return {"host": (buffered, "host", "Engine(attention='host')"),
            "device": (buffered, "device", "Engine(attention='device')"), "split": split}


# -- one run of the engine ------------------------------------------------------------------

def requests(n: int, lo: int, hi: int, new: int, vocab: int, seed: int) -> list[Any]:
    from moecc_runtime.scheduler.sequence import GenRequest

    rng = random.Random(seed)
    return [GenRequest(f"r{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))], new)
            for i in range(n)]


def run_engine(plan: dict[str, Any], ckpt: Path, device: str, attention: str | None, reqs: list[Any],
               keep: bool | None = None, deadline: float | None = None, logits: bool = True,
               small: bool = False) -> dict[str, Any]:
    """Greedy outputs {key: (tokens, logits [n, V] fp32 on the CPU)} and what the engine measured."""
    import torch

    from moecc_runtime.engine import Engine, generate

    res: dict[str, Any] = {}
    kw = {"expert_chunk": 3, "attn_micro_batch": 2} if small else {}
    t = time.perf_counter()
    # The tiny plans' --gpu-mem (1.1 MB, no reserve) only forces streaming; capped at it, the
    # caching allocator could not hold one 2 MiB block. Their runs go uncapped; (c) checks the cap.
    uncapped = {"MOECC_NO_DEVICE_CAP": "1"} if small else {}
    os.environ.update(uncapped)
    try:
        eng = Engine(plan, ckpt, device, attention=attention, keep_on_device=keep, **kw)
    finally:
        for name in uncapped:
            os.environ.pop(name, None)
    res["setup_s"] = time.perf_counter() - t
    outs: dict[str, Any] = {}
    stop = (lambda: "stop" if time.time() > deadline else "run") if deadline else None
    try:
        res["keep_on_device"] = eng.worker.keep_on_device
        res["race_amplified"] = eng.worker.copy is not None and eng.worker.copy.race is not None
        t = time.perf_counter()
        how = generate(eng, reqs, lambda r: outs.__setitem__(r.key, (r.token_ids, _stack(r.logits))),
                       record_logits=logits, control=stop)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        res.update(seconds=time.perf_counter() - t, ended=how, steps=eng.stats.steps)
        res["poisoned"] = eng.worker.copy.race.poisoned if res["race_amplified"] else 0
    finally:
        eng.close()
    res["outputs"] = outs
    return res


def _stack(rows: list[Any]) -> Any:
    import torch

    return torch.stack([r.float().cpu() for r in rows]) if rows else torch.empty(0)


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Tokens identical, max |logit difference|, bit-equal logits, over the common keys."""
    import torch

    keys = sorted(ref)
    same_keys = set(ref) == set(got)
    tok = same_keys and all(ref[k][0] == got[k][0] for k in keys)
    diff, bits = 0.0, same_keys
    for k in keys:
        if k not in got or ref[k][1].shape != got[k][1].shape:
            bits, diff = False, float("inf")
            continue
        a, b = ref[k][1], got[k][1]
        bits = bits and torch.equal(a, b)
        if a.numel():
            d = (a - b).abs().max().item()
            diff = max(diff, d if d == d else float("inf"))  # NaN: no match
    return {"requests": len(keys), "tokens_identical": bool(tok), "max_abs_logit_diff": diff,
            "logits_bit_equal": bool(bits)}


# -- setup: the native kernel ---------------------------------------------------------------

def build_native(timeout: float) -> dict[str, Any]:
    """Build runtime/native's extensions in place (setup.py build_ext --inplace; then cc for any
    still missing: they are optional there, so its exit status says nothing) when this Python
    has none of them and a C compiler exists; then whether the runtime loads the attention kernel."""
    import importlib

    names = ["_" + p.stem for p in sorted((ROOT / "runtime" / "native").glob("*.c"))]
    missing = _missing(names)
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    res: dict[str, Any] = {"extensions": names, "present_before": [n for n in names if n not in missing],
                           "compiler": cc, "built": [], "how": None}
    if missing and cc and not os.environ.get("MOECC_NO_NATIVE"):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, capture_output=True,
                           text=True, timeout=timeout)
        importlib.invalidate_caches()
        still = _missing(names)
        res["how"], res["setup_py_rc"] = "setup.py build_ext --inplace", p.returncode
        if still:
            res["setup_py_tail"] = (p.stderr or p.stdout)[-800:]
            res["how"] = "setup.py, then cc for " + ", ".join(still)
            res["cc_errors"] = {n: e for n in still if (e := _cc(cc, n, timeout))}
            importlib.invalidate_caches()
        res["built"] = [n for n in missing if n not in _missing(names)]
        res["build_s"] = time.perf_counter() - t
    elif missing and not cc:
        res["reason"] = "no C compiler: host attention falls back to gathered KV"
    from moecc_runtime import native

    res["missing_after"] = _missing(names)
    res["built_here"] = bool(res["built"])
    res["available"] = native.available()
    return res


def _missing(names: list[str]) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(f"moecc_runtime.native.{n}") is None]


def _cc(cc: str, name: str, timeout: float) -> str | None:
    """Compile runtime/native/<name minus _>.c into the extension `name` in place; the error, or None."""
    import sysconfig

    d = ROOT / "runtime" / "native"
    so = d / (name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    p = subprocess.run([cc, "-O3", "-std=c11", "-ffp-contract=fast", "-shared", "-fPIC", "-pthread",
                        f"-I{sysconfig.get_paths()['include']}", f"-I{d}", str(d / (name[1:] + ".c")), "-o", str(so),
                        "-lm"], capture_output=True, text=True, timeout=timeout)
    return None if p.returncode == 0 else p.stderr[-600:]


# -- phases ---------------------------------------------------------------------------------

class Ctx:
    """What the phases share: arguments, clock, prepared files, results."""

    def __init__(self, a: argparse.Namespace, clock: Clock, res: dict[str, Any]):
        self.a, self.clock, self.res = a, clock, res
        self.work: Path = a.work
        self.device: str = a.device
        self.man: dict[str, Any] = json.loads((a.work / "manifest.json").read_text())
        self.wl: dict[str, Any] = self.man["workload"]
        self.ref: dict[str, dict[str, Any]] = {}  # placement -> the device run's outputs (keep on)

    def plan(self, name: str) -> dict[str, Any] | None:
        """A prepared plan (None: not prepared, e.g. big-device when big-auto has KV buffers)."""
        from moecc_runtime.plan import load_plan

        path = self.work / f"{name}.pt"
        return load_plan(path) if path.is_file() else None

    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def _skip(reason: str) -> dict[str, Any]:
    print(f"    SKIPPED: {reason}", flush=True)
    return {"skipped": reason}


def _tiny_runs(c: Ctx, budget: float) -> tuple[float, Path, dict[str, Any], list[Any]]:
    """What phases (a) and (b) run: their deadline, the tiny checkpoint, its plan per placement, the requests."""
    w = c.wl["tiny"]
    return (min(c.clock.deadline, time.time() + budget), c.work / c.man["tiny_ckpt"],
            placement_plans(c.plan("tiny-auto"), c.plan("tiny-device")),
            requests(w["prompts"], w["min"], w["max"], w["new"], 384, 1))


def phase_correctness(c: Ctx, budget: float) -> dict[str, Any]:
    """(a) the tiny fp32 model on the device against the CPU, every placement, keep on and off."""
    end, ckpt, plans, reqs = _tiny_runs(c, budget)
    out: dict[str, Any] = {"tolerance": TOL, "runs": []}
    for pl in PLACEMENTS:
        plan, att, how = plans[pl]
        if time.time() > end - 5:
            out["runs"].append({"placement": pl, **_skip(f"correctness: out of its time ({budget:.0f} s)")})
            continue
        try:
            cpu = run_engine(plan, ckpt, "cpu", att, reqs, keep=False, small=True)
            for keep in (True, False):
                got = run_engine(plan, ckpt, c.device, att, reqs, keep=keep, deadline=end, small=True)
                if got["ended"] != "done":
                    out["runs"].append({"placement": pl, "keep_on_device": keep,
                                        **_skip(f"correctness: stopped at its time ({budget:.0f} s)")})
                    continue
                row = {"placement": pl, "how": how, "keep_on_device": got["keep_on_device"],
                       "seconds": got["seconds"], "ended": got["ended"], **compare(cpu["outputs"], got["outputs"])}
                row["ok"] = row["tokens_identical"] and row["max_abs_logit_diff"] <= TOL
                out["runs"].append(row)
                if keep:
                    c.ref[pl] = got["outputs"]
                print(f"    {pl:6s} keep={keep!s:5s}: tokens identical {row['tokens_identical']}, max |dlogit| "
                      f"{row['max_abs_logit_diff']:.2e} ({'ok' if row['ok'] else 'FAIL'})", flush=True)
        except Exception as e:
            out["runs"].append({"placement": pl, "error": traceback.format_exc()[-2000:], "ok": False})
            print(f"    {pl}: ERROR {e}", flush=True)
    out["ok"] = bool(out["runs"]) and all(r.get("ok") for r in out["runs"])
    return out


def phase_race(c: Ctx, budget: float) -> dict[str, Any]:
    """(b) race amplification in-process, and a CUDA_LAUNCH_BLOCKING=1 child: bit-equal logits."""
    end, ckpt, plans, reqs = _tiny_runs(c, budget)
    out: dict[str, Any] = {"runs": [], "cuda_sleep": c.cuda()}
    for pl in PLACEMENTS:
        plan, att, _ = plans[pl]
        if pl not in c.ref or time.time() > end - 15:
            out["runs"].append({"placement": pl, **_skip("no unperturbed run to compare" if pl not in c.ref
                                                          else "race: out of its time")})
            continue
        os.environ.update(MOECC_RACE_AMPLIFY="1", MOECC_RACE_SEED="7")
        try:
            got = run_engine(plan, ckpt, c.device, att, reqs, keep=True, deadline=end, small=True)
            row = {"placement": pl, "mode": "MOECC_RACE_AMPLIFY=1", "poisoned": got["poisoned"],
                   "race_amplified": got["race_amplified"], **compare(c.ref[pl], got["outputs"])}
        except Exception:
            row = {"placement": pl, "mode": "MOECC_RACE_AMPLIFY=1", "error": traceback.format_exc()[-2000:]}
        finally:
            os.environ.pop("MOECC_RACE_AMPLIFY", None)
            os.environ.pop("MOECC_RACE_SEED", None)
        row["ok"] = bool(row.get("logits_bit_equal") and row.get("race_amplified"))
        out["runs"].append(row)
        print(f"    race {pl:6s}: bit-equal {row.get('logits_bit_equal')}, poisoned {row.get('poisoned')} "
              f"({'ok' if row['ok'] else 'FAIL'})", flush=True)
    out["launch_blocking"] = launch_blocking(c, end)
    out["ok"] = all(r.get("ok") for r in out["runs"] + out["launch_blocking"].get("runs", [{"ok": False}]))
    return out


def launch_blocking(c: Ctx, end: float) -> dict[str, Any]:
    """The unperturbed runs again in a CUDA_LAUNCH_BLOCKING=1 child; its logits against ours."""
    import torch

    left = end - time.time()
    if left < 20 or not c.ref:
        return _skip(f"CUDA_LAUNCH_BLOCKING child: {left:.0f} s left (needs 20)" if c.ref else "nothing to compare")
    dst = c.a.scratch / "launch_blocking.pt"
    dst.unlink(missing_ok=True)
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(HERE), "_child", "--work", str(c.work), "--device", c.device, "--out", str(dst),
           "--placements", ",".join(c.ref)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"skipped": f"the child ran past the phase's time ({left:.0f} s)"}
    res: dict[str, Any] = {"rc": p.returncode, "seconds": time.perf_counter() - t, "runs": []}
    if p.returncode != 0 or not dst.is_file():
        res["error"] = (p.stderr or p.stdout)[-2000:]
        return res
    got = torch.load(dst, weights_only=True)
    for pl, outs in got.items():
        row = {"placement": pl, "mode": "CUDA_LAUNCH_BLOCKING=1", **compare(c.ref[pl], outs)}
        row["ok"] = row["logits_bit_equal"]
        res["runs"].append(row)
        print(f"    launch-blocking {pl:6s}: bit-equal {row['logits_bit_equal']}", flush=True)
    return res


def child_main(argv: list[str]) -> int:
    """`first_contact.py _child`: the tiny placements (keep on), outputs to --out (torch.save)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--placements", required=True)
    a = ap.parse_args(argv)
    bootstrap()
    import torch

    if not a.device.startswith("cuda"):
        torch.set_num_threads(1)
    c = Ctx(argparse.Namespace(work=a.work, device=a.device), Clock(600), {})
    plans = placement_plans(c.plan("tiny-auto"), c.plan("tiny-device"))
    w = c.wl["tiny"]
    reqs = requests(w["prompts"], w["min"], w["max"], w["new"], 384, 1)
    outs = {pl: run_engine(plans[pl][0], a.work / c.man["tiny_ckpt"], a.device, plans[pl][1], reqs, keep=True,
                           small=True)["outputs"] for pl in a.placements.split(",")}
    torch.save(outs, a.out)
    return 0


def pinned_dma(device: str) -> dict[str, Any]:
    """The best of 3 timed 1 GiB pinned host->device copies (CUDA events), after a warm-up."""
    import torch

    if not device.startswith("cuda"):
        return {"skipped": "no CUDA device: no DMA to time", "gb_per_s": None}
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": n, "seconds": times, "gb_per_s": n / min(times) / GB}


def big_checkpoint(c: Ctx, end: float) -> tuple[Path | None, dict[str, Any]]:
    """The perf model's full random checkpoint (reused when a complete one is there)."""
    from moecc_runtime.plan import PlanError, check_checkpoint

    meta, ckpt = c.work / "mixtral-big.meta", c.a.scratch / "mixtral-big"
    mark = ckpt / "complete.json"
    want = (meta / "headers.json").read_text()
    info: dict[str, Any] = {"dir": str(ckpt), "bytes": c.man["big"]["bytes"]}
    if mark.is_file() and mark.read_text() == want:
        info["reused"] = True
    else:
        mark.unlink(missing_ok=True)
        free = shutil.disk_usage(c.a.scratch).free
        if free < info["bytes"] + 2e9:
            info["error"] = f"{free / GB:.1f} GB free on disk, the checkpoint needs {info['bytes'] / GB:.1f} GB"
            return None, info
        gen_dev = "cuda" if c.cuda() else "cpu"
        print(f"    writing {info['bytes'] / GB:.1f} GB of random bf16 weights into {ckpt} (on {gen_dev})", flush=True)
        try:
            info.update(write_shards(meta, ckpt, headers_only=False, device=gen_dev, deadline=end))
        except TimeoutError as e:
            info["error"] = str(e)
            return None, info
        mark.write_text(want)
    try:
        check_checkpoint(c.plan("big-auto"), ckpt)
    except PlanError as e:
        info["error"] = f"the prepared plan does not match the written checkpoint: {e}"
        return None, info
    return ckpt, info


def phase_perf(c: Ctx) -> dict[str, Any]:
    """(c) the 4-layer model at --gpu-mem 4GB: tok/s, peak, GB/s, overlap, syncs per placement."""
    import torch

    end = c.clock.deadline - 5
    out: dict[str, Any] = {"model": c.man["big"], "gpu_mem": c.wl["gpu_mem"], "runs": []}
    ckpt, out["checkpoint"] = big_checkpoint(c, end)
    if ckpt is None:
        print(f"    checkpoint: {out['checkpoint'].get('error')}", flush=True)
        out.update(_skip(f"no checkpoint: {out['checkpoint'].get('error')}"))
        return out
    out["pinned_dma"] = pinned_dma(c.device)
    plans = placement_plans(c.plan("big-auto"), c.plan("big-device"))
    cfg = json.loads((c.work / "mixtral-big.meta" / "config.json").read_text())
    w = c.wl["perf"]
    reqs = requests(w["prompts"], w["min"], w["max"], w["new"], cfg["vocab_size"], 2)
    for i, pl in enumerate(PLACEMENTS):
        share = (end - time.time()) / (len(PLACEMENTS) - i)
        if share < 15:
            out["runs"].append({"placement": pl, **_skip(f"perf: {end - time.time():.0f} s left")})
            continue
        plan, att, how = plans[pl]
        try:
            row = perf_run(c, plan, ckpt, att, reqs, time.time() + share)
        except Exception as e:
            row = {"error": traceback.format_exc()[-3000:]}
            print(f"    {pl}: ERROR {e}", flush=True)
        out["runs"].append({"placement": pl, "how": how, **row})
        if c.cuda():
            torch.cuda.empty_cache()
    return out


def perf_run(c: Ctx, plan: dict[str, Any], ckpt: Path, att: str | None, reqs: list[Any],
             end: float) -> dict[str, Any]:
    """One placement: the timed run (stopped at `end`), then a short sync census on the same engine."""
    import torch

    from moecc_runtime import native
    from moecc_runtime.engine import Engine, generate
    from moecc_runtime.syncs import HostReads
    from moecc_runtime.worker.attention_backends import Where

    cuda = c.cuda()
    row: dict[str, Any] = {}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row["device_used_before"] = _used()
    t = time.perf_counter()
    eng = Engine(plan, ckpt, c.device, attention=att)
    row["setup_s"] = time.perf_counter() - t
    kernel = _Counter(native.paged_attention)
    native.paged_attention = kernel
    peak = [0]

    gen = [0]  # tokens sampled so far (a run stopped at its time counts what it made)

    def on_step(tokens: int, _: int) -> None:
        gen[0] += tokens
        if cuda:
            peak[0] = max(peak[0], _used())

    try:
        stop = lambda: "stop" if time.time() > end - 8 else "run"  # noqa: E731 (room for the census)
        with HostReads() as hr:
            t = time.perf_counter()
            ended = generate(eng, reqs, lambda r: None, control=stop, on_step=on_step)
            if cuda:
                torch.cuda.synchronize()
            secs = time.perf_counter() - t
        st = eng.stats
        row.update(ended=ended, seconds=secs, generated_tokens=gen[0], tok_s=gen[0] / secs if secs else None,
                   steps=st.steps, partial=ended != "done",
                   predicted_tok_s=(plan.get("predicted") or {}).get("job_tokens_per_s"))
        row.update(_engine_figures(eng, st, hr.counts, peak[0]))
        row["h2d_gb_per_s_over_run"] = st.copy_bytes / secs / GB if secs else None  # bytes / generate's wall time
        row["native_kernel_calls"] = kernel.calls
        row["host_attention_native"] = bool(eng.worker.backends[Where.HOST].native)
        row["sync_census"] = sync_census(c, eng, reqs, end)
    finally:
        native.paged_attention = kernel.inner
        eng.close()
    print(f"    {row.get('tok_s') or 0:8.1f} tok/s  peak {row['true_peak_bytes'] / GB:.2f} GB of "
          f"{row['gpu_mem'] / GB:.2f}  H2D {_f(row['h2d_gb_per_s'], '.1f')} GB/s  overlap "
          f"{_f(row['overlap_efficiency'], '.2f')}  path {row['weight_path']}  ({row['ended']}, {secs:.1f} s)",
          flush=True)
    return row


class _Counter:
    """Counts calls of a function it wraps."""

    def __init__(self, inner: Callable[..., Any]):
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


def _used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _f(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _engine_figures(eng: Any, st: Any, reads: Counter, sampled_peak: int) -> dict[str, Any]:
    """The engine's stats as the table reads them (peaks, copy rate, overlap, syncs, weight path)."""
    wts = eng.worker.weights
    pins = getattr(wts, "pins", None)
    steps = max(st.steps, 1)
    true_peak = max(st.peak_process_device_bytes, sampled_peak) or st.peak_device_bytes
    return {"gpu_mem": st.gpu_mem or ((eng.plan.get("memory") or {}).get("device") or {}).get("gpu_mem"),
            "true_peak_bytes": true_peak, "peak_process_device_bytes": st.peak_process_device_bytes,
            "process_device_source": st.process_device_source, "mem_get_info_peak_bytes": sampled_peak or None,
            "peak_allocated_bytes": st.peak_allocated_bytes, "peak_reserved_bytes": st.peak_reserved_bytes,
            "arena_bytes": st.arena_bytes, "peak_arena_bytes": st.peak_device_bytes,
            "within_gpu_mem": st.within_gpu_mem,
            # the copy engine's counters: streamed weights plus (device attention) KV gathers
            "copy_bytes": st.copy_bytes, "copy_seconds": st.copy_seconds, "wait_seconds": st.wait_seconds,
            "h2d_gb_per_s": st.copy_bytes / st.copy_seconds / GB if st.copy_seconds else None,
            "overlap_efficiency": st.overlap_efficiency,
            # shares of the engine's step time: the link busy, compute not waiting on a copy; the
            # larger is how busy the bound side kept its pipeline (1.0: no bubble)
            **busy_shares(st.copy_seconds, st.wait_seconds, st.seconds),
            "host_reads_per_step": {k: v / steps for k, v in sorted(reads.items())},
            "weight_path": str(getattr(wts, "weight_path", None)),
            "weight_pins": pins.report() if pins is not None else None,
            "steps_on_device": eng.worker.steps_on_device, "keep_on_device": eng.worker.keep_on_device}


def busy_shares(copy_s: float, wait_s: float, seconds: float) -> dict[str, float | None]:
    """link_busy (copy time / step time), compute_busy (step time not waiting on a copy / step
    time) and pipeline_busy, the larger: a copy-bound run is judged by its link, a compute-bound
    one by its compute. 1 - wait/copy says nothing of a copy-bound run (its compute, however
    short, always waits), so it is judged only where compute is the bound side."""
    if seconds <= 0:
        return {"link_busy": None, "compute_busy": None, "pipeline_busy": None}
    link, compute = copy_s / seconds, max(0.0, seconds - wait_s) / seconds
    return {"link_busy": link, "compute_busy": compute, "pipeline_busy": max(link, compute)}


def sync_census(c: Ctx, eng: Any, reqs: list[Any], end: float) -> dict[str, Any]:
    """A short second run on `eng` under torch.cuda.set_sync_debug_mode("warn"): the warnings
    counted by the runtime frame (file:line) that caused them, and HostReads, per step."""
    from moecc_runtime.engine import generate
    from moecc_runtime.syncs import HostReads

    w = c.wl["census"]
    if time.time() > end - 3:
        return _skip("sync census: out of time")
    small = [type(r)(f"s{r.key}", r.prompt_ids, w["new"]) for r in reqs[:w["prompts"]]]
    steps0 = eng.stats.steps
    with sync_warnings(c.cuda()) as sites, HostReads() as hr:
        generate(eng, small, lambda r: None)
    steps = max(eng.stats.steps - steps0, 1)
    return {"steps": steps, "mode": "warn" if c.cuda() else "not set (no CUDA)",
            "sync_warnings_per_step": sum(sites.values()) / steps,
            "by_site_per_step": {k: v / steps for k, v in sites.most_common()},
            "host_reads_per_step": {k: v / steps for k, v in sorted(hr.counts.items())}}


class sync_warnings:
    """Counts warnings raised while open by the innermost runtime/ frame on the stack
    (torch's sync debug warnings are raised inside the op the runtime called)."""

    def __init__(self, cuda: bool):
        self.cuda, self.sites = cuda, Counter()

    def __enter__(self) -> Counter:
        import torch

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self.sites

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        self._cm.__exit__(*exc)

    def _show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
              line: Any = None) -> None:
        import traceback as tb

        rt = str(ROOT / "runtime")
        site = next((f"runtime{fr.filename[len(rt):]}:{fr.lineno} ({fr.name})" for fr in reversed(tb.extract_stack())
                     if fr.filename.startswith(rt)), f"{filename}:{lineno}")
        if "synchroniz" not in str(message):
            site = f"other warning: {str(message)[:60]} @ {site}"
        self.sites[site] += 1


# -- the report -----------------------------------------------------------------------------

def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every figure against its target: [{check, value, target, ok (True/False/None: not measured)}]."""
    rows: list[dict[str, Any]] = []

    def add(check: str, value: Any, target: str, ok: bool | None) -> None:
        rows.append({"check": check, "value": value, "target": target, "ok": ok})

    ph = res.get("phases", {})
    for r in (ph.get("correctness") or {}).get("runs", []):
        name = f"(a) {r['placement']} keep={r.get('keep_on_device')}"
        if "tokens_identical" not in r:
            add(name, r.get("skipped") or "error", "tokens identical, |dlogit| <= 1e-4",
                None if "skipped" in r else False)
            continue
        add(name + " tokens", "identical" if r["tokens_identical"] else "DIFFER", "identical to CPU",
            r["tokens_identical"])
        add(name + " max |dlogit|", f"{r['max_abs_logit_diff']:.2e}", f"<= {TOL:g}", r["max_abs_logit_diff"] <= TOL)
    race = ph.get("race") or {}
    for r in race.get("runs", []) + (race.get("launch_blocking") or {}).get("runs", []):
        name = f"(b) {r['placement']} {r.get('mode', '')}".rstrip()
        ok = r.get("logits_bit_equal") if "skipped" not in r else None
        add(name, r.get("skipped") or ("bit-equal" if ok else r.get("error", "DIFFER")[-80:]),
            "logits bit-equal to the plain run", ok)
    if (race.get("launch_blocking") or {}).get("skipped") or (race.get("launch_blocking") or {}).get("error"):
        lb = race["launch_blocking"]
        add("(b) CUDA_LAUNCH_BLOCKING=1", lb.get("skipped") or lb["error"][-80:], "bit-equal",
            None if "skipped" in lb else False)
    perf = ph.get("perf") or {}
    dma = (perf.get("pinned_dma") or {}).get("gb_per_s")
    for r in perf.get("runs", []):
        _perf_targets(add, r, dma)
    return rows


def _perf_targets(add: Callable[..., None], r: dict[str, Any], dma: float | None) -> None:
    p = f"(c) {r['placement']}"
    if "tok_s" not in r:
        add(p, r.get("skipped") or r.get("error", "error")[-80:], "runs", None if "skipped" in r else False)
        return
    add(p + " tok/s", f"{r['tok_s']:.1f}" + (" (partial)" if r.get("partial") else ""),
        f"measured (plan predicts {_f(r.get('predicted_tok_s'), '.1f')} on its hardware)", None)
    peak, mem = r["true_peak_bytes"], r["gpu_mem"]
    add(p + " true device peak", f"{peak / GB:.3f} GB ({r.get('process_device_source') or 'arena'})",
        f"<= budget {mem / GB:.3f} GB" if mem else "<= budget", peak <= mem if mem and peak else None)
    h2d = r.get("h2d_gb_per_s")
    add(p + " streamed H2D", _f(h2d, ".1f") + " GB/s", f">= 80% of pinned {_f(dma, '.1f')} GB/s",
        h2d >= 0.8 * dma if h2d and dma else None)
    ov, busy = r.get("overlap_efficiency"), r.get("pipeline_busy")
    # a CPU run's copies are memmoves: not judged
    cpu = " (on CUDA; not judged here)" if r.get("weight_path") == "host-memcpy" else ""
    bound = "copy" if (r.get("link_busy") or 0) > (r.get("compute_busy") or 0) else "compute"
    add(p + " pipeline busy", f"{_f(busy, '.3f')} ({bound}-bound; link {_f(r.get('link_busy'), '.2f')}, compute "
        f"{_f(r.get('compute_busy'), '.2f')})", ">= 0.90" + cpu, busy >= 0.9 if busy is not None and not cpu else None)
    # copy-bound: compute has nothing to hide copies behind, so 1 - wait/copy is not judged
    why = cpu or (" (copy-bound: not judged)" if bound == "copy" else "")
    add(p + " overlap 1-wait/copy", _f(ov, ".3f"), ">= 0.90" + why, ov >= 0.9 if ov is not None and not why else None)
    add(p + " host reads/step", ", ".join(f"{k} {v:.1f}" for k, v in r["host_reads_per_step"].items()) or "0",
        "measured", None)
    sc = r.get("sync_census") or {}
    if "sync_warnings_per_step" in sc:
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(sc["by_site_per_step"].items())[:3])
        add(p + " sync warnings/step", f"{sc['sync_warnings_per_step']:.1f}" + (f" [{top}]" if top else ""),
            "measured (set_sync_debug_mode warn)", None)
    add(p + " weight path", r["weight_path"], "registered-mmap or pinned-copy on CUDA", None)
    add(p + " native kernel", f"{r['native_kernel_calls']} calls (native={r['host_attention_native']})",
        "runs where attention is on the host", None)


def print_table(res: dict[str, Any]) -> None:
    rows = [("check", "value", "target", "verdict")] + [
        (t["check"], str(t["value"]), t["target"], {True: "ok", False: "FAIL", None: "-"}[t["ok"]])
        for t in res["targets"]]
    widths = [min(70, max(len(r[i]) for r in rows)) for i in range(4)]
    print(f"\n== first contact: {res['mode']} on {res['device']} ({res.get('gpu') or 'no GPU'}); "
          f"native kernel built {res['native'].get('built_here')} / available {res['native'].get('available')}")
    for r in rows:
        print("  ".join(str(c)[:w].ljust(w) for c, w in zip(r, widths)).rstrip())
    fails = sum(t["ok"] is False for t in res["targets"])
    print(f"{fails} check(s) failed; phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["phase_s"].items())
          + f"; total {res['total_s']:.0f} s of a {res['budget_s']:.0f} s budget")


# -- the driver -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--prepare", action="store_true", help="write bench/out/gpu_check/ here (needs OR-Tools)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="prepare tiny shapes and run everything on the CPU")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    ap.add_argument("--work", type=Path, default=None, help="the prepared files (default bench/out/gpu_check; "
                    "dry run: bench/out/gpu_check-dry)")
    ap.add_argument("--scratch", type=Path, default=None, help="where the perf checkpoint is written "
                    "(default WORK-device)")
    ap.add_argument("--device", default=None, help="default cuda (dry run: cpu)")
    ap.add_argument("--json", type=Path, default=None, help="where to write the JSON")
    a = ap.parse_args(argv)
    a.work = a.work or (PREPARED.parent / "gpu_check-dry" if a.dry_run_cpu else PREPARED)
    a.scratch = a.scratch or a.work.parent / (a.work.name + "-device")
    a.device = a.device or ("cpu" if a.dry_run_cpu else "cuda")
    return a


def json_path(a: argparse.Namespace) -> Path:
    out = os.environ.get("OUT")
    if a.json:
        return a.json
    if a.dry_run_cpu:
        return Path(out) / "gpu_check-dry-run.json" if out else a.work / "gpu_check.json"
    if out:
        return Path(out) / "gpu_check.json"
    return ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-gpu-check.json"


def do_prepare(a: argparse.Namespace) -> int:
    t = time.time()
    print(f"== preparing {a.work} (tiny checkpoint and plans, perf model headers and plans)", flush=True)
    prepare(a.work, dry=False)
    size = sum(p.stat().st_size for p in a.work.rglob("*") if p.is_file())
    rel = os.path.relpath(a.work, ROOT)
    print(f"wrote {a.work}: {size / 2**20:.1f} MiB in {time.time() - t:.0f} s\n"
          f"on the device: run tool, carry=[\"{rel}\"], command: bash bench/gpu_check.sh", flush=True)
    return 0


def machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpus": os.cpu_count(),
                            "cuda_available": torch.cuda.is_available()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), gpu_total_bytes=torch.cuda.get_device_properties(0).total_memory,
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return info


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    bootstrap()
    if a.prepare:
        return do_prepare(a)
    clock = Clock(a.budget)
    mode = "dry-run-cpu" if a.dry_run_cpu else "device"
    print(f"== first contact ({mode}, device {a.device}, budget {a.budget:.0f} s)", flush=True)
    if a.dry_run_cpu:
        import torch

        torch.set_num_threads(1)  # tiny matrices: as fast, and not slowed by a loaded machine
        prepare(a.work, dry=True, log=lambda s: print(s, flush=True))
        clock.phases["prepare"] = time.time() - clock.t0
    elif not (a.work / "manifest.json").is_file():
        print(f"error: {a.work}/manifest.json missing: run `bash bench/gpu_check.sh --prepare` on a machine with "
              f"OR-Tools and carry {os.path.relpath(a.work, ROOT)}", flush=True)
        return 2
    import torch

    res: dict[str, Any] = {"what": "moecc first contact with a GPU (issue 29 item 9)", "mode": mode,
                           "device": a.device, "budget_s": a.budget, "machine": machine(a.device), "phases": {}}
    res["gpu"] = res["machine"].get("gpu")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here; use --dry-run-cpu", flush=True)
        return 2
    a.scratch.mkdir(parents=True, exist_ok=True)
    t = time.time()
    res["native"] = build_native(timeout=max(10.0, min(120.0, clock.left() / 4)))
    print(f"[setup] native kernel: {res['native']}", flush=True)
    clock.phases["setup"] = time.time() - t
    c = Ctx(a, clock, res)
    for name, fn in (("correctness", lambda: phase_correctness(c, min(90.0, clock.left() * 0.25))),
                     ("race", lambda: phase_race(c, min(90.0, clock.left() * 0.3))),
                     ("perf", lambda: phase_perf(c))):
        t = time.time()
        print(f"[{name}] ({clock.left():.0f} s left)", flush=True)
        try:
            res["phases"][name] = fn()
        except Exception as e:
            res["phases"][name] = {"error": traceback.format_exc()[-3000:]}
            print(f"    ERROR {e}", flush=True)
        clock.phases[name] = time.time() - t
    return finish(a, res, clock)


def finish(a: argparse.Namespace, res: dict[str, Any], clock: Clock) -> int:
    res["phase_s"] = clock.phases
    res["total_s"] = time.time() - clock.t0
    res["targets"] = targets(res)
    res["failed"] = sum(t["ok"] is False for t in res["targets"])
    print_table(res)
    path = json_path(a)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        sys.exit(child_main(sys.argv[2:]))
    sys.exit(main())
