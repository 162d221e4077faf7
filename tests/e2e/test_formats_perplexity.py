"""Quality of the downloaded layouts (issue 33): the trained demo model written by the
libraries' own round-to-nearest packing (moecc.testing.quantized_libs: GPTQ, AWQ,
compressed-tensors, ModelOpt NVFP4; not by moecc) keeps its held-out perplexity through
`moecc perplexity`'s runtime within 1% (8-bit layouts) and 5% (4-bit layouts) of the
unquantized model's recorded figure (examples/demo-model/training.json, which moecc's own
figure matches: tests/e2e/test_demo_model.py).

    python -m pytest tests/e2e/test_formats_perplexity.py -s     # prints each layout's figure
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from moecc.compiler import compile_model
from moecc.testing import quantized_libs as L
from moecc_runtime.perplexity import plan_perplexity
from moecc_runtime.plan import save_plan

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
RECORD = json.loads((DEMO / "training.json").read_text(encoding="utf-8"))
GROUP = 32  # the demo model's expert width (224) is no multiple of 128

#: layout -> (writer of the demo model in it, allowed relative rise of the perplexity)
LAYOUTS: dict[str, tuple[Callable[[Path], Path], float]] = {
    "gptq-int8": (lambda o: L.write_gptq_checkpoint(DEMO, o, bits=8, group=GROUP), 0.01),
    "ct-w8-channel-asym": (lambda o: L.write_ct_checkpoint(DEMO, o, scheme="w8_channel_asym"), 0.01),
    "ct-fp8-channel": (lambda o: L.write_ct_checkpoint(DEMO, o, scheme="fp8_channel"), 0.01),
    "gptq-int4": (lambda o: L.write_gptq_checkpoint(DEMO, o, bits=4, group=GROUP), 0.05),
    "gptq-int4-act-order": (lambda o: L.write_gptq_checkpoint(DEMO, o, bits=4, group=GROUP, desc_act=True), 0.05),
    "awq": (lambda o: L.write_awq_checkpoint(DEMO, o, group=GROUP), 0.05),
    "ct-w4-sym": (lambda o: L.write_ct_checkpoint(DEMO, o, scheme="w4_group_sym"), 0.05),
    "ct-w4-asym": (lambda o: L.write_ct_checkpoint(DEMO, o, scheme="w4_group_asym"), 0.05),
    "nvfp4": (lambda o: L.write_nvfp4_checkpoint(DEMO, o), 0.05),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_heldout_perplexity_within_target(layout: str, tmp_path: Path) -> None:
    write, tolerance = LAYOUTS[layout]
    model = write(tmp_path / layout)
    plan, _ = compile_model(model, prompt_tokens=RECORD["window"], output_tokens=16, max_batch=8)
    path = tmp_path / f"{layout}.pt"
    save_plan(plan, path)
    res = plan_perplexity(path, DEMO / "heldout.txt", window=RECORD["window"], device="cpu")
    base = RECORD["heldout_perplexity"]
    print(f"{layout}: held-out perplexity {res.value:.4f} ({100 * (res.value / base - 1):+.2f}% against {base})")
    assert res.value == pytest.approx(base, rel=tolerance)
