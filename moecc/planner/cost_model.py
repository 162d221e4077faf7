"""The planner's one cost model of a step, and its one entry point (`CostModel`).

A step of a phase (decode or prefill) is a DAG of compute and copy jobs (schedule.py); its
critical path is the predicted step time. Everything that prices a step asks `CostModel`:
  - the solver (solve.py) builds its linear program from the per-layer job times
    (`attention_s`, `ffn_s`, `head_s`, `kv_load_s`, `fetch_s`) at the step shapes below;
  - solve_batch_sizes predicts a plan's rates and timelines with `predict`;
  - calibrate (moecc/measure) fits a profile's calibration to measured steps with `step`;
  - bench/predict.py evaluates hand-set plans with `predict(workload, choice_of(plan))`.

A configuration (`Choice`) includes, per phase, where attention runs: the share of a step's
sequences that attend on the host (0: all on the device; 1: all on the host; between: a split,
the two parts at once), priced by schedule.py.

The step shapes of a workload are one rule for all of them (`Workload`): a decode step of B
sequences has B rows at a mean context of prompt + output / 2; a prefill step of tps prompt
tokens covers ceil(tps / prompt) sequences (at least one: a longer prompt is prefilled over
several steps), each at a mean context of prompt / 2, and that many rows reach the head.
With a shared prefix (a share s of the prompt tokens computed once, by the runtime's prefix
sharing) a request prefills only (1 - s) x prompt tokens, each still attending over the
shared prefix before it (mean context s x prompt + (1 - s) x prompt / 2); decode is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from moecc.planner.costs import LayerCost, ModelCost
from moecc.planner.schedule import (Knobs, Rates, Schedule, StepShape, attn_layer_parts, attn_layer_seconds,
                                    build_schedule, calibrated, ffn_layer_seconds, head_seconds, mode_of, split_shape,
                                    to_data)


@dataclass(frozen=True)
class Workload:
    """The typical request: prompt tokens and output tokens (means; need not be integers),
    and the share of the prompt tokens whose KV the runtime's prefix sharing computes once
    (`shared_prefix`, in [0, 1): moecc/planner/shared_prefix.py; 0: every prompt token is
    prefilled)."""

    prompt_tokens: float
    output_tokens: float
    shared_prefix: float = 0.0

    @property
    def prefill_tokens(self) -> float:
        """Prompt tokens a request computes in prefill: (1 - shared_prefix) of its prompt."""
        return self.prompt_tokens * (1.0 - self.shared_prefix) if self.shared_prefix else self.prompt_tokens

    def decode_shape(self, B: int) -> StepShape:
        """B sequences, one row each, at the mean context over the request's decode."""
        return StepShape(S=B, T=B, context=self.prompt_tokens + self.output_tokens / 2, head_rows=B)

    def prefill_shape(self, tps: int) -> StepShape:
        """tps computed prompt tokens over ceil(tps / prefill_tokens) sequences (at least
        one), at the mean position of a computed token: the shared prefix before it, and
        half the rest (the prompt / 2 without sharing): a computed token still attends over
        the shared prefix."""
        seqs = int(math.ceil(max(1.0, tps / max(self.prefill_tokens, 1))))
        if self.shared_prefix:
            context = self.prompt_tokens * self.shared_prefix + self.prefill_tokens / 2
        else:
            context = self.prompt_tokens / 2
        return StepShape(S=seqs, T=tps, context=context, head_rows=seqs)


PHASES: tuple[str, ...] = ("decode", "prefill")


@dataclass(frozen=True)
class Choice:
    """A candidate configuration: the batch B, decode sizes, prefill (tokens per step, b_a,
    b_e), prefetch depth, the residency groups kept on the device, and per phase (decode,
    prefill) the share of a step's sequences whose attention runs on the host."""

    B: int
    b_a: int
    b_e: int
    prefill: tuple[int, int, int]  # tps, b_a, b_e
    prefetch: int
    resident: frozenset[str]
    attention: tuple[float, float] = (0.0, 0.0)  # host fraction: decode, prefill (0: all on the device)

    def host_fraction(self, phase: str) -> float:
        return self.attention[_phase_index(phase)]

    def knobs(self, phase: str, streams: bool) -> Knobs:
        """The schedule's knobs for `phase`; without an arena every weight is read in place."""
        b_a, b_e = (self.b_a, self.b_e) if _phase_index(phase) == 0 else self.prefill[1:]
        return Knobs(b_a, b_e, self.prefetch, self.resident if streams else frozenset({"all"}),
                     self.host_fraction(phase))


def _phase_index(phase: str) -> int:
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: decode or prefill")
    return PHASES.index(phase)


def placement(host_fraction: float) -> dict[str, Any]:
    """A phase's attention placement as the plan holds it (plan_schema.AttentionPlacement)."""
    f = float(host_fraction)
    return {"where": "host" if f >= 1.0 else "device" if f <= 0.0 else "split", "host_fraction": f}


def choice_of(plan: dict[str, Any]) -> Choice:
    """The configuration a plan carries (a hand-edited plan's too; a phase without an
    attention placement attends on the device)."""
    d, p, arena = plan["batch"]["decode"], plan["batch"]["prefill"], plan.get("arena")
    host = tuple(float((plan["batch"][ph].get("attention") or {}).get("host_fraction", 0.0)) for ph in PHASES)
    return Choice(int(d["B"]), int(d["b_a"]), int(d["b_e"]),
                  (int(p["tokens_per_step"]), int(p["b_a"]), int(p["b_e"])),
                  int(arena["expert_slots"]) - 1 if arena else 1,
                  frozenset(arena["resident"]) if arena else frozenset(), (host[0], host[1]))


def streams_of(plan: dict[str, Any]) -> bool:
    """Whether the plan runs weights and KV through a device arena."""
    return plan.get("arena") is not None


def workload_of(plan: dict[str, Any]) -> Workload:
    """The workload the plan was sized for (its shared-prefix share: `shared_prefix_of`)."""
    wl = plan["batch"]["workload"]
    return Workload(float(wl["prompt_tokens"]), float(wl["output_tokens"]), shared_prefix_of(plan))


def shared_prefix_of(plan: dict[str, Any]) -> float:
    """The share of prompt tokens the plan was sized to compute once (batch.workload.shared_prefix;
    0 when it records none)."""
    return float((plan["batch"]["workload"]["shared_prefix"] or {}).get("share", 0.0))


@dataclass
class Prediction:
    """Both phases' step DAGs for one configuration, and the rates they predict."""

    workload: Workload
    B: int
    tps: int
    decode: Schedule
    prefill: Schedule

    @property
    def decode_tokens_per_s(self) -> float:
        return self.B / self.decode.seconds

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tps / self.prefill.seconds

    @property
    def job_tokens_per_s(self) -> float:
        """Generated tokens per second of a request's share of both phases' steps (its
        prefill: the prompt tokens it computes, less its shared prefix)."""
        wl = self.workload
        per_request = wl.output_tokens / self.decode_tokens_per_s + wl.prefill_tokens / self.prefill_tokens_per_s
        return wl.output_tokens / per_request

    def rates(self) -> dict[str, float]:
        return {"decode_tokens_per_s": self.decode_tokens_per_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "job_tokens_per_s": self.job_tokens_per_s}

    def timeline(self) -> dict[str, Any]:
        """Both DAGs as plain data (what `moecc explain --timeline` draws)."""
        return {"decode": {"B": self.B, "tokens": self.B, **to_data(self.decode)},
                "prefill": {"B": self.prefill_seqs, "tokens": self.tps, **to_data(self.prefill)}}

    @property
    def prefill_seqs(self) -> int:
        return self.workload.prefill_shape(self.tps).S


@dataclass(frozen=True)
class CostModel:
    """What a step costs on `rates` for the model `cost`, in one execution mode (`streams`:
    weights and KV through a device arena; else read in place, KV gathered by compute)."""

    cost: ModelCost
    rates: Rates
    streams: bool

    @property
    def mode(self) -> str:
        return mode_of(self.streams)

    def step(self, shape: StepShape, knobs: Knobs) -> Schedule:
        """The step's job DAG and its critical path."""
        if knobs.streams != self.streams:
            raise ValueError(f"knobs for {mode_of(knobs.streams)} weights given to a {self.mode} cost model")
        return build_schedule(self.cost, self.rates, shape, knobs)

    def predict(self, workload: Workload, choice: Choice) -> Prediction:
        """Both phases' DAGs for `choice` at the workload's step shapes."""
        dec = self.step(workload.decode_shape(choice.B), choice.knobs("decode", self.streams))
        pre = self.step(workload.prefill_shape(choice.prefill[0]), choice.knobs("prefill", self.streams))
        return Prediction(workload, choice.B, choice.prefill[0], dec, pre)

    # -- per-layer job times (seconds): the terms of the solver's linear program ---------

    def _per_layer(self, price: Callable[[LayerCost], Any]) -> list[Any]:
        """`price` of every layer, evaluated once per distinct layer (identical layers cost alike)."""
        seen: dict[tuple, Any] = {}
        return [seen[k] if k in seen else seen.setdefault(k, price(lc))
                for k, lc in zip(self._layer_keys, self.cost.layers)]

    @cached_property
    def _layer_keys(self) -> list[tuple]:
        return [tuple(v for k, v in vars(lc).items() if k != "layer") for lc in self.cost.layers]

    def attention_parts(self, shape: StepShape, b_a: int, host_fraction: float = 0.0
                        ) -> tuple[list[float], list[float]]:
        """Each layer's attention micro-batches, the host and device parts together (as they
        overlap), and each layer's host part alone (calibrated; without the copies they steal
        from). The host part precedes the router, so beside it the copy lane moves only what
        needs no routing (the experts wait for the router, but the first ones where the
        runtime speculates: schedule.speculates)."""
        c, r = self.cost, self.rates

        def price(lc: LayerCost) -> tuple[float, float]:
            host = attn_layer_parts(lc, r, c.dtype, shape, b_a, not self.streams, host_fraction)[0]
            return attn_layer_seconds(lc, r, c.dtype, shape, b_a, not self.streams, host_fraction), host

        both = self._per_layer(price)
        return [t for t, _ in both], [h for _, h in both]

    def attention_s(self, shape: StepShape, b_a: int, host_fraction: float = 0.0) -> list[float]:
        """Each layer's attention micro-batches (attention_parts)."""
        return self.attention_parts(shape, b_a, host_fraction)[0]

    def host_attention_s(self, shape: StepShape, b_a: int, host_fraction: float) -> list[float]:
        """Each layer's host part of attention (attention_parts; 0 without one)."""
        return self.attention_parts(shape, b_a, host_fraction)[1]

    def ffn_s(self, T: float, b_e: int) -> list[float]:
        """Each layer's router and experts (or dense MLP) over T rows in chunks of b_e."""
        c, r = self.cost, self.rates
        return self._per_layer(lambda lc: ffn_layer_seconds(lc, r, c.dtype, T, b_e, self.mode))

    def head_s(self, rows: int) -> float:
        return head_seconds(self.cost, self.rates, rows, self.mode)

    def kv_load_s(self, shape: StepShape, host_fraction: float = 0.0) -> tuple[list[float], list[float]]:
        """Each layer's KV loads of the device part of attention (the stores are the compute
        thread's, inside attention), as calibrated and at bytes / rate; all 0 without an arena."""
        r = self.rates
        raw = [0.0 for _ in self.cost.layers]
        S_d = split_shape(shape, host_fraction)[1][0]
        if self.streams:
            for i, lc in enumerate(self.cost.layers):
                load = S_d * shape.context * lc.kv_bytes_per_ctx
                raw[i] = load / r.copy_rate("h2d", load) if load > 0 else 0.0
        return [calibrated(r, self.mode, "kv_load", t) if t > 0 else 0.0 for t in raw], raw

    def fetch_s(self, nbytes: float, jobs: float = 1.0) -> tuple[float, float]:
        """A fetch of `nbytes` in `jobs` copy jobs, as calibrated and at bytes / rate."""
        if not nbytes:
            return 0.0, 0.0
        t = nbytes / self.rates.copy_rate("h2d", nbytes)
        return calibrated(self.rates, self.mode, "fetch", t, jobs), t
