"""The worker: execute a plan's module schedule over one step plan (module-based batching).

Legend: T = rows (new tokens) in this step, S' = sequences finishing their known tokens
this step, V = vocabulary.

A step plan (scheduler/step_plan.py) gives, for each sequence in the step, a chunk of its
not-yet-cached tokens (a prompt chunk being prefilled, or the one token it decodes) with the
KV slots they go to. The worker runs them all together as T rows, module by module in plan
order:
  * attention modules run in micro-batches of b_a sequences (worker/batch.py), each through
    the attention backend the placement gives it (worker/attention_backends.py), the next
    micro-batch's KV gathered while one computes where its backend gathers
    (memory/streaming.py's KVStaging);
  * expert modules run every expert over all rows routed to it, in chunks of b_e rows;
    dense MLPs over all rows in chunks of b_e;
  * values that cross modules are kept in host buffers [T, ...], or, where the next device
    module reads them (`keep_on_device`, the default on CUDA), on the device in the arena's
    staging area (see `_device_slots`): a [T, ...] view per value, a module's output written
    over its input's rows at the end of each run, so the residual stream never leaves the
    device between modules and attention micro-batches collect their rows in place.
On CUDA, what does cross to the host goes there asynchronously (copy_engine.DeviceToHost:
module outputs into pinned host buffers, new K/V into the pinned pool, each with an event its
reader waits on) and the KV pool is pinned.
Only the last row of each sequence whose known tokens are all cached after the step
reaches the head (final norm, lm_head). The step's phase picks (b_a, b_e): the plan's
prefill sizes or its decode sizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from moecc_runtime.memory.arena import ArenaError, DeviceArena, Region, align
from moecc_runtime.memory import device_budget, pinned
from moecc_runtime.memory.copy_engine import CopyEngine, DeviceToHost
from moecc_runtime.contract.kv_geometry import KVGeometry
from moecc_runtime.contract.plan_types import ArenaLayout, Module, Op, PlanView
from moecc_runtime.memory.kv import KVPool, pool_geometry
from moecc_runtime.memory.streaming import Copier, InPlaceWeights, KVStaging, StreamedWeights
from moecc_runtime.memory.packed_weights import in_place_weights
from moecc_runtime.memory.weights import TORCH_DTYPES, WeightStore, fp32_weight_keys
from moecc_runtime.plan import PlanError, has_sidecar, sidecar_path
from moecc_runtime.scheduler.step_plan import StepOutput, StepPlan
from moecc_runtime.syncs import to_device
from moecc_runtime.plan_schema import OP_JOB_KIND, TRANSFER_OPS, speculates
from moecc_runtime.worker import kernels
from moecc_runtime.worker.attention_backends import AttentionBackend, host_fractions, make_backends, place
from moecc_runtime.worker.batch import MicroBatch, StepBatch
from moecc_runtime.worker.norm_ahead import NormAhead, norms_ahead
from moecc_runtime.worker.stats import EngineStats, account, copy_counters
from moecc_runtime.worker.timeline import StepTrace, pick_trace



def _sums_kept(schedule: Sequence[Module]) -> dict[str, str]:
    """add op -> the host buffer that keeps its sum: the buffer op right after the add (transfer
    ops aside) whose one input it is, the pattern every residual add ends its module with."""
    out: dict[str, str] = {}
    for m in schedule:
        ops = [op for op in m.ops if op.op not in TRANSFER_OPS]
        for op, nxt in zip(ops, ops[1:]):
            if op.op == "add" and nxt.op == "host_buffer" and list(nxt.inputs) == [op.name]:
                out[op.name] = nxt.name
    return out


def _layer_experts(schedule: Sequence[Module]) -> list[Op | None]:
    """Per module: for an attention module, the experts op of the same layer that follows it."""
    out: list[Op | None] = [None] * len(schedule)
    for i, m in enumerate(schedule):
        if m.kind != "attn":
            continue
        for later in schedule[i + 1:]:
            if later.layer != m.layer:
                break
            op = next((o for o in later.ops if o.op == "experts"), None)
            if op is not None:
                out[i] = op
                break
    return out


def _next_attention(schedule: Sequence[Module]) -> list[tuple[int, int | None] | None]:
    """Per module: (layer, sliding window) of the next attention module in the schedule."""
    out: list[tuple[int, int | None] | None] = []
    nxt: tuple[int, int | None] | None = None
    for m in reversed(schedule):
        out.append(nxt)
        for op in m.ops:
            if op.op == "attention":
                nxt = (op.attrs["layer_index"], op.attrs.get("sliding_window"))
    return out[::-1]


def refuse_unbudgeted_cuda(plan: dict[str, Any], device: torch.device) -> None:
    """A plan without a device arena (compiled without --gpu-mem) does not run on CUDA: the
    runtime would have to copy every weight to the device and keep it there. PlanError
    saying to compile with --gpu-mem (`moecc exec` recompiles such a plan itself)."""
    if device.type == "cuda" and not plan.get("arena"):
        mdir = plan.get("model", {}).get("dir", "MODEL_DIR")
        raise PlanError(f"this plan has no device arena (it was compiled without --gpu-mem), so on {device} the "
                        f"runtime would copy every weight to the device and keep it there; it refuses to. "
                        f"Compile the plan for this device: `moecc compile {mdir} --gpu-mem <device memory to use, "
                        f"e.g. 20GB> -o plan.pt` (`moecc exec` does this in memory by itself), or run with "
                        f"--device cpu")


def _device_slots(schedule: Sequence[Module]) -> dict[str, tuple[int, int]]:
    """The host-buffer values that can stay on the device, in schedule order, each with
    (its producer's module index, the last module index that reads it). A value qualifies
    when modules after its producer read it (not its producer, not the head); it is kept
    in a [T, ...] view of the staging area (`_assign_slots` says which)."""
    bufs = {op.name: i for i, m in enumerate(schedule) for op in m.ops if op.op == "host_buffer"}
    readers: dict[str, set[int]] = {}
    for i, m in enumerate(schedule):
        for op in m.ops:
            for x in op.inputs:
                if x in bufs:
                    readers.setdefault(x, set()).add(i)
    out: dict[str, tuple[int, int]] = {}
    for name, p in bufs.items():
        r = readers.get(name, set())
        if r and min(r) > p and schedule[p].kind != "head":
            out[name] = (p, max(r))
    return out


def _assign_slots(values: dict[str, tuple[int, int]], row_bytes: dict[str, int]) -> dict[str, int]:
    """Slot numbers for the kept values (`_device_slots`, in schedule order) whose rows take
    `row_bytes`. A value written by the module that last reads an earlier value with rows of
    the same size takes over that one's slot (each run of that module reads its rows of the
    old value and writes the same rows of the new one at its end, so no row is overwritten
    before it is read); otherwise it gets a slot of its own."""
    slots: dict[str, int] = {}
    free: dict[int, list[tuple[int, int]]] = {}  # module index -> (slot, row bytes) it may hand over
    n = 0
    for name, (p, last) in values.items():
        rb = row_bytes[name]
        cands = free.get(p, [])
        pick = next((c for c in cands if c[1] == rb), None)
        if pick is not None:
            cands.remove(pick)
            s = pick[0]
        else:
            s, n = n, n + 1
        slots[name] = s
        free.setdefault(last, []).append((s, rb))
    return slots


@dataclass
class _DeviceValues:
    """One step's values kept on the device: where each one's [T, ...] view lies in the stage."""

    T: int
    offsets: dict[str, tuple[int, tuple[int, ...], torch.dtype]]  # value -> (stage offset, row shape, dtype)
    top: int  # stage bytes they take; inputs staged from host buffers go after
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # made when first written

    def view(self, stage: Region, name: str) -> torch.Tensor:
        v = self.views.get(name)
        if v is None:
            off, row, dtype = self.offsets[name]
            v = self.views[name] = stage.view(off, (self.T, *row), dtype, what=f"device value {name}")
        return v


class Worker:
    """Runs step plans of one plan's model on one device."""

    def __init__(self, plan: dict[str, Any], model_dir: Path, device: torch.device | str = "cpu", *,
                 expert_chunk: int | None = None, attn_micro_batch: int | None = None,
                 kv: KVGeometry | None = None, record_steps: bool = False, plan_path: Path | str | None = None,
                 attention: str | None = None, keep_on_device: bool | None = None, view: PlanView | None = None):
        """needs: a loaded plan and its checkpoint (and where the plan was read from, when it has
        quantized weights beside it: `plan_path`); on CUDA a plan with a device arena
        (PlanError otherwise). `expert_chunk` / `attn_micro_batch` override the plan's b_e /
        b_a of both phases; `kv` its KV pool's geometry; `attention` (an attention backend's
        name, attention_backends.Where) the plan's attention placement of both phases.
        `keep_on_device`: keep values between device modules in the arena's staging area
        instead of host buffers (default: on CUDA; a CPU run keeps the host buffers unless
        asked, with the same results). `view`: the plan typed (PlanView.of(plan) when not given)."""
        self.device = torch.device(device)
        self.view = view or PlanView.of(plan)
        refuse_unbudgeted_cuda(plan, self.device)
        # CUDA: the allocator capped at the plan's budget before anything is allocated there
        self.device_cap = device_budget.cap_process(plan, self.device)
        self.plan = plan
        self.info = plan["model"]["info"]
        self.cuda = self.device.type == "cuda"
        self.dtype = TORCH_DTYPES[self.view.info.dtype]
        sidecar = sidecar_path(plan_path) if plan_path is not None and has_sidecar(plan) else None
        self.store = WeightStore(plan["weights"], model_dir, self.device, compute_dtype=self.dtype,
                                 keep=fp32_weight_keys(self.view.schedule), sidecar=sidecar)
        # (b_a, b_e) per phase: a step that is mostly prompt tokens runs with the plan's prefill
        # sizes, any other with its decode sizes (the arena was sized for both)
        self._phase_sizes = {phase: (int(attn_micro_batch or self.view.phase(phase).b_a),
                                     int(expert_chunk or self.view.phase(phase).b_e))
                             for phase in ("decode", "prefill")}
        self.b_a, self.b_e = self._phase_sizes["decode"]
        self.inv_freq_host = plan["rope"]["inv_freq"].float()
        self.rope_scaling = float(plan["rope"]["attention_scaling"])
        self.schedule = self.view.schedule
        self._producer = {op.name: op.op for m in self.schedule for op in m.ops}
        self._next_attn = _next_attention(self.schedule)
        self._layer_experts = _layer_experts(self.schedule)
        self.kv = KVPool.of(kv or pool_geometry(self.view), self.dtype, compute_device=self.device)
        self.d2h = DeviceToHost(self.device) if self.cuda else None  # module outputs and K/V to the host
        self.kv.d2h = self.d2h
        self.backends = make_backends(self.kv, self.device)  # attention backends, by name (attention_backends.Where)
        self._host_share = host_fractions(plan, self.device, attention)  # per phase: placement's host fraction
        self._phase = "decode"
        # host buffers share storage by slot (the plan's host_buffer attrs.slot: values whose
        # lives do not overlap and whose rows are the same size), as the planner counts them
        self._slot_of = {op.name: op.attrs.get("slot", op.name) for m in self.schedule for op in m.ops
                         if op.op == "host_buffer"}
        self._sums_kept = {} if self.cuda else _sums_kept(self.schedule)  # add -> its host buffer (_add_into)
        # the add and the next module's norm in one pass (weights read in place: no arena)
        self._norm_ahead = NormAhead(norms_ahead(self.schedule, self._sums_kept) if self.view.arena is None else {},
                                     lambda op: self._w(op, "weight"))
        self._host_bufs: dict[Any, torch.Tensor] = {}  # host buffer storage (bytes) by slot, reused
        self._host_ready: dict[Any, Any] = {}  # CUDA: slot -> event after its last device->host write
        self._host_read: dict[Any, Any] = {}  # CUDA: slot -> event after its last non-blocking read
        self.keep_on_device = self.cuda if keep_on_device is None else bool(keep_on_device)
        self._slots: dict[str, tuple[int, int]] = {}  # values that may stay on the device (with an arena)
        self._widths: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # value -> row shape, dtype (learned)
        self._staged_inputs: list[list[str]] = []  # per module: host-buffer inputs not kept on the device
        self._dev: _DeviceValues | None = None  # this step's values on the device, when they fit
        self._rows_dev: tuple[torch.Tensor, torch.Tensor] | None = None  # (host rows, their device copy)
        self.steps_on_device = 0  # steps whose values between modules stayed on the device
        self.host_buffer_writes = 0  # module outputs written to host buffers (rows of one run each)
        self.stats = EngineStats(records=[] if record_steps else None)
        self.stats.gpu_mem = device_budget.plan_device_budget(plan)[0]  # what the true peak is held against
        self._step_no = 0
        self._trace: StepTrace | None = None  # the step being recorded for the timeline, if any
        self._layer: int | None = None  # layer of the module running (for the timeline)
        self.arena: DeviceArena | None = None
        self.copy: CopyEngine | None = None
        self.stage: Region | None = None
        if self.view.arena is not None:
            self._init_arena(self.view.arena)
            if self.keep_on_device:
                self._slots = _device_slots(self.schedule)
                bufs = {op.name for m in self.schedule for op in m.ops if op.op == "host_buffer"}
                self._staged_inputs = [list(dict.fromkeys(i for op in m.ops for i in op.inputs
                                                          if i in bufs and i not in self._slots))
                                       for m in self.schedule]
        else:
            self.weights: InPlaceWeights | StreamedWeights = in_place_weights(self.store, self.view, self.b_e)
            self.stats.packed_weight_bytes = self.weights.packed_bytes
            self.kv_staging = KVStaging(self.kv, self.device)

    def _init_arena(self, lay: ArenaLayout) -> None:
        """Carve the plan's arena: resident weights, dense and expert slots, two KV buffers,
        the staging area for hidden states; start the copy engine."""
        cap_blocks = lay.kv_buffer_tokens // self.kv.block_size  # 0: attention on the host only
        kv_bytes = KVStaging.region_bytes(self.kv, cap_blocks) if cap_blocks else 0
        self.arena = DeviceArena(lay.bytes, self.device)
        self.copy = CopyEngine(self.device)
        copier = Copier(self.device, max(lay.dense_slot_bytes, lay.expert_slot_bytes))
        self.weights = StreamedWeights(self.view, self.store, self.arena, self.copy, copier)
        if cap_blocks:
            self.kv_staging = KVStaging(self.kv, self.device, self.copy, self.arena.region("kv_buffers", kv_bytes),
                                        cap_blocks)
        else:
            self.arena.region("kv_buffers", 0)  # none (attention on the host); the usage report names it still
            self.kv_staging = KVStaging(self.kv, self.device, cap_blocks=0)
            if any(f < 1.0 for f in self._host_share.values()):
                raise ArenaError("device arena: the plan places attention on the device but gives it no KV "
                                 "buffers (arena.kv_buffer_tokens 0); recompile, or run with attention on the host")
        self.stage = self.arena.region("stage", lay.stage_bytes)
        self.stats.arena_bytes = self.arena.nbytes

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """needs: every slot of `plan` reserved (the scheduler did). does: zero the plan's new
        blocks, make its copies on write, run every module over the step's rows, account the step. guarantees: the
        chunks' K/V are in the pool; the logits of the finishing sequences [S', V] (fp32),
        or of every row [T, V] with `plan.all_rows`."""
        t0 = time.perf_counter()
        self.kv.zero(plan.new_blocks)
        self.kv.copy_blocks(plan.copies)
        b = StepBatch.build(plan, self.kv.block_size)
        experts_before = self.stats.experts_run
        copy0 = copy_counters(self.copy)
        self._step_no += 1
        self.b_a, self.b_e = self._phase_sizes[plan.phase]
        self._phase = plan.phase
        trace = None  # the timeline is recorded only with step records on
        if self.stats.records is not None:
            trace = pick_trace(self.stats.timeline.get(plan.phase), plan.phase, self._step_no, b.T, b.prefill_tokens,
                               len(plan.seqs), t0)
        self._trace = trace
        if self.copy is not None:
            self.copy.trace = trace
        self._dev = self._layout(b.T) if self._slots else None
        if self._dev is not None:
            self.steps_on_device += 1
            self._drop_host_buffers(self._slots)  # not needed while the values stay on the device
        try:
            logits = self._run_schedule(b)
        finally:
            self._dev = None
        self.kv.flush()  # every K/V of this step is in the pool when the step ends (CUDA: waits on events)
        if trace is not None and self.copy is not None:
            self.copy.trace = None  # before the clock stops: no recorded copy ends after the step
        seconds = time.perf_counter() - t0
        if trace is not None:
            self._trace = None
            context = sum(c.start + c.n / 2 for c in plan.seqs) / max(1, len(plan.seqs))  # before this step's
            self.stats.timeline[plan.phase] = trace.finish(seconds, len(plan.seqs), b.T, b.prefill_tokens, context,
                                                           len(b.finishing))
        account(self.stats, plan, seconds, self.stats.experts_run - experts_before, copy0, self.copy, self.arena,
                self.device, self.kv)
        return StepOutput(b.finishing, logits)

    def _run_schedule(self, b: StepBatch) -> torch.Tensor:
        """Every module in plan order over the step's rows; the head's logits."""
        env: dict[str, torch.Tensor] = {"input_ids": b.input_ids, "positions": b.positions}
        mbs = place(b, self._host_share[self._phase], self.b_a, self.kv_staging.cap_blocks)
        self._norm_ahead.start_step()
        logits = None
        for index, module in enumerate(self.schedule):
            kind = module.kind
            self._layer = module.layer
            self.weights.enter(index)
            self.kv.flush(wait=False)  # CUDA: scatter K/V stores whose copies are done, while the device works
            if kind == "attn":
                self._run_attention_module(index, module, env, b, mbs)
            else:
                out = self._run_module(module, env, b, None)
                if kind == "head":
                    logits = out
        assert logits is not None, "plan has no head module"
        return logits

    def _run_attention_module(self, index: int, module: Module, env: dict[str, torch.Tensor], b: StepBatch,
                              mbs: list[MicroBatch]) -> None:
        """Micro-batch by micro-batch, each through its backend. Those whose backend gathers:
        the next one's KV (after the last one: the next attention layer's first) is gathered
        while this one computes. The others read the pool in place, after them."""
        attn = next(op for op in module.ops if op.op == "attention").attrs
        layer, window = attn["layer_index"], attn.get("sliding_window")
        nxt = self._next_attn[index]
        staged = [mb for mb in mbs if self._backend(mb).gathers]
        if not staged:
            self._speculate(index, b)
        for j, mb in enumerate(staged):
            key = (self._step_no, layer, j)
            kv = self.kv_staging.acquire(key, layer, self._gather_blocks(mb, window))
            if j + 1 < len(staged):
                self.kv_staging.submit((self._step_no, layer, j + 1), layer, self._gather_blocks(staged[j + 1], window))
            if j + 2 >= len(staged):  # this layer's last KV load is queued: the experts may follow it
                self._speculate(index, b)
            self._run_module(module, env, b, mb, kv)
            self.kv_staging.release(key)
        if nxt is not None and staged:
            nlayer, nwindow = nxt
            self.kv_staging.submit((self._step_no, nlayer, 0), nlayer, self._gather_blocks(staged[0], nwindow))
        for mb in mbs:
            if not self._backend(mb).gathers:
                self._backend(mb).prepare(mb, window)
                self._run_module(module, env, b, mb)

    def _backend(self, mb: MicroBatch) -> AttentionBackend:
        """The attention backend micro-batch `mb` names."""
        return self.backends[mb.where]

    def _gather_blocks(self, mb: MicroBatch, window: int | None) -> torch.Tensor:
        """[nb] the pool blocks KV staging gathers for `mb` (its backend builds its views)."""
        blocks = self._backend(mb).prepare(mb, window)
        if blocks is None:
            raise RuntimeError(f"runtime: attention backend {mb.where.value!r} gathers but named no KV blocks "
                               f"for micro-batch {mb.index}; its prepare() must return them")
        return blocks

    def _speculate(self, index: int, b: StepBatch) -> None:
        """Fetch the layer's first experts before its router runs when the step's rows make
        every expert almost surely chosen (streaming.speculates)."""
        op = self._layer_experts[index]
        if op is not None and speculates(b.T, int(op.attrs.get("top_k", 1)), int(op.attrs["num_experts"])):
            self.weights.speculate(op.name)

    def _run_module(self, module: Module, env: dict[str, torch.Tensor], b: StepBatch,
                    mb: MicroBatch | None, kv: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor | None:
        """Run one module's ops over the attention micro-batch `mb` (whose gathered KV is
        `kv`), or over all rows (the head module reads only the finishing sequences' last
        rows). Host buffers collect each op's output rows; the module's last output is returned."""
        if mb is not None:
            rows: slice | torch.Tensor = slice(mb.r0, mb.r1)
        elif module.kind == "head":
            rows = b.last_rows
        else:
            rows = slice(None)
        arg = _Inputs(self, module, env, rows, self._rows_on_device(rows))
        last = None
        trace = self._trace
        dev = self._dev
        handover: list[tuple[str, Any]] = []  # outputs kept on the device, written after the run's ops
        summed: dict[str, torch.Tensor] = {}  # host buffer -> its rows an add wrote in place (_add_into)
        for op in module.ops:
            kind = op.op
            if kind in TRANSFER_OPS:  # the weights policy and the KV staging did these (memory/)
                continue  # the weights policy and the KV staging did these (see streaming.py)
            t_op = time.perf_counter() if trace is not None else 0.0
            inputs = [arg(i) for i in op.inputs if self._producer.get(i) not in TRANSFER_OPS]
            if kind == "host_buffer":
                name, x = op.name, inputs[0]
                self._widths.setdefault(name, (tuple(x.shape[1:]), x.dtype))
                if dev is not None and name in dev.offsets:
                    handover.append((name, x))
                    continue
                if summed.get(name) is x:  # the add wrote these rows in place
                    self.host_buffer_writes += 1
                    continue
                self._to_host(name, self._step_buffer(env, name, b.T, x.shape[1:], x.dtype), rows, x)
                continue
            into = self._add_into(op, inputs, env, b.T, rows) if op.name in self._sums_kept else None
            if into is not None:
                summed[self._sums_kept[op.name]] = into
            last = arg.local[op.name] = into if into is not None else self._compute(op, inputs, mb, kv)
            if trace is not None and kind != "experts":  # experts: _experts records them (per expert, or per layer)
                name = f"L{self._layer}.attn.{mb.index}" if kind == "attention" and mb is not None else \
                    f"{module.module}.{op.name}"
                trace.add(name, "compute", OP_JOB_KIND.get(kind, "glue"), self._layer, t_op, time.perf_counter())
        assert dev is not None or not handover
        for name, x in handover:  # this run's rows of the value, over the rows of the input it replaces
            assert self.stage is not None and dev is not None
            full = dev.view(self.stage, name)
            if isinstance(rows, slice):
                full[rows].copy_(x)
            else:
                full[arg.rows_dev] = x.to(full.device)
            env[name] = full
        return last

    def _add_into(self, op: Op, x: list[Any], env: dict[str, torch.Tensor], T: int,
                  rows: slice | torch.Tensor) -> torch.Tensor | None:
        """A CPU run's residual add written straight into the rows of the host buffer that keeps
        its sum (`_sums_kept`): the same bits as `x[0] + x[1]` then the buffer's copy, without
        the copy or a fresh [t, H]. The buffer never holds an input of its own module (the
        planner's slots: insert_host_buffers.assign_slots); where the next module opens with the
        norm of that buffer, the norm of the sum in the same pass (norm_ahead.py). None where this
        does not apply (rows by index, a value kept on the device, shapes that broadcast); the
        caller computes it."""
        name = self._sums_kept[op.name]
        if not isinstance(rows, slice) or (self._dev is not None and name in self._dev.offsets) \
                or x[0].shape != x[1].shape:
            return None
        full = self._step_buffer(env, name, T, x[0].shape[1:], torch.result_type(x[0], x[1]))
        dst = full[rows]
        if dst.shape != x[0].shape:
            return None
        if self._norm_ahead.add(op, x, dst, full):  # and the next module's norm of the sum
            return dst
        return torch.add(x[0], x[1], out=dst)

    def _step_buffer(self, env: dict[str, torch.Tensor], name: str, T: int, row: Any, dtype: torch.dtype
                     ) -> torch.Tensor:
        """Host buffer `name` of this step, [T, *row] on the host: made (`_host_buffer`) by the
        first module run that writes it, then filled run by run (micro-batches)."""
        full = env.get(name)
        if full is None:
            full = env[name] = self._host_buffer(name, (T, *row), dtype)
        return full

    def _rows_on_device(self, rows: slice | torch.Tensor) -> slice | torch.Tensor:
        """Row indexes on the compute device, sent once per step (the head's last rows are
        the only index tensor; syncs.to_device never waits)."""
        if isinstance(rows, slice):
            return rows
        cached = self._rows_dev
        if cached is None or cached[0] is not rows:
            cached = self._rows_dev = (rows, to_device(rows, self.device, torch.long))
        return cached[1]

    def _to_host(self, name: str, full: torch.Tensor, rows: slice | torch.Tensor, x: torch.Tensor) -> None:
        """Rows `rows` of host buffer `full` (value `name`) from `x`: on CUDA a non-blocking copy
        on the device->host stream whose event the buffer's readers wait on."""
        self.host_buffer_writes += 1
        if x.is_cuda and self.d2h is not None and isinstance(rows, slice):
            # (the copy stream waits for the compute stream, so the slot's earlier reads come first)
            self._host_ready[self._slot_of.get(name, name)] = self.d2h.into(full[rows], x)
            return
        read = self._host_read.pop(self._slot_of.get(name, name), None)
        if read is not None:
            read.synchronize()  # a non-blocking copy out of this buffer has finished before the host writes it
        full[rows] = x.to("cpu")

    def _layout(self, T: int) -> _DeviceValues | None:
        """Where this step's kept values lie in the stage, or None when they (with the inputs
        still staged from host buffers) do not fit the plan's stage or their row shapes are
        not known yet (learned by the first step, which keeps the host buffers)."""
        if self.stage is None or any(n not in self._widths for n in self._slots):
            return None
        rbs = {n: _row_bytes(*self._widths[n]) for n in self._slots}
        slot_of = _assign_slots(self._slots, rbs)
        offsets: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        at: dict[int, int] = {}  # slot -> its offset
        top = 0
        for name, s in slot_of.items():
            if s not in at:
                at[s] = top
                top += align(T * rbs[name])
            row, dtype = self._widths[name]
            offsets[name] = (at[s], row, dtype)
        extra = max((sum(align(T * _row_bytes(*self._widths[n])) for n in names if n in self._widths)
                     for names in self._staged_inputs), default=0)
        if top + extra > self.stage.nbytes:
            return None
        return _DeviceValues(T, offsets, top)

    def _drop_host_buffers(self, names: Any) -> None:
        """Release the storage of the slots whose every value is among `names` (kept on the
        device, or all of them at close)."""
        names = set(names)
        for slot in {self._slot_of.get(n, n) for n in names}:
            if any(self._slot_of.get(v, v) == slot and v not in names for v in self._slot_of):
                continue  # another value of this slot still lives on the host
            buf = self._host_bufs.pop(slot, None)
            if buf is not None:
                self._settle(slot)
                pinned.release(buf)

    def _host_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer's storage: its slot's bytes, kept across steps and grown when a step
        needs more (big steps pay no fresh page faults), viewed as [shape] of `dtype`."""
        slot = self._slot_of.get(name, name)
        need = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            need *= d
        buf = self._host_bufs.get(slot)
        if buf is None or buf.numel() < need:
            if buf is not None:
                self._settle(slot)
                pinned.release(buf)
            buf = self._host_bufs[slot] = pinned.host_empty((max(need, 16),), torch.uint8, pin=self.cuda,
                                                            what=f"host buffer slot {slot}")
        return buf[:need].view(dtype).view(shape)

    def _settle(self, slot: Any) -> None:
        """CUDA: wait for the copies into and out of host buffer slot `slot`."""
        for events in (self._host_ready, self._host_read):
            ev = events.pop(slot, None)
            if ev is not None:
                ev.synchronize()

    def _w(self, op: Op, local: str) -> torch.Tensor:
        return self.weights.get(op.weights[local])

    def _compute(self, op: Op, x: list[Any], mb: MicroBatch | None,
                 kv: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        """One op of the plan's vocabulary over its inputs `x`."""
        kind, a = op.op, op.attrs
        if kind == "embed":  # on the host: only the rows used travel
            return F.embedding(x[0], self.store.host(op.weights["weight"]))
        if kind == "rope":
            return kernels.rope_table(x[0], self.inv_freq_host, self.rope_scaling, self.dtype)
        if kind == "rmsnorm":
            made = self._norm_ahead.take(op, x[0])  # the rows the previous module's add normalised
            return made if made is not None else kernels.rmsnorm(x[0], self._w(op, "weight"), a["eps"])
        if kind == "attention":
            assert mb is not None, f"attention node {op.name} outside an attention module"
            w = {k: self._w(op, k) for k in op.weights}
            return self._backend(mb).forward(op, x[0], x[1], mb, w, kv)
        if kind == "router":
            return kernels.route(x[0], self._w(op, "weight"), a,
                                 self._w(op, "bias") if "bias" in op.weights else None)
        if kind == "experts":
            return self._experts(op, x)
        if kind == "mlp":
            out = torch.empty_like(x[0])
            for s in range(0, x[0].shape[0], self.b_e):
                out[s:s + self.b_e] = kernels.gated_mlp(x[0][s:s + self.b_e], self._w(op, "gate"),
                                                        self._w(op, "up"), self._w(op, "down"), a["act"])
            return out
        if kind == "linear":
            bias = self._w(op, "bias") if "bias" in op.weights else None
            return kernels.linear(x[0], self._w(op, "weight"), bias)
        if kind == "add":
            return x[0] + x[1]
        if kind == "mul":
            return x[0] * x[1]
        if kind == "sigmoid":
            return torch.sigmoid(x[0])
        if kind == "lm_head":
            return kernels.linear(x[0], self._w(op, "weight"))
        raise RuntimeError(f"runtime: op {kind!r} (node {op.name}) is not implemented by this runtime; "
                           f"the plan is newer than the runtime")

    def _experts(self, op: Op, x: list[Any]) -> torch.Tensor:
        """Every routed expert over its rows in chunks of b_e, weights from the weights policy."""
        top_w, top_i = x[1]
        trace, layer = self._trace, self._layer
        together = self.weights.holds_together  # weights in place: the layer may run as one native call

        def weights(es: list[int]):
            it = self.weights.experts(op.name, es)
            return it if trace is None or together else trace.experts(it, layer, es)

        a = op.attrs
        start = time.perf_counter()
        out, used = kernels.experts(x[0], top_w, top_i, weights, a["num_experts"], kernels.expert_mlp(a), self.b_e,
                                    together=together)
        if trace is not None and together:  # one compute job for the layer's experts (no fetch to tell apart)
            trace.add(f"L{layer}.experts", "compute", "gemm", layer, start, time.perf_counter())
        self.stats.experts_run += used
        return out

    def close(self) -> None:
        try:
            self.weights.close()
        finally:
            if self.copy is not None:
                self.copy.close()
            self.kv_staging.close()
            self._drop_host_buffers(list(self._host_bufs))
            self.kv.close()
            self.store.close()
            if self.arena is not None:
                self.arena.close()
            device_budget.uncap(self.device_cap)
            self.device_cap = None  # a second close leaves another engine's cap alone


def _row_bytes(row: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in row:
        n *= int(d)
    return n


class _Inputs:
    """A module's inputs for one run: rows `rows` of each value. A value kept on the device
    is read where it is (a view of the stage); a host buffer's rows are brought to the
    device once per module run however many ops read them (into the arena's staging area
    when there is one, after the kept values; on CUDA a non-blocking copy from pinned memory
    behind the compute stream's wait for the buffer's device->host event); the stem
    (embedding, rope table) reads them on the host."""

    def __init__(self, worker: Worker, module: Module, env: dict[str, torch.Tensor], rows: slice | torch.Tensor,
                 rows_dev: slice | torch.Tensor):
        """`rows`: which rows of each value (host indexes, for host buffers); `rows_dev` the same
        on the compute device (for values kept there)."""
        self.worker, self.module, self.env, self.rows, self.rows_dev = worker, module, env, rows, rows_dev
        self.host = module.kind == "stem"
        self.local: dict[str, Any] = {}  # value name -> its tensor in this module run
        dev = worker._dev
        self.staged = dev.top if dev is not None else 0  # bytes of the staging area used so far

    def __call__(self, name: str) -> Any:
        if name in self.local:
            return self.local[name]
        w = self.worker
        dev = w._dev
        if dev is not None and name in dev.offsets:
            full = dev.views.get(name)
            if full is None:
                raise RuntimeError(f"runtime: {self.module.module} reads {name} before any module wrote it "
                                   f"(the plan's schedule is out of order)")
            x = full[self.rows_dev]
            self.local[name] = x
            return x
        src = self.env[name]
        slot = w._slot_of.get(name, name)
        ready = w._host_ready.get(slot)  # CUDA: the buffer's device->host copies, possibly in flight
        stage = w.stage
        # CUDA: rows of a (pinned) host buffer go to the stage without the host waiting: the
        # compute stream waits for the buffer's device->host event, the copy is non-blocking
        # and an event marks when the host may write the buffer again (Worker._to_host)
        behind = w.cuda and stage is not None and isinstance(self.rows, slice) and not self.host
        if ready is not None and not behind:
            ready.synchronize()  # the host reads the rows itself
        x = src[self.rows]
        if self.host:
            return x
        if stage is None:
            dst = x.to(w.device)
        else:
            dst = stage.view(self.staged, x.shape, x.dtype, what=f"staged input {name} of {self.module.module}")
            self.staged += align(x.numel() * x.element_size())
            if behind:
                compute = torch.cuda.current_stream(w.device)
                if ready is not None:
                    compute.wait_event(ready)  # on the device: the host goes on
                dst.copy_(x, non_blocking=True)
                read = torch.cuda.Event(blocking=True)  # whoever waits on it sleeps, not spins
                read.record(compute)
                w._host_read[slot] = read
            else:
                dst.copy_(x)
        self.local[name] = dst
        return dst
