"""solve_batch_sizes: choose B, b_a, b_e (prefill and decode), prompt tokens per prefill
step, expert slots and prefetch depth, which weights stay on the device and, per phase,
where attention runs (host, device or a split), by the
integer program in moecc/planner/solve.py (OR-Tools CP-SAT) over the planner's cost model;
predict prefill and decode tokens/s from the critical path of each phase's job DAG (both
from moecc/planner/cost_model.py, `CostModel`).

Requires: transfers.
Does: reads the hardware profile (`ctx.options.hardware`: a preset name, a profile JSON,
  or None for this machine's default), the budgets (`gpu_mem`, `host_mem`, bytes), the
  workload (`prompt_tokens`, `output_tokens`, `shared_prefix`, `max_batch`), `attention` (auto, host,
  device) and `solve_seconds`; fails with BudgetError naming the smallest budget that would
  fit when even the minimum working set does not. Solves once more with attention all on
  the host and once all on the device, unless the chosen plan is one of them, for what
  `moecc explain` compares the placement with.
Guarantees: batch_sizes (graph.attrs["batch"], ["arena"], ["memory"], ["solution"], ["predicted"],
  ["timeline"]: the predicted decode and prefill step DAGs as plain data); each phase's
  batch sizes carry its attention placement, and ["predicted"]["attention"] the rates of
  the placements not chosen; an arena whose phases both attend on the host has no KV buffers;
  every plan fits --gpu-mem at a 0.9 derate, and --host-mem with the host reserve
  (moecc/planner/host_memory.py) kept out of it; the KV pool gets the host bytes left.
"""

from __future__ import annotations

from typing import Any

from moecc.errors import BudgetError
from moecc.ir import Graph
from moecc.ir.pass_infra import Pass, PassContext, PassResult
from moecc.options import CompileOptions
from moecc.planner import solve as S
from moecc.planner.cost_model import PHASES, Choice, Prediction, placement
from moecc.planner.schedule import (SPECULATE_ROUTED_PER_EXPERT, StepShape, experts_in_use, p_expert_unused,
                                    speculated_experts, speculates)
from moecc.planner.costs import ModelCost, model_cost
from moecc.planner.host_memory import available_host_bytes, host_bytes, kv_pool_blocks, minimum_host_bytes
from moecc.sizes import format_bytes, format_size_at_least
from moecc_runtime.plan_schema import expert_group


class SolveBatchSizes(Pass):
    name = "solve_batch_sizes"
    requires = frozenset({"transfers"})
    ensures = frozenset({"batch_sizes"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        pr = _problem(g, ctx.options)
        _check_minimum(pr)
        sol = S.solve(pr, time_limit_s=float(ctx.options.solve_seconds))
        if sol is None:
            raise BudgetError(f"no batch size fits the budgets (--gpu-mem {_fmt(pr.gpu_mem)}, --host-mem "
                              f"{_fmt(pr.host_mem)}); raise one of them or lower --prompt-tokens/--output-tokens")
        pred = pr.cost_model().predict(pr.workload, sol.choice)
        g.attrs["batch"], kv_why = _batch(pr, sol.choice)
        g.attrs["arena"] = _arena(pr, sol)
        g.attrs["memory"] = {
            "device": {"budget": pr.device_budget, "gpu_mem": pr.gpu_mem, "derate": S.DEVICE_DERATE,
                       **sol.device_bytes},
            "host": {"budget": pr.host_mem, **sol.host_bytes, "reserve": pr.reserve.total,
                     "kv_pool": g.attrs["batch"]["kv"]["num_blocks"] * g.attrs["batch"]["kv"]["bytes_per_block"]},
            "host_model": {"budget": _host_source(pr), "reserve": pr.reserve.parts(), "kv_pool": kv_why},
        }
        g.attrs["predicted"] = _predicted(pr, pred)
        g.attrs["predicted"]["attention"] = _attention_report(pr, sol, pred, float(ctx.options.solve_seconds))
        g.attrs["predicted"]["expert_prefetch"] = _expert_prefetch(pr, sol.choice)
        g.attrs["timeline"] = pred.timeline()  # the two DAGs as plain data: what `moecc explain --timeline` draws
        g.attrs["solution"] = _solution(sol)
        return PassResult(g, modified=True)


def _problem(g: Graph, o: CompileOptions) -> S.Problem:
    """The planner's problem: the graph's costs, the hardware profile, the budgets, and the
    workload (its output clipped to the model's context)."""
    from moecc.planner.hardware import resolve_hardware

    prompt, output = float(o.prompt_tokens), float(o.output_tokens)
    max_ctx = g.info.max_position_embeddings
    if prompt + output > max_ctx:
        output = max(1.0, max_ctx - prompt)
    available = available_host_bytes() if o.host_mem is None else None
    return S.Problem(model_cost(g), resolve_hardware(o.hardware), prompt, output, gpu_mem=o.gpu_mem,
                     host_mem=o.host_mem, max_batch=int(o.max_batch), host_reserve_given=o.host_reserve,
                     host_available=available, attention=o.attention, shared_prefix=float(o.shared_prefix),
                     device_reserve_given=o.device_reserve)


def _shared_prefix(pr: S.Problem) -> dict[str, Any]:
    """The prefix sharing the plan was sized for (what `moecc explain` shows): the share of
    prompt tokens computed once, per request the prompt and shared tokens (means), the
    prefill work left (1 - share) and the KV block size the share was counted in."""
    from moecc.planner.shared_prefix import UPPER_BOUND_NOTE

    s = pr.shared_prefix
    return {"share": s, "prompt_tokens": pr.prompt_tokens, "shared_tokens": pr.prompt_tokens * s,
            "prefill_work": 1.0 - s, "block_size": S.KV_BLOCK,
            "note": UPPER_BOUND_NOTE + "; the KV pool is sized as if nothing were shared"}


def _host_source(pr: S.Problem) -> str:
    """Where the host budget came from, for explain."""
    if pr.host_mem is not None:
        return "--host-mem"
    if pr.host_available is not None:
        return (f"--host-mem unset: nothing refused; the KV pool sized by this machine's "
                f"{format_bytes(pr.host_available)} available at compile")
    return "--host-mem unset and this machine's memory unknown: nothing refused"


def _batch(pr: S.Problem, ch: Choice) -> tuple[dict[str, Any], str]:
    """The plan's batch section, and why its KV pool has the blocks it has."""
    tps, pa, pe = ch.prefill
    cost = pr.cost
    blocks, why = kv_pool_blocks(cost, pr.seq_len, ch.B, tps, pr.host_mem, pr.reserve, pr.host_available)
    return {
        "prefill": {"B": ch.B, "b_a": pa, "b_e": pe, "tokens_per_step": tps,
                    "attention": placement(ch.host_fraction("prefill"))},
        "decode": {"B": ch.B, "b_a": ch.b_a, "b_e": ch.b_e, "attention": placement(ch.host_fraction("decode"))},
        "kv": {"block_size": S.KV_BLOCK, "num_blocks": blocks,
               "bytes_per_block": cost.kv_bytes_per_token * S.KV_BLOCK},
        "overlap": {"expert_slots": ch.prefetch + 1, "prefetch": ch.prefetch,
                    "resident": sorted(ch.resident) if pr.copies else ["all"]},
        "workload": {"prompt_tokens": pr.prompt_tokens, "output_tokens": pr.output_tokens, "seq_len": pr.seq_len,
                     "shared_prefix": _shared_prefix(pr) if pr.shared_prefix else None},
        "rule": "solve_batch_sizes (CP-SAT, see moecc/planner/solve.py)",
    }, why


def _arena(pr: S.Problem, sol: S.Solution) -> dict[str, Any] | None:
    """The device arena the runtime carves (runtime/memory/arena.py, streaming.py); none
    without a device budget (weights are then read where they are)."""
    if not pr.copies:
        return None
    ch, cost = sol.choice, pr.cost
    return {
        "bytes": sol.device_bytes["arena"],
        "resident": sorted(ch.resident),
        "dense_slot_bytes": S.dense_slot_bytes(pr.dense_slot_groups(), ch.resident),
        "expert_slots": ch.prefetch + 1,
        "expert_slot_bytes": cost.expert_slot_bytes,
        "kv_buffer_tokens": pr.kv_buffer_tokens(_kv_buffer_seqs(pr, ch)),
        "stage_bytes": sol.device_bytes["staging"],
    }


def _kv_buffer_seqs(pr: S.Problem, ch: Choice) -> int:
    """Sequences a device KV buffer holds: the larger of both phases' device micro-batches
    (0: both attend on the host, the arena has no KV buffers)."""
    pre_S = pr.workload.prefill_shape(ch.prefill[0]).S
    return max(pr.kv_buffer_seqs(ch.B, ch.host_fraction("decode"), ch.b_a),
               pr.kv_buffer_seqs(pre_S, ch.host_fraction("prefill"), ch.prefill[1]))


def _attention_report(pr: S.Problem, sol: S.Solution, pred: Prediction, seconds: float) -> dict[str, Any]:
    """Per phase: where attention runs (forced by --attention or chosen), its predicted
    tokens/s, the same phase's tokens/s of the best plan with attention all on the host and
    all on the device (None: nothing fits so), and the facts a reason rests on (facts)."""
    import dataclasses

    rates: dict[str, dict[str, Any] | None] = {}
    for where, f in (("host", 1.0), ("device", 0.0)):
        if sol.choice.attention == (f, f):
            alt: Prediction | None = pred
        else:
            forced = S.solve(dataclasses.replace(pr, host_fractions={ph: (f,) for ph in PHASES}), seconds)
            alt = None if forced is None else pr.cost_model().predict(pr.workload, forced.choice)
        rates[where] = None if alt is None else {
            "B": alt.B, "decode_tokens_per_s": alt.decode_tokens_per_s,
            "prefill_tokens_per_s": alt.prefill_tokens_per_s, "job_tokens_per_s": alt.job_tokens_per_s}
    out: dict[str, Any] = {"forced": None if pr.attention == "auto" else f"--attention {pr.attention}",
                           "device_kind": pr.rates.device_kind}
    for phase in PHASES:
        alts = {w: None if r is None else {"B": r["B"], "tokens_per_s": r[f"{phase}_tokens_per_s"]}
                for w, r in rates.items()}
        out[phase] = {**placement(sol.choice.host_fraction(phase)), "B": sol.choice.B,
                      "tokens_per_s": getattr(pred, f"{phase}_tokens_per_s"), **alts,
                      "facts": _attention_facts(pr, sol.choice, phase)}
    return out


def _expert_prefetch(pr: S.Problem, ch: Choice) -> dict[str, Any] | None:
    """Per phase, whether the runtime fetches experts before routing (schedule.speculates:
    a step's rows x top_k >= 4 x experts) and the figures behind it, for the first MoE layer:
    rows, top_k, experts, the chance an expert goes unused, how many experts a layer fetches
    ahead (the expert slots, at most those in use) and in how many layers the experts stream
    at all (resident ones are not fetched). None for a model without experts."""
    lc = next((lc for lc in pr.cost.layers if lc.moe), None)
    if lc is None:
        return None
    streamed = sum(1 for x in pr.cost.layers if x.moe and pr.copies and expert_group(x.layer) not in ch.resident)
    out: dict[str, Any] = {"factor": SPECULATE_ROUTED_PER_EXPERT, "streamed_layers": streamed}
    for phase in PHASES:
        T = pr.workload.decode_shape(ch.B).T if phase == "decode" else pr.workload.prefill_shape(ch.prefill[0]).T
        out[phase] = {"rows": T, "top_k": lc.top_k, "num_experts": lc.num_experts,
                      "before_routing": speculates(T, lc.top_k, lc.num_experts),
                      "p_expert_unused": p_expert_unused(T, lc.top_k, lc.num_experts),
                      "experts_in_use": experts_in_use(lc, T),
                      "experts_ahead": speculated_experts(lc, T, ch.prefetch + 1)}
    return out


def _attention_facts(pr: S.Problem, ch: Choice, phase: str) -> dict[str, Any]:
    """A step of `phase` at the chosen sizes, per layer (mean): its sequences, the KV bytes its
    attention reads, the seconds of that KV crossing the host link, of attention on the
    device (without the crossing) and of attention all on the host, the two rates, and
    whether the host's FLOPs rather than its memory bound host attention."""
    wl, cm = pr.workload, pr.cost_model()
    shape: StepShape = wl.decode_shape(ch.B) if phase == "decode" else wl.prefill_shape(ch.prefill[0])
    b_a = ch.b_a if phase == "decode" else ch.prefill[1]
    L = max(1, len(pr.cost.layers))
    kv = sum(shape.S * shape.context * lc.kv_bytes_per_ctx for lc in pr.cost.layers) / L
    link = cm.kv_load_s(shape, 0.0)[0] if pr.copies else [kv / pr.rates.copy_rate("h2d", kv) if kv else 0.0]
    host_rate = pr.rates.attention_rate(pr.cost.dtype, kv, on_cpu=True) if kv else 0.0
    flops = sum(shape.T * shape.context * lc.attn_ctx_flops for lc in pr.cost.layers) / L
    cpu_flops = pr.rates.cpu_flops.get(pr.cost.dtype, pr.rates.cpu_flops["float32"])
    return {"sequences": shape.S, "kv_bytes_per_layer": kv,
            "host_flop_bound": bool(kv and flops / cpu_flops > kv / host_rate),
            "kv_crossing_s_per_layer": sum(link) / max(1, len(link)),
            "device_attention_s_per_layer": sum(cm.attention_s(shape, b_a, 0.0)) / L,
            "host_attention_s_per_layer": sum(cm.host_attention_s(shape, b_a, 1.0)) / L,
            "link_bytes_per_s": pr.rates.copy_rate("h2d", kv) if kv else 0.0,
            "host_attention_bytes_per_s": host_rate}


def _predicted(pr: S.Problem, pred: Prediction) -> dict[str, Any]:
    dec, pre = pred.decode, pred.prefill
    return {
        "hardware": pr.rates.name,
        "calibrated_on": pr.rates.calibration.get("model"),  # the runtime job the profile was fitted to (None: not)
        **pred.rates(),
        "decode_step_s": dec.seconds,
        "prefill_step_s": pre.seconds,
        "bottleneck": {"decode": dec.bottleneck(), "prefill": pre.bottleneck()},
        "lanes_s": {"decode": dec.totals, "prefill": pre.totals},
    }


def _solution(sol: S.Solution) -> dict[str, Any]:
    return {
        "status": sol.status,
        "variables (at the chosen B, after dropping dominated options)": sol.variables,
        "seconds_per_request": sol.seconds_per_request,
        "linear_model_step_s": {"decode": sol.decode_step_s, "prefill": sol.prefill_step_s},
        "binding": sol.binding,
        "batch_candidates": sol.candidates,
        "formulation": "see moecc/planner/solve.py: minimise output/B x T_decode + prompt/tps x T_prefill "
                       "over one-hot (attention host fraction, b_a), b_e, (tps, b_a, b_e, host fraction), prefetch "
                       "and residency booleans; per layer t >= compute + (1 - copy_overlap) x copy at bytes/rate, "
                       "t >= copy, t >= host attention + routed fetches (less those the runtime speculates on, fetched "
                       "beside attention), t >= compute + copy without prefetch",
    }


def _fmt(x: int | None) -> str:
    return "unbounded" if x is None else format_bytes(x)


def _check_minimum(pr: S.Problem) -> None:
    """The smallest working set (device: the solver's smallest choice; host: the model plus
    one sequence's KV); fails naming the budget that would fit."""
    c = pr.cost
    if pr.gpu_mem is not None:
        minimum = S.minimum_device_bytes(pr)
        if pr.device_budget < minimum:
            kv = ("one sequence's KV for one layer" if pr.attention == "device"
                  else "no KV buffer (attention on the host)")
            raise BudgetError(
                f"--gpu-mem {format_bytes(pr.gpu_mem)} cannot hold the minimum working set: "
                f"{format_bytes(minimum)} (slots for the largest dense module "
                f"{format_bytes(c.max_dense_module_bytes)} and one expert of {format_bytes(c.max_expert_bytes)}, "
                f"{kv}, the smallest chunk's activations, one step's logits and sampler temporaries) at a "
                f"{S.DEVICE_DERATE:.0%} derate, after the {format_bytes(pr.device_reserve)} device reserve (CUDA "
                f"context and library workspaces: the hardware profile's device_reserve_bytes); use --gpu-mem "
                f"{format_size_at_least(pr.gpu_mem_for(minimum))} or more")
    if pr.host_mem is not None:
        tps = min(S.tps_offered(pr, 1))
        need = minimum_host_bytes(c, pr.seq_len, tps, pr.reserve)
        if pr.host_mem < need:
            sized = host_bytes(c, pr.seq_len, 1, tps)
            raise BudgetError(
                f"--host-mem {format_bytes(pr.host_mem)} cannot hold the model ({format_bytes(c.weight_bytes)}), "
                f"one sequence's KV cache ({format_bytes(sized['kv_cache'])}), the host buffers of a "
                f"{tps}-token prefill step ({format_bytes(sized['buffers'])}) and the host reserve "
                f"({format_bytes(pr.reserve.total)}: {_parts(pr.reserve.parts())}); use --host-mem "
                f"{format_size_at_least(need)} or more" + ("" if pr.host_reserve_given is not None else
                                                          ", or a smaller --host-reserve"))


def _parts(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())

