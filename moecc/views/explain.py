"""`moecc explain plan.pt`: what the planner predicted and why, from the plan alone.

Reads only the plan's plain data (and, for an ETA, the prompts file through the runtime's
own parser and tokenizer); imports no solver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moecc.ir import DTYPE_BYTES
from moecc.sizes import format_bytes


def explain(plan: dict[str, Any], prompts: Path | None = None, model_dir: Path | None = None,
            default_max_tokens: int = 256, measured: dict[str, Any] | None = None,
            plan_path: Path | None = None) -> dict[str, Any]:
    """The explain report as plain data (what `--json` prints); with `measured` (the timeline
    of a `moecc exec --stats` file, see measured_timeline) also the predicted-against-measured
    comparison per job kind."""
    pred = plan.get("predicted", {})
    batch = plan["batch"]
    mem = plan.get("memory", {})
    dev = mem.get("device", {})
    host = mem.get("host", {})
    out: dict[str, Any] = {
        "model": plan["model"]["architecture"],
        "hardware": pred.get("hardware"),
        "calibrated_on": pred.get("calibrated_on"),
        "prefill_tokens_per_s": pred.get("prefill_tokens_per_s"),
        "decode_tokens_per_s": pred.get("decode_tokens_per_s"),
        "job_tokens_per_s": pred.get("job_tokens_per_s"),
        "bottleneck": pred.get("bottleneck"),
        "device_bytes": {k: v for k, v in dev.items() if v is not None},
        "device_table": device_table(dev) if "device_reserve" in dev else None,
        "host_bytes": {k: v for k, v in host.items() if v is not None},
        "host_model": mem.get("host_model"),
        "weight_formats": weight_formats(plan),
        "dtype": _dtype_report(plan),
        "batch": {phase: {k: batch[phase][k] for k in ("B", "b_a", "b_e", "tokens_per_step") if k in batch[phase]}
                  for phase in ("prefill", "decode")},
        "overlap": batch.get("overlap"),
        "workload": batch.get("workload"),
        "attention": attention_report(plan),
        "weight_path": weight_path_report(plan),
        "expert_prefetch": pred.get("expert_prefetch"),
        "shared_prefix": (batch.get("workload") or {}).get("shared_prefix"),
    }
    if prompts is not None:
        out["eta"] = _eta(plan, prompts, model_dir, default_max_tokens, out, plan_path)
    if measured is not None:
        out["measured"] = compare_timelines(plan.get("timeline") or {}, measured)
    return out


def workload_of(prompts: Path, model_dir: Path, default_max: int, block_size: int | None = None) -> dict[str, Any]:
    """Valid and invalid requests of a prompts file, their prompt tokens and max_tokens, and
    the prompt tokens prefix sharing would reuse (`shared_prefix_tokens`: leading full KV
    blocks of `block_size` tokens, before a prompt's last token, that an earlier request
    computed; in file order with everything kept cached: an upper bound), the tokens left to
    compute (`unique_prompt_tokens`) and their share (`shared_prefix`:
    moecc/planner/shared_prefix.py). block_size None: the planner's (KV_BLOCK_SIZE)."""
    from moecc_runtime.job.requests import RequestError, iter_requests
    from moecc_runtime.tokenizer import Tokenizer

    from moecc.planner.shared_prefix import PrefixCounter

    tok = Tokenizer(model_dir)
    prefix = PrefixCounter() if block_size is None else PrefixCounter(int(block_size))
    n = bad = output_tokens = 0
    for item in iter_requests(prompts):
        if isinstance(item, RequestError):
            bad += 1
            continue
        n += 1
        prefix.add(tok.encode_request(item))
        output_tokens += item.max_tokens or default_max
    return {"requests": n, "invalid": bad, "prompt_tokens": prefix.prompt_tokens, "max_output_tokens": output_tokens,
            "shared_prefix_tokens": prefix.shared_tokens, "unique_prompt_tokens": prefix.unique_tokens,
            "shared_prefix": prefix.share, "block_size": prefix.block_size}


def _eta(plan: dict[str, Any], prompts: Path, model_dir: Path | None, default_max: int,
         rep: dict[str, Any], plan_path: Path | None = None) -> dict[str, Any]:
    from moecc_runtime.plan import check_checkpoint

    block = (plan["batch"].get("kv") or {}).get("block_size")
    w = workload_of(prompts, check_checkpoint(plan, model_dir, plan_path), default_max, block)
    pre, dec = rep["prefill_tokens_per_s"] or 0, rep["decode_tokens_per_s"] or 0
    # prefill computes only the prompt tokens no earlier request computed (prefix sharing)
    seconds = (w["unique_prompt_tokens"] / pre if pre else 0) + (w["max_output_tokens"] / dec if dec else 0)
    note = "upper bound: requests that stop at EOS finish sooner"
    if w["shared_prefix_tokens"]:
        note += (f"; prefill of the {w['unique_prompt_tokens']} prompt tokens not in a shared prefix (at most "
                 f"{w['shared_prefix']:.0%} shared, if every block seen stays cached)")
    return {**w, "seconds": seconds, "note": note}


def format_explain(rep: dict[str, Any]) -> str:
    cal = f" (planner calibrated on a job of {rep['calibrated_on']})" if rep.get("calibrated_on") else ""
    lines = [f"{rep['model']} on {rep['hardware'] or 'unknown hardware'}{cal}"]
    b = rep["batch"]
    for phase in ("prefill", "decode"):
        rate = rep.get(f"{phase}_tokens_per_s")
        neck = (rep.get("bottleneck") or {}).get(phase, "-")
        pb = b.get(phase, {})
        step = f" tokens/step={pb['tokens_per_step']}" if "tokens_per_step" in pb else ""
        lines.append(f"  {phase:8s} {rate:12.1f} tok/s  bottleneck: {neck:18s} B={pb.get('B')} b_a={pb.get('b_a')} "
                     f"b_e={pb.get('b_e')}{step}" if rate else f"  {phase:8s} (no prediction in this plan)")
    if rep.get("job_tokens_per_s"):
        lines.append(f"  job      {rep['job_tokens_per_s']:12.1f} generated tok/s for the compiled workload "
                     f"{rep.get('workload')}")
    if rep.get("dtype"):
        lines.append(f"  computes in {rep['dtype']['compute']}: {rep['dtype']['why']}")
    lines += shared_prefix_lines(rep.get("shared_prefix"))
    lines += attention_lines(rep.get("attention"))
    ov = rep.get("overlap")
    if ov:
        lines.append(f"  overlap: {ov.get('expert_slots')} expert slots, prefetch depth {ov.get('prefetch')}, "
                     f"resident: {', '.join(ov.get('resident') or []) or 'none'}")
    lines += expert_prefetch_lines(rep.get("expert_prefetch"))
    lines += weight_path_lines(rep.get("weight_path"))
    for side in ("device", "host"):
        d = rep[f"{side}_bytes"]
        if not d:
            continue
        if side == "device" and "device_reserve" in d:
            lines += device_table_lines(d)
            continue
        lines.append(f"  {side} memory:")
        for k, v in d.items():
            lines.append(f"    {k:18s} {format_bytes(int(v)):>12s}")
    lines += _host_model_lines(rep.get("host_model"))
    lines += _format_lines(rep.get("weight_formats") or {})
    eta = rep.get("eta")
    if eta:
        computed = (f", {eta['unique_prompt_tokens']} of them computed" if eta.get("shared_prefix_tokens") else "")
        lines.append(f"  ETA for {eta['requests']} requests ({eta['prompt_tokens']} prompt tokens{computed}, up to "
                     f"{eta['max_output_tokens']} output tokens): {_hms(eta['seconds'])} ({eta['note']})")
    if rep.get("measured"):
        lines.append(format_comparison(rep["measured"]))
    return "\n".join(lines)


#: The device allocations of a step, in the order explain lists them: (key or (decode key,
#: prefill key), label). Arena regions first, then the temporaries beside the arena.
DEVICE_ROWS: tuple[tuple[str | tuple[str, str], str], ...] = (
    ("resident_weights", "arena: resident weights"),
    ("expert_slots", "arena: expert slots"),
    ("dense_slots", "arena: dense slots (2, streamed modules)"),
    ("kv_buffers", "arena: KV staging buffers"),
    ("staging", "arena: stage (activations, host buffers)"),
    (("decode_activations", "prefill_activations"), "activations"),
    (("decode_attention_workspace", "prefill_attention_workspace"), "attention workspace"),
    ("logits", "logits (model dtype + fp32 copy)"),
    ("sampler", "sampler temporaries"),
    ("dequantize", "dequantize temporaries"),
)


def device_table(d: dict[str, Any]) -> list[tuple[str, int, int]]:
    """Every device allocation of a step as (label, decode bytes, prefill bytes), then the
    plan's totals, the device reserve and the process's total (what --gpu-mem bounds)."""
    rows = []
    for key, label in DEVICE_ROWS:
        dk, pk = key if isinstance(key, tuple) else (key, key)
        rows.append((label, int(d.get(dk) or 0), int(d.get(pk) or 0)))
    dec, pre = int(d.get("decode_total") or 0), int(d.get("prefill_total") or 0)
    reserve = int(d.get("device_reserve") or 0)
    rows.append(("planned (arena + temporaries)", dec, pre))
    rows.append(("context reserve (CUDA context, cuBLAS workspaces)", reserve, reserve))
    rows.append(("process total", dec + reserve, pre + reserve))
    return rows


def device_table_lines(d: dict[str, Any]) -> list[str]:
    """The device table (device_table) under a line naming --gpu-mem, the reserve and the
    derated budget; each total against what bounds it."""
    gpu, budget, reserve = d.get("gpu_mem"), d.get("budget"), int(d.get("device_reserve") or 0)
    if gpu is None:
        head = "  device memory (no --gpu-mem: weights read in place, temporaries only):"
    else:
        derate = float(d.get("derate") or 0.9)
        head = (f"  device memory: --gpu-mem {format_bytes(int(gpu))}: {format_bytes(reserve)} device reserve, of the "
                f"rest {derate:.0%} for the plan (budget {format_bytes(int(budget or 0))}) and {1 - derate:.0%} the "
                f"allocator's fragmentation margin")
    lines = [head, f"    {'allocation':50s} {'decode':>10s} {'prefill':>10s}"]
    for label, dec, pre in device_table(d):
        tail = ""
        if label.startswith("planned") and budget is not None:
            tail = f"  of budget {format_bytes(int(budget))}"
        elif label == "process total" and gpu is not None:
            tail = f"  of --gpu-mem {format_bytes(int(gpu))}"
        lines.append(f"    {label:50s} {format_bytes(dec):>10s} {format_bytes(pre):>10s}{tail}")
    return lines


def shared_prefix_lines(sp: dict[str, Any] | None) -> list[str]:
    """One line when the plan was sized for a shared prefix (compiled with --prompts), e.g.
    "shared prefix: 61% of prompt tokens (512 of 840 per request) computed once; prefill
    work 0.39x (an upper bound: ...)"."""
    if not sp or not sp.get("share"):
        return []
    s = float(sp["share"])
    return [f"  shared prefix: {s:.0%} of prompt tokens ({float(sp['shared_tokens']):.0f} of "
            f"{float(sp['prompt_tokens']):.0f} per request) computed once; prefill work "
            f"{float(sp.get('prefill_work', 1.0 - s)):.2f}x ({sp.get('note') or 'an upper bound'})"]


def attention_report(plan: dict[str, Any]) -> dict[str, Any]:
    """Per phase: where attention runs (the plan's placement) and, when the plan predicted
    them, the rates of the placements not chosen and the facts behind the choice."""
    pred = (plan.get("predicted") or {}).get("attention") or {}
    out: dict[str, Any] = {"forced": pred.get("forced"), "device_kind": pred.get("device_kind")}
    for phase in ("decode", "prefill"):
        placed = plan["batch"][phase].get("attention") or {"where": "device", "host_fraction": 0.0}
        out[phase] = {**(pred.get(phase) or {}), **placed}
    return out


def weight_path_report(plan: dict[str, Any]) -> dict[str, Any] | None:
    """How the plan's streamed weights will reach the device, by the runtime's own rule
    (moecc_runtime.memory.weight_path) on the plan's hardware, with its --host-mem as the
    memory available (unknown without one); None for a plan without an arena."""
    from moecc_runtime.memory.weight_path import DESCRIPTIONS, plan_streamed_bytes, predict_weight_path

    if not plan.get("arena"):
        return None
    kind = ((plan.get("predicted") or {}).get("attention") or {}).get("device_kind") or "cuda"
    budget = ((plan.get("memory") or {}).get("host") or {}).get("budget")
    path = predict_weight_path(plan, kind, None if budget is None else int(budget))
    return {"path": path.value, "how": DESCRIPTIONS[path], "streamed_bytes": plan_streamed_bytes(plan),
            "device_kind": kind, "host_budget": budget}


def weight_path_lines(wp: dict[str, Any] | None) -> list[str]:
    if not wp:
        return []
    mem = f"--host-mem {format_bytes(int(wp['host_budget']))}" if wp.get("host_budget") else "host memory unknown"
    return [f"  streamed weights ({format_bytes(int(wp['streamed_bytes']))} a pass) reach the {wp['device_kind']} "
            f"device by {wp['path']}: {wp['how']} ({mem}; the runtime decides again from the run machine's memory)"]


def attention_lines(att: dict[str, Any] | None) -> list[str]:
    """One line per phase: where attention runs, its predicted tok/s, the other placements'
    and why, e.g. "attention (decode): host, 469 tok/s predicted; on the device 195 tok/s:
    the KV of 512 sequences (...) crosses the host link in ... a layer; ..."."""
    if not att:
        return []
    lines = []
    forced = f" (forced by {att['forced']})" if att.get("forced") else ""
    for phase in ("decode", "prefill"):
        a = att.get(phase) or {}
        where = a.get("where", "device")
        head = where if where != "split" else (f"split: the first {a['host_fraction']:.0%} of each step's sequences "
                                               f"on the host, the rest on the device at once")
        rate = f", {a['tokens_per_s']:.0f} tok/s predicted" if a.get("tokens_per_s") else ""
        others = [_other(w, a.get(w), a) for w in ("host", "device") if w != where and w in a]
        why = _why(a.get("facts"), att.get("device_kind")) if a.get("facts") else ""
        tail = (f"; {', '.join(others)}" if others else "") + (f": {why}" if why else "")
        lines.append(f"  attention ({phase}): {head}{forced}{rate}{tail}")
    return lines


def expert_prefetch_lines(ep: dict[str, Any] | None) -> list[str]:
    """One line: per phase whether the runtime fetches a layer's first experts before its
    router has run (beside attention) and why: its rows x top_k against 4 x experts, e.g.
    "experts fetched before routing: decode yes, each layer's first 2 experts during its
    attention (1024 rows x top-2 = 2048 >= 4 x 8 experts = 32; P(an expert unused) < 1e-6); ..."."""
    if not ep:
        return []
    parts = []
    for phase in ("decode", "prefill"):
        d = ep.get(phase)
        if not d:
            continue
        rows, k, E = int(d["rows"]), int(d["top_k"]), int(d["num_experts"])
        yes = bool(d["before_routing"])
        fig = (f"{rows} rows x top-{k} = {rows * k} {'>=' if yes else '<'} {ep['factor']} x {E} experts = "
               f"{ep['factor'] * E}; P(an expert unused) {_chance(float(d['p_expert_unused']))}")
        parts.append(f"{phase} yes, each layer's first {d['experts_ahead']:.3g} experts during its attention "
                     f"({fig})" if yes else f"{phase} no, once the router has chosen them ({fig})")
    tail = "" if ep.get("streamed_layers") else " (no layer's experts stream: all resident)"
    return [f"  experts fetched before routing: {'; '.join(parts)}{tail}"]


def _chance(p: float) -> str:
    return "< 1e-6" if p < 1e-6 else f"= {p:.2g}"


def _other(where: str, alt: dict[str, Any] | None, chosen: dict[str, Any]) -> str:
    """'on the device 195 tok/s' (at its own best B when that differs), or why there is none."""
    label = f"all on the {where}" if chosen.get("where") == "split" else f"on the {where}"
    if alt is None:
        return f"{label}: nothing fits the budgets"
    at = f" (at B={alt['B']})" if alt.get("B") not in (None, chosen.get("B")) else ""
    return f"{label} {alt['tokens_per_s']:.0f} tok/s{at}"


def _why(f: dict[str, Any], device_kind: str | None) -> str:
    """What each placement pays for the step's KV, per layer."""
    S, kv = int(f["sequences"]), format_bytes(int(f["kv_bytes_per_layer"]))
    host = f"{f['host_attention_s_per_layer'] * 1e3:.1f} ms"
    if device_kind == "cpu":
        return (f"the device is this machine's CPU: device attention copies the KV of {S} sequences ({kv} a "
                f"layer) into a buffer every layer (with --gpu-mem the arena's), host attention reads it in place "
                f"({host} a layer)")
    bound = ", bound by the CPU's FLOPs" if f.get("host_flop_bound") else ""
    return (f"the KV of {S} sequences ({kv} a layer) crosses the host link in "
            f"{f['kv_crossing_s_per_layer'] * 1e3:.1f} ms a layer ({_per_s(f['link_bytes_per_s'])}), device "
            f"attention over it takes {f['device_attention_s_per_layer'] * 1e3:.1f} ms; host attention reads it "
            f"in place in {host} ({_per_s(f['host_attention_bytes_per_s'])}{bound})")


def _per_s(rate: float) -> str:
    return f"{rate / 1e9:.0f} GB/s"


def _dtype_report(plan: dict[str, Any]) -> dict[str, str]:
    """The compute dtype and why (--dtype; plans from before it: the dtype only)."""
    info = plan["model"]["info"]
    d = (info.get("extra") or {}).get("dtype") or {}
    return {"compute": info["dtype"], "why": d.get("why", "the checkpoint's (transformers' dtype=\"auto\")")}


def weight_formats(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per kind of weight (attention, experts, dense: the MoE module's router, norms, shared
    and dense MLPs; head; stem): how many slices each stored format holds, their stored
    bytes, and what they would take in the compute dtype."""
    itemsize = DTYPE_BYTES.get(plan["model"]["info"]["dtype"], 2)
    out: dict[str, dict[str, Any]] = {}
    for m in plan["schedule"]:
        for op in m["ops"]:
            kind = "experts" if op["op"] == "experts" else {"attn": "attention", "moe": "dense", "mlp": "dense"}.get(
                m["kind"], m["kind"])
            for key in op["weights"].values():
                e = plan["weights"][key]
                row = out.setdefault(kind, {"formats": {}, "stored_bytes": 0, "compute_bytes": 0})
                fmt = e.get("format", "dense")
                row["formats"][fmt] = row["formats"].get(fmt, 0) + 1
                row["stored_bytes"] += e["nbytes"] + sum(p["nbytes"] for p in e.get("parts", {}).values())
                numel = 1
                for d in e.get("logical_shape", e["shape"]):
                    numel *= int(d)
                row["compute_bytes"] += numel * itemsize
    return out


def _format_lines(wf: dict[str, dict[str, Any]]) -> list[str]:
    """The stored format of each kind of weight and the bytes it saves against the compute dtype."""
    if not wf or all(set(r["formats"]) == {"dense"} for r in wf.values()):
        return []
    lines = ["  weight formats (stored bytes; in the compute dtype; saved):"]
    for kind, r in wf.items():
        fmts = ", ".join(f"{f} x{n}" for f, n in sorted(r["formats"].items()))
        saved = r["compute_bytes"] / r["stored_bytes"] if r["stored_bytes"] else 1.0
        lines.append(f"    {kind:10s} {fmts:28s} {format_bytes(r['stored_bytes']):>10s} of "
                     f"{format_bytes(r['compute_bytes']):>10s} ({saved:.2f}x smaller)")
    return lines


def _host_model_lines(hm: dict[str, Any] | None) -> list[str]:
    """Where the host budget came from, the reserve kept out of it (by cause), and why the
    KV pool has its size."""
    if not hm:
        return []
    parts = ", ".join(f"{k} {format_bytes(int(v))}" for k, v in (hm.get("reserve") or {}).items())
    return [f"    budget from: {hm.get('budget')}",
            f"    reserve kept: {parts} (moecc compile --host-reserve replaces it)",
            f"    KV pool: {hm.get('kv_pool')}"]


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def measured_timeline(measured: Path) -> dict[str, Any]:
    """The `engine.timeline` of a `moecc exec --stats` file: {phase: step}. Raises
    TimelineError naming the file and the missing field."""
    import json

    from moecc.views.timeline_svg import TimelineError

    try:
        stats = json.loads(Path(measured).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TimelineError(f"--measured {measured}: not a readable stats JSON file ({e})") from e
    meas = (stats.get("engine") or {}).get("timeline") if isinstance(stats, dict) else None
    if not meas:
        raise TimelineError(f"--measured {measured}: no field engine.timeline; write it with `moecc exec "
                            f"--stats` of this moecc on a job with a full decode or prefill step")
    return meas


def compare_timelines(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Predicted against measured seconds per (lane, job kind) of each phase's step: where the
    model is off, op by op. Only the layers the plan's timeline kept are summed on both
    sides (a deep model's stored timeline keeps a few; the stem and head count always).
    "compute/idle" is the step's time with the compute thread waiting (only when every layer
    is compared). Returns {phase: {"predicted_step_s", "measured_step_s", "measured_tokens",
    "measured_prefill_tokens", "layers_compared", "kinds": {"lane/kind": {"predicted_s",
    "measured_s"}}}}; phases missing on either side are left out."""
    out: dict[str, Any] = {}
    for phase in ("decode", "prefill"):
        pt, mt = predicted.get(phase), measured.get(phase)
        if not pt or not mt:
            continue
        kept = set(pt.get("layers_kept") or [])
        kinds: dict[str, dict[str, float]] = {}
        for side, t in (("predicted_s", pt), ("measured_s", mt)):
            for _name, lane, kind, layer, _start, sec in (j[:6] for j in t["jobs"]):
                if layer is not None and kept and layer not in kept:
                    continue
                k = kinds.setdefault(f"{lane}/{kind}", {"predicted_s": 0.0, "measured_s": 0.0})
                k[side] += float(sec)
        if not kept or len(kept) == pt.get("layers"):  # whole steps: the compute thread's waits too
            for side, t in (("predicted_s", pt), ("measured_s", mt)):
                busy = sum(float(j[5]) for j in t["jobs"] if j[1] == "compute")
                kinds.setdefault("compute/idle", {"predicted_s": 0.0, "measured_s": 0.0})[side] = \
                    max(0.0, float(t["step_s"]) - busy)
        out[phase] = {"predicted_step_s": pt["step_s"], "measured_step_s": mt["step_s"],
                      "measured_tokens": mt.get("tokens"), "measured_prefill_tokens": mt.get("prefill_tokens"),
                      "layers_compared": len(kept) if kept else None, "kinds": dict(sorted(kinds.items()))}
    return out


def format_comparison(cmp: dict[str, Any]) -> str:
    """The comparison as a table per phase: seconds predicted, measured, and their ratio."""
    lines = ["  predicted against measured (seconds per step, by job kind):"]
    for phase, c in cmp.items():
        layers = f", {c['layers_compared']} layers compared" if c.get("layers_compared") else ""
        lines.append(f"    {phase}: step {c['predicted_step_s']:.4f} predicted, {c['measured_step_s']:.4f} measured "
                     f"({c['measured_tokens']} tokens, {c['measured_prefill_tokens']} of them prompt{layers})")
        for kind, v in c["kinds"].items():
            ratio = f"{v['measured_s'] / v['predicted_s']:6.2f}x" if v["predicted_s"] > 0 else "      -"
            lines.append(f"      {kind:18s} {v['predicted_s']:9.4f} {v['measured_s']:9.4f} {ratio}")
    return "\n".join(lines)


def write_timeline(plan: dict[str, Any], out: Path, measured: dict[str, Any] | None = None,
                   layers: int | None = 2) -> Path:
    """Draw the plan's predicted decode and prefill steps (and the measured ones, the timeline
    of a `moecc exec --stats` file) to `out` as SVG (moecc/views/timeline_svg.py)."""
    from moecc.views.timeline_svg import draw_timeline

    name = f"{plan['model']['architecture']} on {plan.get('predicted', {}).get('hardware') or 'unknown hardware'}"
    out = Path(out)
    out.write_text(draw_timeline(plan.get("timeline") or {}, measured, layers, title=name), encoding="utf-8")
    return out
