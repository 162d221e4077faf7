"""solve_batch_sizes: choose B, b_a, b_e (prefill and decode), prompt tokens per prefill
step, expert slots and prefetch depth, and which weights stay on the device, by the
integer program in moecc/planner/solve.py (OR-Tools CP-SAT) over the planner's cost model;
predict prefill and decode tokens/s from the critical path of each phase's job DAG (both
from moecc/planner/cost_model.py, `CostModel`).

Requires: transfers.
Does: reads the hardware profile (`ctx.options.hardware`: a preset name, a profile JSON,
  or None for this machine's default), the budgets (`gpu_mem`, `host_mem`, bytes), the
  workload (`prompt_tokens`, `output_tokens`, `max_batch`) and `solve_seconds`; fails with
  BudgetError naming the smallest budget that would fit when even the minimum working set
  does not.
Guarantees: batch_sizes (graph.attrs["batch"], ["arena"], ["memory"], ["solution"], ["predicted"],
  ["timeline"]: the predicted decode and prefill step DAGs as plain data);
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
from moecc.planner.cost_model import Choice, Prediction
from moecc.planner.costs import ModelCost, model_cost
from moecc.planner.host_memory import available_host_bytes, host_bytes, kv_pool_blocks, minimum_host_bytes
from moecc.sizes import format_bytes, format_size_at_least


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
            "device": {"budget": None if pr.gpu_mem is None else int(pr.gpu_mem * S.DEVICE_DERATE),
                       **sol.device_bytes},
            "host": {"budget": pr.host_mem, **sol.host_bytes, "reserve": pr.reserve.total,
                     "kv_pool": g.attrs["batch"]["kv"]["num_blocks"] * g.attrs["batch"]["kv"]["bytes_per_block"]},
            "host_model": {"budget": _host_source(pr), "reserve": pr.reserve.parts(), "kv_pool": kv_why},
        }
        g.attrs["predicted"] = _predicted(pr, pred)
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
                     host_available=available)


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
        "prefill": {"B": ch.B, "b_a": pa, "b_e": pe, "tokens_per_step": tps},
        "decode": {"B": ch.B, "b_a": ch.b_a, "b_e": ch.b_e},
        "kv": {"block_size": S.KV_BLOCK, "num_blocks": blocks,
               "bytes_per_block": cost.kv_bytes_per_token * S.KV_BLOCK},
        "overlap": {"expert_slots": ch.prefetch + 1, "prefetch": ch.prefetch,
                    "resident": sorted(ch.resident) if pr.copies else ["all"]},
        "workload": {"prompt_tokens": pr.prompt_tokens, "output_tokens": pr.output_tokens, "seq_len": pr.seq_len},
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
        "dense_slot_bytes": cost.dense_slot_bytes,
        "expert_slots": ch.prefetch + 1,
        "expert_slot_bytes": cost.expert_slot_bytes,
        "kv_buffer_tokens": pr.kv_buffer_tokens(max(ch.b_a, ch.prefill[1])),
        "stage_bytes": sol.device_bytes["staging"],
    }


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
                       "over one-hot b_a, b_e, (tps, b_a, b_e), prefetch and residency booleans; "
                       "per layer t >= compute + (1 - copy_overlap) x copy at bytes/rate, t >= copy, "
                       "t >= compute + copy without prefetch",
    }


def _fmt(x: int | None) -> str:
    return "unbounded" if x is None else format_bytes(x)


def _check_minimum(pr: S.Problem) -> None:
    """The smallest working set (device: the solver's smallest choice; host: the model plus
    one sequence's KV); fails naming the budget that would fit."""
    c = pr.cost
    if pr.gpu_mem is not None:
        minimum = S.minimum_device_bytes(pr)
        if pr.gpu_mem * S.DEVICE_DERATE < minimum:
            raise BudgetError(
                f"--gpu-mem {format_bytes(pr.gpu_mem)} cannot hold the minimum working set: "
                f"{format_bytes(minimum)} (slots for the largest dense module "
                f"{format_bytes(c.max_dense_module_bytes)} and one expert of {format_bytes(c.max_expert_bytes)}, "
                f"one sequence's KV for one layer and the smallest chunk's activations) at a "
                f"{S.DEVICE_DERATE:.0%} derate; use --gpu-mem {format_size_at_least(minimum / S.DEVICE_DERATE)} "
                f"or more")
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

