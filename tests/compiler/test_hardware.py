"""Tests for moecc.planner.hardware (profiles, presets, rate models, resolve_hardware) and
`moecc profile` (moecc.measure.profile.measure through the CLI, quick, on this machine).

No outcome here depends on timing: the profile's measurements run their real work but read
a fake clock (StepClock), so every curve has every point however loaded the machine is."""

from __future__ import annotations

import functools
import json
import math
import re

import pytest

from moecc.errors import HardwareError, MoeccError
from moecc.planner.hardware import (
    DTYPES,
    PRESETS,
    HardwareProfile,
    interpolate_log2,
    normalize_dtype,
    preset_for_device_name,
    resolve_hardware,
)
from moecc.sizes import parse_size

GPU_PRESETS = [n for n, p in PRESETS.items() if p.device_kind == "cuda"]
NAMED_MEMORY = {"t4": "16GB", "l4": "24GB", "rtx4090": "24GB", "a5000": "24GB", "a6000": "48GB",
                "a100-80gb": "80GB", "h100-80gb": "80GB", "h200": "141GB", "cpu": "24GB"}
TOKENS = [1, 2, 3, 4, 7, 16, 33, 64, 100, 256, 1000, 1024, 4096, 10**5]


def _measured_like() -> HardwareProfile:
    """A profile with hand-written curves (points at 1, 16, 256 tokens etc.)."""
    p = resolve_hardware("cpu")
    p.source = "measured"
    p.curves = {
        "gemm": {"float32": [[1.0, 1e9], [16.0, 9e9], [256.0, 5e10]]},
        "attention": {"float32": [[1024.0, 1e8], [1048576.0, 4e9]]},
        "cpu_attention": {"float32": [[1024.0, 5e7], [1048576.0, 2e9]]},
        "copy": {"h2d": [[65536.0, 1e9], [1 << 26, 8e9]], "d2h": [[65536.0, 2e9], [1 << 26, 7e9]]},
    }
    return HardwareProfile.from_json(p.to_json())


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_round_trips(name, tmp_path):
    p = PRESETS[name]
    assert HardwareProfile.from_json(p.to_json()) == p
    assert HardwareProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
    p.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == p


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_is_sane(name):
    p = PRESETS[name]
    assert p.name == name and p.source == "preset"
    assert p.device_memory_bytes == parse_size(NAMED_MEMORY[name])
    assert set(p.device_flops) == set(DTYPES) == set(p.cpu_flops)
    rates = [*p.device_flops.values(), *p.cpu_flops.values(), p.device_bandwidth, p.h2d_bandwidth,
             p.d2h_bandwidth, p.host_bandwidth]
    assert all(r > 0 and math.isfinite(r) for r in rates)
    assert p.cpu_cores >= 1 and p.curves == {}
    if p.device_kind == "cuda":
        assert p.device_flops["bfloat16"] >= p.device_flops["float32"]
        assert p.device_flops["float16"] >= p.device_flops["float32"]
        assert p.device_bandwidth > p.h2d_bandwidth  # the device's own memory beats the host link
        assert 10e9 <= p.h2d_bandwidth <= 64e9  # PCIe 3.0 .. 5.0, achievable
    else:
        assert p.device_bandwidth == p.host_bandwidth


def test_preset_figures_spot_checks():
    assert PRESETS["h100-80gb"].device_flops["bfloat16"] == pytest.approx(989.4e12)
    assert PRESETS["a100-80gb"].device_flops["float32"] == pytest.approx(19.5e12)
    assert PRESETS["h200"].device_bandwidth == pytest.approx(4.8e12)
    assert PRESETS["t4"].h2d_bandwidth < PRESETS["l4"].h2d_bandwidth < PRESETS["h100-80gb"].h2d_bandwidth
    assert PRESETS["cpu"].device_flops["float32"] == pytest.approx(2 * 3e9 * 32)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_preset_gemm_rate_monotone_and_capped(name, dtype):
    p = PRESETS[name]
    rates = [p.gemm_rate(dtype, t) for t in TOKENS]
    assert all(b >= a for a, b in zip(rates, rates[1:]))
    assert all(0 < r <= p.device_flops[dtype] for r in rates)
    assert rates[-1] == p.device_flops[dtype]  # enough tokens reach the peak
    # memory-bound end: one token reads each weight element once for 2 FLOP
    elem = 4 if dtype == "float32" else 2
    assert p.gemm_rate(dtype, 1) == min(p.device_flops[dtype], p.device_bandwidth * 2 / elem)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_attention_and_copy_constants(name):
    p = PRESETS[name]
    assert p.attention_rate("bfloat16", 1e6) == pytest.approx(0.5 * p.device_bandwidth)
    assert p.attention_rate("bfloat16", 1e9, on_cpu=True) == pytest.approx(0.5 * p.host_bandwidth)
    assert p.copy_rate("h2d", 1 << 20) == p.h2d_bandwidth
    assert p.copy_rate("d2h", 1 << 30) == p.d2h_bandwidth


def test_presets_are_not_shared():
    p = resolve_hardware("h100")
    p.device_flops["bfloat16"] = 1.0
    assert PRESETS["h100-80gb"].device_flops["bfloat16"] == pytest.approx(989.4e12)


# ----------------------------------------------------------------------------- curves


def test_interpolation_hits_points_and_clamps():
    p = _measured_like()
    for tokens, rate in p.curves["gemm"]["float32"]:
        assert p.gemm_rate("float32", int(tokens)) == rate
    assert p.gemm_rate("float32", 0) == 1e9 and p.gemm_rate("float32", 10**6) == 5e10
    assert p.gemm_rate("float32", 4) == pytest.approx(5e9)  # halfway in log2 between 1 and 16
    for kv, rate in p.curves["attention"]["float32"]:
        assert p.attention_rate("float32", kv) == rate
    assert p.attention_rate("float32", 1) == 1e8 and p.attention_rate("float32", 1e12) == 4e9
    assert p.attention_rate("float32", 32768) == pytest.approx((1e8 + 4e9) / 2)
    assert p.attention_rate("float32", 1024, on_cpu=True) == 5e7
    assert p.attention_rate("float32", 1e12, on_cpu=True) == 2e9
    assert p.copy_rate("h2d", 65536) == 1e9 and p.copy_rate("h2d", 1) == 1e9
    assert p.copy_rate("d2h", 1 << 40) == 7e9
    # dtypes without a curve fall back to the models
    assert p.gemm_rate("bfloat16", 1) == min(p.device_flops["bfloat16"], p.device_bandwidth)
    assert p.attention_rate("bf16", 1e6) == 0.5 * p.device_bandwidth


def test_interpolate_log2_between_points():
    pts = [[2.0, 10.0], [8.0, 40.0]]
    assert interpolate_log2(pts, 4.0) == pytest.approx(25.0)
    assert interpolate_log2(pts, 2.0) == 10.0 and interpolate_log2(pts, 8.0) == 40.0
    assert interpolate_log2([[5.0, 3.0]], 1.0) == 3.0 == interpolate_log2([[5.0, 3.0]], 99.0)


def test_dtype_aliases_and_errors():
    assert normalize_dtype("bf16") == "bfloat16" and normalize_dtype("torch.float16") == "float16"
    assert normalize_dtype("FP32") == "float32"
    p = PRESETS["l4"]
    assert p.gemm_rate("bf16", 64) == p.gemm_rate("bfloat16", 64)
    with pytest.raises(HardwareError, match="float8.*float32, bfloat16, float16"):
        p.gemm_rate("float8", 1)
    with pytest.raises(HardwareError, match="h2d"):
        p.copy_rate("d2d", 1)


# ----------------------------------------------------------------------------- resolve_hardware


@pytest.mark.parametrize(("spec", "name"), [
    ("rtx-4090", "rtx4090"), ("4090", "rtx4090"), ("RTX4090", "rtx4090"), ("a100", "a100-80gb"),
    ("A100-80GB", "a100-80gb"), ("h100", "h100-80gb"), ("H200", "h200"), ("t4", "t4"), ("L4", "l4"),
    ("rtx_a6000", "a6000"), ("NVIDIA A5000", "a5000"), ("cpu", "cpu"),
])
def test_resolve_names_and_aliases(spec, name):
    assert resolve_hardware(spec) == PRESETS[name]


def test_resolve_json_path(tmp_path):
    p = _measured_like()
    path = tmp_path / "hw.json"
    p.save(path)
    assert resolve_hardware(str(path)) == p
    assert resolve_hardware(path) == p
    with pytest.raises(HardwareError, match="does not exist.*moecc profile"):
        resolve_hardware(str(tmp_path / "missing.json"))


def test_resolve_unknown_name_lists_presets():
    with pytest.raises(MoeccError) as e:
        resolve_hardware("v100")
    msg = str(e.value)
    assert "v100" in msg and "moecc profile" in msg and "JSON" in msg
    for name in PRESETS:
        assert name in msg


def test_resolve_none_on_this_machine():
    import torch

    p = resolve_hardware(None)
    if not torch.cuda.is_available():
        assert p == PRESETS["cpu"]
    else:
        assert p.device_kind == "cuda" and p.device_memory_bytes > 0


@pytest.mark.parametrize(("device_name", "preset"), [
    ("Tesla T4", "t4"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None), ("NVIDIA RTX A5000", "a5000"), ("NVIDIA RTX A6000", "a6000"),
    ("NVIDIA RTX 6000 Ada Generation", None), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200"),
])
def test_preset_for_device_name(device_name, preset):
    assert preset_for_device_name(device_name) == preset


# ----------------------------------------------------------------------------- from_json errors


def _broken(edit) -> dict:
    d = PRESETS["a100-80gb"].to_json()
    edit(d)
    return d


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d.pop("device_flops"), "device_flops"),
    (lambda d: d.pop("h2d_bandwidth"), "h2d_bandwidth"),
    (lambda d: d["device_flops"].pop("bfloat16"), "device_flops.bfloat16"),
    (lambda d: d.__setitem__("device_bandwidth", -1.0), "device_bandwidth"),
    (lambda d: d.__setitem__("device_bandwidth", "fast"), "device_bandwidth"),
    (lambda d: d.__setitem__("device_memory_bytes", 1.5), "device_memory_bytes"),
    (lambda d: d.__setitem__("cpu_cores", True), "cpu_cores"),
    (lambda d: d.__setitem__("device_kind", "tpu"), "device_kind"),
    (lambda d: d.__setitem__("source", "guess"), "source"),
    (lambda d: d.__setitem__("schema", "moecc.plan"), "schema"),
    (lambda d: d.__setitem__("version", 2), "version"),
    (lambda d: d.__setitem__("bandwith", 1.0), "bandwith"),
    (lambda d: d["cpu_flops"].__setitem__("float32", float("nan")), "cpu_flops.float32"),
    (lambda d: d.__setitem__("curves", {"gemm": {"float32": [[1, 2], [1, 3]]}}), "curves.gemm.float32[1][0]"),
    (lambda d: d.__setitem__("curves", {"gemm": {"float32": [[1, 0]]}}), "curves.gemm.float32[0][1]"),
    (lambda d: d.__setitem__("curves", {"gemm": {"float32": []}}), "curves.gemm.float32"),
    (lambda d: d.__setitem__("curves", {"copy": {"d2d": [[1, 1]]}}), "curves.copy.d2d"),
    (lambda d: d.__setitem__("curves", {"roofline": {}}), "curves.roofline"),
    (lambda d: d.__setitem__("copy_overlap", 1.5), "copy_overlap"),
    (lambda d: d.__setitem__("copy_overlap", -2.5), "copy_overlap"),
    (lambda d: d.__setitem__("curves", {"mlp": {"float32": [[1, 1]]}}), "curves.mlp.float32"),
    (lambda d: d.__setitem__("copy_overlap", "half"), "copy_overlap"),
])
def test_from_json_names_the_field(edit, field):
    with pytest.raises(HardwareError, match=re.escape(f"field '{field}'")):
        HardwareProfile.from_json(_broken(edit))


def test_from_json_curves_optional_and_not_an_object():
    d = PRESETS["t4"].to_json()
    del d["curves"]
    del d["copy_overlap"]  # optional too: a GPU's DMA engine overlaps fully
    assert HardwareProfile.from_json(d) == PRESETS["t4"]
    assert PRESETS["t4"].copy_overlap == 1.0 and PRESETS["cpu"].copy_overlap < 1.0
    with pytest.raises(HardwareError, match="expected a JSON object"):
        HardwareProfile.from_json([1, 2])


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HardwareError, match="bad.json.*not valid JSON"):
        HardwareProfile.load(bad)
    d = PRESETS["t4"].to_json()
    del d["cpu_cores"]
    bad.write_text(json.dumps(d))
    with pytest.raises(HardwareError, match="bad.json: field 'cpu_cores' is missing"):
        resolve_hardware(str(bad))
    with pytest.raises(HardwareError, match="cannot read"):
        HardwareProfile.load(tmp_path / "nope.json")


# ----------------------------------------------------------------------------- moecc profile


class StepClock:
    """A fake time.perf_counter: each reading is `step` seconds after the one before (plus what
    a test adds to `t`), however long the work between the readings took."""

    def __init__(self, step: float = 0.01):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


@pytest.fixture
def steady_clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    """Every timer `moecc profile` makes in this test reads one StepClock (10 ms a reading: a
    point takes its fewest calls, and no curve is cut short)."""
    from moecc.measure import profile

    clock = StepClock()
    monkeypatch.setattr(profile, "_Timer", functools.partial(profile._Timer, clock=clock))
    return clock


def test_profile_quick_cli_writes_a_loadable_profile(tmp_path, steady_clock):
    from typer.testing import CliRunner

    from moecc.cli import app

    out = tmp_path / "hw.json"
    result = CliRunner().invoke(app, ["profile", "--quick", "--device", "cpu", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "gemm float32: peak" in result.output and "copy h2d" in result.output
    p = resolve_hardware(str(out))
    assert p.source == "measured" and p.device_kind == "cpu" and p.cpu_cores >= 1
    assert p.device_memory_bytes > 10**8
    assert set(p.curves) == {"gemm", "attention", "cpu_attention", "copy", "elementwise"}
    assert set(p.curves["copy"]) == {"h2d", "d2h"}
    for kind, per in p.curves.items():
        for key, pts in per.items():
            assert pts, (kind, key)
            assert all(x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y) for x, y in pts), (kind, key)
    assert len(p.curves["gemm"]["float32"]) == 4, "every size measured (the clock is steady)"
    assert p.device_flops["float32"] == max(r for _, r in p.curves["gemm"]["float32"])
    assert p.cpu_flops == p.device_flops
    assert all(math.isfinite(r) and r > 0 for r in [p.device_bandwidth, p.host_bandwidth, p.h2d_bandwidth])
    assert p.gemm_rate("float32", 16) > 0 and p.attention_rate("float32", 1 << 20, on_cpu=True) > 0
    assert -2.0 <= p.copy_overlap <= 1.0 and "can hide behind compute" in result.output


def test_profile_cli_rejects_bad_dtype_and_device(tmp_path):
    from typer.testing import CliRunner

    from moecc.cli import app

    r = CliRunner().invoke(app, ["profile", "--quick", "--dtype", "int4", "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 1 and "int4" in r.output
    r = CliRunner().invoke(app, ["profile", "--quick", "--device", "tpu", "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 1 and "--device" in r.output
    assert not (tmp_path / "x.json").exists()


def test_mlp_rate_uses_the_curve_of_its_shape_else_gemm():
    p = HardwareProfile.from_json({**PRESETS["cpu"].to_json(),
                                   "curves": {"mlp": {"float32:64x128": [[1, 1e9], [256, 4e10]]}}})
    assert p.mlp_rate("float32", 256, 64, 128) == 4e10
    assert p.mlp_rate("fp32", 16, 64, 128) == p.mlp_rate("float32", 16, 64, 128) < 4e10
    assert p.mlp_rate("float32", 256, 64, 256) == p.gemm_rate("float32", 256)  # another shape


def test_profile_model_option_measures_its_expert_shape(tmp_path, steady_clock, monkeypatch):
    from typer.testing import CliRunner

    from moecc.cli import app

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 256,
                                                   "moe_intermediate_size": 96, "torch_dtype": "float32"}))
    out = tmp_path / "hw.json"
    result = CliRunner().invoke(app, ["profile", "--quick", "--device", "cpu", "--model", str(model), "--no-calibrate",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    p = resolve_hardware(str(out))
    pts = p.curves["mlp"]["float32:64x96"]
    assert len(pts) >= 3 and all(r > 0 for _, r in pts)
    assert p.mlp_rate("float32", pts[-1][0], 64, 96) == pts[-1][1]
    monkeypatch.setattr("moecc.measure.profile.measure", lambda **kw: p)  # measured above: only calibration is new
    no_weights = CliRunner().invoke(app, ["profile", "--quick", "--device", "cpu", "--model", str(model), "-o",
                                          str(tmp_path / "cal.json")])
    assert no_weights.exit_code == 1 and "--no-calibrate" in no_weights.output
    bad = CliRunner().invoke(app, ["profile", "--quick", "--model", str(tmp_path / "nope"), "-o", str(out)])
    assert bad.exit_code != 0 and "cannot read hidden/intermediate sizes" in bad.output


def test_elementwise_rate_uses_its_curve_else_a_share_of_memory_bandwidth():
    p = HardwareProfile.from_json({**PRESETS["cpu"].to_json(),
                                   "curves": {"elementwise": {"float32": [[1e6, 2e10], [1e8, 1e10]]}}})
    assert p.elementwise_rate("float32", 1e8) == 1e10 and p.elementwise_rate("fp32", 1e9) == 1e10
    assert 1e10 < p.elementwise_rate("float32", 1e7) < 2e10
    assert p.elementwise_rate("bfloat16", 1e7) == 0.5 * p.device_bandwidth  # no curve for this dtype


def test_elementwise_glue_is_counted_per_module():
    """Norms, residual adds, rope and the expert gather/scatter are priced per token: a step's
    attention and MoE times grow with them, and MLA queries count their latent width."""
    from moecc.planner.costs import ELEMENTWISE_PASSES, elementwise_bytes
    from moecc.ir import Node

    H = 64
    norm = Node("n", "rmsnorm", shape=("T", H))
    assert elementwise_bytes(norm, 4, H) == ELEMENTWISE_PASSES["rmsnorm"] * H * 4
    mha = Node("a", "attention", attrs={"num_heads": 4, "head_dim": 16})
    mla = Node("a", "attention", attrs={"variant": "mla", "num_heads": 4, "head_dim": 8, "kv_lora_rank": 32,
                                        "qk_rope_head_dim": 8})
    assert elementwise_bytes(mha, 2, H) == ELEMENTWISE_PASSES["attention_q"] * 64 * 2
    assert elementwise_bytes(mla, 2, H) == ELEMENTWISE_PASSES["attention_q"] * 4 * 40 * 2
    experts = Node("e", "experts", attrs={"top_k": 2, "num_experts": 8, "intermediate_size": 32})
    assert elementwise_bytes(experts, 4, H) == ELEMENTWISE_PASSES["experts"] * 2 * H * 4
    assert elementwise_bytes(Node("k", "kv_load"), 4, H) == 0


def test_speed_canary_times_the_runtime_expert_mlp_and_scales_with_its_shape(monkeypatch):
    """The benchmark's canary: the median time of the runtime's expert MLP calls over about
    the duration asked, per expert shape; read here from a fake clock that each call advances
    by 0.1 µs per weight (the calls themselves are real), so the figures are exact under any load."""
    from moecc.measure.profile import SpeedCanary
    from moecc_runtime.worker import kernels

    assert SpeedCanary(64, 128, rows=16, pool_bytes=1 << 20).seconds(0.0) > 0  # the real clock: 5 calls
    clock, real, calls = StepClock(step=0.0), kernels.gated_mlp, [0]

    def timed(x, gate, up, down, act):
        calls[0] += 1
        clock.t += (gate.numel() + up.numel() + down.numel()) * 1e-7
        return real(x, gate, up, down, act)

    monkeypatch.setattr(kernels, "gated_mlp", timed)
    small = SpeedCanary(64, 128, rows=16, pool_bytes=1 << 20, clock=clock)
    big = SpeedCanary(256, 1024, rows=16, pool_bytes=1 << 22, clock=clock)
    s, b = small.seconds(0.05), big.seconds(0.05)
    assert s == pytest.approx(3 * 64 * 128 * 1e-7) and b == pytest.approx(3 * 256 * 1024 * 1e-7)
    assert calls[0] == pytest.approx(math.ceil(0.05 / s) + 5, abs=1), "calls until 0.05 s is spent, and at least 5"
    assert small.seconds(0.02) == pytest.approx(s)
