"""The `moecc` command line: compile a checkpoint into a plan, run a plan over prompts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Compile and run Mixture-of-Experts models for large offline batch jobs.")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@app.command("compile")
def compile_cmd(
    model_dir: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json, *.safetensors)."),
    output: Path = typer.Option(Path("plan.pt"), "-o", "--output", help="Where to write the plan."),
    gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="Device memory budget, e.g. 24GB, 24GiB. "
                                          "Unset: unbounded (weights stay where they are on CPU)."),
    host_mem: Optional[str] = typer.Option(None, "--host-mem", help="Host memory budget, e.g. 256GB. Unset: "
                                           "unbounded; the KV pool is sized by this machine's available memory."),
    host_reserve: Optional[str] = typer.Option(None, "--host-reserve", help="Host memory kept out of --host-mem "
                                               "for what the plan does not size (the process, page tables, the "
                                               "request table). Unset: modelled (`moecc explain` shows it)."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Typical prompt length, for sizing the batch."),
    output_tokens: int = typer.Option(256, "--output-tokens", help="Typical output length, for sizing the batch."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Take the workload shape (mean prompt "
                                           "tokens, mean max_tokens, and the share of prompt tokens in "
                                           "prefixes shared across requests) from this prompts file instead."),
    max_batch: int = typer.Option(1024, "--max-batch", help="Upper bound on sequences in flight (B)."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="A preset (t4, l4, rtx4090, a5000, a6000, "
                                           "a100-80gb, h100-80gb, h200, cpu) or a JSON file from `moecc profile`. "
                                           "Unset: this machine's preset."),
    attention: str = typer.Option("auto", "--attention", help="Where attention runs, per phase: auto (the planner "
                                  "picks host, device or a split of each step's sequences by predicted "
                                  "throughput), host (on the CPU over the KV pool in place: only queries and "
                                  "outputs cross) or device (the KV brought to the device every layer)."),
    dump_dir: Optional[Path] = typer.Option(None, "--dump-dir", help="Write the graph after every pass as NNN_<pass>.txt."),
    dump_format: str = typer.Option("txt", "--dump-format", help="Comma-separated dump formats: txt, onnx "
                                    "(NNN_<pass>.onnx, one node per module-level op, opens in Netron), svg "
                                    "(NNN_<pass>.svg, the graph drawn; graphviz dot's layout when installed)."),
    print_after: list[str] = typer.Option([], "--print-after", help="Print the graph after PASS (repeatable) or 'all'."),
    verify: bool = typer.Option(False, "--verify", help="Check the graph's well-formedness after every pass."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="Weight-only quantization of a bf16/fp16/fp32 "
                                           "checkpoint: int8 (per output channel) or int4 (groups of input "
                                           "channels). The quantized weights are written once beside the plan, "
                                           "as OUTPUT.weights.safetensors; the checkpoint is not changed."),
    quantize_group_size: int = typer.Option(128, "--quantize-group-size", help="int4: input channels per scale "
                                            "and zero point (a row's last group may be partial)."),
    quantize_scope: str = typer.Option("experts", "--quantize-scope", help="experts: the routed experts only; "
                                       "all: also attention and dense/shared-expert MLP weights (never "
                                       "embeddings, norms, routers or lm_head)."),
) -> None:
    """Compile MODEL_DIR into a plan for this machine's budgets."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moecc.errors import MoeccError
    from moecc.sizes import SizeError, format_bytes, parse_size

    try:
        gpu = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
        host = parse_size(host_mem, what="--host-mem") if host_mem is not None else None
        reserve = parse_size(host_reserve, what="--host-reserve", allow_zero=True) if host_reserve is not None else None
    except SizeError as e:
        _fail(str(e))
    from moecc.compiler import check_attention, compile_model
    from moecc.quantize import quantize_spec
    from moecc_runtime.plan import save_plan

    try:
        quantize_spec(quantize, quantize_group_size, quantize_scope)
        check_attention(attention)
    except (MoeccError, ValueError) as e:
        _fail(str(e))

    shared_prefix = 0.0
    if prompts is not None:
        try:
            prompt_tokens, output_tokens, shared_prefix = _workload_from(prompts, model_dir, output_tokens)
        except (OSError, RuntimeError, ValueError) as e:
            _fail(f"--prompts {prompts}: {e}")
        shared = (f"; {shared_prefix:.0%} of prompt tokens in shared prefixes (computed once)"
                  if shared_prefix else "")
        typer.echo(f"workload from {prompts}: {prompt_tokens} prompt tokens, {output_tokens} output tokens "
                   f"on average{shared}", err=True)

    try:
        plan, graph = compile_model(model_dir, gpu_mem=gpu, host_mem=host, host_reserve=reserve,
                                    prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                                    shared_prefix=shared_prefix, max_batch=max_batch, hardware=hardware,
                                    dump_dir=dump_dir,
                                    dump_formats=tuple(f.strip() for f in dump_format.split(",") if f.strip()),
                                    print_after=set(print_after) or None, verify=verify, quantize=quantize,
                                    quantize_group_size=quantize_group_size, quantize_scope=quantize_scope,
                                    output=output, log=lambda line: typer.echo(line, err=True), attention=attention)
    except (MoeccError, ValueError) as e:
        _fail(str(e))
    save_plan(plan, output)
    d = plan["batch"]["decode"]
    pred = plan["predicted"]
    present = "weights present" if plan["model"]["fingerprint"]["weight_files"] else "config only (cannot exec)"
    typer.echo(f"wrote {output}: {plan['model']['architecture']}, {graph.info.num_layers} layers, "
               f"{format_bytes(pred['weight_bytes'])} of weights ({present}); "
               f"decode B={d['B']} b_a={d['b_a']} b_e={d['b_e']}; attention {_where(plan)}; "
               f"predicted on {pred.get('hardware')}: "
               f"prefill {pred.get('prefill_tokens_per_s', 0):.0f} tok/s, decode "
               f"{pred.get('decode_tokens_per_s', 0):.0f} tok/s (`moecc explain {output}` says why)", err=True)
    side = plan["model"]["fingerprint"].get("sidecar")
    if side is not None:
        typer.echo(f"wrote {output.with_name(side['file'])}: {graph.attrs['quantized']['tensors']} weights as "
                   f"{side['quantize']['scheme']} ({format_bytes(side['size'])}); keep it beside the plan", err=True)


def _where(plan: dict) -> str:
    """Where each phase's attention runs, e.g. 'host (decode), host (prefill)'."""
    return ", ".join(f"{(plan['batch'][ph].get('attention') or {}).get('where', '?')} ({ph})"
                     for ph in ("decode", "prefill"))


def _workload_from(prompts: Path, model_dir: Path, default_max: int) -> tuple[int, int, float]:
    """Mean prompt tokens and mean max_tokens of the valid requests in a prompts file, and
    the share of their prompt tokens prefix sharing computes once (explain.workload_of:
    counted in the planner's KV block size, KV_BLOCK_SIZE, the block size of every plan)."""
    from moecc.views.explain import workload_of

    w = workload_of(prompts, model_dir, default_max)
    if w["requests"] == 0:
        raise ValueError("no valid request in the file")
    n = w["requests"]
    return max(1, round(w["prompt_tokens"] / n)), max(1, round(w["max_output_tokens"] / n)), float(w["shared_prefix"])


@app.command("exec")
def exec_cmd(
    plan: Path = typer.Argument(..., help="Plan written by `moecc compile`."),
    prompts: Path = typer.Argument(..., help="JSONL file, one request per line."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Results JSONL (default: stdout)."),
    errors: Optional[Path] = typer.Option(None, "--errors", help="Error records JSONL (default: beside the output)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory, if moved since compile."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Default max_tokens for requests that set none."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="Override the plan's B."),
    stats: Optional[Path] = typer.Option(None, "--stats", help="Write the job summary and per-step engine "
                                         "records (time, tokens, KV use) to this JSON file."),
    fmt: str = typer.Option("moecc", "--format", help="Output lines: moecc (custom_id, text, token_ids, "
                            "finish_reason, usage) or openai (Batch API output lines)."),
    resume: bool = typer.Option(False, "--resume", help="Skip requests already in the output (and errors) file "
                                "and append the rest: continues a killed or interrupted job."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing non-empty output file."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display or per-request error lines."),
    ray: bool = typer.Option(False, "--ray", help="Run on a Ray cluster: the requests are split into shards "
                             "run by Ray actors, one device each (needs pip install 'moecc[ray]')."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster to join (default: a "
                                              "local one; 'auto': the running cluster)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Ray actors (default: one per GPU, or per "
                                          "CPU core on a CPU-only cluster)."),
    no_share_prefixes: bool = typer.Option(False, "--no-share-prefixes", help="Compute every request's whole "
                                           "prompt, even prefixes an earlier request computed (by default their "
                                           "KV blocks are shared)."),
) -> None:
    """Run PLAN over every request in PROMPTS (moecc's simple lines or OpenAI Batch API lines).

    Results are appended as each request finishes (flushed at once, fsync'ed every few
    seconds). Ctrl-C once: finish the requests in flight and stop; twice, or SIGTERM: stop
    after this step. Either way `--resume` continues the job. Exit status: 0 all done, 1 some
    requests failed, 130 interrupted."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moecc_runtime.memory.arena import ArenaError
    from moecc_runtime.memory.copy_engine import CopyError
    from moecc_runtime.job.lock import JobLockError
    from moecc_runtime.job.exec import run_job
    from moecc_runtime.plan import PlanError
    from moecc_runtime.job.results import FORMATS
    from moecc_runtime.memory.weights import WeightError

    if fmt not in FORMATS:
        _fail(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if resume and output is None:
        _fail("--resume needs -o FILE: it continues the job whose results are in that file")
    if resume and overwrite:
        _fail("--resume and --overwrite contradict each other: pick one")
    if output is not None and not resume and not overwrite and output.is_file() and output.stat().st_size > 0:
        _fail(f"{output} already holds results; pass --resume to continue that job or --overwrite to start over")
    if (ray_address is not None or workers is not None) and not ray:
        _fail("--ray-address and --workers only apply with --ray")
    ray_options = None
    if ray:
        from moecc_runtime.job.distributed import RayOptions, import_ray

        try:
            import_ray()
        except RuntimeError as e:
            _fail(str(e))
        if workers is not None and workers < 1:
            _fail(f"--workers must be at least 1, not {workers}")
        ray_options = RayOptions(address=ray_address, workers=workers)
    if errors is None and output is not None:
        errors = output.with_name(output.stem + ".errors.jsonl")
    from functools import partial

    from moecc.replan import replan_for_device  # a plan without --gpu-mem on CUDA: recompiled for the device

    try:
        summary = run_job(plan, prompts, output if output is not None else sys.stdout, errors_path=errors,
                          model_dir=model, max_tokens=max_tokens, device=device, max_batch=max_batch,
                          stats_path=stats, fmt=fmt, resume=resume, progress="quiet" if quiet else "auto",
                          handle_signals=True, log=None if quiet else sys.stderr, ray=ray_options,
                          share_prefixes=not no_share_prefixes,
                          replan=partial(replan_for_device, plan_path=plan, log=lambda m: typer.echo(m, err=True)))
    except JobLockError as e:  # nothing was written: the files belong to another run, or collide
        _fail(str(e))
    except (PlanError, WeightError, CopyError, ArenaError, OSError, RuntimeError, ValueError) as e:
        wrote = output is None or (output.is_file() and output.stat().st_size > 0)
        _fail(f"{e}" + (f" (results finished before this are in {output or 'stdout'}; rerun with --resume to "
                        f"continue)" if wrote else ""))
    typer.echo(f"moecc: {summary.report()}" + (f"; errors in {errors}" if summary.failed and errors else ""),
               err=True)
    eng = summary.engine
    if eng.get("arena_bytes"):
        eff = eng.get("overlap_efficiency")
        typer.echo(f"device arena {eng['arena_bytes'] / 2**20:.1f} MiB, peak used {eng['peak_device_bytes'] / 2**20:.1f} "
                   f"MiB; copied {eng['copy_bytes'] / 2**30:.2f} GiB in {eng['copy_seconds']:.2f}s, compute waited "
                   f"{eng['wait_seconds']:.2f}s" + (f" (overlap {eff:.0%})" if eff is not None else ""), err=True)
    if summary.status == "interrupted":
        raise typer.Exit(130)
    if summary.failed:
        raise typer.Exit(1)


@app.command("explain")
def explain_cmd(
    plan: Path = typer.Argument(..., help="Plan written by `moecc compile`."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="A prompts file to estimate the job's ETA for."),
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory, if moved since compile "
                                         "(only needed with --prompts)."),
    timeline: Optional[Path] = typer.Option(None, "--timeline", help="Draw the predicted schedule of one decode "
                                            "and one prefill step (compute and copy lanes, critical path) as SVG."),
    measured: Optional[Path] = typer.Option(None, "--measured", help="A `moecc exec --stats` file: its measured "
                                            "step timelines against the predicted ones, seconds per job kind (and "
                                            "with --timeline drawn below the predicted ones)."),
    layers: int = typer.Option(2, "--layers", help="Layers the timeline shows (0: all, with the head)."),
) -> None:
    """Predicted prefill and decode tokens/s, their bottlenecks, memory use and the ETA of a job."""
    import json

    from moecc.views.explain import explain, format_explain, measured_timeline, write_timeline
    from moecc.views.timeline_svg import TimelineError
    from moecc_runtime.plan import PlanError, load_plan

    if layers < 0:
        _fail(f"--layers must be 0 (all) or more, got {layers}")
    try:
        p = load_plan(plan)
        meas = measured_timeline(measured) if measured is not None else None  # read once, used twice
        rep = explain(p, prompts, model, measured=meas, plan_path=plan)
        if timeline is not None:
            write_timeline(p, timeline, meas, layers or None)
    except (PlanError, OSError, RuntimeError, TimelineError) as e:
        _fail(str(e))
    typer.echo(json.dumps(rep, indent=1) if json_out else format_explain(rep))
    if timeline is not None and not json_out:
        typer.echo(f"wrote {timeline}" + (f" (predicted and measured from {measured})" if measured else ""))


@app.command("perplexity")
def perplexity_cmd(
    plan: Path = typer.Argument(..., help="Plan written by `moecc compile`."),
    text: Path = typer.Argument(..., help="UTF-8 text file to score (e.g. examples/demo-model/heldout.txt)."),
    window: int = typer.Option(256, "--window", help="Next-token predictions per scored window (each window "
                               "sees only its own tokens)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory, if moved since compile."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto."),
    json_out: bool = typer.Option(False, "--json", help="Print perplexity, nll, tokens and windows as JSON."),
) -> None:
    """Perplexity of PLAN's model on TEXT, computed by the runtime as `exec` runs the model:
    how output quality is compared across weight formats."""
    import json

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moecc_runtime.scheduler.blocks import KVCacheFull
    from moecc_runtime.perplexity import plan_perplexity
    from moecc_runtime.plan import PlanError
    from moecc_runtime.memory.weights import WeightError

    try:
        res = plan_perplexity(plan, text, window=window, model_dir=model, device=device)
    except KVCacheFull as e:
        _fail(f"{e}: the plan's KV pool cannot hold one window of {window} tokens; pass a smaller --window")
    except (PlanError, WeightError, OSError, RuntimeError, ValueError) as e:
        _fail(str(e))
    if json_out:
        typer.echo(json.dumps({"perplexity": res.value, "nll": res.nll, "tokens": res.tokens,
                               "windows": res.windows}))
    else:
        typer.echo(f"perplexity {res.value:.4f} over {res.tokens} tokens ({res.windows} windows of {window})")


@app.command("profile")
def profile_cmd(
    output: Path = typer.Option(Path("hw.json"), "-o", "--output", help="Where to write the hardware profile (JSON)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda: the compute device to measure."),
    dtype: list[str] = typer.Option([], "--dtype", help="Dtype of the GEMM and attention curves "
                                    "(float32, bfloat16, float16; repeatable; default float32)."),
    quick: bool = typer.Option(False, "--quick", help="Fewer, smaller measurements (seconds, not a minute)."),
    model: list[Path] = typer.Option([], "--model", help="Also measure this checkpoint's expert MLP shape "
                                     "(config.json's hidden and expert intermediate sizes; repeatable), and "
                                     "calibrate the planner on a short job of the first one."),
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="With --model: run a short job of "
                                   "the model with weights resident and streamed, and fit the planner's "
                                   "per-job-kind factors to what the runtime measured (about a minute)."),
) -> None:
    """Measure this machine (GEMM, attention and copy rates) and write a hardware profile."""
    import dataclasses

    from moecc.errors import MoeccError
    from moecc.measure.profile import busy_warning, measure, summarize

    warning = busy_warning()
    if warning:
        typer.echo(warning, err=True)
    try:
        prof = measure(device=device, dtypes=tuple(dtype) or ("float32",), quick=quick,
                       mlp_shapes=[_mlp_shape(m) for m in model])
        if model and calibrate:
            from moecc.measure.calibrate import QUICK, Workload
            from moecc.measure.calibrate import calibrate as run_calibration

            cal = run_calibration(model[0], prof, workload=QUICK if quick else Workload(), device=prof.device_kind,
                                  log=lambda m: typer.echo(m, err=True))
            prof = dataclasses.replace(prof, calibration=cal)
        prof.save(output)
    except MoeccError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot write {output}: {e.strerror or e}")
    for line in summarize(prof):
        typer.echo(line)
    typer.echo(f"wrote {output}", err=True)


def _mlp_shape(model_dir: Path) -> tuple[str, int, int]:
    """(dtype, hidden, expert intermediate size) from a checkpoint's config.json."""
    import json

    from moecc.errors import MoeccError

    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
        inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), int(cfg["hidden_size"]), int(inter)
    except (OSError, ValueError, KeyError) as e:
        raise MoeccError(f"--model {model_dir}: cannot read hidden/intermediate sizes from {path}: {e}") from e


def main() -> None:
    app()


if __name__ == "__main__":
    main()
