"""bench/gpu_check.sh --dry-run-cpu: the first-contact GPU check's whole logic (prepare, every
phase, the report) on the CPU with tiny shapes, so CI runs what a GPU session will run. The
JSON must hold every figure the device run reports, and the checks that mean something on a
CPU (tokens, logits, bit-equality, the arena within its budget) must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PERF_FIELDS = ("tok_s", "generated_tokens", "seconds", "setup_s", "steps", "predicted_tok_s", "true_peak_bytes",
               "gpu_mem", "peak_arena_bytes", "copy_bytes", "copy_seconds", "wait_seconds", "h2d_gb_per_s",
               "overlap_efficiency", "host_reads_per_step", "sync_census", "weight_path", "native_kernel_calls",
               "host_attention_native", "keep_on_device")


@pytest.mark.slow
def test_dry_run_reports_every_field(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run-cpu", "--work", str(tmp_path / "work"),
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["mode"] == "dry-run-cpu" and r["device"] == "cpu" and r["failed"] == 0
    assert {"available", "built_here", "compiler"} <= set(r["native"])
    ph = r["phases"]
    runs = ph["correctness"]["runs"]
    assert {(x["placement"], x["keep_on_device"]) for x in runs} == {
        (pl, keep) for pl in ("host", "device", "split") for keep in (True, False)}
    assert all(x["tokens_identical"] and x["max_abs_logit_diff"] <= 1e-4 for x in runs)
    race = ph["race"]
    assert [x["placement"] for x in race["runs"]] == ["host", "device", "split"]
    assert all(x["logits_bit_equal"] and x["race_amplified"] and x["poisoned"] > 0 for x in race["runs"])
    lb = race["launch_blocking"]["runs"]
    assert len(lb) == 3 and all(x["logits_bit_equal"] for x in lb)
    perf = ph["perf"]
    assert "gb_per_s" in perf["pinned_dma"] and perf["checkpoint"]["dir"]
    assert [x["placement"] for x in perf["runs"]] == ["host", "device", "split"]
    for x in perf["runs"]:
        missing = [f for f in PERF_FIELDS if f not in x]
        assert not missing, (x["placement"], missing, x.get("error"))
        assert x["generated_tokens"] > 0 and x["weight_path"] == "host-memcpy"
        assert x["true_peak_bytes"] <= x["gpu_mem"]
        assert x["host_reads_per_step"].get("sample", 0) >= 1
        assert {"sync_warnings_per_step", "by_site_per_step", "host_reads_per_step"} <= set(x["sync_census"])
    assert perf["runs"][0]["native_kernel_calls"] > 0 or not r["native"]["available"]
    checks = {t["check"] for t in r["targets"]}
    for pl in ("host", "device", "split"):
        for what in ("tok/s", "true device peak", "streamed H2D", "overlap 1-wait/copy", "weight path"):
            assert f"(c) {pl} {what}" in checks
    assert r["total_s"] < r["budget_s"]
