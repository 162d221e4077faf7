"""Hardware profiles: what the planner knows about the machine a plan is for.

A `HardwareProfile` holds peak rates (datasheet figures for a preset, measured ones from
`moecc profile`) and, when measured, rate curves against problem size. The planner asks it
three questions, each a pure function of the profile:

- `gemm_rate(dtype, tokens)`      FLOP/s of a weight GEMM over `tokens` rows,
- `attention_rate(dtype, kv_bytes, on_cpu)`  bytes of KV consumed per second by one
  attention call that reads `kv_bytes` of K and V,
- `copy_rate(direction, nbytes)`  bytes/s of one pinned host<->device copy of `nbytes`.

Units: FLOP/s and bytes/s throughout, memory in bytes (decimal datasheet figures: a "24GB"
card is 24*10**9 bytes here; what CUDA reports is a few percent less). The JSON form is
`{"schema": "moecc.hardware", "version": 1, <every field>}`.

This module imports torch only inside `resolve_hardware(None)` (to look at the local GPU).
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moecc_runtime.contract.job_kinds import COMPUTE_JOB_KINDS, COPY_JOB_KINDS

from moecc.errors import HardwareError

SCHEMA = "moecc.hardware"
VERSION = 1

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
ELEM_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
SOURCES: tuple[str, ...] = ("preset", "measured", "file")
DEVICE_KINDS: tuple[str, ...] = ("cuda", "cpu")
CURVE_KINDS: tuple[str, ...] = ("gemm", "attention", "cpu_attention", "copy", "mlp", "elementwise")
_MLP_KEY = re.compile(r"^(float32|bfloat16|float16):(\d+)x(\d+)$")
COPY_DIRECTIONS: tuple[str, ...] = ("h2d", "d2h")
#: calibration (see HardwareProfile.calibrated): execution modes and the job kinds corrected
CALIBRATION_MODES: tuple[str, ...] = ("resident", "streamed")
CALIBRATION_KINDS: tuple[str, ...] = COMPUTE_JOB_KINDS + COPY_JOB_KINDS  # the plan schema's job kinds
CALIBRATION_FACTOR_RANGE = (0.05, 50.0)

#: What a CUDA process holds on the device outside any plan (bytes): the context, 0.5-0.9 GB
#: by driver and GPU (measured by the issue-29 run: 0.9 GB on an H200 with torch's kernels
#: loaded lazily), and the cuBLAS / cuBLASLt workspaces (torch's default: 32 MiB per stream
#: on Hopper, a few streams), 0.1 GB. The caching allocator's fragmentation is the planner's
#: DEVICE_DERATE, not part of this. A CPU "device" has no context.
CUDA_CONTEXT_BYTES = 900 * 10**6
CUDA_WORKSPACE_BYTES = 100 * 10**6
DEVICE_RESERVE_BYTES: dict[str, int] = {"cuda": CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES, "cpu": 0}


def default_device_reserve(device_kind: str) -> int:
    """The preset device reserve of a device kind (0 for one this module does not know)."""
    return DEVICE_RESERVE_BYTES.get(device_kind, 0)


# Fraction of memory bandwidth that the runtime's elementwise glue (norms, residual adds,
# rope, gathers) achieves when no curve was measured (short ops, each its own pass).
ELEMENTWISE_EFFICIENCY = 0.5

# Fraction of memory bandwidth that attention over a KV cache achieves when no curve was
# measured (decode attention is a streaming read of K and V, but with softmax, small
# heads and gather overhead in between). On the host (`on_cpu`) it applies to host_bandwidth,
# a STREAM-style figure: the paged kernel reads blocks of 8 positions per KV head, each a few
# KiB, and converts bf16 to fp32 on the way, so half of STREAM is what a preset assumes.
ATTENTION_EFFICIENCY = 0.5

_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
}


def normalize_dtype(dtype: Any) -> str:
    """'float32' | 'bfloat16' | 'float16' for a dtype name, alias ('bf16', 'fp16', 'half')
    or torch dtype; raise HardwareError naming the supported ones otherwise."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise HardwareError(f"unsupported dtype {dtype!r}; hardware profiles know {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def interpolate_log2(points: list[list[float]], x: float) -> float:
    """y at `x` on a curve of [x, y] points sorted by strictly increasing x: linear in
    log2(x) between neighbours, clamped to the first/last y outside the measured range.
    Returns a measured y exactly when `x` equals its x."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return float(points[0][1])
    if x >= xs[-1]:
        return float(points[-1][1])
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return float(points[i][1])
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
    return float(y0 + t * (y1 - y0))


@dataclass
class HardwareProfile:
    """One machine: a device (a GPU, or the CPU itself on a CPU-only machine) and its host.

    Rates: `device_flops`/`cpu_flops` are peak dense GEMM FLOP/s per dtype name
    (float32, bfloat16, float16); `device_bandwidth` device memory bytes/s; `h2d_bandwidth`
    and `d2h_bandwidth` pinned copy bytes/s; `host_bandwidth` host memory bytes/s (bytes read
    plus bytes written, as STREAM counts a copy). `curves` (possibly empty) holds measured
    curves of [size, rate] points, sizes strictly increasing:
    "gemm" {dtype: [[tokens, FLOP/s]]}, "attention" and "cpu_attention"
    {dtype: [[kv_bytes, bytes/s]]}, "copy" {"h2d"|"d2h": [[bytes, bytes/s]]}, "mlp"
    {"dtype:HxI": [[tokens, FLOP/s]]}, "elementwise" {dtype: [[bytes, bytes/s]]}.
    Construction validates every field (HardwareError naming the field).
    """

    name: str
    source: str  # "preset" | "measured" | "file"
    device_kind: str  # "cuda" | "cpu"
    device_name: str
    device_memory_bytes: int
    device_flops: dict[str, float]  # peak dense GEMM FLOP/s per dtype
    device_bandwidth: float  # bytes/s
    h2d_bandwidth: float  # bytes/s, pinned host -> device
    d2h_bandwidth: float  # bytes/s, device -> pinned host
    host_bandwidth: float  # bytes/s
    cpu_cores: int
    cpu_flops: dict[str, float]  # peak dense GEMM FLOP/s per dtype on the host CPU
    curves: dict = field(default_factory=dict)
    # share of a transfer's time that can run behind compute: 1 for a GPU's DMA copy engine;
    # on a CPU-only machine the copy thread takes cores and memory bandwidth from compute
    # (`moecc profile` measures it on the runtime's streamed expert loop); from -2 to 1,
    # below 0 when a second of copying costs compute more than a second
    copy_overlap: float = 1.0
    # measured on the runtime itself (`moecc profile --model DIR` runs a short job of the model,
    # moecc/measure/calibrate.py): {"model": name, "resident"|"streamed": {"factor": {kind: x},
    # "job_s": {kind: seconds per job}, "overhead_layer_s": s, "overhead_row_s": s}};
    # empty: nothing corrected
    calibration: dict = field(default_factory=dict)
    # device bytes the process holds that no plan sizes: the CUDA context (0.5-0.9 GB) and the
    # cuBLAS / cuBLASLt workspaces; kept out of --gpu-mem before the plan's own bytes. A preset
    # has DEVICE_RESERVE_BYTES[device_kind]; `moecc profile` on a device measures it (total - free
    # after the context is up and a GEMM has run, before any arena); a JSON profile without
    # the field gets its device kind's preset figure
    device_reserve_bytes: int = -1  # -1: the device kind's preset figure (set in __post_init__)

    def __post_init__(self) -> None:
        if self.device_reserve_bytes < 0:
            self.device_reserve_bytes = default_device_reserve(self.device_kind)
        _validate(self.to_json(), origin=None)

    # ------------------------------------------------------------------ rates

    def gemm_rate(self, dtype: str, tokens: int) -> float:
        """FLOP/s of a weight GEMM (x[tokens, K] @ W[K, N], 2*tokens*K*N FLOP) on the device.

        Measured: the "gemm" curve for `dtype`, linear in log2(tokens) between points and
        clamped to the end points. Otherwise a roofline: min(peak, device_bandwidth *
        intensity) with intensity = 2*tokens/elem_bytes FLOP per weight byte (each weight
        element is read once and used for `tokens` rows). Tokens below 1 count as 1.
        Non-decreasing in tokens without a curve, and never above `device_flops[dtype]`.
        """
        dt = normalize_dtype(dtype)
        tokens = max(1.0, float(tokens))
        curve = self.curves.get("gemm", {}).get(dt)
        if curve:
            return interpolate_log2(curve, tokens)
        intensity = 2.0 * tokens / ELEM_BYTES[dt]  # FLOP per weight byte
        return min(self.device_flops[dt], self.device_bandwidth * intensity)

    def mlp_rate(self, dtype: str, tokens: float, hidden: int, inter: int) -> float:
        """FLOP/s of one gated MLP (gate and up [I, H], down [H, I], 6*tokens*H*I FLOP, the
        runtime's expert kernel with its activation and product) over `tokens` rows. Measured:
        the "mlp" curve for this dtype and shape ("float32:HxI", from `moecc profile
        --model`); otherwise gemm_rate."""
        dt = normalize_dtype(dtype)
        curve = self.curves.get("mlp", {}).get(f"{dt}:{int(hidden)}x{int(inter)}")
        if curve:
            return interpolate_log2(curve, max(1.0, float(tokens)))
        return self.gemm_rate(dt, tokens)

    def attention_rate(self, dtype: str, kv_bytes: float, on_cpu: bool = False) -> float:
        """Bytes of K+V consumed per second by one attention call reading `kv_bytes` of KV
        (decode-style: few query tokens per sequence), on the device or, with `on_cpu`, on
        the host CPU. Measured: the "attention" / "cpu_attention" curve for `dtype`, linear
        in log2(kv_bytes), clamped at the ends; otherwise ATTENTION_EFFICIENCY (0.5) times
        device_bandwidth (host_bandwidth when `on_cpu`)."""
        dt = normalize_dtype(dtype)
        curve = self.curves.get("cpu_attention" if on_cpu else "attention", {}).get(dt)
        if curve:
            return interpolate_log2(curve, max(1.0, float(kv_bytes)))
        return ATTENTION_EFFICIENCY * (self.host_bandwidth if on_cpu else self.device_bandwidth)

    def elementwise_rate(self, dtype: str, nbytes: float) -> float:
        """Bytes/s of the runtime's elementwise ops (counted as costs.ELEMENTWISE_PASSES
        counts them) over one call touching `nbytes`. Measured: the "elementwise" curve for
        `dtype` (the runtime's rmsnorm + residual add), linear in log2(nbytes), clamped;
        otherwise ELEMENTWISE_EFFICIENCY (0.5) times device_bandwidth."""
        dt = normalize_dtype(dtype)
        curve = self.curves.get("elementwise", {}).get(dt)
        if curve:
            return interpolate_log2(curve, max(1.0, float(nbytes)))
        return ELEMENTWISE_EFFICIENCY * self.device_bandwidth

    def copy_rate(self, direction: str, nbytes: float) -> float:
        """Bytes/s of one pinned copy of `nbytes` in `direction` ("h2d" or "d2h"). Measured:
        the "copy" curve, linear in log2(nbytes), clamped at the ends; otherwise the constant
        h2d_bandwidth / d2h_bandwidth."""
        if direction not in COPY_DIRECTIONS:
            raise HardwareError(f"copy direction must be 'h2d' or 'd2h', not {direction!r}")
        curve = self.curves.get("copy", {}).get(direction)
        if curve:
            return interpolate_log2(curve, max(1.0, float(nbytes)))
        return self.h2d_bandwidth if direction == "h2d" else self.d2h_bandwidth

    def calibrated(self, mode: str, kind: str, seconds: float, jobs: float = 1.0) -> float:
        """`jobs` runtime jobs of `kind` (CALIBRATION_KINDS) that the model puts at `seconds`
        in all, when weights are `mode` ("resident": read in place; "streamed": through the
        device arena): factor x seconds + jobs x seconds per job, as measured on the runtime;
        `seconds` when not calibrated."""
        cal = self.calibration.get(mode, {})
        return (float(cal.get("factor", {}).get(kind, 1.0)) * seconds
                + float(cal.get("job_s", {}).get(kind, 0.0)) * jobs)

    def overhead_s(self, mode: str, rows: float) -> float:
        """Seconds per layer of a step over `rows` rows that no modelled job accounts for
        (the runtime's Python between jobs, embedding, waits the schedule does not see):
        a fixed part plus a part per row; 0 when not calibrated."""
        cal = self.calibration.get(mode, {})
        return float(cal.get("overhead_layer_s", 0.0)) + float(cal.get("overhead_row_s", 0.0)) * rows

    # ------------------------------------------------------------------ (de)serialisation

    def to_json(self) -> dict:
        """Plain JSON-ready dict: schema, version and every field (curves deep-copied)."""
        d: dict[str, Any] = {"schema": SCHEMA, "version": VERSION}
        for f in fields(self):
            d[f.name] = copy.deepcopy(getattr(self, f.name))
        return d

    @classmethod
    def from_json(cls, d: Any, *, origin: str | None = None) -> HardwareProfile:
        """A profile from `to_json`'s dict; checks schema "moecc.hardware", version 1 and
        every field, raising HardwareError that names the missing or wrong field (and
        `origin`, e.g. the file, when given). `curves` may be absent (empty)."""
        _validate(d, origin=origin)
        kwargs = {f.name: copy.deepcopy(d[f.name]) for f in fields(cls) if f.name in d}
        kwargs["device_flops"] = {k: float(v) for k, v in d["device_flops"].items()}
        kwargs["cpu_flops"] = {k: float(v) for k, v in d["cpu_flops"].items()}
        for key in ("device_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "host_bandwidth"):
            kwargs[key] = float(d[key])
        kwargs["copy_overlap"] = float(d.get("copy_overlap", 1.0))
        kwargs["calibration"] = copy.deepcopy(d.get("calibration", {}))
        kwargs["device_reserve_bytes"] = int(d.get("device_reserve_bytes", -1))
        kwargs["curves"] = {kind: {k: [[float(x), float(y)] for x, y in pts] for k, pts in per.items()}
                            for kind, per in d.get("curves", {}).items()}
        return cls(**kwargs)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as indented JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        """Read a profile written by `save` / `moecc profile`; HardwareError if the file is
        missing, not JSON, or not a valid profile (the message names the file)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise HardwareError(f"cannot read hardware profile {path}: {e.strerror or e}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise HardwareError(f"hardware profile {path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        return cls.from_json(d, origin=str(path))


# ---------------------------------------------------------------------------------- validation


def _validate(d: Any, *, origin: str | None) -> None:
    """Raise HardwareError naming the first missing or wrong field of a profile dict."""
    where = f"hardware profile {origin}" if origin else "hardware profile"

    def bad(path: str, problem: str) -> HardwareError:
        return HardwareError(f"{where}: field '{path}' {problem}")

    def number(path: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad(path, f"must be a positive finite number, got {v!r}")

    def integer(path: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise bad(path, f"must be a positive integer, got {v!r}")

    def text(path: str, v: Any, choices: tuple[str, ...] | None = None) -> None:
        if not isinstance(v, str) or not v:
            raise bad(path, f"must be a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise bad(path, f"must be one of {', '.join(choices)}, got {v!r}")

    def per_dtype(path: str, v: Any) -> None:
        if not isinstance(v, dict):
            raise bad(path, f"must be an object mapping dtype names to FLOP/s, got {type(v).__name__}")
        for dt in DTYPES:
            if dt not in v:
                raise bad(f"{path}.{dt}", "is missing")
        for dt, rate in v.items():
            if dt not in DTYPES:
                raise bad(f"{path}.{dt}", f"is not a known dtype (use {', '.join(DTYPES)})")
            number(f"{path}.{dt}", rate)

    def curve(path: str, pts: Any) -> None:
        if not isinstance(pts, list) or not pts:
            raise bad(path, "must be a non-empty list of [size, rate] points")
        prev = 0.0
        for i, p in enumerate(pts):
            if not isinstance(p, (list, tuple)) or len(p) != 2:
                raise bad(f"{path}[{i}]", f"must be a [size, rate] pair, got {p!r}")
            number(f"{path}[{i}][0]", p[0])
            number(f"{path}[{i}][1]", p[1])
            if p[0] <= prev:
                raise bad(f"{path}[{i}][0]", f"sizes must strictly increase, got {p[0]!r} after {prev!r}")
            prev = p[0]

    if not isinstance(d, dict):
        raise HardwareError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if d.get("schema") != SCHEMA:
        raise bad("schema", f"must be {SCHEMA!r}, got {d.get('schema')!r} (is this a `moecc profile` file?)")
    if d.get("version") != VERSION:
        raise bad("version", f"must be {VERSION}, got {d.get('version')!r} (written by another moecc version?)")
    known = {"schema", "version"} | {f.name for f in fields(HardwareProfile)}
    for key in d:
        if key not in known:
            raise bad(key, f"is not a hardware profile field (known: {', '.join(sorted(known))})")
    for f in fields(HardwareProfile):
        if f.name not in d and f.name not in ("curves", "copy_overlap", "calibration", "device_reserve_bytes"):
            raise bad(f.name, "is missing")
    res = d.get("device_reserve_bytes", 0)
    if isinstance(res, bool) or not isinstance(res, int) or res < 0:
        raise bad("device_reserve_bytes", f"must be a whole number of bytes >= 0, got {res!r}")
    ov = d.get("copy_overlap", 1.0)
    if isinstance(ov, bool) or not isinstance(ov, (int, float)) or not -2.0 <= ov <= 1.0:
        raise bad("copy_overlap", f"must be a number from -2 to 1, got {ov!r}")
    text("name", d["name"])
    text("source", d["source"], SOURCES)
    text("device_kind", d["device_kind"], DEVICE_KINDS)
    text("device_name", d["device_name"])
    integer("device_memory_bytes", d["device_memory_bytes"])
    per_dtype("device_flops", d["device_flops"])
    for key in ("device_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "host_bandwidth"):
        number(key, d[key])
    integer("cpu_cores", d["cpu_cores"])
    per_dtype("cpu_flops", d["cpu_flops"])
    curves = d.get("curves", {})
    if not isinstance(curves, dict):
        raise bad("curves", f"must be an object, got {type(curves).__name__}")
    for kind, per in curves.items():
        if kind not in CURVE_KINDS:
            raise bad(f"curves.{kind}", f"is not a curve kind (use {', '.join(CURVE_KINDS)})")
        if not isinstance(per, dict):
            raise bad(f"curves.{kind}", f"must be an object, got {type(per).__name__}")
        keys = COPY_DIRECTIONS if kind == "copy" else DTYPES
        for k, pts in per.items():
            if kind == "mlp":
                if not isinstance(k, str) or not _MLP_KEY.match(k):
                    raise bad(f"curves.mlp.{k}", "must be named DTYPE:HIDDENxINTERMEDIATE, e.g. float32:4096x14336")
            elif k not in keys:
                raise bad(f"curves.{kind}.{k}", f"is not one of {', '.join(keys)}")
            curve(f"curves.{kind}.{k}", pts)
    _validate_calibration(d.get("calibration", {}), bad)


def _validate_calibration(cal: Any, bad: Any) -> None:
    """Calibration: {"model": text, mode: {"factor": {kind: a number in
    CALIBRATION_FACTOR_RANGE}, "job_s": {kind: seconds >= 0}, "overhead_layer_s": seconds
    >= 0, "overhead_row_s": seconds >= 0}}; every part optional."""
    if not isinstance(cal, dict):
        raise bad("calibration", f"must be an object, got {type(cal).__name__}")
    lo, hi = CALIBRATION_FACTOR_RANGE

    def seconds(path: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad(path, f"must be a finite number of seconds >= 0, got {v!r}")

    for mode, fit in cal.items():
        if mode == "model":
            if not isinstance(fit, str):
                raise bad("calibration.model", f"must be a string, got {fit!r}")
            continue
        if mode not in CALIBRATION_MODES:
            raise bad(f"calibration.{mode}", f"is not a mode (use model, {', '.join(CALIBRATION_MODES)})")
        if not isinstance(fit, dict):
            raise bad(f"calibration.{mode}", f"must be an object, got {type(fit).__name__}")
        for key, v in fit.items():
            where = f"calibration.{mode}.{key}"
            if key in ("overhead_layer_s", "overhead_row_s"):
                seconds(where, v)
            elif key in ("factor", "job_s"):
                if not isinstance(v, dict):
                    raise bad(where, f"must be an object mapping job kinds to numbers, got {type(v).__name__}")
                for kind, x in v.items():
                    if kind not in CALIBRATION_KINDS:
                        raise bad(f"{where}.{kind}", f"is not a job kind (use {', '.join(CALIBRATION_KINDS)})")
                    if key == "job_s":
                        seconds(f"{where}.{kind}", x)
                    elif isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
                        raise bad(f"{where}.{kind}", f"must be a factor from {lo} to {hi}, got {x!r}")
            else:
                raise bad(where, "is not a calibration field (use factor, job_s, overhead_layer_s, overhead_row_s)")


# ---------------------------------------------------------------------------------- presets

GB = 10**9
TFLOPS = 1e12
GBPS = 1e9  # bytes/s

# Achievable pinned host->device / device->host rates per host link (not the raw link rate).
PCIE3, PCIE4, PCIE5 = 12 * GBPS, 25 * GBPS, 50 * GBPS
SERVER_HOST_BW, WORKSTATION_HOST_BW = 100 * GBPS, 50 * GBPS
# One socket of a DDR4 server CPU, the kind of host MoE-Gen measured its A5000 on ("a
# multi-core server CPU with DDR4"; the exact part is not assumed): 8 channels of DDR4-3200
# = 8 x 25.6 = 204.8 GB/s peak, of which STREAM reaches about 75% on such parts, ~150 GB/s.
# Host attention then reads KV at ATTENTION_EFFICIENCY x 150 = 75 GB/s, three times the
# PCIe 4.0 link's 25 GB/s. 16 cores (e.g. an EPYC 7313P: 16 cores, 8 x DDR4-3200).
DDR4_SERVER_HOST_BW = 150 * GBPS


def _host_cpu(cores: int, ghz: float = 2.5, fp32_per_cycle: int = 32) -> dict[str, float]:
    """Peak GEMM FLOP/s of a host CPU: cores * clock * FP32 FLOP/cycle (two 256-bit FMA
    pipes = 32). bf16 counted at the fp32 rate (not every CPU has native bf16 dot products);
    fp16 at 0.2x: without AVX512-FP16/AMX torch's CPU fp16 GEMM converts on the fly (measured on
    a Zen 4 core through F.linear: 21 GFLOP/s fp16 against 95 fp32)."""
    fp32 = cores * ghz * 1e9 * fp32_per_cycle
    return {"float32": fp32, "bfloat16": fp32, "float16": fp32 * 0.2}


def _gpu(name: str, device_name: str, memory_gb: float, fp32_tflops: float, bf16_tflops: float,
         fp16_tflops: float, bandwidth_gbps: float, link: float, host_bw: float, cores: int) -> HardwareProfile:
    return HardwareProfile(
        name=name, source="preset", device_kind="cuda", device_name=device_name,
        device_memory_bytes=int(memory_gb * GB),
        device_flops={"float32": fp32_tflops * TFLOPS, "bfloat16": bf16_tflops * TFLOPS,
                      "float16": fp16_tflops * TFLOPS},
        device_bandwidth=bandwidth_gbps * GBPS, h2d_bandwidth=link, d2h_bandwidth=link,
        host_bandwidth=host_bw, cpu_cores=cores, cpu_flops=_host_cpu(cores), curves={},
    )


PRESETS: dict[str, HardwareProfile] = {
    # NVIDIA T4 Tensor Core GPU datasheet: 8.1 TFLOPS FP32, 65 TFLOPS FP16 (mixed precision),
    # 16 GB GDDR6 at 320 GB/s, PCIe 3.0 x16. Turing has no bf16 tensor cores: bf16 GEMMs run at
    # about the FP32 rate, so bf16 = FP32 here.
    "t4": _gpu("t4", "Tesla T4", 16, 8.1, 8.1, 65, 320, PCIE3, SERVER_HOST_BW, 8),
    # NVIDIA L4 Tensor Core GPU datasheet: 30.3 TFLOPS FP32, 242 TFLOPS BF16/FP16 with sparsity
    # (121 dense), 24 GB GDDR6 at 300 GB/s, PCIe 4.0 x16.
    "l4": _gpu("l4", "NVIDIA L4", 24, 30.3, 121, 121, 300, PCIE4, SERVER_HOST_BW, 16),
    # NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090): 82.6 TFLOPS FP32, 165.2 TFLOPS
    # FP16/BF16 tensor with FP32 accumulate (dense; 330 with FP16 accumulate), 24 GB GDDR6X at
    # 1008 GB/s, PCIe 4.0 x16.
    "rtx4090": _gpu("rtx4090", "NVIDIA GeForce RTX 4090", 24, 82.6, 165.2, 165.2, 1008, PCIE4,
                    WORKSTATION_HOST_BW, 16),
    # NVIDIA RTX A5000 datasheet: 27.8 TFLOPS FP32, 222.2 TFLOPS tensor with sparsity (111.1
    # dense), 24 GB GDDR6 at 768 GB/s, PCIe 4.0 x16; in a DDR4 server (DDR4_SERVER_HOST_BW), as
    # MoE-Gen measured it: its host's memory rate is what host attention reads KV at.
    "a5000": _gpu("a5000", "NVIDIA RTX A5000", 24, 27.8, 111.1, 111.1, 768, PCIE4, DDR4_SERVER_HOST_BW, 16),
    # NVIDIA RTX A6000 datasheet: 38.7 TFLOPS FP32, 309.7 TFLOPS tensor with sparsity (154.8
    # dense), 48 GB GDDR6 at 768 GB/s, PCIe 4.0 x16.
    "a6000": _gpu("a6000", "NVIDIA RTX A6000", 48, 38.7, 154.8, 154.8, 768, PCIE4, WORKSTATION_HOST_BW, 24),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 19.5 TFLOPS FP32 (PyTorch does not
    # use TF32 for fp32 matmuls by default), 312 TFLOPS BF16/FP16 dense, 80 GB HBM2e at
    # 2039 GB/s, PCIe 4.0 host link.
    "a100-80gb": _gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", 80, 19.5, 312, 312, 2039, PCIE4, SERVER_HOST_BW, 32),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 67 TFLOPS FP32, 1979 TFLOPS BF16/FP16
    # with sparsity (989.4 dense), 80 GB HBM3 at 3.35 TB/s, PCIe 5.0 host link.
    "h100-80gb": _gpu("h100-80gb", "NVIDIA H100 80GB HBM3", 80, 67, 989.4, 989.4, 3350, PCIE5, SERVER_HOST_BW, 32),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 67 TFLOPS FP32, 1979 TFLOPS BF16/FP16 with
    # sparsity (989.4 dense), 141 GB HBM3e at 4.8 TB/s, PCIe 5.0 host link.
    "h200": _gpu("h200", "NVIDIA H200", 141, 67, 989.4, 989.4, 4800, PCIE5, SERVER_HOST_BW, 32),
    # This kind of CPU-only development machine, unmeasured: 2 cores, 24 GB of RAM (the
    # "device" is the CPU and its memory). FP32: 2 cores x 3 GHz x 32 FLOP/cycle (two 256-bit
    # FMA pipes) = 192 GFLOP/s (measured: 95 GFLOP/s on one idle Zen 4 core through F.linear).
    # bf16: 2x FP32 (AVX512-BF16 dot products; measured 212 GFLOP/s per core). fp16: 0.2x FP32
    # (no AVX512-FP16: converted on the fly; measured 21 GFLOP/s per core). Memory ~20 GB/s; a
    # host-to-host memcpy moves ~10 GB/s (it reads and writes every byte); a single-threaded
    # memcpy of weights from the page cache ~7 GB/s. Copy overlap 0.5: bench/stream.py's
    # streamed runs lost about half of their copy time from compute (2 cores shared).
    "cpu": HardwareProfile(
        name="cpu", source="preset", device_kind="cpu", device_name="2-core x86-64 CPU (AVX2 FMA)",
        device_memory_bytes=24 * GB,
        device_flops={"float32": 192e9, "bfloat16": 384e9, "float16": 40e9},
        device_bandwidth=20 * GBPS, h2d_bandwidth=10 * GBPS, d2h_bandwidth=10 * GBPS,
        host_bandwidth=20 * GBPS, cpu_cores=2,
        cpu_flops={"float32": 192e9, "bfloat16": 384e9, "float16": 40e9}, curves={}, copy_overlap=0.5,
    ),
}

# Other spellings accepted by resolve_hardware (after lower-casing, '_'/' ' -> '-', and
# dropping a leading 'nvidia-').
_ALIASES: dict[str, str] = {
    "tesla-t4": "t4",
    "rtx-4090": "rtx4090", "4090": "rtx4090", "geforce-rtx-4090": "rtx4090",
    "rtx-a5000": "a5000", "rtxa5000": "a5000",
    "rtx-a6000": "a6000", "rtxa6000": "a6000",
    "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-sxm4-80gb": "a100-80gb", "a100-80gb-sxm": "a100-80gb",
    "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h100-80g": "h100-80gb", "h100-80gb-hbm3": "h100-80gb",
    "h200-141gb": "h200", "h200-sxm": "h200",
}

# torch.cuda.get_device_name() patterns (lower case) -> preset, first match wins.
_DEVICE_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"h200", "h200"),
    (r"h100", "h100-80gb"),
    (r"a100", "a100-80gb"),
    (r"rtx a6000", "a6000"),
    (r"rtx a5000", "a5000"),
    (r"rtx 4090(?!.*laptop)", "rtx4090"),
    (r"\bl4\b", "l4"),
    (r"\bt4\b", "t4"),
)


def preset_for_device_name(device_name: str) -> str | None:
    """The preset whose GPU `device_name` (as torch.cuda.get_device_name reports it) is, or
    None. Variants share their family's preset (an H100 PCIe matches h100-80gb)."""
    low = device_name.lower()
    for pattern, preset in _DEVICE_NAME_PATTERNS:
        if re.search(pattern, low):
            return preset
    return None


def _preset_key(spec: str) -> str | None:
    key = re.sub(r"[\s_]+", "-", spec.strip().lower()).removeprefix("nvidia-")
    if key in PRESETS:
        return key
    return _ALIASES.get(key)


def _unknown(spec: str) -> HardwareError:
    return HardwareError(
        f"unknown hardware {spec!r}; presets: {', '.join(PRESETS)} (also rtx-4090, 4090, a100, h100), "
        f"or the path of a JSON profile written by `moecc profile -o hw.json`"
    )


def resolve_hardware(spec: str | os.PathLike | None) -> HardwareProfile:
    """The profile for `spec` (a fresh copy; mutating it leaves PRESETS alone).

    - None: measures nothing. No CUDA device visible -> PRESETS["cpu"]. Otherwise the preset
      matching torch.cuda.get_device_name(0), with device_name and device_memory_bytes taken
      from the device (an A100 40GB gets a100-80gb rates and 40GB). An unmatched GPU gets
      a100-80gb rates and its own memory; its name says so ("<gpu> (unmatched: a100-80gb
      rates)"), source stays "preset".
    - A preset name, case-insensitive, or an alias (rtx-4090, 4090, a100, h100, ...).
    - A path to a .json profile (from `moecc profile` or `HardwareProfile.save`).
    Raises HardwareError for an unknown name (listing the presets) or a bad/missing file.
    """
    if spec is None:
        return _local_default()
    text = os.fspath(spec)
    if not isinstance(text, str):
        text = text.decode()
    if isinstance(spec, os.PathLike) or text.lower().endswith(".json") or os.sep in text:
        if not Path(text).is_file():
            raise HardwareError(f"hardware profile {text} does not exist; write one with "
                                f"`moecc profile -o {text}` or name a preset ({', '.join(PRESETS)})")
        return HardwareProfile.load(text)
    key = _preset_key(text)
    if key is None:
        if Path(text).is_file():
            return HardwareProfile.load(text)
        raise _unknown(text)
    return copy.deepcopy(PRESETS[key])


def _local_default() -> HardwareProfile:
    """resolve_hardware(None): the preset for what this process can see (see there)."""
    import torch

    if not torch.cuda.is_available():
        return copy.deepcopy(PRESETS["cpu"])
    name = torch.cuda.get_device_name(0)
    memory = int(torch.cuda.get_device_properties(0).total_memory)
    key = preset_for_device_name(name)
    prof = copy.deepcopy(PRESETS[key or "a100-80gb"])
    prof.device_name = name
    prof.device_memory_bytes = memory
    if key is None:
        prof.name = f"{name} (unmatched: a100-80gb rates)"
    return prof
