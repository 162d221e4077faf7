"""One engine step as a DAG of compute and copy jobs, and its critical path.

The jobs are what the runtime does for one step of a phase (prefill or decode):
  per layer: fetch the attention weights (unless resident); per attention micro-batch,
  load its KV (a copy-lane job with an arena; without one, a gather the compute thread
  does), run projections and attention, store the new K/V; then the router over all rows, and for
  each expert in use, fetch it (unless resident) and run it over its tokens in chunks of
  b_e; dense MLPs in chunks of b_e; finally the head over the rows that sample.
Edges: data dependencies, program order on each lane (one compute lane, one copy lane),
and slot reuse: with prefetch depth p, the fetch of expert i waits for the compute of
expert i - p - 1 (p = 0: no overlap of fetch and compute).
The predicted step time is the longest path; the same networkx DAG is what timelines draw.

Calibration: a profile measured on the runtime (`moecc profile --model`, moecc/measure/calibrate.py)
gives each job kind of an execution mode ("resident" or "streamed") an affine correction,
factor x modelled seconds + fixed seconds per job, and adds the overhead no job accounts for
(fixed plus per row) to each layer's router job; an uncalibrated profile (or any Rates
without `calibrated`) changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import networkx as nx
from moecc_runtime.plan_schema import expert_group, residency_group

from moecc.planner.costs import LayerCost, ModelCost

#: Fixed cost of one kernel launch / Python-level op in the runtime (seconds).
OP_OVERHEAD_S = 15e-6


class Rates(Protocol):
    """What the schedule needs from a hardware profile."""

    device_kind: str
    copy_overlap: float  # share of copy time that can hide behind compute
    host_bandwidth: float  # bytes read + written per second

    def gemm_rate(self, dtype: str, tokens: int) -> float: ...

    def mlp_rate(self, dtype: str, tokens: float, hidden: int, inter: int) -> float: ...

    def attention_rate(self, dtype: str, kv_bytes: float, on_cpu: bool = False) -> float: ...

    def copy_rate(self, direction: str, nbytes: float) -> float: ...

    def elementwise_rate(self, dtype: str, nbytes: float) -> float: ...


def calibrated(rates: Rates, mode: str, kind: str, seconds: float, jobs: float = 1.0) -> float:
    """`jobs` jobs of `kind` modelled at `seconds` in all, as the profile's calibration
    corrects them (unchanged when it has none)."""
    f = getattr(rates, "calibrated", None)
    return f(mode, kind, seconds, jobs) if f is not None else seconds


def overhead_s(rates: Rates, mode: str, rows: float) -> float:
    """The profile's unaccounted seconds per layer of a step over `rows` rows (0 when it has none)."""
    f = getattr(rates, "overhead_s", None)
    return f(mode, rows) if f is not None else 0.0


def mode_of(streams: bool) -> str:
    return "streamed" if streams else "resident"


@dataclass(frozen=True)
class StepShape:
    """The work of one step: S sequences, T rows (tokens), mean context c per sequence,
    R rows reaching the head."""

    S: int
    T: int
    context: float
    head_rows: int


@dataclass(frozen=True)
class Knobs:
    b_a: int
    b_e: int
    prefetch: int = 1
    resident: frozenset[str] = frozenset()  # "L{i}.attn", "L{i}.experts", "L{i}.dense", "head", "all"

    def is_resident(self, what: str) -> bool:
        return "all" in self.resident or what in self.resident

    @property
    def streams(self) -> bool:
        """Weights and KV go through the device arena (a plan with a device budget); else
        weights are read in place and KV is gathered by the compute thread."""
        return "all" not in self.resident


@dataclass
class Job:
    name: str
    lane: str  # "compute" | "copy"
    seconds: float
    kind: str  # stem | attention | router | gemm | fetch | kv_load | head
    layer: int | None = None
    start: float = 0.0

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass
class Schedule:
    dag: nx.DiGraph
    jobs: dict[str, Job]
    seconds: float
    critical_path: list[str]
    totals: dict[str, float] = field(default_factory=dict)  # seconds by lane

    def bottleneck(self) -> str:
        """What the critical path spends most of its time on."""
        by_kind: dict[str, float] = {}
        for name in self.critical_path:
            j = self.jobs[name]
            key = "host->device link" if j.lane == "copy" else (
                "attention" if j.kind in ("attention", "gather") else "device compute")
            by_kind[key] = by_kind.get(key, 0.0) + j.seconds
        return max(by_kind, key=by_kind.get) if by_kind else "none"


def gemm_seconds(rates: Rates, dtype: str, flops_per_row: float, rows: float, chunk: int,
                 mlp: tuple[int, int] | None = None) -> float:
    """Rows in chunks of at most `chunk`, each chunk at the rate for its row count (a gated
    MLP of shape `mlp` = (H, I) at the measured rate of that block, when profiled)."""
    if rows <= 0 or flops_per_row <= 0:
        return 0.0

    def rate(t: float) -> float:
        return rates.mlp_rate(dtype, t, *mlp) if mlp else rates.gemm_rate(dtype, int(t))

    full, rest = divmod(rows, chunk)
    t = 0.0
    if full:
        t += full * (chunk * flops_per_row / rate(chunk) + OP_OVERHEAD_S)
    if rest > 0:
        t += rest * flops_per_row / rate(max(1, int(round(rest)))) + OP_OVERHEAD_S
    return t


def expert_seconds(rates: Rates, dtype: str, flops_per_row: float, n: float, chunk: int,
                   mlp: tuple[int, int] | None = None) -> float:
    """One expert over its tokens in chunks. Routing is never exactly even: an expert's load
    spreads about n +- sqrt(n), so the cost is averaged over n - sqrt(n) and n + sqrt(n)
    (a chunk size just at the mean pays for a second, small chunk half the time)."""
    spread = math.sqrt(max(n, 0.0))
    lo, hi = max(n - spread, min(n, 1.0)), n + spread
    return 0.5 * (gemm_seconds(rates, dtype, flops_per_row, lo, chunk, mlp)
                  + gemm_seconds(rates, dtype, flops_per_row, hi, chunk, mlp)) * n / ((lo + hi) / 2)


def elementwise_seconds(rates: Rates, dtype: str, bytes_per_row: float, rows: float) -> float:
    """The non-GEMM glue of a module (norms, residual adds, rope, row gathers) over `rows`."""
    nbytes = bytes_per_row * rows
    return nbytes / rates.elementwise_rate(dtype, nbytes) if nbytes > 0 else 0.0


def mlp_shape(lc: LayerCost, rates: Rates) -> tuple[int, int] | None:
    """(H, I) of the layer's experts, from their FLOPs (6 H I per row) and intermediate size."""
    if not lc.expert_inter:
        return None
    return (lc.expert_flops // (6 * lc.expert_inter), lc.expert_inter)


def experts_in_use(lc: LayerCost, T: float) -> float:
    """Expected experts chosen by at least one of T tokens (uniform routing)."""
    if not lc.moe or T <= 0:
        return 0.0
    return lc.num_experts * (1.0 - (1.0 - lc.top_k / lc.num_experts) ** T)


def attn_micro_seconds(lc: LayerCost, rates: Rates, dtype: str, s_m: float, t_m: float, c: float,
                       gather: bool = True) -> float:
    """Compute-thread time of one attention micro-batch: projections at its row count,
    attention at the rate it reads KV, the store of its new K/V to the host pool, and (with
    `gather`, i.e. without an arena's copy engine) the gather of its KV."""
    kv = s_m * c * lc.kv_bytes_per_ctx
    store = t_m * lc.kv_bytes_per_ctx
    proj = gemm_seconds(rates, dtype, lc.attn_flops, t_m, max(1, int(math.ceil(t_m))))
    att = kv / rates.attention_rate(dtype, kv, on_cpu=rates.device_kind == "cpu") if kv > 0 else 0.0
    put = store / rates.copy_rate("d2h", store) if store > 0 else 0.0
    get = 0.0
    if gather and kv > 0:  # the compute thread's own copy: at host memory speed on a CPU
        rate = rates.host_bandwidth / 2 if rates.device_kind == "cpu" else rates.copy_rate("h2d", kv)
        get = kv / rate + OP_OVERHEAD_S
    glue = elementwise_seconds(rates, dtype, lc.attn_elem_bytes, t_m)
    return proj + att + put + get + glue + 12 * OP_OVERHEAD_S


def attn_layer_seconds(lc: LayerCost, rates: Rates, dtype: str, shape: StepShape, b_a: int,
                       gather: bool = True) -> float:
    """A layer's attention micro-batches (calibrated; without the copies they steal from)."""
    M = max(1, math.ceil(shape.S / max(1, b_a)))
    dequant = elementwise_seconds(rates, dtype, lc.attn_dequant_bytes, 1)  # once per step, kept for its micro-batches
    return calibrated(rates, mode_of(not gather), "attention",
                      M * attn_micro_seconds(lc, rates, dtype, shape.S / M, shape.T / M, shape.context, gather)
                      + dequant, M)


def router_seconds(lc: LayerCost, rates: Rates, dtype: str, T: float, mode: str = "resident") -> float:
    """The router over T rows with the MoE/MLP module's glue (calibrated), plus the
    calibrated overhead of a layer that no job accounts for."""
    t = (gemm_seconds(rates, dtype, lc.router_flops, T, max(1, int(T))) + 6 * OP_OVERHEAD_S
         + elementwise_seconds(rates, dtype, lc.ffn_elem_bytes, T))
    return calibrated(rates, mode, "router", t) + overhead_s(rates, mode, T)


def ffn_layer_seconds(lc: LayerCost, rates: Rates, dtype: str, T: float, b_e: int, mode: str = "resident") -> float:
    """Router plus every expert in use over its tokens in chunks of b_e (or the dense MLP)."""
    t = router_seconds(lc, rates, dtype, T, mode)
    t += elementwise_seconds(rates, dtype, lc.ffn_dequant_bytes, 1)  # quantized dense / shared weights, per step
    if lc.moe:
        used = experts_in_use(lc, T)
        per_expert = T * lc.top_k / max(used, 1e-9)
        dequant = elementwise_seconds(rates, dtype, lc.expert_dequant_bytes, 1)  # each expert in use, per step
        return t + calibrated(rates, mode, "gemm", used * (expert_seconds(
            rates, dtype, lc.expert_flops, per_expert, b_e, mlp_shape(lc, rates)) + 8 * OP_OVERHEAD_S + dequant), used)
    return t + calibrated(rates, mode, "gemm", gemm_seconds(rates, dtype, lc.dense_flops, T, b_e))


def head_seconds(cost: ModelCost, rates: Rates, rows: int, mode: str = "resident") -> float:
    return calibrated(rates, mode, "head", gemm_seconds(rates, cost.dtype, cost.head_flops, rows, max(1, rows))
                      + 4 * OP_OVERHEAD_S + elementwise_seconds(rates, cost.dtype, cost.head_elem_bytes, rows))


def build_schedule(cost: ModelCost, rates: Rates, shape: StepShape, knobs: Knobs) -> Schedule:
    """The step's job DAG and its critical path (times from `rates`).

    With an arena (`knobs.streams`) fetches and KV loads are copy-lane jobs; a copy that
    cannot fully hide behind compute (`rates.copy_overlap` < 1: a CPU's copy thread shares
    its cores) also lengthens the compute job that consumes it by the share it steals
    (1 - copy_overlap of its length, more than its length when copy_overlap < 0); an expert
    fetch with prefetch 0 runs while compute waits for it and steals nothing."""
    dt = cost.dtype
    streams = knobs.streams
    mode = mode_of(streams)
    steal = 1.0 - rates.copy_overlap
    g = nx.DiGraph()
    jobs: dict[str, Job] = {}
    last = {"compute": None, "copy": None}

    def add(name: str, lane: str, seconds: float, kind: str, deps: list[str | None], layer: int | None = None,
            ) -> str:
        jobs[name] = Job(name, lane, max(0.0, seconds), kind, layer)
        g.add_node(name)
        for d in deps + [last[lane]]:
            if d is not None:
                g.add_edge(d, name)
        last[lane] = name
        return name

    moved: dict[str, float] = {}  # copy job -> its modelled length (bytes / rate): what it steals

    def copy_job(name: str, bytes_: float, kind: str, deps: list[str | None], layer: int | None,
                 share: float = 1.0) -> str:
        t = share * bytes_ / rates.copy_rate("h2d", bytes_) if bytes_ > 0 else 0.0
        moved[name] = t
        return add(name, "copy", calibrated(rates, mode, kind, t, share) if t > 0 else 0.0, kind, deps, layer)

    def cal(kind: str, seconds: float, jobs: float = 1.0) -> float:
        return calibrated(rates, mode, kind, seconds, jobs)

    def stolen(*copies: str | None) -> float:
        return steal * sum(moved[c] for c in copies if c is not None)

    S, T, c = shape.S, shape.T, shape.context
    M = max(1, math.ceil(S / max(1, knobs.b_a)))
    prev = add("stem", "compute", OP_OVERHEAD_S * 3, "stem", [])
    all_attn: list[str] = []  # attention jobs in order: KV buffers are double-buffered across them
    for lc in cost.layers:
        i = lc.layer
        wfetch = None
        if streams and not knobs.is_resident(str(residency_group("attn", i))):
            wfetch = copy_job(f"L{i}.fetch.attn", lc.attn_bytes, "fetch", [], i)
        attn_jobs = []
        for m in range(M):
            s_m, t_m = S / M, T / M
            kv = s_m * c * lc.kv_bytes_per_ctx
            load = None
            if streams:  # into the KV buffer the attention job two back used
                load = copy_job(f"L{i}.kv_load.{m}", kv, "kv_load", [all_attn[-2] if len(all_attn) >= 2 else None], i)
            t = attn_micro_seconds(lc, rates, dt, s_m, t_m, c, gather=not streams)
            a = add(f"L{i}.attn.{m}", "compute", cal("attention", t + stolen(load, wfetch if m == 0 else None)),
                    "attention", [prev, load, wfetch], i)
            attn_jobs.append(a)
            all_attn.append(a)
        prev = add(f"L{i}.router", "compute", router_seconds(lc, rates, dt, T, mode), "router", attn_jobs, i)
        if lc.moe:
            used = experts_in_use(lc, T)
            n_jobs = max(1, int(math.ceil(used - 1e-9)))
            per_expert = T * lc.top_k / max(used, 1e-9)  # tokens per expert in use
            computes: list[str] = []
            resident = knobs.is_resident(expert_group(i)) or not streams
            for e in range(n_jobs):
                share = min(1.0, used - e)  # the last job carries the fractional expert
                fetch = None
                if not resident:
                    back = e - knobs.prefetch - 1
                    fetch = copy_job(f"L{i}.fetch.e{e}", lc.expert_bytes, "fetch",
                                     [computes[back] if back >= 0 else prev], i, share)
                t = share * expert_seconds(rates, dt, lc.expert_flops, per_expert, knobs.b_e,
                                           mlp_shape(lc, rates)) + share * 8 * OP_OVERHEAD_S
                # prefetch 0: the fetch ran while compute waited for it (one slot), so it stole nothing
                steal_e = stolen(fetch) if knobs.prefetch > 0 else 0.0
                computes.append(add(f"L{i}.expert.{e}", "compute", cal("gemm", t + steal_e, share), "gemm",
                                    [prev, fetch], i))
            prev = computes[-1]
        else:
            dfetch = None
            if streams and not knobs.is_resident(str(residency_group("moe", i))):
                dfetch = copy_job(f"L{i}.fetch.dense", lc.dense_bytes, "fetch", [prev], i)
            prev = add(f"L{i}.mlp", "compute", cal("gemm", gemm_seconds(rates, dt, lc.dense_flops, T, knobs.b_e)
                                                     + stolen(dfetch)), "gemm", [prev, dfetch], i)
    hfetch = None
    if streams and not knobs.is_resident(str(residency_group("head", None))):
        hfetch = copy_job("head.fetch", cost.head_bytes, "fetch", [], None)
    add("head", "compute", head_seconds(cost, rates, shape.head_rows, mode) + cal("head", stolen(hfetch), 0.0),
        "head", [prev, hfetch])
    return _critical(g, jobs)


def _critical(g: nx.DiGraph, jobs: dict[str, Job]) -> Schedule:
    finish: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for name in nx.topological_sort(g):
        j = jobs[name]
        preds = list(g.predecessors(name))
        j.start = max((finish[p] for p in preds), default=0.0)
        via[name] = max(preds, key=lambda p: finish[p]) if preds else None
        finish[name] = j.end
    end = max(finish, key=finish.get)
    path = [end]
    while via[path[-1]] is not None:
        path.append(via[path[-1]])
    totals: dict[str, float] = {}
    for j in jobs.values():
        totals[j.lane] = totals.get(j.lane, 0.0) + j.seconds
    return Schedule(g, jobs, finish[end], path[::-1], totals)


#: A stored timeline keeps every job up to this many; past it, only the first
#: TIMELINE_LAYERS layers, the last layer, the stem and the head (a 61-layer, 256-expert
#: model has some 30 000 jobs per step).
TIMELINE_MAX_JOBS = 4000
TIMELINE_LAYERS = 4


def to_data(s: Schedule, max_jobs: int = TIMELINE_MAX_JOBS, keep: int = TIMELINE_LAYERS) -> dict[str, Any]:
    """The schedule as plain data for the plan (what `moecc explain --timeline` draws): the
    step's predicted seconds; each job in topological order as [name, lane, kind, layer,
    start, seconds]; its dependency edges as index pairs; the critical path as indices.
    Over `max_jobs` jobs only the first `keep` layers and the last are kept.
    Kept jobs keep their start times from the whole step, so the critical path's jobs (all
    kept when nothing is cut) add up to `step_s`."""
    layers = sorted({j.layer for j in s.jobs.values() if j.layer is not None})
    keep_layers = set(layers)
    if len(s.jobs) > max_jobs and layers:
        keep_layers = set(layers[:keep]) | {layers[-1]}
    names = [n for n in nx.topological_sort(s.dag) if s.jobs[n].layer is None or s.jobs[n].layer in keep_layers]
    index = {n: i for i, n in enumerate(names)}
    jobs = [[j.name, j.lane, j.kind, j.layer, j.start, j.seconds] for j in (s.jobs[n] for n in names)]
    edges = [[index[u], index[v]] for u, v in s.dag.edges if u in index and v in index]
    return {"step_s": s.seconds, "jobs": jobs, "edges": edges,
            "critical": [index[n] for n in s.critical_path if n in index],
            "layers": len(layers), "layers_kept": sorted(keep_layers), "lanes_s": dict(s.totals)}
