"""solve_batch_sizes: choose B, b_a, b_e (prefill and decode), prompt tokens per prefill
step, expert slots and prefetch depth, and which weights stay on the device, by the
integer program in moecc/planner/solve.py (OR-Tools CP-SAT) over a measured performance
model; predict prefill and decode tokens/s from the critical path of each phase's job DAG.

Requires: transfers.
Does: reads the hardware profile (ctx option `hardware`: a preset name, a profile JSON,
  or None for this machine's default), the budgets (`gpu_mem`, `host_mem`, bytes), the
  workload (`prompt_tokens`, `output_tokens`, `max_batch`); fails with BudgetError naming
  the smallest budget that would fit when even the minimum working set does not.
Guarantees: batch_sizes (graph.attrs["batch"], ["memory"], ["solution"], ["predicted"],
  ["timeline"]: the predicted decode and prefill step DAGs as plain data);
  every plan fits --gpu-mem at a 0.9 derate and --host-mem at a 0.8 derate.
"""

from __future__ import annotations

from moecc.errors import BudgetError
from moecc.ir import Graph
from moecc.pass_infra import Pass, PassContext, PassResult
from moecc.planner import solve as S
from moecc.planner.costs import ModelCost, model_cost
from moecc.planner.schedule import Knobs, StepShape, build_schedule, to_data
from moecc.sizes import format_bytes, format_size_at_least


class SolveBatchSizes(Pass):
    name = "solve_batch_sizes"
    requires = frozenset({"transfers"})
    ensures = frozenset({"batch_sizes"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        from moecc.hardware import resolve_hardware

        g = graph.copy()
        hw = resolve_hardware(ctx.option("hardware"))
        cost = model_cost(g)
        prompt = float(ctx.option("prompt_tokens", 512))
        output = float(ctx.option("output_tokens", 256))
        gpu_mem, host_mem = ctx.option("gpu_mem"), ctx.option("host_mem")
        max_ctx = g.info.max_position_embeddings
        if prompt + output > max_ctx:
            output = max(1.0, max_ctx - prompt)
        pr = S.Problem(cost, hw, prompt, output, gpu_mem=gpu_mem, host_mem=host_mem,
                       max_batch=int(ctx.option("max_batch", 1024)))
        _check_minimum(pr)
        sol = S.solve(pr, time_limit_s=float(ctx.option("solve_seconds", 10.0)))
        if sol is None:
            raise BudgetError(f"no batch size fits the budgets (--gpu-mem {_fmt(gpu_mem)}, --host-mem "
                              f"{_fmt(host_mem)}); raise one of them or lower --prompt-tokens/--output-tokens")
        ch = sol.choice
        tps, pa, pe = ch.prefill
        knobs_dec = Knobs(ch.b_a, ch.b_e, ch.prefetch, ch.resident if pr.copies else frozenset({"all"}))
        knobs_pre = Knobs(pa, pe, ch.prefetch, knobs_dec.resident)
        dec = build_schedule(cost, hw, StepShape(ch.B, ch.B, prompt + output / 2, ch.B), knobs_dec)
        seqs = max(1, int(round(tps / max(prompt, 1))))
        pre = build_schedule(cost, hw, StepShape(seqs, tps, prompt / 2, seqs), knobs_pre)
        decode_tps = ch.B / dec.seconds
        prefill_tps = tps / pre.seconds
        per_request = output / decode_tps + prompt / prefill_tps
        g.attrs["batch"] = {
            "prefill": {"B": ch.B, "b_a": pa, "b_e": pe, "tokens_per_step": tps},
            "decode": {"B": ch.B, "b_a": ch.b_a, "b_e": ch.b_e},
            "kv": {"block_size": S.KV_BLOCK, "num_blocks": _kv_blocks(pr, cost, ch.B),
                   "bytes_per_block": cost.kv_bytes_per_token * S.KV_BLOCK},
            "overlap": {"expert_slots": ch.prefetch + 1, "prefetch": ch.prefetch,
                        "resident": sorted(ch.resident) if pr.copies else ["all"]},
            "workload": {"prompt_tokens": prompt, "output_tokens": output, "seq_len": pr.seq_len},
            "rule": "solve_batch_sizes (CP-SAT, see moecc/planner/solve.py)",
        }
        # the device arena the runtime carves (runtime/arena.py, runtime/streaming.py); none
        # without a device budget (weights are then read where they are)
        g.attrs["arena"] = None if not pr.copies else {
            "bytes": sol.device_bytes["arena"],
            "resident": sorted(ch.resident),
            "dense_slot_bytes": cost.max_dense_module_bytes + S.DENSE_SLOT_PAD,
            "expert_slots": ch.prefetch + 1,
            "expert_slot_bytes": cost.max_expert_bytes + S.EXPERT_SLOT_PAD,
            "kv_buffer_tokens": pr.kv_buffer_tokens(max(ch.b_a, pa)),
            "stage_bytes": sol.device_bytes["staging"],
        }
        g.attrs["memory"] = {
            "device": {"budget": None if gpu_mem is None else int(gpu_mem * S.DEVICE_DERATE), **sol.device_bytes},
            "host": {"budget": None if host_mem is None else int(host_mem * S.HOST_DERATE), **sol.host_bytes},
        }
        g.attrs["predicted"] = {
            "hardware": hw.name,
            "calibrated_on": hw.calibration.get("model"),  # the runtime job the profile was fitted to (None: not)
            "decode_tokens_per_s": decode_tps,
            "prefill_tokens_per_s": prefill_tps,
            "job_tokens_per_s": output / per_request,
            "decode_step_s": dec.seconds,
            "prefill_step_s": pre.seconds,
            "bottleneck": {"decode": dec.bottleneck(), "prefill": pre.bottleneck()},
            "lanes_s": {"decode": dec.totals, "prefill": pre.totals},
        }
        # the two DAGs above, as plain data: what `moecc explain --timeline` draws
        g.attrs["timeline"] = {"decode": {"B": ch.B, "tokens": ch.B, **to_data(dec)},
                               "prefill": {"B": seqs, "tokens": tps, **to_data(pre)}}
        tb = S._tables(pr, ch.B)
        g.attrs["solution"] = {
            "status": sol.status,
            "variables (at the chosen B, after dropping dominated options)": {
                "decode b_a": tb.b_a, "decode b_e": tb.b_e,
                "prefill (tps, b_a, b_e)": len(tb.pre), "prefetch depth": tb.p,
                "residency booleans": len(tb.groups)},
            "seconds_per_request": sol.seconds_per_request,
            "linear_model_step_s": {"decode": sol.decode_step_s, "prefill": sol.prefill_step_s},
            "binding": sol.binding,
            "batch_candidates": sol.candidates,
            "formulation": "see moecc/planner/solve.py: minimise output/B x T_decode + prompt/tps x T_prefill "
                           "over one-hot b_a, b_e, (tps, b_a, b_e), prefetch and residency booleans; "
                           "per layer t >= compute + (1 - copy_overlap) x copy at bytes/rate, t >= copy, t >= compute + copy "
                           "without prefetch",
        }
        return PassResult(g, modified=True)


def _kv_blocks(pr: S.Problem, cost: ModelCost, B: int) -> int:
    block = cost.kv_bytes_per_token * S.KV_BLOCK
    per_seq = -(-pr.seq_len // S.KV_BLOCK) + 1
    if pr.host_mem is None:
        return B * per_seq
    free = int(pr.host_mem * S.HOST_DERATE) - cost.weight_bytes - max(B, 4096) * cost.buffer_bytes_per_token
    return max(B * per_seq, free // block)


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
        kv_seq = (-(-pr.seq_len // S.KV_BLOCK) + 1) * S.KV_BLOCK * c.kv_bytes_per_token
        need = c.weight_bytes + kv_seq + c.buffer_bytes_per_token
        if pr.host_mem * S.HOST_DERATE < need:
            raise BudgetError(
                f"--host-mem {format_bytes(pr.host_mem)} cannot hold the model ({format_bytes(c.weight_bytes)}) "
                f"plus one sequence's KV cache ({format_bytes(kv_seq)}) at a {S.HOST_DERATE:.0%} derate; use "
                f"--host-mem {format_size_at_least(need / S.HOST_DERATE)} or more")

