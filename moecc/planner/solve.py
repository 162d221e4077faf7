"""The planner's integer program (OR-Tools CP-SAT), solved once per candidate batch B.

Formulation (all times in µs, memory in bytes; `x_*` one-hot choices, `r_g` residency):
  B               enumerated outside the program (as FlexGen does, to keep it linear);
                  candidates: powers of two up to min(--max-batch, what host memory holds)
  decode          x_a[(h, b_a)] (attention placement h, micro-batch b_a), x_e[b_e] (expert chunk)
  prefill         z[(b_a, b_e, h)] for each prompt-tokens-per-step tps (enumerated outside)
  placement       h: the share of a step's sequences whose attention runs on the host, over
                  the KV pool in place (1 host, 0 device, between: a split, the two parts
                  concurrent); offered: 1, 0.75, 0.5, 0.25, 0 (host or device only on a
                  CPU-only profile, whose "device" is the host), one value with --attention
  overlap         y[p] prefetch depth p in {0..3}; p + 1 expert slots on the device (only p = 0
                  when the profile says copies hide less than NO_OVERLAP behind compute)
  residency       r_g for g in L{i}.attn, L{i}.experts, L{i}.dense, head (1 = kept on device)
  per phase f and layer l:
    comp_fl = sum x . attention time(h, b_a) + sum x . expert/MLP time(b_e)  (measured rates,
                                                          calibrated on the runtime when profiled so;
                                                          attention: max of its host and device parts)
    copy_fl = sum_g (1 - r_g) . fetch time(g) + KV load time(h)              (0 on a CPU device
                                                                               without --gpu-mem;
                                                                               KV: the device part's)
    moved_fl = copy_fl at bytes / rate, before calibration (what a copy steals from compute)
    gate_fl = sum x . host part of attention(h, b_a): experts are fetched once the router
              has chosen them, and the router follows attention
    spec_fl[p] = the share of the layer's expert fetch the runtime speculates on: in a step
              of T rows with T . top_k >= 4 . experts (schedule.speculates) its first p + 1
              experts are fetched while attention runs, before routing; else 0
    t_fl >= comp_fl + (1 - copy_overlap) . moved_fl,  t_fl >= copy_fl,
    t_fl >= gate_fl + sum_g (1 - r_g) . fetch time(g) . (1 - spec_fl[p])   (if y[p])
    t_fl >= comp_fl + copy_fl - BIG . (1 - y[0])
              (with speculation: less the speculated fetch, plus what it steals: if y[0])
    T_f = sum_l t_fl + head_f (+ its fetch)
  device memory (each phase, when --gpu-mem is set): budget = (gpu_mem - device reserve) . 0.9,
    the reserve the process holds outside any plan (CUDA context, cuBLAS workspaces: the
    profile's device_reserve_bytes), the 0.9 derate the caching allocator's fragmentation:
    arena = sum_g r_g . bytes_g + (p + 1) . expert slot + 2 . dense slot
            (dense slot >= (1 - r_g) . bytes_g for every attention, dense and head group:
             sized for what really streams, not for a resident lm_head)
            + kv (two KV buffers: kv >= the chosen (h, b_a)'s of both phases; each buffer holds
              b_a sequences of the workload's length (a split: its device part's, at most
              b_a), and at least one of the model's context; none when h = 1)
            + staging (B + tps rows of hidden state and rope)
    arena + temporaries of the phase <= budget, the temporaries (what lives beside the arena):
      activations  rows . hidden . 6 . itemsize of an attention micro-batch + b_e . expert row
      attention    the device part's attention workspace (costs.ModelCost.attention_workspace:
                   math-SDPA scores of a micro-batch, a prompt chunk's K/V widened to every head)
      logits       head rows . vocab . (itemsize + 4) (the head's and the worker's fp32 copy)
      sampler      head rows . vocab . 4 . 2 (the sampler's fp32 temporaries)
      dequantize   the largest module's quantized weights materialised, with fp32 temporaries
    The arena is what the runtime allocates (plan["arena"]); temporaries live beside it.
  host memory (when --host-mem is set), with the host reserve kept out of it (host_memory.py):
    weights + B . blocks per sequence . block bytes + rows . host-buffer bytes per row <= budget
    (host buffers per row: one per slot that insert_host_buffers shares by liveness, not one
    per layer boundary; B candidates include the largest B host memory holds per prefill step)
  objective (per request): minimise output/B . T_decode + prompt/tps . T_prefill
    (prompt: the tokens a request computes, (1 - shared prefix share) of its prompt),
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

from moecc_runtime.contract.blocks import KV_BLOCK_SIZE, blocks_for
from moecc_runtime.contract.placement import ALIGN
from moecc_runtime.contract.residency import expert_group, residency_group

from moecc.planner.cost_model import Choice, CostModel, Workload
from moecc.planner.costs import ModelCost
from moecc.planner.host_memory import HostReserve, fits, host_bytes, host_reserve
from moecc.planner.schedule import Rates, StepShape, experts_in_use, speculated_experts, split_shape

DEVICE_DERATE = 0.9  # of what the caching allocator may hold: its fragmentation margin
KV_BLOCK = KV_BLOCK_SIZE
NO_OVERLAP = 0.1  # a profile whose copies hide less than this behind compute gets no prefetch
CPU_FRESH_MAP_BYTES = 32 * 2**20
US = 1e6  # time unit of the program: microseconds
STEAL_SCALE = 1000  # (1 - copy_overlap) as an integer share in thousandths
T_MAX = 10**9  # µs: bound on one step (1000 s) (keeps every product inside int64)
ATTENTION_CHOICES: tuple[str, ...] = ("auto", "host", "device")  # --attention


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
    # up to 16384: a prefill step of a model that streams most of its weights must hold enough
    # tokens to amortise one pass over them (DeepSeek-V2 on an A5000: ~18 s of link a pass)
    tps_options: tuple[int, ...] = (256, 1024, 2048, 4096, 8192, 16384)
    prefetch_options: tuple[int, ...] = (0, 1, 2, 3)
    b_a_options_max: int = 6  # how many powers of two below B to offer for b_a
    pareto: bool = True  # drop dominated options before solving (exact; off only to test that)
    attention: str = "auto"  # --attention: auto (placed by the program), host or device
    split_options: tuple[float, ...] = (0.75, 0.5, 0.25)  # host fractions of a split offered by auto
    host_fractions: dict[str, tuple[float, ...]] | None = None  # per phase, offered (overrides `attention`)
    shared_prefix: float = 0.0  # share of prompt tokens computed once (prefix sharing; cost_model.Workload)
    device_reserve_given: int | None = None  # replaces the profile's device_reserve_bytes (tests: 0)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, not {self.attention!r}")
        if not 0.0 <= self.shared_prefix < 1.0:
            raise ValueError(f"shared_prefix is a share of the prompt tokens in [0, 1), not {self.shared_prefix!r}")

    def offered_fractions(self, phase: str) -> tuple[float, ...]:
        """Host fractions offered for `phase`'s attention: `host_fractions` when set; else by
        --attention: host (1), device (0), or auto: both and the splits between, but no split
        on a CPU-only profile (its device is the host: the two parts would share its cores)."""
        if self.host_fractions is not None:
            return self.host_fractions[phase]
        if self.attention != "auto":
            return (1.0,) if self.attention == "host" else (0.0,)
        splits = () if self.rates.device_kind == "cpu" else self.split_options
        return (1.0, *splits, 0.0)

    @property
    def device_reserve(self) -> int:
        """Device bytes the process holds outside the plan (CUDA context, library workspaces):
        the given figure, else the profile's (0 for a profile without one)."""
        if self.device_reserve_given is not None:
            return int(self.device_reserve_given)
        return int(getattr(self.rates, "device_reserve_bytes", 0) or 0)

    @property
    def device_budget(self) -> int | None:
        """Device bytes the plan's arena and temporaries may take: (--gpu-mem - the device
        reserve) x DEVICE_DERATE (never below 0); None without --gpu-mem."""
        if self.gpu_mem is None:
            return None
        return max(0, int((self.gpu_mem - self.device_reserve) * DEVICE_DERATE))

    def gpu_mem_for(self, planned: int) -> int:
        """The --gpu-mem at which `planned` bytes of arena and temporaries fit (device_budget's inverse)."""
        return int(math.ceil(planned / DEVICE_DERATE)) + self.device_reserve

    def dense_slot_groups(self) -> dict[str, int]:
        """The residency groups a dense slot streams (attention, dense / shared MLPs, head) and
        their bytes as placed: a dense slot holds the largest of them not resident."""
        return {g: b for g, b in self.groups().items() if not g.endswith(".experts")}

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
        return Workload(self.prompt_tokens, self.output_tokens, self.shared_prefix)

    @property
    def prefill_tokens(self) -> float:
        """Prompt tokens a request computes in prefill (less its shared prefix)."""
        return self.workload.prefill_tokens

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

    def kv_buffer_seqs(self, S: int, host_fraction: float, b_a: int) -> int:
        """Sequences one device KV buffer holds for steps attending over S sequences: b_a when
        all attend on the device, a micro-batch of the device part (at most b_a) in a split,
        none when all attend on the host."""
        if host_fraction <= 0.0:
            return b_a
        device_seqs = split_shape(StepShape(S, S, 0.0, 0), host_fraction)[1][0]
        return min(b_a, device_seqs)

    def kv_buffer_tokens(self, seqs: int) -> int:
        """Positions one device KV buffer holds: `seqs` sequences of the workload's length (in
        whole blocks), and never less than one sequence of the model's full context; 0 for
        no sequences (attention on the host: no KV buffers)."""
        if seqs <= 0:
            return 0
        blocks = max(seqs * blocks_for(self.seq_len, KV_BLOCK), blocks_for(max(self.cost.max_context, 1), KV_BLOCK))
        return blocks * KV_BLOCK

    def kv_buffer_bytes(self, seqs: int) -> int:
        """Both KV buffers (K and V each) for `seqs` sequences, as the runtime carves them."""
        if seqs <= 0:
            return 0
        layer_pos = max((lc.kv_bytes_per_ctx for lc in self.cost.layers), default=0)
        return 2 * self.kv_buffer_tokens(seqs) * layer_pos + 4 * ALIGN

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
            pr.prefill_tokens / self.choice.prefill[0] * self.prefill_step_s
        return pr.output_tokens / t if t > 0 else 0.0


# -- the coefficient tables both the program and the enumeration use -----------------------

DecKey = tuple[float, int]  # decode attention: (host fraction, b_a)
PreKey = tuple[int, int, int, float]  # prefill: (tps, b_a, b_e, host fraction)


def dec_key(ch: Choice) -> DecKey:
    return (ch.attention[0], ch.b_a)


def pre_key(ch: Choice) -> PreKey:
    return (*ch.prefill, ch.attention[1])


@dataclass
class _Tables:
    B: int
    att: list[DecKey]  # decode attention options
    b_e: list[int]
    pre: list[PreKey]
    p: list[int]
    groups: dict[str, int]
    dec_attn: dict[DecKey, list[int]]  # ns per layer
    dec_gate: dict[DecKey, list[int]]  # the host part of attention: expert fetches wait for it (ns per layer)
    dec_ffn: dict[int, list[int]]  # b_e -> ns per layer
    pre_comp: dict[PreKey, list[int]]  # -> ns per layer
    pre_gate: dict[PreKey, list[int]]
    dec_head: int
    pre_head: dict[PreKey, int]
    dec_copy_fixed: dict[DecKey, list[int]]  # KV traffic per layer (ns)
    pre_copy_fixed: dict[PreKey, list[int]]
    fetch_ns: dict[str, dict[str, int]]  # phase -> group -> ns when not resident (per step)
    # the same copies at their modelled length (bytes / rate), before calibration: what a copy
    # steals from compute goes with the bytes it moves, not with its waits
    dec_steal_fixed: dict[DecKey, list[int]]
    pre_steal_fixed: dict[PreKey, list[int]]
    steal_fetch_ns: dict[str, dict[str, int]]
    # (phase, rows, prefetch depth) -> group -> (ns, ns at bytes / rate) of its fetch that the
    # runtime speculates on (before routing, beside attention); only groups with some
    spec_ns: dict[tuple[str, int, int], dict[str, tuple[int, int]]]
    dev_fixed: int  # two dense slots when nothing is resident (the largest group streams)
    dense_groups: dict[str, int]  # groups a dense slot streams -> bytes (the slot: the largest not resident)
    dev_dec_head: dict[str, int]  # "logits", "sampler": of B rows, the most a step samples (either phase)
    dev_dequant: int  # the largest module's dequantize (either phase)
    dev_att_ws: dict[DecKey, int]  # the attention workspace part of dev_att
    dev_pre_ws: dict[PreKey, int]  # the attention workspace part of dev_pre
    dev_att: dict[DecKey, int]  # decode temporaries of an attention micro-batch (with its attention workspace)
    dev_b_e: dict[int, int]  # decode temporaries of an expert chunk
    dev_pre: dict[PreKey, int]  # prefill temporaries (activations, attention workspace, logits, sampler)
    dev_p: dict[int, int]  # expert slots
    dev_kv_dec: dict[DecKey, int]  # KV buffers for a decode option
    dev_kv_pre: dict[PreKey, int]  # KV buffers for a prefill option
    dev_stage: dict[PreKey, int]  # staging for B + tps rows
    host_bytes: dict[str, int]  # at the smallest prefill step offered (every offered one fits)
    steal: int  # (1 - copy_overlap) x STEAL_SCALE: compute time a copy-second costs
    w_dec: float  # decode steps per request
    w_pre: dict[PreKey, float]  # prefill steps per request
    room: int | None = None  # device bytes residency can take at most (None: no device budget)
    by_layer: dict[int, list[str]] = field(default_factory=dict)  # a layer's residency groups (cached)


def _tables(pr: Problem, B: int) -> _Tables:
    """The program's coefficients at batch B: times in ns from the cost model at the
    workload's step shapes, bytes; dominated options dropped when `pr.pareto`."""
    b_a, b_e, pre_tps, p = _options(pr, B)
    att = [(h, a) for h in pr.offered_fractions("decode") for a in b_a]
    pre = [(t, a, e, h) for t in pre_tps for a in prefill_b_a(pr, B, t) for e in b_e
           for h in pr.offered_fractions("prefill")]
    times = _times(pr, B, att, b_e, pre, max(pre_tps))
    times["spec_ns"] = _speculated_times(pr, times["fetch_ns"], times["steal_fetch_ns"],
                                         [("decode", B)] + [("prefill", t) for t in pre_tps], p)
    mem = _memory(pr, B, att, b_e, pre, p)
    if pr.pareto:  # drop dominated options (no faster in any layer and no smaller): they can never be optimal
        att, b_e, pre = _prune(pre_tps, att, b_e, pre, times, mem)
    host = host_bytes(pr.cost, pr.seq_len, B, min(pre_tps))
    room = None
    if pr.gpu_mem is not None:  # what residency may take at most: the budget less one expert slot and the
        # least of the temporaries (dense slots may be empty when every dense group is resident)
        room = pr.device_budget - min(mem["dev_p"].values()) - mem["dev_dequant"] - sum(mem["dev_dec_head"].values())
    return _Tables(B=B, att=att, b_e=b_e, pre=pre, p=p, groups=pr.groups(), **times, **mem, host_bytes=host,
                   steal=int(round((1.0 - pr.rates.copy_overlap) * STEAL_SCALE)), w_dec=pr.output_tokens / B,
                   w_pre={k: pr.prefill_tokens / k[0] for k in pre}, room=room)


def tps_offered(pr: Problem, B: int) -> list[int]:
    """Prompt tokens per prefill step offered at batch B (before the host budget)."""
    pre_tps = sorted({min(t, max(1, int(B * pr.prefill_tokens))) for t in pr.tps_options})
    if pr.rates.device_kind == "cpu":  # host tensors above glibc's 32 MiB mmap threshold are mapped
        # fresh on every allocation (page faults on first touch: measured 25% slower steps)
        fit = [t for t in pre_tps if t * pr.cost.hidden * 4 < CPU_FRESH_MAP_BYTES]
        pre_tps = fit or pre_tps[:1]
    return pre_tps


def prefill_b_a(pr: Problem, B: int, tps: int) -> list[int]:
    """Prefill micro-batch sizes offered for steps of `tps` prompt tokens at batch B: powers of
    two below the step's own sequences (not B's: a step of 32 prompts needs micro-batches of a
    few of them, whose activations a large step's device budget can hold), at most B."""
    seqs = min(B, pr.workload.prefill_shape(tps).S)
    return sorted({max(1, seqs >> i) for i in range(pr.b_a_options_max)})


def _options(pr: Problem, B: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The values offered at batch B: decode b_a, b_e, prompt tokens per prefill step, prefetch depth."""
    r = pr.rates
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


def _times(pr: Problem, B: int, att: list[DecKey], b_e: list[int], pre: list[PreKey],
           max_tps: int) -> dict[str, Any]:
    """The time fields of `_Tables` (ns), each from the cost model."""
    cm, wl = pr.cost_model(), pr.workload
    dec = wl.decode_shape(B)
    parts = {k: cm.attention_parts(dec, k[1], k[0]) for k in att}
    out: dict[str, Any] = {
        "dec_attn": {k: [_ns(t) for t in parts[k][0]] for k in att},
        "dec_gate": {k: [_ns(t) for t in parts[k][1]] for k in att},
        "dec_ffn": {e: [_ns(t) for t in cm.ffn_s(B, e)] for e in b_e},
        "dec_head": _ns(cm.head_s(B)), "dec_copy_fixed": {}, "dec_steal_fixed": {}}
    for h in {k[0] for k in att}:
        copy, moved = cm.kv_load_s(dec, h)
        for k in att:
            if k[0] == h:
                out["dec_copy_fixed"][k], out["dec_steal_fixed"][k] = [_ns(x) for x in copy], [_ns(x) for x in moved]
    out.update(_prefill_times(cm, wl, pre))
    out["fetch_ns"], out["steal_fetch_ns"] = _fetch_times(pr, cm, {"decode": B, "prefill": max_tps})
    return out


def _prefill_times(cm: CostModel, wl: Workload, pre: list[PreKey]) -> dict[str, dict[PreKey, Any]]:
    """The prefill time fields of `_Tables` (ns); attention, KV loads and the expert chunks
    each computed once per distinct shape they depend on."""
    att: dict[tuple[int, int, float], tuple[list[float], list[float]]] = {}
    ffn: dict[tuple[int, int], list[float]] = {}
    kv: dict[tuple[int, float], tuple[list[float], list[float]]] = {}
    out: dict[str, dict[PreKey, Any]] = {k: {} for k in ("pre_comp", "pre_gate", "pre_head", "pre_copy_fixed",
                                                         "pre_steal_fixed")}
    for k in pre:
        t, a, e, h = k
        sh = wl.prefill_shape(t)
        if (t, a, h) not in att:
            att[(t, a, h)] = cm.attention_parts(sh, a, h)
        if (t, e) not in ffn:
            ffn[(t, e)] = cm.ffn_s(t, e)
        if (t, h) not in kv:
            kv[(t, h)] = cm.kv_load_s(sh, h)
        attn, gate = att[(t, a, h)]
        out["pre_comp"][k] = [_ns(x + y) for x, y in zip(attn, ffn[(t, e)])]
        out["pre_gate"][k] = [_ns(x) for x in gate]
        out["pre_head"][k] = _ns(cm.head_s(sh.head_rows))
        out["pre_copy_fixed"][k] = [_ns(x) for x in kv[(t, h)][0]]
        out["pre_steal_fixed"][k] = [_ns(x) for x in kv[(t, h)][1]]
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


SpecTimes = dict[tuple[str, int, int], dict[str, tuple[int, int]]]  # (phase, rows, p) -> group -> (ns, raw ns)


def _speculated_times(pr: Problem, fetch: dict[str, dict[str, int]], moved: dict[str, dict[str, int]],
                      steps: list[tuple[str, int]], p: list[int]) -> SpecTimes:
    """Per (phase, rows of its step, prefetch depth): each expert group's part of its fetch
    (calibrated, and at bytes / rate) that the runtime speculates on, fetched beside attention
    before routing (schedule.speculated_experts: min(p + 1, experts in use) of them, when the
    step's rows make every expert almost surely chosen). Groups without any are left out."""
    out: SpecTimes = {}
    groups = pr.groups()
    for (phase, rows), q in itertools.product(steps, p):
        got = out[(phase, rows, q)] = {}
        for lc in pr.cost.layers:
            g = expert_group(lc.layer)
            n = speculated_experts(lc, rows, q + 1) if g in groups else 0.0
            if n > 0:
                share = n / experts_in_use(lc, rows)
                got[g] = (int(round(fetch[phase][g] * share)), int(round(moved[phase][g] * share)))
    return out


def _memory(pr: Problem, B: int, att: list[DecKey], b_e: list[int], pre: list[PreKey],
            p: list[int]) -> dict[str, Any]:
    """The device-memory fields of `_Tables` (bytes)."""
    c, it = pr.cost, pr.cost.itemsize
    wl = pr.workload

    def kv_pre(k: PreKey) -> int:
        return pr.kv_buffer_bytes(pr.kv_buffer_seqs(wl.prefill_shape(k[0]).S, k[3], k[1]))

    ws_dec = {k: _decode_workspace(pr, B, k) for k in att}
    ws_pre = {k: _prefill_workspace(pr, k) for k in pre}
    dense = pr.dense_slot_groups()
    return {
        "dev_fixed": 2 * max(dense.values(), default=0) if pr.copies else 0,
        "dense_groups": dense,
        "dev_dec_head": {"logits": c.logits_bytes(B), "sampler": c.sampler_bytes(B)},
        "dev_dequant": c.dequant_device_bytes,
        "dev_att_ws": ws_dec, "dev_pre_ws": ws_pre,
        "dev_att": {k: k[1] * c.hidden * 6 * it + ws_dec[k] for k in att},
        "dev_b_e": {e: e * c.act_bytes_per_token for e in b_e},
        "dev_pre": {k: min(k[0], k[1] * max(1, int(pr.prefill_tokens))) * c.hidden * 6 * it
                    + k[2] * c.act_bytes_per_token + ws_pre[k] for k in pre},
        "dev_p": {q: (q + 1) * c.expert_slot_bytes for q in p},
        "dev_kv_dec": {k: pr.kv_buffer_bytes(pr.kv_buffer_seqs(B, k[0], k[1])) for k in att},
        "dev_kv_pre": {k: kv_pre(k) for k in pre},
        "dev_stage": {k: pr.stage_bytes(B, k[0]) for k in pre},
    }


def _decode_workspace(pr: Problem, B: int, k: DecKey) -> int:
    """Attention workspace of a decode micro-batch's device part: its sequences at the
    workload's full length (0 when attention is all on the host)."""
    seqs = pr.kv_buffer_seqs(B, k[0], k[1])
    return pr.cost.attention_workspace(seqs, 1, pr.seq_len, prompt_chunk=False) if seqs > 0 else 0


def _prefill_workspace(pr: Problem, k: PreKey) -> int:
    """Attention workspace of a prefill step's device part: a prompt chunk (one sequence at a
    time, at most the prompt's tokens, over the whole prompt), or decode rows of a mixed step
    in a micro-batch of b_a sequences, whichever is larger (0 when all on the host)."""
    tps, b_a, _, h = k
    seqs = pr.kv_buffer_seqs(pr.workload.prefill_shape(tps).S, h, b_a)
    if seqs <= 0:
        return 0
    prompt = int(math.ceil(pr.prompt_tokens))
    chunk = min(tps, int(math.ceil(pr.prefill_tokens)))
    return max(pr.cost.attention_workspace(1, chunk, prompt, prompt_chunk=True),
               pr.cost.attention_workspace(b_a, 1, pr.seq_len, prompt_chunk=False))


def _prune(pre_tps: list[int], att: list[DecKey], b_e: list[int], pre: list[PreKey], times: dict[str, Any],
           mem: dict[str, Any]) -> tuple[list[DecKey], list[int], list[PreKey]]:
    """The options no other option dominates: in every layer's compute, host part (gate) and
    KV copy times (with what they steal), and in each memory component (KV buffers, the
    phase's own temporaries)."""
    def dec_times(k: DecKey) -> list[int]:
        return times["dec_attn"][k] + times["dec_gate"][k] + times["dec_copy_fixed"][k] + times["dec_steal_fixed"][k]

    def pre_times(k: PreKey) -> list[int]:
        return (times["pre_comp"][k] + [times["pre_head"][k]] + times["pre_gate"][k] + times["pre_copy_fixed"][k]
                + times["pre_steal_fixed"][k])

    att = _pareto(att, dec_times, lambda k: (mem["dev_kv_dec"][k], mem["dev_att"][k]))
    b_e = _pareto(b_e, lambda e: times["dec_ffn"][e], lambda e: (mem["dev_b_e"][e],))
    def pre_mem(k: PreKey) -> tuple[int, int]:
        return mem["dev_kv_pre"][k], mem["dev_pre"][k] + mem["dev_stage"][k]

    pre = [k for t in pre_tps for k in _pareto([k for k in pre if k[0] == t], pre_times, pre_mem)]
    return att, b_e, pre


def _pareto(options: list, times, mem) -> list:
    """Options not dominated by another (all layer times <= and every memory component <=,
    one strictly). Memory is a tuple of components that meet different constraints (KV
    buffers, shared by both phases through a max, and the phase's own temporaries), so
    only an option no larger in each can stand in for another."""
    def le(a: tuple, b: tuple) -> bool:
        return all(x <= y for x, y in zip(a, b))

    priced = [(times(o), mem(o)) for o in options]
    keep = []
    for j, (to, mo) in enumerate(priced):
        dominated = False
        for q, (tq, mq) in enumerate(priced):
            if q != j and le(mq, mo) and le(tq, to) and (mq != mo or tq != to or q < j):
                dominated = True
                break
        if not dominated:
            keep.append(options[j])
    return keep


def _signature(lc) -> tuple:
    return tuple(v for k, v in vars(lc).items() if k != "layer")


def _lower_bound(tb: _Tables, pre: list[PreKey]) -> float:
    """Seconds per request that no choice of residency, slots or sizes can beat: each layer
    no faster than its compute, KV copies or host attention alone, and a step's copies no
    shorter than its KV loads plus the fetches of what the device budget cannot keep."""
    L = len(tb.dec_ffn[tb.b_e[0]])
    dec = min(sum(max(tb.dec_attn[k][i] + tb.dec_ffn[e][i], tb.dec_copy_fixed[k][i], tb.dec_gate[k][i])
                  for i in range(L)) for k in tb.att for e in tb.b_e)
    dec = max(dec, min(sum(tb.dec_copy_fixed[k]) for k in tb.att) + _fetch_floor(tb, "decode")) + tb.dec_head
    pre_t = min(sum(max(tb.pre_comp[k][i], tb.pre_copy_fixed[k][i], tb.pre_gate[k][i]) for i in range(L))
                + tb.pre_head[k] for k in pre)
    pre_t = max(pre_t, min(sum(tb.pre_copy_fixed[k]) + tb.pre_head[k] for k in pre) + _fetch_floor(tb, "prefill"))
    return (tb.w_dec * dec + tb.w_pre[pre[0]] * pre_t) / US


def _fetch_floor(tb: _Tables, phase: str) -> int:
    """The least a step's weight fetches can take (ns): every group's fetch but what the
    device room can hold, kept in order of fetch time saved per byte (fractional knapsack)."""
    if tb.room is None:
        return 0
    total = sum(tb.fetch_ns[phase].values())
    room, saved = max(0, tb.room), 0.0
    for g in sorted(tb.groups, key=lambda g: -tb.fetch_ns[phase][g] / max(1, tb.groups[g])):
        take = min(room, tb.groups[g])
        saved += tb.fetch_ns[phase][g] * take / max(1, tb.groups[g])
        room -= take
        if room <= 0:
            break
    return int(max(0.0, total - saved))


def _layer_groups(tb: _Tables, layer: int) -> list[str]:
    if layer not in tb.by_layer:
        tb.by_layer[layer] = [g for g in tb.groups if g.startswith(f"L{layer}.")]
    return tb.by_layer[layer]


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


def _cp_sat(pr: Problem, tb: _Tables, pre: list[PreKey], time_limit_s: float) -> Solution | None:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    xa = {k: m.NewBoolVar(f"dec_attention={k}") for k in tb.att}
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
    phase_T = {}
    for phase in ("decode", "prefill"):
        ts = [_layer_time(m, tb, phase, i, (xa, xe, z, y, rg), pre) for i in range(len(layers))]
        head = tb.dec_head if phase == "decode" else sum(z[k] * tb.pre_head[k] for k in pre)
        if "head" in rg:
            head = head + (1 - rg["head"]) * tb.fetch_ns[phase]["head"]
        T = m.NewIntVar(0, T_MAX, f"T_{phase}")
        m.Add(T == sum(ts) + head)
        phase_T[phase] = T
    if pr.gpu_mem is not None:
        _device_budget(m, tb, pr.device_budget, (xa, xe, z, y, rg), pre)
    # integer weights in proportion to the steps per request (largest 10^4: keeps CP-SAT's
    # arithmetic far from int64 limits; relative rounding <= 1e-4)
    scale = 1e4 / max(tb.w_dec, tb.w_pre[pre[0]])
    m.Minimize(max(1, round(tb.w_dec * scale)) * phase_T["decode"]
               + max(1, round(tb.w_pre[pre[0]] * scale)) * phase_T["prefill"])
    solver = cp_model.CpSolver()
    # one search worker, stopped by CP-SAT's deterministic time (work done, not wall-clock), so
    # one input gives one plan however loaded the machine is; the wall clock only as a backstop
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = 20 * time_limit_s
    solver.parameters.relative_gap_limit = 1e-4  # optimal to 0.01%: far below the model's own error
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    pick = lambda d: next(k for k, v in d.items() if solver.Value(v))  # noqa: E731
    (h_dec, b_a), (tps, pa, pe, h_pre) = pick(xa), pick(z)
    choice = Choice(tb.B, b_a, pick(xe), (tps, pa, pe), pick(y),
                    frozenset(g for g, v in rg.items() if solver.Value(v)), (h_dec, h_pre))
    sol = _describe(pr, tb, choice)
    sol.status = "optimal" if status == cp_model.OPTIMAL else "feasible (time limit)"
    return sol


def _layer_time(m: Any, tb: _Tables, phase: str, i: int, v: tuple[dict, ...], pre: list[PreKey]) -> Any:
    """Layer i's time variable in `phase` under its constraints (the formulation above); `v`:
    the one-hot decode attention and b_e, prefill, prefetch and residency variables."""
    xa, xe, z, y, rg = v
    if phase == "decode":
        comp = sum(xa[k] * tb.dec_attn[k][i] for k in tb.att) + sum(xe[e] * tb.dec_ffn[e][i] for e in tb.b_e)
        fixed = sum(xa[k] * tb.dec_copy_fixed[k][i] for k in tb.att)
        fixed_steal = sum(xa[k] * tb.dec_steal_fixed[k][i] for k in tb.att)
        gate = sum(xa[k] * tb.dec_gate[k][i] for k in tb.att)
    else:
        comp = sum(z[k] * tb.pre_comp[k][i] for k in pre)
        fixed = sum(z[k] * tb.pre_copy_fixed[k][i] for k in pre)
        fixed_steal = sum(z[k] * tb.pre_steal_fixed[k][i] for k in pre)
        gate = sum(z[k] * tb.pre_gate[k][i] for k in pre)
    groups, routed = _layer_groups(tb, i), _routed_groups(tb, i)
    rows = _rows(tb, phase, pre)
    copy = fixed + sum((1 - rg[g]) * tb.fetch_ns[phase][g] for g in groups)
    moved = fixed_steal + sum((1 - rg[g]) * tb.steal_fetch_ns[phase][g] for g in groups)
    spec = {q: _speculated(tb, phase, rows, q, routed) for q in tb.p}
    t = m.NewIntVar(0, T_MAX, f"t_{phase}_{i}")
    m.Add(STEAL_SCALE * t >= STEAL_SCALE * comp + tb.steal * moved)  # copies steal compute
    m.Add(t >= copy)
    # host attention, then the router, then the fetches of what it chose (but those the
    # runtime speculated on, beside attention: the first p + 1 experts, with y[p])
    if not any(spec.values()):
        m.Add(t >= gate + sum((1 - rg[g]) * tb.fetch_ns[phase][g] for g in routed))
    else:
        for q in tb.p:
            m.Add(t >= gate + sum((1 - rg[g]) * (tb.fetch_ns[phase][g] - spec[q].get(g, (0, 0))[0])
                                  for g in routed)).OnlyEnforceIf(y[q])
    if 0 in y and not spec[0]:  # no prefetch: a layer's fetches and compute do not overlap
        m.Add(t >= comp + copy - T_MAX * (1 - y[0]))
    elif 0 in y:  # ... but the speculated fetch, which runs beside attention and steals from it
        m.Add(STEAL_SCALE * t >= STEAL_SCALE * (comp + copy - sum((1 - rg[g]) * s for g, (s, _) in spec[0].items()))
              + tb.steal * sum((1 - rg[g]) * r for g, (_, r) in spec[0].items())).OnlyEnforceIf(y[0])
    return t


def _rows(tb: _Tables, phase: str, pre: list[PreKey]) -> int:
    """The rows of a step of `phase` in one CP-SAT program (decode: B; prefill: its one tps)."""
    if phase == "decode":
        return tb.B
    tps = {k[0] for k in pre}
    assert len(tps) == 1, "one CP-SAT program per prompt tokens per step"
    return tps.pop()


def _speculated(tb: _Tables, phase: str, rows: int, q: int, groups: list[str]) -> dict[str, tuple[int, int]]:
    """Of `groups`, those the runtime speculates on at prefetch depth q, with their speculated
    fetch (ns, ns at bytes / rate)."""
    spec = tb.spec_ns.get((phase, rows, q), {})
    return {g: spec[g] for g in groups if g in spec}


def _device_budget(m: Any, tb: _Tables, budget: int, v: tuple[dict, ...], pre: list[PreKey]) -> None:
    """The arena and each phase's temporaries within the device budget."""
    xa, xe, z, y, rg = v
    res = sum(rg[g] * b for g, b in tb.groups.items())
    slots = sum(y[q] * tb.dev_p[q] for q in tb.p)
    kv = m.NewIntVar(0, budget, "kv_buffers")  # one arena for both phases: the larger KV buffers
    m.Add(kv >= sum(xa[k] * tb.dev_kv_dec[k] for k in tb.att))
    m.Add(kv >= sum(z[k] * tb.dev_kv_pre[k] for k in pre))
    dense = _dense_slot_var(m, tb, rg)
    fixed = sum(tb.dev_dec_head.values()) + tb.dev_dequant  # logits, sampler, dequantize: both phases
    arena = res + slots + 2 * dense + kv + sum(z[k] * tb.dev_stage[k] for k in pre)
    m.Add(arena + fixed + sum(xa[k] * tb.dev_att[k] for k in tb.att) + sum(xe[e] * tb.dev_b_e[e] for e in tb.b_e)
          <= budget)
    m.Add(arena + fixed + sum(z[k] * tb.dev_pre[k] for k in pre) <= budget)


def _dense_slot_var(m: Any, tb: _Tables, rg: dict) -> Any:
    """One dense slot's bytes as a linear term: a one-hot choice among the distinct group sizes
    (and 0), every dense group larger than the chosen size resident. (Few booleans and a tight
    relaxation: a max over every group's (1 - r_g) . bytes made CP-SAT's search on a 61-layer
    model hit its time limit.)"""
    sizes = sorted(set(tb.dense_groups.values()) | {0})
    pick = {z: m.NewBoolVar(f"dense_slot={z}") for z in sizes}
    m.AddExactlyOne(pick.values())
    for g, b in tb.dense_groups.items():
        m.AddBoolOr([rg[g]] + [pick[z] for z in sizes if z >= b])
    return sum(z * v for z, v in pick.items())


def _routed_groups(tb: _Tables, layer: int) -> list[str]:
    """Layer `layer`'s groups fetched once its router has run: its experts (but those the
    runtime speculates on, `_Tables.spec_ns`; a dense layer: its MLP, fetched after the
    router job the schedule gives every layer)."""
    experts = f"L{layer}.experts"
    if experts in tb.groups:
        return [experts]
    return [g for g in (f"L{layer}.dense",) if g in tb.groups]


def _evaluate(pr: Problem, tb: _Tables, ch: Choice) -> tuple[float, int, int, list[str]] | None:
    """The linear model's (objective, T_decode, T_prefill, binding terms) for a choice, or
    None when it breaks a memory budget."""
    dev = _device_bytes(pr, tb, ch)
    if pr.gpu_mem is not None and max(dev["decode_total"], dev["prefill_total"]) > pr.device_budget:
        return None
    binding: list[str] = []
    Ts = {}
    for phase in ("decode", "prefill"):
        total = 0
        for i in range(len(pr.cost.layers)):
            t, why = _layer_value(tb, ch, phase, i)
            if phase == "decode":
                binding.append(f"L{i} decode: {why}")
            total += t
        head = tb.dec_head if phase == "decode" else tb.pre_head[pre_key(ch)]
        if "head" in tb.groups and "head" not in ch.resident:
            head += tb.fetch_ns[phase]["head"]
        Ts[phase] = total + head
    obj = (tb.w_dec * Ts["decode"] + tb.w_pre[pre_key(ch)] * Ts["prefill"]) / US
    return obj, Ts["decode"], Ts["prefill"], binding


def _layer_value(tb: _Tables, ch: Choice, phase: str, i: int) -> tuple[float, str]:
    """Layer i's time in `phase` under choice `ch` (the linear model) and what binds it."""
    if phase == "decode":
        k = dec_key(ch)
        comp = tb.dec_attn[k][i] + tb.dec_ffn[ch.b_e][i]
        copy, moved, gate = tb.dec_copy_fixed[k][i], tb.dec_steal_fixed[k][i], tb.dec_gate[k][i]
    else:
        k = pre_key(ch)
        comp = tb.pre_comp[k][i]
        copy, moved, gate = tb.pre_copy_fixed[k][i], tb.pre_steal_fixed[k][i], tb.pre_gate[k][i]
    fetched = [g for g in _layer_groups(tb, i) if g not in ch.resident]
    routed = [g for g in _routed_groups(tb, i) if g not in ch.resident]
    rows = tb.B if phase == "decode" else ch.prefill[0]
    spec = _speculated(tb, phase, rows, ch.prefetch, routed)
    copy += sum(tb.fetch_ns[phase][g] for g in fetched)
    moved += sum(tb.steal_fetch_ns[phase][g] for g in fetched)
    gated = gate + sum(tb.fetch_ns[phase][g] - spec.get(g, (0, 0))[0] for g in routed)
    stolen = comp + tb.steal * moved / STEAL_SCALE
    if ch.prefetch == 0:
        if not spec:
            return comp + copy, "compute+copy (no prefetch)" if copy else "compute"
        ahead, ahead_moved = sum(s for s, _ in spec.values()), sum(r for _, r in spec.values())
        serial = comp + copy - ahead + tb.steal * ahead_moved / STEAL_SCALE
        t = max(serial, stolen, copy, gated)
        return t, "compute+copy (no prefetch)" if t == serial else "copy" if t == copy else "compute"
    t = max(stolen, copy, gated)
    if gated > max(stolen, copy):
        return t, "host attention, then expert fetch"
    return t, "copy" if copy > comp else "compute"


def dense_slot_bytes(groups: dict[str, int], resident: frozenset[str]) -> int:
    """One dense slot: the largest of `groups` (Problem.dense_slot_groups) that streams, i.e.
    is not `resident` (0: all resident)."""
    return max((b for g, b in groups.items() if g not in resident), default=0)


def _dense_slot(tb: _Tables, ch: Choice) -> int:
    return dense_slot_bytes(tb.dense_groups, ch.resident)


def _device_bytes(pr: Problem, tb: _Tables, ch: Choice) -> dict[str, int]:
    """The plan's device bytes by allocation: the arena's regions, each phase's temporaries
    by kind (activations, attention workspace, logits, sampler, dequantize) and totals (the
    arena and a phase's temporaries: what device_budget bounds)."""
    dk, pk = dec_key(ch), pre_key(ch)
    head = tb.dev_dec_head
    parts = {"decode_activations": tb.dev_att[dk] - tb.dev_att_ws[dk] + tb.dev_b_e[ch.b_e],
             "decode_attention_workspace": tb.dev_att_ws[dk],
             "prefill_activations": tb.dev_pre[pk] - tb.dev_pre_ws[pk],
             "prefill_attention_workspace": tb.dev_pre_ws[pk],
             "logits": head["logits"], "sampler": head["sampler"], "dequantize": tb.dev_dequant}
    fixed = head["logits"] + head["sampler"] + tb.dev_dequant
    dec_tmp, pre_tmp = tb.dev_att[dk] + tb.dev_b_e[ch.b_e] + fixed, tb.dev_pre[pk] + fixed
    if not pr.copies:  # no budget: no arena, weights are read in place
        return {"resident_weights": 0, "expert_slots": 0, "dense_slots": 0, "kv_buffers": 0, "staging": 0,
                "arena": 0, **parts, "decode_temporaries": dec_tmp, "prefill_temporaries": pre_tmp,
                "decode_total": 0, "prefill_total": 0, "device_reserve": 0}
    res = sum(b for g, b in tb.groups.items() if g in ch.resident)
    kv = max(tb.dev_kv_dec[dk], tb.dev_kv_pre[pk])
    dense = 2 * _dense_slot(tb, ch)
    arena = res + tb.dev_p[ch.prefetch] + dense + kv + tb.dev_stage[pk]
    return {"resident_weights": res, "expert_slots": tb.dev_p[ch.prefetch], "dense_slots": dense,
            "kv_buffers": kv, "staging": tb.dev_stage[pk], "arena": arena, **parts,
            "decode_temporaries": dec_tmp, "prefill_temporaries": pre_tmp,
            "decode_total": arena + dec_tmp, "prefill_total": arena + pre_tmp, "device_reserve": pr.device_reserve}


def _describe(pr: Problem, tb: _Tables, ch: Choice) -> Solution:
    ev = _evaluate(pr, tb, ch)
    assert ev is not None, "solver returned a choice the model rejects"
    obj, td, tp, binding = ev
    dev = _device_bytes(pr, tb, ch)
    if pr.gpu_mem is not None:
        slack = pr.device_budget - max(dev["decode_total"], dev["prefill_total"])
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
    for (h, a), e, (t, pa, pe, ph), q in itertools.product(tb.att, tb.b_e, tb.pre, tb.p):
        for bits in itertools.product((0, 1), repeat=len(gs)):
            ch = Choice(B, a, e, (t, pa, pe), q, frozenset(g for g, b in zip(gs, bits) if b), (h, ph))
            ev = _evaluate(pr, tb, ch)
            if ev is not None and (best is None or ev[0] < best[0]):
                best = (ev[0], ch)
    return None if best is None else _describe(pr, tb, best[1])


def minimum_device_bytes(pr: Problem) -> int:
    """Device bytes of the smallest choice the program can make (B = 1, nothing resident,
    the smallest b_a, b_e, prefill step and prefetch depth, attention on the host when that
    is offered): below this nothing fits."""
    import dataclasses

    tb = _tables(dataclasses.replace(pr, pareto=False, gpu_mem=pr.gpu_mem or 1), 1)
    k = min(tb.pre, key=lambda k: tb.dev_pre[k] + tb.dev_kv_pre[k] + tb.dev_stage[k])
    common = (_least_dense(tb.dense_groups) + min(tb.dev_p.values()) + tb.dev_stage[k] + sum(tb.dev_dec_head.values())
              + tb.dev_dequant)
    kv = max(min(tb.dev_kv_dec.values()), tb.dev_kv_pre[k])
    dec = min(tb.dev_att.values()) + min(tb.dev_b_e.values())
    return common + kv + max(dec, tb.dev_pre[k])


def _least_dense(groups: dict[str, int]) -> int:
    """The fewest device bytes dense weights can take: the j largest groups resident and two
    slots of the next largest, at the best j (a big lm_head is cheaper kept once than
    streamed through two slots of its size)."""
    sizes = sorted(groups.values(), reverse=True) + [0]
    return min(sum(sizes[:j]) + 2 * sizes[j] for j in range(len(sizes)))


def batch_candidates(pr: Problem) -> list[int]:
    """Powers of two up to --max-batch, --max-batch itself and, with --host-mem, for each
    prompt-tokens-per-step option the largest B whose KV and that step's host buffers fit it
    (the batches host memory holds: a power of two below them can leave a third of the KV
    pool unused); none above the largest B host memory holds at all."""
    cands = {1 << i for i in range(0, 20) if (1 << i) <= pr.max_batch} | {pr.max_batch}
    limits = host_batch_limits(pr)
    if limits:
        cands = {B for B in cands if B <= max(limits)} | set(limits)
    return sorted(cands)


def host_batch_limits(pr: Problem) -> list[int]:
    """Per prompt-tokens-per-step option, the largest B up to --max-batch that --host-mem holds
    with such prefill steps (empty without --host-mem; 1 where not even B = 1 fits: that B
    is then refused)."""
    if pr.host_mem is None:
        return []

    def fits(B: int, tps: int) -> bool:
        return pr.host_fits(B, min(tps, max(1, int(B * pr.prefill_tokens))))

    out = set()
    for tps in pr.tps_options:
        lo, hi = 1, int(pr.max_batch)
        if fits(hi, tps):
            out.add(hi)
            continue
        while lo < hi:  # host bytes grow with B: the last B that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid, tps) else (lo, mid - 1)
        out.add(lo)
    return sorted(out)


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
        best.variables = _variables(pr, tables[best.choice.B])
        best.solve_s = time.perf_counter() - t0
    return best


def _variables(pr: Problem, tb: _Tables) -> dict[str, Any]:
    """The program's choices at one B (after dropping dominated options), for the plan."""
    return {"attention host fractions offered": {ph: list(pr.offered_fractions(ph)) for ph in ("decode", "prefill")},
            "decode (host fraction, b_a)": tb.att, "decode b_e": tb.b_e,
            "prefill (tps, b_a, b_e, host fraction)": len(tb.pre), "prefetch depth": tb.p,
            "residency booleans": len(tb.groups)}


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
    for e in sorted({k[2] for k in tb.pre if k[:2] == (t, a) and k[3] == ch.attention[1]}, reverse=True):
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
