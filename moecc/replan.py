"""`moecc exec` on a GPU with a plan compiled without --gpu-mem: recompile it in memory for
the device's free memory instead of copying every weight to the device.

A plan without a device budget has no arena (plan["arena"] is None): on a CPU the runtime
reads weights where they are, but on CUDA that would mean every weight copied to the device
and kept, which is what offloading exists to avoid, so the runtime refuses such a plan on
CUDA (moecc_runtime.worker.worker.refuse_unbudgeted_cuda). The CLI, which has the compiler,
recompiles it instead: the same checkpoint, workload and compile options (the plan's
`compiled_with`: --attention, --hardware, --dtype, --host-mem and the reserves, --max-batch)
through `compile_model`, with
`gpu_mem` = the device's free memory (torch.cuda.mem_get_info) minus a headroom of
max(HEADROOM_MIN_BYTES, HEADROOM_FRACTION of it) for the CUDA context, the allocator's
fragmentation and whatever else runs there. The planner derates that budget once more
(0.9) and counts its temporaries in it.

`device_free_bytes` is the one place that asks the device, so a test can replace it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

HEADROOM_FRACTION = 0.10
HEADROOM_MIN_BYTES = 1 << 30


def device_free_bytes(device: torch.device) -> int:
    """Free memory on `device` now (bytes), as the driver reports it."""
    return int(torch.cuda.mem_get_info(device)[0])


def budget_for(free: int) -> tuple[int, int]:
    """(the --gpu-mem to compile for, the headroom kept out) for `free` bytes free."""
    headroom = max(HEADROOM_MIN_BYTES, int(free * HEADROOM_FRACTION))
    return free - headroom, headroom


def needs_replan(plan: dict[str, Any], device: torch.device) -> bool:
    """A plan without a device arena on a CUDA device."""
    return device.type == "cuda" and not plan.get("arena")


def replan_for_device(plan: dict[str, Any], model_dir: Path, device: torch.device, *,
                      plan_path: str | Path | None = None,
                      free_bytes: Callable[[torch.device], int] | None = None,
                      log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The plan to run on `device`: None when `plan` runs as it is, else `plan` recompiled
    from `model_dir` for the device's free memory (one line on `log` says so). PlanError
    when it cannot be: a plan with quantized weights beside it (recompiling would rewrite
    them), too little free memory, or a compile that fails here (no OR-Tools, a budget
    below the model's minimum working set); each says to compile with --gpu-mem."""
    from moecc_runtime.plan import PlanError

    if not needs_replan(plan, device):
        return None
    where = plan_path or "the plan"
    if plan["model"]["fingerprint"].get("sidecar"):
        raise PlanError(f"{where} has no device budget (compiled without --gpu-mem) and quantized weights beside "
                        f"it; on {device} recompile it with --gpu-mem (and the same --quantize options)")
    free = (free_bytes or device_free_bytes)(device)
    budget, headroom = budget_for(free)
    if budget <= 0:
        raise PlanError(f"{where} has no device budget (compiled without --gpu-mem), and {device} has only "
                        f"{_gib(free)} free, less than the {_gib(headroom)} headroom moecc keeps; free the device "
                        f"or compile with an explicit --gpu-mem")
    from moecc.errors import MoeccError

    wl, kept = plan["batch"]["workload"], plan["compiled_with"]  # the user's options, as compiled
    try:
        from moecc.compiler import compile_model
        from moecc.planner.cost_model import shared_prefix_of

        new, _ = compile_model(model_dir, gpu_mem=budget, host_mem=kept["host_mem"], host_reserve=kept["host_reserve"],
                               device_reserve=kept["device_reserve"],
                               prompt_tokens=max(1, round(float(wl["prompt_tokens"]))),
                               output_tokens=max(1, round(float(wl["output_tokens"]))),
                               shared_prefix=shared_prefix_of(plan), max_batch=int(kept["max_batch"]),
                               hardware=_hardware_kept(kept["hardware"]), attention=kept["attention"],
                               dtype=kept["dtype"])
    except (MoeccError, ValueError, ImportError) as e:
        raise PlanError(f"{where} has no device budget (compiled without --gpu-mem) and could not be recompiled "
                        f"here for {device} ({e}); compile it with `moecc compile ... --gpu-mem <device memory>` "
                        f"where the compiler runs") from e
    d = new["batch"]["decode"]
    if log is not None:
        log(f"moecc: {where} has no device budget (compiled without --gpu-mem); recompiled it in memory for "
            f"{device} with --gpu-mem {_gib(budget)} ({_gib(free)} free minus {_gib(headroom)} headroom): "
            f"arena {_gib((new.get('arena') or {}).get('bytes', 0))}, decode B={d['B']} b_a={d['b_a']} b_e={d['b_e']} "
            f"(compile with --gpu-mem to choose the budget yourself)")
    return new


def _hardware_kept(hardware: str | None) -> str | None:
    """The plan's --hardware for the recompile: a preset name as it was; a profile file when
    it exists on this machine; else (none given, or the file is not here) None: this machine's."""
    if hardware is None:
        return None
    if Path(hardware).suffix == ".json" and not Path(hardware).is_file():
        return None
    return hardware


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
