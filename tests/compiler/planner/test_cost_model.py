"""The one cost model of a step: the workload's step shapes (one rule), a plan's predictions
are the cost model's for the configuration the plan carries, and a model refuses knobs of
the other execution mode."""

from __future__ import annotations

import pytest

from moecc.planner.cost_model import CostModel, Workload, choice_of, streams_of, workload_of
from moecc.planner.costs import model_cost
from moecc.planner.hardware import resolve_hardware
from moecc.planner.schedule import Knobs

from tests.compiler.passes.util import run_pass
from tests.compiler.planner.test_solve import cost


@pytest.mark.parametrize("prompt, tps, seqs", [(100.0, 256, 3), (24.0, 128, 6), (512.0, 256, 1), (32.0, 64, 2)])
def test_prefill_covers_ceil_of_tokens_over_prompt_sequences(prompt, tps, seqs):
    shape = Workload(prompt, 8.0).prefill_shape(tps)
    assert (shape.S, shape.head_rows, shape.T, shape.context) == (seqs, seqs, tps, prompt / 2)


def test_decode_shape_is_one_row_per_sequence_at_the_mean_context():
    shape = Workload(24.0, 16.0).decode_shape(32)
    assert (shape.S, shape.T, shape.head_rows, shape.context) == (32, 32, 32, 32.0)


@pytest.mark.parametrize("gpu_mem", [None, 2_000_000])
def test_plan_predictions_are_the_cost_models_for_the_plans_choice(gpu_mem):
    _, result = run_pass("solve_batch_sizes", gpu_mem=gpu_mem, prompt_tokens=24, output_tokens=16, max_batch=64,
                         device_reserve=0,
                         hardware="a5000")
    g = result.graph
    plan = {"batch": g.attrs["batch"], "arena": g.attrs["arena"]}
    cm = CostModel(model_cost(g), resolve_hardware("a5000"), streams_of(plan))
    pred = cm.predict(workload_of(plan), choice_of(plan))
    assert pred.rates() == {k: g.attrs["predicted"][k] for k in pred.rates()}
    assert pred.timeline() == g.attrs["timeline"]


def test_a_cost_model_refuses_knobs_of_the_other_mode():
    cm = CostModel(cost(), resolve_hardware("a5000"), streams=False)
    with pytest.raises(ValueError, match="streamed weights given to a resident cost model"):
        cm.step(Workload(24.0, 16.0).decode_shape(4), Knobs(4, 8, 1))
