"""One engine step as a DAG of compute and copy jobs, and its critical path.

The jobs are what the runtime does for one step of a phase (prefill or decode):
  per layer: fetch the attention weights (unless resident); per attention micro-batch,
  load its KV (a copy-lane job with an arena; without one, a gather the compute thread
  does), run projections and attention, store the new K/V; then the router over all rows, and for
  each expert in use, fetch it (unless resident) and run it over its tokens in chunks of
  b_e; dense MLPs in chunks of b_e; finally the head over the rows that sample.
Attention placement (`Knobs.host_fraction`): the first share of the step's sequences attend
on the host over the KV pool in place (no KV load; only their queries and outputs cross the
link), in micro-batches on a host lane beside the device part, which runs as above; on a
CPU-only profile the host is the device, so those jobs are compute-lane jobs. Experts are
fetched once the router has chosen them (as the runtime streams them), except in a step
whose rows make every expert almost surely chosen (`speculates`: rows x top_k >= 4 x
experts): there the runtime fetches a layer's first `expert_slots` experts as soon as its
attention module has submitted its last device KV load (host attention: when the module
starts), so they overlap attention, host attention included.
Edges: data dependencies, program order on each lane (compute, copy, host), and slot
reuse: with prefetch depth p, the fetch of expert i waits for the compute of expert
i - p - 1 (p = 0: no overlap of fetch and compute); the first p + 1 wait for the router,
or when speculated only for the layer's attention module to start (the copy lane's order
puts them after its KV loads).
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
from moecc_runtime.contract.residency import expert_group, residency_group
from moecc_runtime.contract.speculation import SPECULATE_ROUTED_PER_EXPERT, speculates

from moecc.planner.costs import LayerCost, ModelCost

#: Fixed cost of one kernel launch / Python-level op in the runtime (seconds).
OP_OVERHEAD_S = 15e-6


class Rates(Protocol):
    """What the schedule needs from a hardware profile."""

    device_kind: str
    copy_overlap: float  # share of copy time that can hide behind compute
    host_bandwidth: float  # bytes read + written per second
    cpu_flops: dict[str, float]  # the host CPU's peak GEMM FLOP/s per dtype (bounds host attention)

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
    host_fraction: float = 0.0  # share of the step's sequences whose attention runs on the host (1: all)

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
    lane: str  # "compute" | "copy" | "host" (attention on the host CPU beside a real device)
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
            key = "host->device link" if j.lane == "copy" else "host attention" if j.lane == "host" else (
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


def p_expert_unused(rows: float, top_k: int, num_experts: int) -> float:
    """The chance that none of `rows` rows chooses a given expert (uniform routing)."""
    return (1.0 - top_k / num_experts) ** rows if num_experts > 0 else 1.0


def speculated_experts(lc: LayerCost, T: float, slots: int) -> float:
    """Experts of layer `lc` fetched before its router in a step of T rows with `slots`
    expert slots: min(slots, experts in use) when the runtime speculates, else 0."""
    if not lc.moe or not speculates(T, lc.top_k, lc.num_experts):
        return 0.0
    return min(float(slots), experts_in_use(lc, T))


def experts_in_use(lc: LayerCost, T: float) -> float:
    """Expected experts chosen by at least one of T tokens (uniform routing)."""
    if not lc.moe or T <= 0:
        return 0.0
    return lc.num_experts * (1.0 - (1.0 - lc.top_k / lc.num_experts) ** T)


def attention_core_seconds(lc: LayerCost, rates: Rates, dtype: str, s_m: float, t_m: float, c: float,
                           on_cpu: bool) -> float:
    """Scores and weighted values of one micro-batch (s_m sequences, t_m rows, mean context c):
    its KV bytes at the profiled attention rate of the device, or with `on_cpu` of the host;
    on a CPU also no faster than its FLOP peak (a prompt chunk's rows each attend to the
    context: O(n^2) work that reading the context once does not bound)."""
    kv = s_m * c * lc.kv_bytes_per_ctx
    if kv <= 0:
        return 0.0
    t = kv / rates.attention_rate(dtype, kv, on_cpu=on_cpu)
    flops = t_m * c * lc.attn_ctx_flops
    if on_cpu and flops > 0:
        t = max(t, flops / rates.cpu_flops.get(dtype, rates.cpu_flops["float32"]))
    return t


def attn_micro_seconds(lc: LayerCost, rates: Rates, dtype: str, s_m: float, t_m: float, c: float,
                       gather: bool = True) -> float:
    """Compute-thread time of one attention micro-batch on the device: projections at its
    row count, attention over its KV (attention_core_seconds), the store of its new K/V to
    the host pool, and (with `gather`, i.e. without an arena's copy engine) the gather of its KV."""
    kv = s_m * c * lc.kv_bytes_per_ctx
    store = t_m * lc.kv_bytes_per_ctx
    proj = gemm_seconds(rates, dtype, lc.attn_flops, t_m, max(1, int(math.ceil(t_m))))
    att = attention_core_seconds(lc, rates, dtype, s_m, t_m, c, on_cpu=rates.device_kind == "cpu")
    put = store / rates.copy_rate("d2h", store) if store > 0 else 0.0
    get = 0.0
    if gather and kv > 0:  # the compute thread's own copy: at host memory speed on a CPU
        rate = rates.host_bandwidth / 2 if rates.device_kind == "cpu" else rates.copy_rate("h2d", kv)
        get = kv / rate + OP_OVERHEAD_S
    glue = elementwise_seconds(rates, dtype, lc.attn_elem_bytes, t_m)
    return proj + att + put + get + glue + 12 * OP_OVERHEAD_S


#: Bytes per value of the queries that cross to host attention and of its outputs that come
#: back: the host kernel reads and writes fp32 (runtime/native/paged_attention.c).
HOST_ATTN_ELEM_BYTES = 4


def host_attn_micro_seconds(lc: LayerCost, rates: Rates, dtype: str, s_m: float, t_m: float, c: float) -> float:
    """Time of one attention micro-batch attending on the host over the KV pool in place: the
    device's projections and glue, the store of its new K/V to the pool, its queries crossing
    to the host and its outputs back (nothing crosses on a CPU-only profile: the host is the
    device), and the host's attention (attention_core_seconds on the CPU). No KV is copied."""
    store = t_m * lc.kv_bytes_per_ctx
    proj = gemm_seconds(rates, dtype, lc.attn_flops, t_m, max(1, int(math.ceil(t_m))))
    att = attention_core_seconds(lc, rates, dtype, s_m, t_m, c, on_cpu=True)
    put = store / rates.copy_rate("d2h", store) if store > 0 else 0.0
    cross = 0.0
    if rates.device_kind != "cpu" and t_m > 0:
        q, out = (t_m * w * HOST_ATTN_ELEM_BYTES for w in (lc.attn_q_width, lc.attn_out_width))
        cross = sum(b / rates.copy_rate(d, b) for b, d in ((q, "d2h"), (out, "h2d")) if b > 0) + 2 * OP_OVERHEAD_S
    glue = elementwise_seconds(rates, dtype, lc.attn_elem_bytes, t_m)
    return proj + att + put + cross + glue + 12 * OP_OVERHEAD_S


def split_shape(shape: StepShape, host_fraction: float) -> tuple[tuple[int, float], tuple[int, float]]:
    """((sequences, rows) on the host, (sequences, rows) on the device): the first
    round(host_fraction x S) sequences attend on the host, as the runtime cuts a step."""
    S_h = min(shape.S, max(0, round(host_fraction * shape.S)))
    T_h = shape.T * S_h / shape.S if shape.S else 0.0
    return (S_h, T_h), (shape.S - S_h, shape.T - T_h)


def micro_batches(seqs: int, b_a: int) -> int:
    """Micro-batches of at most b_a sequences over `seqs` sequences (0 for none)."""
    return math.ceil(seqs / max(1, b_a)) if seqs > 0 else 0


def attn_layer_parts(lc: LayerCost, rates: Rates, dtype: str, shape: StepShape, b_a: int, gather: bool = True,
                     host_fraction: float = 0.0) -> tuple[float, float]:
    """(host part, device part) of a layer's attention micro-batches, each calibrated, without
    the copies they steal from; host_fraction 0 (all on the device) keeps a device part of
    at least one micro-batch, as a step with no sequences would still launch one."""
    (S_h, T_h), (S_d, T_d) = split_shape(shape, host_fraction)
    dequant = elementwise_seconds(rates, dtype, lc.attn_dequant_bytes, 1)  # once per step, kept for its micro-batches
    mode = mode_of(not gather)
    host = dev = 0.0
    M_h = micro_batches(S_h, b_a)
    if M_h:
        host = calibrated(rates, mode, "attention",
                          M_h * host_attn_micro_seconds(lc, rates, dtype, S_h / M_h, T_h / M_h, shape.context)
                          + dequant, M_h)
    M_d = micro_batches(S_d, b_a) or (0 if M_h else 1)
    if M_d:
        dev = calibrated(rates, mode, "attention",
                         M_d * attn_micro_seconds(lc, rates, dtype, S_d / M_d, T_d / M_d, shape.context, gather)
                         + dequant, M_d)
    return host, dev


def attn_layer_seconds(lc: LayerCost, rates: Rates, dtype: str, shape: StepShape, b_a: int,
                       gather: bool = True, host_fraction: float = 0.0) -> float:
    """A layer's attention micro-batches (calibrated; without the copies they steal from): the
    host part after the device part, as the runtime runs a split (its host micro-batches'
    projections queue behind the device micro-batches, so the host attends once the device
    has drained them; on a CPU-only machine the host is the device)."""
    host, dev = attn_layer_parts(lc, rates, dtype, shape, b_a, gather, host_fraction)
    return host + dev


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


class _StepBuilder:
    """A step's DAG under construction: jobs on lanes in program order, and what each copy
    job moves at bytes / rate (what it steals from compute that cannot hide it)."""

    def __init__(self, rates: Rates, streams: bool):
        self.rates, self.mode = rates, mode_of(streams)
        self.steal = 1.0 - rates.copy_overlap
        self.g = nx.DiGraph()
        self.jobs: dict[str, Job] = {}
        self.last: dict[str, str | None] = {}
        self.moved: dict[str, float] = {}

    def add(self, name: str, lane: str, seconds: float, kind: str, deps: list[str | None],
            layer: int | None = None) -> str:
        """Job `name` after `deps` and after the last job on its lane."""
        self.jobs[name] = Job(name, lane, max(0.0, seconds), kind, layer)
        self.g.add_node(name)
        for d in deps + [self.last.get(lane)]:
            if d is not None:
                self.g.add_edge(d, name)
        self.last[lane] = name
        return name

    def copy_job(self, name: str, nbytes: float, kind: str, deps: list[str | None], layer: int | None,
                 share: float = 1.0) -> str:
        """A host-to-device copy of `share` x `nbytes` on the copy lane (calibrated)."""
        t = share * nbytes / self.rates.copy_rate("h2d", nbytes) if nbytes > 0 else 0.0
        self.moved[name] = t
        return self.add(name, "copy", self.cal(kind, t, share) if t > 0 else 0.0, kind, deps, layer)

    def cal(self, kind: str, seconds: float, jobs: float = 1.0) -> float:
        return calibrated(self.rates, self.mode, kind, seconds, jobs)

    def stolen(self, *copies: str | None) -> float:
        """Compute seconds the copies take from the job that consumes them."""
        return self.steal * sum(self.moved[c] for c in copies if c is not None)


def build_schedule(cost: ModelCost, rates: Rates, shape: StepShape, knobs: Knobs) -> Schedule:
    """The step's job DAG and its critical path (times from `rates`).

    With an arena (`knobs.streams`) fetches and KV loads are copy-lane jobs; a copy that
    cannot fully hide behind compute (`rates.copy_overlap` < 1: a CPU's copy thread shares
    its cores) also lengthens the compute job that consumes it by the share it steals
    (1 - copy_overlap of its length, more than its length when copy_overlap < 0); an expert
    fetch with prefetch 0 runs while compute waits for it and steals nothing. The sequences
    of `knobs.host_fraction` attend on the host (_attention_jobs): no KV load, the copy lane
    free for the weight fetches that need no routing, and for the layer's first experts
    where the runtime speculates on them (`speculates`, _ffn_jobs)."""
    b = _StepBuilder(rates, knobs.streams)
    prev = b.add("stem", "compute", OP_OVERHEAD_S * 3, "stem", [])
    kv_users: list[str] = []  # device attention jobs in order: KV buffers are double-buffered across them
    for lc in cost.layers:
        i = lc.layer
        wfetch = None
        if knobs.streams and not knobs.is_resident(str(residency_group("attn", i))):
            wfetch = b.copy_job(f"L{i}.fetch.attn", lc.attn_bytes, "fetch", [], i)
        attn = _attention_jobs(b, cost.dtype, lc, shape, knobs, [prev, wfetch], kv_users)
        start = prev  # the attention module starts after it: speculated expert fetches wait for it only
        prev = b.add(f"L{i}.router", "compute", router_seconds(lc, rates, cost.dtype, shape.T, b.mode), "router",
                     attn, i)
        prev = _ffn_jobs(b, cost.dtype, lc, shape.T, knobs, prev, start)
    hfetch = None
    if knobs.streams and not knobs.is_resident(str(residency_group("head", None))):
        hfetch = b.copy_job("head.fetch", cost.head_bytes, "fetch", [], None)
    b.add("head", "compute", head_seconds(cost, rates, shape.head_rows, b.mode) + b.cal("head", b.stolen(hfetch), 0.0),
          "head", [prev, hfetch])
    return _critical(b.g, b.jobs)


def _attention_jobs(b: _StepBuilder, dtype: str, lc: LayerCost, shape: StepShape, knobs: Knobs,
                    deps: list[str | None], kv_users: list[str]) -> list[str]:
    """A layer's attention micro-batches, each after `deps` (the previous layer, the attention
    weights' fetch): the device part's on the compute lane, with an arena each after its KV
    load (a copy into the buffer the attention job two back used); the host part's on the
    host lane ("compute" on a CPU-only machine, where the host is the device), copying no KV."""
    r, i, c = b.rates, lc.layer, shape.context
    wfetch = deps[1]
    (S_h, T_h), (S_d, T_d) = split_shape(shape, knobs.host_fraction)
    M_h = micro_batches(S_h, knobs.b_a)
    M_d = micro_batches(S_d, knobs.b_a) or (0 if M_h else 1)
    jobs: list[str] = []
    for m in range(M_d):
        s_m, t_m = S_d / M_d, T_d / M_d
        load = None
        if knobs.streams:
            load = b.copy_job(f"L{i}.kv_load.{m}", s_m * c * lc.kv_bytes_per_ctx, "kv_load",
                              [kv_users[-2] if len(kv_users) >= 2 else None], i)
        t = attn_micro_seconds(lc, r, dtype, s_m, t_m, c, gather=not knobs.streams)
        a = b.add(f"L{i}.attn.{m}", "compute", b.cal("attention", t + b.stolen(load, wfetch if m == 0 else None)),
                  "attention", [deps[0], load, wfetch], i)
        jobs.append(a)
        kv_users.append(a)
    lane = "compute" if r.device_kind == "cpu" else "host"
    # a split's host part starts after its device part: the runtime queues the host
    # micro-batches' projections behind the device micro-batches (no overlap is priced)
    after = deps + [jobs[-1]] if jobs else deps  # (host micro-batches follow each other on their lane)
    for m in range(M_h):
        t = host_attn_micro_seconds(lc, r, dtype, S_h / M_h, T_h / M_h, c)
        first = m == 0 and not M_d  # the job that waits for the attention weights' fetch
        jobs.append(b.add(f"L{i}.host_attn.{m}", lane, b.cal("attention", t + b.stolen(wfetch if first else None)),
                          "attention", after, i))
    return jobs


def _ffn_jobs(b: _StepBuilder, dtype: str, lc: LayerCost, T: float, knobs: Knobs, prev: str,
              start: str) -> str:
    """A layer's experts in use (each after its fetch, which waits for the router `prev` and
    for the slot the expert prefetch + 1 back frees) or its dense MLP; returns the last job.
    Where the runtime speculates (`speculates`), the first prefetch + 1 fetches wait not for
    the router but for `start`, what the layer's attention module starts after (every slot
    is free then), and on the copy lane for its KV loads; such a fetch overlaps compute, so
    it steals from it even with prefetch 0."""
    r, i = b.rates, lc.layer
    if not lc.moe:
        dfetch = None
        if knobs.streams and not knobs.is_resident(str(residency_group("moe", i))):
            dfetch = b.copy_job(f"L{i}.fetch.dense", lc.dense_bytes, "fetch", [prev], i)
        return b.add(f"L{i}.mlp", "compute", b.cal("gemm", gemm_seconds(r, dtype, lc.dense_flops, T, knobs.b_e)
                                                   + b.stolen(dfetch)), "gemm", [prev, dfetch], i)
    used = experts_in_use(lc, T)
    n_jobs = max(1, int(math.ceil(used - 1e-9)))
    per_expert = T * lc.top_k / max(used, 1e-9)  # tokens per expert in use
    computes: list[str] = []
    resident = knobs.is_resident(expert_group(i)) or not knobs.streams
    early = speculated_experts(lc, T, knobs.prefetch + 1) > 0  # the first slots' fetches precede routing
    for e in range(n_jobs):
        share = min(1.0, used - e)  # the last job carries the fractional expert
        fetch = None
        back = e - knobs.prefetch - 1
        speculated = early and back < 0 and not resident
        if not resident:
            fetch = b.copy_job(f"L{i}.fetch.e{e}", lc.expert_bytes, "fetch",
                               [computes[back] if back >= 0 else start if speculated else prev], i, share)
        t = share * expert_seconds(r, dtype, lc.expert_flops, per_expert, knobs.b_e, mlp_shape(lc, r)) \
            + share * 8 * OP_OVERHEAD_S
        # prefetch 0: the fetch ran while compute waited for it (one slot), so it stole nothing,
        # unless it was speculated (it ran beside attention)
        steal_e = b.stolen(fetch) if knobs.prefetch > 0 or speculated else 0.0
        computes.append(b.add(f"L{i}.expert.{e}", "compute", b.cal("gemm", t + steal_e, share), "gemm",
                              [prev, fetch], i))
    return computes[-1]


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
