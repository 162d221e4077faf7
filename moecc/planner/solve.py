"""The planner's integer program (OR-Tools CP-SAT), solved once per candidate batch B.

Formulation (all times in µs, memory in bytes; `x_*` one-hot choices, `r_g` residency):
  B               enumerated outside the program (as FlexGen does, to keep it linear);
                  candidates: powers of two up to min(--max-batch, what host memory holds)
  decode          x_a[b_a] (attention micro-batch), x_e[b_e] (expert chunk)
  prefill         z[(b_a, b_e)] for each prompt-tokens-per-step tps (enumerated outside)
  overlap         y[p] prefetch depth p in {0..3}; p + 1 expert slots on the device (only p = 0
                  when the profile says copies hide less than NO_OVERLAP behind compute)
  residency       r_g for g in L{i}.attn, L{i}.experts, L{i}.dense, head (1 = kept on device)
  per phase f and layer l:
    comp_fl = sum x . attention time(b_a) + sum x . expert/MLP time(b_e)      (measured rates,
                                                          calibrated on the runtime when profiled so)
    copy_fl = sum_g (1 - r_g) . fetch time(g) + KV load/store time           (0 on a CPU device
                                                                               without --gpu-mem)
    moved_fl = copy_fl at bytes / rate, before calibration (what a copy steals from compute)
    t_fl >= comp_fl + (1 - copy_overlap) . moved_fl,  t_fl >= copy_fl,
    t_fl >= comp_fl + copy_fl - BIG . (1 - y[0])
    T_f = sum_l t_fl + head_f (+ its fetch)
  device memory (each phase, when --gpu-mem is set), at a 0.9 derate:
    arena = sum_g r_g . bytes_g + (p + 1) . expert slot + 2 . dense slot
            + kv (two KV buffers: kv >= the chosen b_a's of both phases; each buffer holds
              b_a sequences of the workload's length, and at least one of the model's context)
            + staging (B + tps rows of hidden state and rope)
    arena + b_e . expert activation row + rows . hidden . 6 . itemsize (temporaries) <= budget
    The arena is what the runtime allocates (plan["arena"]); temporaries live beside it.
  host memory (when --host-mem is set), at a 0.8 derate:
    weights + B . blocks per sequence . block bytes + rows . host-buffer bytes per row <= budget
  objective (per request): minimise output/B . T_decode + prompt/tps . T_prefill,
    i.e. maximise the job's generated tokens/s; B and tps are enumerated outside (each a
    constant there, so the objective is linear) and the best pair wins.
`enumerate_best` evaluates the same model by brute force (tests check they agree).
Every coefficient comes from the one cost model of a step (cost_model.py: `CostModel`, at
the step shapes of `Workload`), whose DAG predicts the chosen plan's rates.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from moecc_runtime.plan_schema import ALIGN, KV_BLOCK_SIZE, expert_group, residency_group

from moecc.planner.cost_model import Choice, CostModel, Workload
from moecc.planner.costs import ModelCost
from moecc.planner.host_memory import HostReserve, fits, host_bytes, host_reserve
from moecc.planner.schedule import Rates, experts_in_use

DEVICE_DERATE = 0.9
KV_BLOCK = KV_BLOCK_SIZE
NO_OVERLAP = 0.1  # a profile whose copies hide less than this behind compute gets no prefetch
CPU_FRESH_MAP_BYTES = 32 * 2**20
US = 1e6  # time unit of the program: microseconds
STEAL_SCALE = 1000  # (1 - copy_overlap) as an integer share in thousandths
T_MAX = 10**9  # µs: bound on one step (1000 s) (keeps every product inside int64)


@dataclass
class Problem:
    cost: ModelCost
    rates: Rates
    prompt_tokens: float
    output_tokens: float
    gpu_mem: int | None = None
    host_mem: int | None = None
    max_batch: int = 1024
    host_reserve_given: int | None = None  # --host-reserve: replaces the modelled reserve
    host_available: int | None = None  # this machine's available host memory (sizes the KV pool without --host-mem)
    b_e_options: tuple[int, ...] = (8, 32, 128, 256, 512, 1024, 2048, 4096)
    tps_options: tuple[int, ...] = (256, 1024, 2048, 4096, 8192)
    prefetch_options: tuple[int, ...] = (0, 1, 2, 3)
    b_a_options_max: int = 6  # how many powers of two below B to offer for b_a
    pareto: bool = True  # drop dominated options before solving (exact; off only to test that)

    @property
    def seq_len(self) -> int:
        return int(math.ceil(self.prompt_tokens + self.output_tokens))

    @property
    def reserve(self) -> HostReserve:
        """Host bytes kept out of the budget (moecc/planner/host_memory.py)."""
        return host_reserve(self.cost, self.host_reserve_given)

    def host_fits(self, B: int, tps: int) -> bool:
        """Whether batch B with `tps` prompt tokens per prefill step fits --host-mem."""
        return fits(self.host_mem, self.reserve, host_bytes(self.cost, self.seq_len, B, tps))

    @property
    def workload(self) -> Workload:
        return Workload(self.prompt_tokens, self.output_tokens)

    def cost_model(self) -> CostModel:
        """The cost model of this problem's steps (streamed exactly when copies are made)."""
        return CostModel(self.cost, self.rates, streams=self.copies)

    @property
    def copies(self) -> bool:
        """Weights and KV cross a link only when a device budget is set (else read in place)."""
        return self.gpu_mem is not None

    def groups(self) -> dict[str, int]:
        """Residency groups and their bytes."""
        out: dict[str, int] = {}
        if not self.copies:
            return out
        for lc in self.cost.layers:  # as the runtime places them (costs.slot_bytes)
            out[str(residency_group("attn", lc.layer))] = lc.attn_slot_bytes
            if lc.moe:
                out[expert_group(lc.layer)] = lc.expert_slot_bytes * lc.num_experts
            out[str(residency_group("moe", lc.layer))] = lc.ffn_slot_bytes
        out[str(residency_group("head", None))] = self.cost.head_slot_bytes
        return out

    def kv_buffer_tokens(self, b_a: int) -> int:
        """Positions one device KV buffer holds: b_a sequences of the workload's length (in
        whole blocks), and never less than one sequence of the model's full context."""
        blocks = max(b_a * -(-self.seq_len // KV_BLOCK), -(-max(self.cost.max_context, 1) // KV_BLOCK))
        return blocks * KV_BLOCK

    def kv_buffer_bytes(self, b_a: int) -> int:
        """Both KV buffers (K and V each), as the runtime carves them."""
        layer_pos = max((lc.kv_bytes_per_ctx for lc in self.cost.layers), default=0)
        return 2 * self.kv_buffer_tokens(b_a) * layer_pos + 4 * ALIGN

    def stage_bytes(self, B: int, tps: int) -> int:
        """Staging for hidden states brought to the device: a step has at most B + tps rows."""
        c = self.cost
        return (B + tps) * (c.hidden + 2 * c.head_dim) * c.itemsize + 4 * ALIGN


@dataclass
class Solution:
    choice: Choice
    seconds_per_request: float  # output/B x T_decode + prompt/tps x T_prefill (the linear model)
    decode_step_s: float  # linear model
    prefill_step_s: float
    device_bytes: dict[str, int]
    host_bytes: dict[str, int]
    binding: list[str]
    status: str
    solve_s: float
    candidates: list[dict[str, Any]] = field(default_factory=list)  # per B tried
    variables: dict[str, Any] = field(default_factory=dict)  # the program's choices at the chosen B

    def tokens_per_s(self, pr: "Problem") -> float:
        """The linear model's job throughput: generated tokens per second of one request's
        share of the steps."""
        t = pr.output_tokens / self.choice.B * self.decode_step_s + \
            pr.prompt_tokens / self.choice.prefill[0] * self.prefill_step_s
        return pr.output_tokens / t if t > 0 else 0.0


# -- the coefficient tables both the program and the enumeration use -----------------------

@dataclass
class _Tables:
    B: int
    b_a: list[int]
    b_e: list[int]
    pre: list[tuple[int, int, int]]
    p: list[int]
    groups: dict[str, int]
    dec_attn: dict[int, list[int]]  # b_a -> ns per layer
    dec_ffn: dict[int, list[int]]  # b_e -> ns per layer
    pre_comp: dict[tuple[int, int, int], list[int]]  # -> ns per layer
    dec_head: int
    pre_head: dict[tuple[int, int, int], int]
    dec_copy_fixed: list[int]  # KV traffic per layer (ns)
    pre_copy_fixed: dict[tuple[int, int, int], list[int]]
    fetch_ns: dict[str, dict[str, int]]  # phase -> group -> ns when not resident (per step)
    # the same copies at their modelled length (bytes / rate), before calibration: what a copy
    # steals from compute goes with the bytes it moves, not with its waits
    dec_steal_fixed: list[int]
    pre_steal_fixed: dict[tuple[int, int, int], list[int]]
    steal_fetch_ns: dict[str, dict[str, int]]
    dev_fixed: int  # two dense slots
    dev_b_a: dict[int, int]  # decode temporaries of an attention micro-batch
    dev_b_e: dict[int, int]  # decode temporaries of an expert chunk
    dev_pre: dict[tuple[int, int, int], int]  # prefill temporaries
    dev_p: dict[int, int]  # expert slots
    dev_kv_dec: dict[int, int]  # KV buffers for a decode b_a
    dev_kv_pre: dict[tuple[int, int, int], int]  # KV buffers for a prefill (tps, b_a, b_e)
    dev_stage: dict[tuple[int, int, int], int]  # staging for B + tps rows
    host_bytes: dict[str, int]  # at the smallest prefill step offered (every offered one fits)
    steal: int  # (1 - copy_overlap) x STEAL_SCALE: compute time a copy-second costs
    w_dec: float  # decode steps per request
    w_pre: dict[tuple[int, int, int], float]  # prefill steps per request


def _tables(pr: Problem, B: int) -> _Tables:
    """The program's coefficients at batch B: times in ns from the cost model at the
    workload's step shapes, bytes; dominated options dropped when `pr.pareto`."""
    b_a, b_e, pre_tps, p = _options(pr, B)
    pre = [(t, a, e) for t in pre_tps for a in b_a for e in b_e]
    times = _times(pr, B, b_a, b_e, pre, max(pre_tps))
    mem = _memory(pr, B, b_a, b_e, pre, p)
    # drop dominated options (no faster in any layer and no smaller): they can never be optimal
    if pr.pareto:
        b_a, b_e, pre = _prune(pr, b_a, b_e, pre, pre_tps, times["dec_attn"], times["dec_ffn"], times["pre_comp"],
                               times["pre_head"], {a: (mem["dev_kv_dec"][a], mem["dev_b_a"][a]) for a in b_a},
                               mem["dev_b_e"],
                               {k: (mem["dev_kv_pre"][k], mem["dev_pre"][k] + mem["dev_stage"][k]) for k in pre})
    host = host_bytes(pr.cost, pr.seq_len, B, min(pre_tps))
    return _Tables(B=B, b_a=b_a, b_e=b_e, pre=pre, p=p, groups=pr.groups(), **times, **mem, host_bytes=host,
                   steal=int(round((1.0 - pr.rates.copy_overlap) * STEAL_SCALE)), w_dec=pr.output_tokens / B,
                   w_pre={k: pr.prompt_tokens / k[0] for k in pre})


def tps_offered(pr: Problem, B: int) -> list[int]:
    """Prompt tokens per prefill step offered at batch B (before the host budget)."""
    pre_tps = sorted({min(t, max(1, int(B * pr.prompt_tokens))) for t in pr.tps_options})
    if pr.rates.device_kind == "cpu":  # host tensors above glibc's 32 MiB mmap threshold are mapped
        # fresh on every allocation (page faults on first touch: measured 25% slower steps)
        fit = [t for t in pre_tps if t * pr.cost.hidden * 4 < CPU_FRESH_MAP_BYTES]
        pre_tps = fit or pre_tps[:1]
    return pre_tps


def _options(pr: Problem, B: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The values offered at batch B: decode b_a, b_e, prompt tokens per prefill step, prefetch depth."""
    c, r = pr.cost, pr.rates
    b_a = sorted({max(1, B >> i) for i in range(pr.b_a_options_max)})
    b_e = [e for e in pr.b_e_options] or [4096]
    pre_tps = tps_offered(pr, B)
    pre_tps = [t for t in pre_tps if pr.host_fits(B, t)] or pre_tps[:1]  # host buffers grow with the step
    p = list(pr.prefetch_options) if pr.copies else [1]
    if pr.copies and r.copy_overlap < NO_OVERLAP:  # copies cannot hide behind compute (a CPU's copy
        # thread shares its cores and memory bus): a prefetch slot buys nothing, costs arena bytes,
        # and two streams contending ran 6% slower than fetching in turn (bench/predict.py)
        p = [0]
    return b_a, b_e, pre_tps, p


def _ns(seconds: float) -> int:
    return int(round(seconds * US))


def _times(pr: Problem, B: int, b_a: list[int], b_e: list[int], pre: list[tuple[int, int, int]],
           max_tps: int) -> dict[str, Any]:
    """The time fields of `_Tables` (ns), each from the cost model."""
    cm, wl = pr.cost_model(), pr.workload
    dec = wl.decode_shape(B)
    out: dict[str, Any] = {
        "dec_attn": {a: [_ns(t) for t in cm.attention_s(dec, a)] for a in b_a},
        "dec_ffn": {e: [_ns(t) for t in cm.ffn_s(B, e)] for e in b_e},
        "dec_head": _ns(cm.head_s(B)), "pre_comp": {}, "pre_head": {}, "pre_copy_fixed": {}, "pre_steal_fixed": {}}
    for t, a, e in pre:
        sh = wl.prefill_shape(t)
        out["pre_comp"][(t, a, e)] = [_ns(x + y) for x, y in zip(cm.attention_s(sh, a), cm.ffn_s(t, e))]
        out["pre_head"][(t, a, e)] = _ns(cm.head_s(sh.head_rows))
        copy, moved = cm.kv_load_s(sh)
        out["pre_copy_fixed"][(t, a, e)] = [_ns(x) for x in copy]
        out["pre_steal_fixed"][(t, a, e)] = [_ns(x) for x in moved]
    copy, moved = cm.kv_load_s(dec)
    out["dec_copy_fixed"], out["dec_steal_fixed"] = [_ns(x) for x in copy], [_ns(x) for x in moved]
    out["fetch_ns"], out["steal_fetch_ns"] = _fetch_times(pr, cm, {"decode": B, "prefill": max_tps})
    return out


def _fetch_times(pr: Problem, cm: CostModel, rows: dict[str, int]) -> tuple[dict[str, dict[str, int]], ...]:
    """Per phase (over `rows` rows) and residency group, the fetch when not resident (ns): as
    calibrated, and at bytes / rate. A layer's experts: those its rows are expected to choose."""
    fetch: dict[str, dict[str, int]] = {phase: {} for phase in rows}
    moved: dict[str, dict[str, int]] = {phase: {} for phase in rows}
    for phase, T in rows.items():
        for g, nbytes in pr.groups().items():
            used, jobs = nbytes, 1.0
            if g.endswith(".experts"):
                lc = pr.cost.layers[int(g.split(".")[0][1:])]
                jobs = experts_in_use(lc, T)
                used = jobs * lc.expert_bytes
            t, raw = cm.fetch_s(used, jobs)
            fetch[phase][g], moved[phase][g] = _ns(t), _ns(raw)
    return fetch, moved


def _memory(pr: Problem, B: int, b_a: list[int], b_e: list[int], pre: list[tuple[int, int, int]],
            p: list[int]) -> dict[str, Any]:
    """The device-memory fields of `_Tables` (bytes)."""
    c, it = pr.cost, pr.cost.itemsize
    return {
        "dev_fixed": 2 * c.dense_slot_bytes if pr.copies else 0,
        "dev_b_a": {a: a * c.hidden * 6 * it for a in b_a},
        "dev_b_e": {e: e * c.act_bytes_per_token for e in b_e},
        "dev_pre": {(t, a, e): min(t, a * max(1, int(pr.prompt_tokens))) * c.hidden * 6 * it + e * c.act_bytes_per_token
                    for t, a, e in pre},
        "dev_p": {q: (q + 1) * c.expert_slot_bytes for q in p},
        "dev_kv_dec": {a: pr.kv_buffer_bytes(a) for a in b_a},
        "dev_kv_pre": {k: pr.kv_buffer_bytes(k[1]) for k in pre},
        "dev_stage": {k: pr.stage_bytes(B, k[0]) for k in pre},
    }


def _prune(pr, b_a, b_e, pre, pre_tps, dec_attn, dec_ffn, pre_comp, pre_head, dev_b_a, dev_b_e, dev_pre):
    """dev_b_a / dev_pre: memory tuples (KV buffers, the rest); dev_b_e: bytes."""
    b_a = _pareto(b_a, lambda a: dec_attn[a], lambda a: dev_b_a[a])
    b_e = _pareto(b_e, lambda e: dec_ffn[e], lambda e: (dev_b_e[e],))
    pre = [k for t in pre_tps for k in _pareto([k for k in pre if k[0] == t],
                                               lambda k: pre_comp[k] + [pre_head[k]], lambda k: dev_pre[k])]
    return b_a, b_e, pre


def _pareto(options: list, times, mem) -> list:
    """Options not dominated by another (all layer times <= and every memory component <=,
    one strictly). Memory is a tuple of components that meet different constraints (KV
    buffers, shared by both phases through a max, and the phase's own temporaries), so
    only an option no larger in each can stand in for another."""
    def le(a: tuple, b: tuple) -> bool:
        return all(x <= y for x, y in zip(a, b))

    keep = []
    for o in options:
        to, mo = times(o), mem(o)
        dominated = False
        for q in options:
            if q is o:
                continue
            tq, mq = times(q), mem(q)
            if le(mq, mo) and all(a <= b for a, b in zip(tq, to)) and (mq != mo or tq != to or
                                                                        options.index(q) < options.index(o)):
                dominated = True
                break
        if not dominated:
            keep.append(o)
    return keep


def _signature(lc) -> tuple:
    return tuple(v for k, v in vars(lc).items() if k != "layer")


def _lower_bound(tb: _Tables, pre: list[tuple[int, int, int]]) -> float:
    """Seconds per request with every weight resident and no memory limit: no choice of
    residency, slots or budget can do better."""
    L = len(tb.dec_copy_fixed)
    dec = min(sum(max(tb.dec_attn[a][i] + tb.dec_ffn[e][i], tb.dec_copy_fixed[i]) for i in range(L))
              for a in tb.b_a for e in tb.b_e) + tb.dec_head
    pre_t = min(sum(max(tb.pre_comp[k][i], tb.pre_copy_fixed[k][i]) for i in range(L)) + tb.pre_head[k]
                for k in pre)
    return (tb.w_dec * dec + tb.w_pre[pre[0]] * pre_t) / US


def _layer_groups(tb: _Tables, layer: int) -> list[str]:
    return [g for g in tb.groups if g.startswith(f"L{layer}.")]


# -- CP-SAT --------------------------------------------------------------------------------

def solve_for_batch(pr: Problem, B: int, time_limit_s: float = 10.0, bound: float | None = None,
                    tb: "_Tables | None" = None) -> Solution | None:
    """The best choice for this B, or None when nothing fits (or nothing beats `bound`,
    seconds per request). The prompt tokens per prefill step are enumerated too (few
    values), so the objective stays linear."""
    tb = tb or _tables(pr, B)
    if not fits(pr.host_mem, pr.reserve, tb.host_bytes):
        return None
    if not pr.copies:  # nothing couples the choices: the exact optimum by enumeration
        sol = _enumerate(pr, tb)
        if sol is not None:
            sol.status = "optimal (no device budget: enumerated)"
        return sol
    best: Solution | None = None
    t0 = time.perf_counter()
    groups = [[k for k in tb.pre if k[0] == tps] for tps in sorted({k[0] for k in tb.pre})]
    for pre in sorted(groups, key=lambda g: _lower_bound(tb, g)):
        if bound is not None and _lower_bound(tb, pre) >= bound:
            continue  # cannot beat what is already found
        if best is not None and _lower_bound(tb, pre) >= best.seconds_per_request:
            continue
        sol = _cp_sat(pr, tb, pre, time_limit_s)
        if sol is not None and (best is None or sol.seconds_per_request < best.seconds_per_request):
            best = sol
    if best is not None:
        best.solve_s = time.perf_counter() - t0
    return best


def _cp_sat(pr: Problem, tb: _Tables, pre: list[tuple[int, int, int]], time_limit_s: float) -> Solution | None:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    xa = {a: m.NewBoolVar(f"dec_b_a={a}") for a in tb.b_a}
    xe = {e: m.NewBoolVar(f"dec_b_e={e}") for e in tb.b_e}
    z = {k: m.NewBoolVar(f"pre={k}") for k in pre}
    y = {q: m.NewBoolVar(f"prefetch={q}") for q in tb.p}
    rg = {g: m.NewBoolVar(f"resident[{g}]") for g in tb.groups}
    for group in (xa, xe, z, y):
        m.AddExactlyOne(group.values())
    # identical layers are interchangeable: keep the earlier one resident first (breaks the
    # L! symmetric copies of every solution; changes no optimum)
    layers = pr.cost.layers
    for a, b in zip(layers, layers[1:]):
        if _signature(a) == _signature(b):
            for kind in ("attn", "experts", "dense"):
                ga, gb = f"L{a.layer}.{kind}", f"L{b.layer}.{kind}"
                if ga in rg and gb in rg:
                    m.Add(rg[ga] >= rg[gb])
    L = len(pr.cost.layers)
    phase_T = {}
    for phase in ("decode", "prefill"):
        ts = []
        for i in range(L):
            if phase == "decode":
                comp = sum(xa[a] * tb.dec_attn[a][i] for a in tb.b_a) + sum(xe[e] * tb.dec_ffn[e][i] for e in tb.b_e)
                fixed, fixed_steal = tb.dec_copy_fixed[i], tb.dec_steal_fixed[i]
            else:
                comp = sum(z[k] * tb.pre_comp[k][i] for k in pre)
                fixed = sum(z[k] * tb.pre_copy_fixed[k][i] for k in pre)
                fixed_steal = sum(z[k] * tb.pre_steal_fixed[k][i] for k in pre)
            copy = fixed + sum((1 - rg[g]) * tb.fetch_ns[phase][g] for g in _layer_groups(tb, i))
            moved = fixed_steal + sum((1 - rg[g]) * tb.steal_fetch_ns[phase][g] for g in _layer_groups(tb, i))
            t = m.NewIntVar(0, T_MAX, f"t_{phase}_{i}")
            m.Add(STEAL_SCALE * t >= STEAL_SCALE * comp + tb.steal * moved)  # copies steal compute
            m.Add(t >= copy)
            if 0 in y:  # no prefetch: a layer's fetches and compute do not overlap
                m.Add(t >= comp + copy - T_MAX * (1 - y[0]))
            ts.append(t)
        head = tb.dec_head if phase == "decode" else sum(z[k] * tb.pre_head[k] for k in pre)
        if "head" in rg:
            head = head + (1 - rg["head"]) * tb.fetch_ns[phase]["head"]
        T = m.NewIntVar(0, T_MAX, f"T_{phase}")
        m.Add(T == sum(ts) + head)
        phase_T[phase] = T
    if pr.gpu_mem is not None:
        budget = int(pr.gpu_mem * DEVICE_DERATE)
        res = sum(rg[g] * b for g, b in tb.groups.items())
        slots = sum(y[q] * tb.dev_p[q] for q in tb.p)
        kv = m.NewIntVar(0, budget, "kv_buffers")  # one arena for both phases: the larger b_a's
        m.Add(kv >= sum(xa[a] * tb.dev_kv_dec[a] for a in tb.b_a))
        m.Add(kv >= sum(z[k] * tb.dev_kv_pre[k] for k in pre))
        arena = res + slots + tb.dev_fixed + kv + sum(z[k] * tb.dev_stage[k] for k in pre)
        m.Add(arena + sum(xa[a] * tb.dev_b_a[a] for a in tb.b_a) + sum(xe[e] * tb.dev_b_e[e] for e in tb.b_e)
              <= budget)
        m.Add(arena + sum(z[k] * tb.dev_pre[k] for k in pre) <= budget)
    # integer weights in proportion to the steps per request (largest 10^4: keeps CP-SAT's
    # arithmetic far from int64 limits; relative rounding <= 1e-4)
    scale = 1e4 / max(tb.w_dec, tb.w_pre[pre[0]])
    m.Minimize(max(1, round(tb.w_dec * scale)) * phase_T["decode"]
               + max(1, round(tb.w_pre[pre[0]] * scale)) * phase_T["prefill"])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1  # one search worker is deterministic: one input, one plan, every compile
    solver.parameters.relative_gap_limit = 1e-4  # optimal to 0.01%: far below the model's own error
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    pick = lambda d: next(k for k, v in d.items() if solver.Value(v))  # noqa: E731
    choice = Choice(tb.B, pick(xa), pick(xe), pick(z), pick(y),
                    frozenset(g for g, v in rg.items() if solver.Value(v)))
    sol = _describe(pr, tb, choice)
    sol.status = "optimal" if status == cp_model.OPTIMAL else "feasible (time limit)"
    return sol


def _evaluate(pr: Problem, tb: _Tables, ch: Choice) -> tuple[float, int, int, list[str]] | None:
    """The linear model's (objective, T_decode, T_prefill, binding terms) for a choice, or
    None when it breaks a memory budget."""
    L = len(pr.cost.layers)
    dev = _device_bytes(pr, tb, ch)
    if pr.gpu_mem is not None and max(dev["decode_total"], dev["prefill_total"]) > int(pr.gpu_mem * DEVICE_DERATE):
        return None
    binding: list[str] = []
    Ts = {}
    for phase in ("decode", "prefill"):
        total = 0
        for i in range(L):
            if phase == "decode":
                comp = tb.dec_attn[ch.b_a][i] + tb.dec_ffn[ch.b_e][i]
                copy, moved = tb.dec_copy_fixed[i], tb.dec_steal_fixed[i]
            else:
                comp = tb.pre_comp[ch.prefill][i]
                copy, moved = tb.pre_copy_fixed[ch.prefill][i], tb.pre_steal_fixed[ch.prefill][i]
            copy += sum(tb.fetch_ns[phase][g] for g in _layer_groups(tb, i) if g not in ch.resident)
            moved += sum(tb.steal_fetch_ns[phase][g] for g in _layer_groups(tb, i) if g not in ch.resident)
            t = comp + copy if ch.prefetch == 0 else max(comp + tb.steal * moved / STEAL_SCALE, copy)
            if phase == "decode":
                binding.append(f"L{i} decode: {'compute+copy (no prefetch)' if ch.prefetch == 0 and copy else 'copy' if copy > comp else 'compute'}")
            total += t
        head = tb.dec_head if phase == "decode" else tb.pre_head[ch.prefill]
        if "head" in tb.groups and "head" not in ch.resident:
            head += tb.fetch_ns[phase]["head"]
        Ts[phase] = total + head
    obj = (tb.w_dec * Ts["decode"] + tb.w_pre[ch.prefill] * Ts["prefill"]) / US
    return obj, Ts["decode"], Ts["prefill"], binding


def _device_bytes(pr: Problem, tb: _Tables, ch: Choice) -> dict[str, int]:
    res = sum(b for g, b in tb.groups.items() if g in ch.resident)
    if not pr.copies:  # no budget: no arena, weights are read in place
        return {"resident_weights": 0, "expert_slots": 0, "dense_slots": 0, "kv_buffers": 0, "staging": 0,
                "arena": 0, "decode_temporaries": tb.dev_b_a[ch.b_a] + tb.dev_b_e[ch.b_e],
                "prefill_temporaries": tb.dev_pre[ch.prefill], "decode_total": 0, "prefill_total": 0}
    kv = max(tb.dev_kv_dec[ch.b_a], tb.dev_kv_pre[ch.prefill])
    arena = res + tb.dev_p[ch.prefetch] + tb.dev_fixed + kv + tb.dev_stage[ch.prefill]
    dec_tmp, pre_tmp = tb.dev_b_a[ch.b_a] + tb.dev_b_e[ch.b_e], tb.dev_pre[ch.prefill]
    return {"resident_weights": res, "expert_slots": tb.dev_p[ch.prefetch], "dense_slots": tb.dev_fixed,
            "kv_buffers": kv, "staging": tb.dev_stage[ch.prefill], "arena": arena,
            "decode_temporaries": dec_tmp, "prefill_temporaries": pre_tmp,
            "decode_total": arena + dec_tmp, "prefill_total": arena + pre_tmp}


def _describe(pr: Problem, tb: _Tables, ch: Choice) -> Solution:
    ev = _evaluate(pr, tb, ch)
    assert ev is not None, "solver returned a choice the model rejects"
    obj, td, tp, binding = ev
    dev = _device_bytes(pr, tb, ch)
    if pr.gpu_mem is not None:
        budget = int(pr.gpu_mem * DEVICE_DERATE)
        slack = budget - max(dev["decode_total"], dev["prefill_total"])
        if slack < max(pr.cost.max_expert_bytes, 1):
            binding.append(f"device memory (slack {slack} B)")
    host = host_bytes(pr.cost, pr.seq_len, tb.B, ch.prefill[0])
    if pr.host_mem is not None:
        slack = pr.host_mem - pr.reserve.total - sum(host.values())
        binding.append(f"host memory (slack {slack} B)")
    return Solution(ch, obj, td / US, tp / US, dev, host, binding, "", 0.0)


def enumerate_best(pr: Problem, B: int) -> Solution | None:
    """Brute force over every choice of the same model (small instances only)."""
    tb = _tables(pr, B)
    if not fits(pr.host_mem, pr.reserve, tb.host_bytes):
        return None
    return _enumerate(pr, tb)


def _enumerate(pr: Problem, tb: _Tables) -> Solution | None:
    B = tb.B
    best: tuple[int, Choice] | None = None
    gs = list(tb.groups)
    for a, e, k, q in itertools.product(tb.b_a, tb.b_e, tb.pre, tb.p):
        for bits in itertools.product((0, 1), repeat=len(gs)):
            ch = Choice(B, a, e, k, q, frozenset(g for g, b in zip(gs, bits) if b))
            ev = _evaluate(pr, tb, ch)
            if ev is not None and (best is None or ev[0] < best[0]):
                best = (ev[0], ch)
    return None if best is None else _describe(pr, tb, best[1])


def minimum_device_bytes(pr: Problem) -> int:
    """Device bytes of the smallest choice the program can make (B = 1, nothing resident,
    the smallest b_a, b_e, prefill step and prefetch depth): below this nothing fits."""
    import dataclasses

    tb = _tables(dataclasses.replace(pr, pareto=False, gpu_mem=pr.gpu_mem or 1), 1)
    k = min(tb.pre, key=lambda k: tb.dev_pre[k] + tb.dev_kv_pre[k] + tb.dev_stage[k])
    common = tb.dev_fixed + min(tb.dev_p.values()) + tb.dev_stage[k]
    kv = max(min(tb.dev_kv_dec.values()), tb.dev_kv_pre[k])
    dec = min(tb.dev_b_a.values()) + min(tb.dev_b_e.values())
    return common + kv + max(dec, tb.dev_pre[k])


def batch_candidates(pr: Problem) -> list[int]:
    cands = {1 << i for i in range(0, 20) if (1 << i) <= pr.max_batch} | {pr.max_batch}
    return sorted(cands)


def solve(pr: Problem, time_limit_s: float = 10.0) -> Solution | None:
    """Best over B: the candidate with the smallest time per request. Candidates are tried
    in order of their lower bound and skipped once the bound cannot beat the best found."""
    best: Solution | None = None
    tried = []
    t0 = time.perf_counter()
    bounds = {}
    tables = {}
    for B in batch_candidates(pr):
        tb = tables[B] = _tables(pr, B)
        groups = [[k for k in tb.pre if k[0] == tps] for tps in sorted({k[0] for k in tb.pre})]
        bounds[B] = min(_lower_bound(tb, g) for g in groups)
    for B in sorted(bounds, key=bounds.get):
        if best is not None and bounds[B] >= best.seconds_per_request:
            tried.append({"B": B, "skipped": "lower bound cannot beat the best", "bound_s": bounds[B]})
            continue
        s = solve_for_batch(pr, B, time_limit_s, None if best is None else best.seconds_per_request, tables[B])
        if s is None:
            tried.append({"B": B, "feasible": False})
            continue
        tried.append({"B": B, "feasible": True, "seconds_per_request": s.seconds_per_request,
                      "tokens_per_s": s.tokens_per_s(pr)})
        if best is None or s.seconds_per_request < best.seconds_per_request:
            best = s
    if best is not None:
        best = _widen_chunks(pr, best)
        best.candidates = sorted(tried, key=lambda d: d["B"])
        best.variables = _variables(tables[best.choice.B])
        best.solve_s = time.perf_counter() - t0
    return best


def _variables(tb: _Tables) -> dict[str, Any]:
    """The program's choices at one B (after dropping dominated options), for the plan."""
    return {"decode b_a": tb.b_a, "decode b_e": tb.b_e, "prefill (tps, b_a, b_e)": len(tb.pre),
            "prefetch depth": tb.p, "residency booleans": len(tb.groups)}


def _widen_chunks(pr: Problem, sol: Solution) -> Solution:
    """Among expert chunks the model finds equally fast (within 0.1%), take the largest that
    fits: real routers load experts far less evenly than the model's n +- sqrt(n), and a
    chunk with headroom costs only memory (measured: b_e 128 -> 4096 at B=256 on this CPU,
    15% faster decode, where the model saw no difference)."""
    import dataclasses

    ch = sol.choice
    tb = _tables(dataclasses.replace(pr, pareto=False), ch.B)
    base = _evaluate(pr, tb, ch)
    if base is None:
        return sol
    for e in sorted(tb.b_e, reverse=True):
        if e <= ch.b_e:
            break
        trial = dataclasses.replace(ch, b_e=e)
        ev = _evaluate(pr, tb, trial)
        if ev is not None and ev[0] <= base[0] * 1.001:
            ch = trial
            break
    t, a, e0 = ch.prefill
    for e in sorted({k[2] for k in tb.pre if k[0] == t and k[1] == a}, reverse=True):
        if e <= e0:
            break
        trial = dataclasses.replace(ch, prefill=(t, a, e))
        ev = _evaluate(pr, tb, trial)
        if ev is not None and ev[0] <= base[0] * 1.001:
            ch = trial
            break
    if ch == sol.choice:
        return sol
    out = _describe(pr, tb, ch)
    out.status = sol.status + "; expert chunks widened at equal predicted time"
    return out
