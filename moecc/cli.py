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
    model_dir: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json, *.safetensors), "
                                     "or a Hub model id ORG/NAME[@REVISION]: from the local Hugging Face cache, "
                                     "else downloaded (safetensors, config and tokenizer files) unless "
                                     "HF_HUB_OFFLINE is set."),
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
    quantize_group_size: Optional[int] = typer.Option(None, "--quantize-group-size", help="int4 only: input "
                                                      "channels per scale and zero point (default 128; a row's "
                                                      "last group may be partial)."),
    quantize_scope: Optional[str] = typer.Option(None, "--quantize-scope", help="With --quantize: experts "
                                                 "(default: the routed experts only) or all (also attention and "
                                                 "dense/shared-expert MLP weights; never embeddings, norms, "
                                                 "routers or lm_head)."),
    dtype: str = typer.Option("auto", "--dtype", help="The compute dtype: auto (what transformers' "
                              "dtype=\"auto\" loads: config.json's torch_dtype, or the weights' own), fastest "
                              "(bfloat16 for an fp32 model where the hardware computes it faster), bfloat16, "
                              "float16 or float32 (weights stored in another dtype are cast when read)."),
) -> None:
    """Compile MODEL_DIR into a plan for this machine's budgets."""
    from moecc.errors import MoeccError
    from moecc.frontend.checkpoint import resolve_model

    try:  # a Hub id: before HF_HUB_OFFLINE is defaulted on below, so a download is allowed unless the user set it
        model_dir = resolve_model(model_dir)
    except MoeccError as e:
        _fail(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moecc.sizes import SizeError, format_bytes, parse_size

    try:
        gpu = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
        host = parse_size(host_mem, what="--host-mem") if host_mem is not None else None
        reserve = parse_size(host_reserve, what="--host-reserve", allow_zero=True) if host_reserve is not None else None
    except SizeError as e:
        _fail(str(e))
    from moecc.compiler import check_attention, compile_model
    from moecc.frontend.dtype_choice import check_dtype
    from moecc.quantize import DEFAULT_GROUP, quantize_spec
    from moecc_runtime.plan import save_plan

    try:
        _refuse_inapplicable(quantize, quantize_group_size, quantize_scope, dump_dir, dump_format)
        spec = quantize_spec(quantize, DEFAULT_GROUP if quantize_group_size is None else quantize_group_size,
                             quantize_scope or "experts")
        quantize_group_size, quantize_scope = (spec.group_size, spec.scope) if spec else (DEFAULT_GROUP, "experts")
        check_attention(attention)
        check_dtype(dtype)
    except (MoeccError, ValueError) as e:
        _fail(str(e))
    _check_compile_paths(output, quantize is not None, dump_dir)

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
                                    output=output, log=lambda line: typer.echo(line, err=True), attention=attention,
                                    dtype=dtype)
    except (MoeccError, ValueError) as e:
        _fail(str(e))
    try:
        save_plan(plan, output)
    except OSError as e:
        _fail(f"cannot write the plan file {output}: {e.strerror or e}; give -o a path this user can write")
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
        _warn_if_bigger(graph.attrs["quantized"], side, format_bytes)


def _refuse_inapplicable(quantize: Optional[str], group_size: Optional[int], scope: Optional[str],
                         dump_dir: Optional[Path], dump_format: str) -> None:
    """ValueError for a compile option that does nothing with the others given (silently
    ignoring it would hide a mistake): the quantize knobs without --quantize, a group size
    with int8 (per channel: no groups), --dump-format without --dump-dir."""
    if quantize is None and (group_size is not None or scope is not None):
        flag = "--quantize-group-size" if group_size is not None else "--quantize-scope"
        raise ValueError(f"{flag} only applies with --quantize; add --quantize int8|int4 or drop {flag}")
    if quantize == "int8" and group_size is not None:
        raise ValueError(f"--quantize-group-size {group_size} does not apply to --quantize int8 (one scale per "
                         f"output channel, no groups); drop it, or use --quantize int4")
    if dump_dir is None and dump_format != "txt":
        raise ValueError(f"--dump-format {dump_format} only applies with --dump-dir DIR (where the dumps go)")


def _check_compile_paths(output: Path, quantized: bool, dump_dir: Optional[Path]) -> None:
    """Every path compile writes, checked before any work: the plan, its quantized weights
    file beside it (with --quantize), the dump directory; one `error:` line otherwise."""
    from moecc_runtime.job.paths import PathError, check_dir_writable, check_file_writable
    from moecc_runtime.plan import sidecar_path

    try:
        check_file_writable(output, "plan file", "-o")
        if quantized:  # written as a partial file beside the plan, then renamed over the old one
            side = sidecar_path(output)
            if side.is_dir():
                raise PathError(f"cannot write the quantized weights file {side} (beside the plan): it is a "
                                f"directory; remove it or give -o another path")
            check_dir_writable(side.parent, "plan's directory (its quantized weights go there)", "-o")
        if dump_dir is not None:
            check_dir_writable(dump_dir, "dump directory", "--dump-dir")
    except PathError as e:
        _fail(str(e))


def _warn_if_bigger(record: dict, side: dict, format_bytes) -> None:  # type: ignore[no-untyped-def]
    """A warning when the quantized weights take more bytes than the checkpoint's weights they
    replace (int4 with a tiny group: a scale and a zero point per group outweigh the values)."""
    source = int(record.get("source_bytes") or 0)
    if source and side["size"] > source:
        q = side["quantize"]
        group = f" --quantize-group-size {q.get('group_size')}" if q.get("scheme") == "int4" else ""
        typer.echo(f"warning: --quantize {q.get('scheme')}{group} made the weights bigger: "
                   f"{format_bytes(side['size'])} stored against {format_bytes(source)} in the checkpoint "
                   f"(each group's scale and zero point outweigh its values); use a larger group "
                   f"(default 128) or no --quantize", err=True)


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
    from moecc_runtime.job.paths import describe_os_error

    before = _size(output)
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
        wrote = output is not None and _size(output) > before  # this run wrote results: the hint helps
        text = describe_os_error(e) if isinstance(e, OSError) else str(e)
        _fail(text + (f" (results finished before this are in {output}; rerun with --resume to continue)"
                      if wrote else ""))
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


def _size(path: Optional[Path]) -> int:
    """The size of a regular file (0: missing, not a file, or no path)."""
    try:
        return path.stat().st_size if path is not None and path.is_file() else 0
    except OSError:
        return 0


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
    if timeline is not None:
        _check_out(timeline, "timeline picture", "--timeline")
    try:
        p = load_plan(plan)
        meas = measured_timeline(measured) if measured is not None else None  # read once, used twice
        rep = explain(p, prompts, model, measured=meas, plan_path=plan)
        if timeline is not None:
            write_timeline(p, timeline, meas, layers or None)
    except OSError as e:
        from moecc_runtime.job.paths import describe_os_error

        _fail(describe_os_error(e))
    except (PlanError, RuntimeError, TimelineError) as e:
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
        _verify_quantized(plan, model)  # the same check exec makes before its first step
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

    _check_out(output, "hardware profile", "-o")
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
    except MoeccError as e:
        _fail(str(e))
    try:
        prof.save(output)
    except OSError as e:
        _fail(f"cannot write the hardware profile {output}: {e.strerror or e}")
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


def _verify_quantized(plan_path: Path, model: Optional[Path]) -> None:
    """A plan with quantized weights: its sidecar's bytes and the checkpoint tensors it was
    made from verified (moecc_runtime/job/integrity.py); PlanError otherwise."""
    from moecc_runtime.job.integrity import verify_sidecar
    from moecc_runtime.plan import check_checkpoint, has_sidecar, load_plan

    p = load_plan(plan_path)
    if has_sidecar(p):
        verify_sidecar(p, check_checkpoint(p, model, plan_path), plan_path)


def _check_out(path: Path, role: str, flag: str) -> None:
    """One `error:` line, before any work, when the file `path` cannot be written."""
    from moecc_runtime.job.paths import PathError, check_file_writable

    try:
        check_file_writable(path, role, flag)
    except PathError as e:
        _fail(str(e))


@app.command("serve")
def serve_cmd(
    models: list[str] = typer.Argument(..., help="Checkpoint directories to serve, each DIR (served under the "
                                       "directory's name) or NAME=DIR; a batch line's body.model picks one."),
    data_dir: Path = typer.Option(..., "--data-dir", help="Where files, batches, their state and the cached "
                                  "plans live (kept across restarts: a killed server resumes from it)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (a non-loopback one needs "
                             "an API key)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one, printed at start)."),
    api_key: list[str] = typer.Option([], "--api-key", help="Require Authorization: Bearer KEY (repeatable); "
                                      "each key sees only its own files and batches."),
    api_keys: Optional[Path] = typer.Option(None, "--api-keys", help="A file of API keys, one a line."),
    max_file_size: str = typer.Option("8GiB", "--max-file-size", help="Largest upload accepted."),
    gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="Device memory budget each model's plan is "
                                          "compiled for, as `compile --gpu-mem`."),
    host_mem: Optional[str] = typer.Option(None, "--host-mem", help="Host memory budget, as `compile --host-mem`."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="Hardware preset or profile, as `compile`."),
    max_batch: int = typer.Option(1024, "--max-batch", help="Upper bound on sequences in flight, as `compile`."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto: where jobs run."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads of the job process (default: "
                                          "all cores but one, keeping one for the HTTP side)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Default max_tokens for lines that set none."),
) -> None:
    """Serve OpenAI's Files and Batches API for MODELS on this machine (the official openai
    client works with base_url http://HOST:PORT/v1); batches run through `exec`'s runtime,
    one at a time, and survive a crash of the server. Status page at http://HOST:PORT/."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moecc.errors import MoeccError
    from moecc.serve.auth import read_keys_file
    from moecc.serve.config import ServeConfig, parse_model
    from moecc.serve.main import serve
    from moecc.sizes import SizeError, parse_size

    try:
        keys = list(api_key) + (read_keys_file(api_keys) if api_keys is not None else [])
        cfg = ServeConfig([parse_model(m) for m in models], data_dir, host=host, port=port, keys=keys,
                          max_file_size=parse_size(max_file_size, what="--max-file-size"),
                          gpu_mem=parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None,
                          host_mem=parse_size(host_mem, what="--host-mem") if host_mem is not None else None,
                          hardware=hardware, device=device, max_batch=max_batch, max_tokens=max_tokens,
                          threads=threads if threads is not None else max(1, (os.cpu_count() or 2) - 1))
        serve(cfg)
    except ImportError as e:
        _fail(f"moecc serve needs Starlette, uvicorn and python-multipart (moecc's own dependencies): reinstall "
              f"moecc with `pip install .` ({e})")
    except (SizeError, MoeccError, ValueError, RuntimeError, OSError) as e:
        _fail(str(e))


def main() -> None:
    """The `moecc` entry point: no command ends in a traceback. An OSError no command caught
    is one `error:` line naming its path and the OS's reason; any other exception one line
    naming it as a moecc bug (MOECC_TRACEBACK=1 shows the traceback)."""
    try:
        app()
    except OSError as e:
        from moecc_runtime.job.paths import describe_os_error

        _exit_with(f"error: {describe_os_error(e)}", 1, e)
    except Exception as e:  # noqa: BLE001 - the last line of defence of a command line
        _exit_with(f"error: internal error, a moecc bug: {type(e).__name__}: {e} (set MOECC_TRACEBACK=1 "
                   f"for the traceback)", 2, e)


def _exit_with(line: str, code: int, e: BaseException) -> None:
    if os.environ.get("MOECC_TRACEBACK") == "1":
        raise e
    print(line, file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
