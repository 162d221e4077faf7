"""`moecc profile`: measure the machine at hand and return a HardwareProfile.

What is measured (all with torch, on the compute device unless said otherwise):

- GEMM FLOP/s against token count: F.linear(x[tokens, K], W[N, K]) over a square weight,
  cycling through enough weight copies that they do not stay in cache (so small token
  counts see memory bandwidth, as streamed expert weights do).
- Attention rate against KV bytes: scaled_dot_product_attention with one query token per
  sequence over a K/V cache; rate = K+V bytes read / time. On CUDA also on the CPU.
- Copy rate against size: pinned host -> device and device -> pinned host on CUDA; on a
  CPU-only machine the "device" is the CPU and a copy is what the runtime's copy engine
  does there: a single-threaded memmove between two host buffers on its own thread (both
  directions share that one curve).
- Copy/compute overlap (CPU-only machines): the runtime's expert loop (its gated MLP over
  memory-mapped experts) timed in place and streamed through two slots by the runtime's copy
  engine; the compute time lost per second of copying is the share of a copy that cannot
  hide (copy_overlap = 1 - that; below 0 when a copy costs compute more than its own length,
  as on small VMs). On CUDA the copy engine is a DMA engine: 1.
- Host memory bandwidth (a big host copy; bytes read + written per second), device memory
  bandwidth (a big device copy on CUDA; the host figure on CPU), cores, memory size.

Every timing is the median of repeated runs (each run batches enough calls to last about a
millisecond, synchronising CUDA around it); a curve stops growing once one call takes too
long, so slow dtypes (fp16 GEMM on most CPUs) cannot stall the run. Budget: a full run takes
under a minute on a 2-core CPU, `quick=True` a few seconds.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from moecc.errors import HardwareError
from moecc.planner.hardware import PRESETS, HardwareProfile, normalize_dtype, resolve_hardware


@dataclass(frozen=True)
class _Settings:
    """Problem sizes and time limits of one run (see _settings)."""

    gemm_dim: int  # K = N of the square weight
    gemm_tokens: tuple[int, ...]
    weight_pool_bytes: int  # total bytes of the rotating weight copies
    attn_batch: int  # sequences per attention call
    attn_heads: int
    attn_head_dim: int
    attn_seq: tuple[int, ...]  # KV positions per sequence
    copy_sizes: tuple[int, ...]  # bytes
    big_copy_bytes: int  # for host/device memory bandwidth
    glue_rows: tuple[int, ...]  # rows of the elementwise (norm + add) measurement
    min_reps: int
    min_point_s: float  # repeat a point at least this long (and min_reps times)
    point_budget_s: float  # stop repeating a point after this long
    slow_call_s: float  # one call slower than this ends the curve after this point


def _settings(device: str, quick: bool) -> _Settings:
    cuda = device == "cuda"
    if quick:
        return _Settings(
            gemm_dim=2048 if cuda else 1024, gemm_tokens=(1, 16, 256, 1024),
            weight_pool_bytes=(256 if cuda else 64) << 20,
            attn_batch=16 if cuda else 4, attn_heads=8, attn_head_dim=128,
            attn_seq=(256, 4096) if cuda else (32, 256, 1024),
            copy_sizes=(1 << 16, 1 << 20, 1 << 24, 1 << 26), big_copy_bytes=1 << 26, glue_rows=(16, 256),
            min_reps=3, min_point_s=0.02, point_budget_s=0.15, slow_call_s=0.2,
        )
    return _Settings(
        gemm_dim=4096 if cuda else 2048, gemm_tokens=(1, 4, 16, 64, 256, 1024, 4096),
        weight_pool_bytes=(512 if cuda else 128) << 20,
        attn_batch=16 if cuda else 4, attn_heads=8, attn_head_dim=128,
        attn_seq=(64, 256, 1024, 4096, 16384) if cuda else (16, 64, 256, 1024, 4096),
        copy_sizes=tuple(1 << s for s in range(16, 29, 2)), big_copy_bytes=1 << 28, glue_rows=(16, 128, 1024, 4096),
        min_reps=5, min_point_s=0.25, point_budget_s=1.0, slow_call_s=1.0,
    )


class _Timer:
    """Times a callable on one device: median seconds per call over repeated batches, read
    from `clock` (time.perf_counter; a test passes a fake one to make the curves' shape
    independent of the machine's load)."""

    def __init__(self, sync: Callable[[], None], settings: _Settings, batch_target_s: float = 1e-3,
                 clock: Callable[[], float] = time.perf_counter):
        self.sync, self.s, self.batch_target_s, self.clock = sync, settings, batch_target_s, clock

    def per_call(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(median seconds per call, seconds of the first timed call). Needs fn to be
        repeatable; runs it once untimed first (warm-up: allocator, kernel selection)."""
        fn()
        self.sync()
        t = self.clock()
        fn()
        self.sync()
        first = self.clock() - t
        if first > self.s.slow_call_s:  # too slow to repeat; the curve ends here anyway
            return first, first
        calls = max(1, min(256, int(self.batch_target_s / max(first, 1e-7))))
        samples: list[float] = []
        start = self.clock()
        while True:
            t = self.clock()
            for _ in range(calls):
                fn()
            self.sync()
            samples.append((self.clock() - t) / calls)
            spent = self.clock() - start
            if len(samples) >= 50 or (len(samples) >= self.s.min_reps and spent >= self.s.min_point_s) \
                    or spent >= self.s.point_budget_s:
                break
        return statistics.median(samples), first


def _curve(sizes: Sequence[float], measure_one: Callable[[float], tuple[float, float]],
           slow_call_s: float) -> list[list[float]]:
    """[[size, rate]] for each size in order; measure_one(size) -> (rate, first call seconds).
    Stops after the first size whose single call took longer than slow_call_s, and before a
    size whose call would, at the last call's time per unit size, take over 3 * slow_call_s."""
    points: list[list[float]] = []
    prev: tuple[float, float] | None = None  # (size, seconds of one call)
    for size in sizes:
        if prev is not None and prev[1] * size / prev[0] > 3 * slow_call_s:
            break
        rate, first = measure_one(size)
        if rate > 0 and math.isfinite(rate):
            points.append([float(size), float(rate)])
        if first > slow_call_s:
            break
        prev = (size, first)
    return points


def _gemm_curve(torch, dev: str, dt, s: _Settings, timer: _Timer) -> list[list[float]]:
    """FLOP/s of F.linear over `tokens` rows of a gemm_dim x gemm_dim weight, cycling through
    weight copies totalling weight_pool_bytes."""
    k = s.gemm_dim
    w0 = torch.rand(k, k, dtype=dt, device=dev) - 0.5
    copies = max(1, min(64, s.weight_pool_bytes // w0.nbytes))
    weights = [w0] + [w0.clone() for _ in range(copies - 1)]
    counter = [0]

    def one(tokens: float) -> tuple[float, float]:
        x = torch.rand(int(tokens), k, dtype=dt, device=dev) - 0.5

        def call():
            counter[0] += 1
            return torch.nn.functional.linear(x, weights[counter[0] % copies])

        sec, first = timer.per_call(call)
        return 2.0 * tokens * k * k / sec, first

    return _curve(s.gemm_tokens, one, s.slow_call_s)


def _attention_curve(torch, dev: str, dt, s: _Settings, timer: _Timer) -> list[list[float]]:
    """K+V bytes/s of scaled_dot_product_attention, one query token per sequence, over a
    cache of attn_seq positions for attn_batch sequences."""
    b, h, d = s.attn_batch, s.attn_heads, s.attn_head_dim
    q = torch.rand(b, h, 1, d, dtype=dt, device=dev)
    elem = torch.empty((), dtype=dt).element_size()

    def one(kv_bytes: float) -> tuple[float, float]:
        seq = int(kv_bytes) // (2 * b * h * d * elem)
        kk = torch.rand(b, h, seq, d, dtype=dt, device=dev)
        vv = torch.rand(b, h, seq, d, dtype=dt, device=dev)
        sec, first = timer.per_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, vv))
        return kv_bytes / sec, first

    sizes = [2 * b * h * n * d * elem for n in s.attn_seq]
    return _curve(sizes, one, s.slow_call_s)


def _copy_curve(torch, src_dev: str, dst_dev: str, pinned: bool, s: _Settings, timer: _Timer) -> list[list[float]]:
    """Bytes/s of dst.copy_(src) for each copy size; the host side pinned when `pinned`.
    Successive copies read successive slices of a source pool of at least weight_pool_bytes,
    so small copies stream from memory (as weights and KV do) instead of from cache."""
    biggest = max(s.copy_sizes)

    def buf(dev: str, nbytes: int):
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev, pin_memory=pinned and dev == "cpu")
        t.fill_(1)
        return t

    src, dst = buf(src_dev, max(biggest, s.weight_pool_bytes)), buf(dst_dev, biggest)
    counter = [0]

    def one(nbytes: float) -> tuple[float, float]:
        n = int(nbytes)
        slots = src.numel() // n
        b = dst[:n]

        def call():
            counter[0] += 1
            i = counter[0] % slots
            return b.copy_(src[i * n:(i + 1) * n], non_blocking=pinned)

        sec, first = timer.per_call(call)
        return nbytes / sec, first

    return _curve(s.copy_sizes, one, s.slow_call_s)


def _memory_bandwidth(torch, dev: str, nbytes: int, timer: _Timer) -> float:
    """Bytes read + written per second by one big copy on `dev` (STREAM's copy counting)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    sec, _ = timer.per_call(lambda: dst.copy_(src))
    return 2.0 * nbytes / sec


def _expert_shapes(hidden: int, inter: int) -> list[tuple[int, int]]:
    """gate, up [I, H] and down [H, I], as F.linear takes them."""
    return [(inter, hidden), (inter, hidden), (hidden, inter)]


def _mapped_experts(torch, dt, hidden: int, inter: int, pool: int) -> list[tuple]:
    """`pool` experts (gate, up, down) as views of a memory-mapped temporary file, the way
    the runtime reads a checkpoint's weights on a CPU (the file is unlinked; the mapping
    keeps its pages)."""
    import mmap
    import tempfile

    n = inter * hidden
    with tempfile.TemporaryFile(prefix="moecc-profile-") as f:
        chunk = torch.randn(n).to(dt).view(torch.uint8).numpy().tobytes()
        for _ in range(3 * pool):
            f.write(chunk)
        f.flush()
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(m, dtype=dt)
    shapes = _expert_shapes(hidden, inter)
    return [tuple(flat[(3 * j + i) * n:(3 * j + i + 1) * n].view(*shapes[i]) for i in range(3)) for j in range(pool)]


def _mlp_curve(torch, dev: str, dt, hidden: int, inter: int, s: _Settings, timer: _Timer) -> list[list[float]]:
    """FLOP/s of the runtime's gated MLP (F.linear gate and up, SiLU, product in place,
    F.linear down) at one model's expert shape. The weights are as the runtime holds them: on
    a CPU, views of a memory-mapped file (4 KiB pages: measured 8% slower than anonymous
    memory at 128 rows), on CUDA device tensors; enough copies (4x the GEMM pool) that they
    stream from memory as a step's experts do."""
    from moecc_runtime.worker.kernels import gated_mlp

    elem = torch.empty((), dtype=dt).element_size()
    pool = max(2, min(32, 4 * s.weight_pool_bytes // (3 * hidden * inter * elem)))
    if dev == "cpu":
        ws = _mapped_experts(torch, dt, hidden, inter, pool)
    else:
        ws = [tuple(torch.randn(*sh, device=dev).to(dt) for sh in _expert_shapes(hidden, inter)) for _ in range(pool)]
    counter = [0]

    def one(tokens: float) -> tuple[float, float]:
        x = torch.randn(int(tokens), hidden, device=dev).to(dt)

        def call():
            counter[0] += 1
            g, u, d = ws[counter[0] % pool]
            return gated_mlp(x, g, u, d, "silu")

        sec, first = timer.per_call(call)
        return 6.0 * tokens * hidden * inter / sec, first

    tokens = sorted(set(s.gemm_tokens) | {2 ** k for k in range(0, 13) if s.gemm_tokens[0] <= 2 ** k <= s.gemm_tokens[-1]})
    return _curve(tokens, one, s.slow_call_s)


def _elementwise_curve(torch, dev: str, dt, hidden: int, s: _Settings, timer: _Timer) -> list[list[float]]:
    """Bytes/s of the runtime's glue: its rmsnorm then a residual add over [rows, hidden],
    bytes counted as the planner counts them (costs.ELEMENTWISE_PASSES: 6 + 3 passes of a
    row), against the bytes one call touches. Inputs rotate through a pool larger than the
    caches, as a step's activations are cold by the time the glue after a GEMM reads them."""
    from moecc.planner.costs import ELEMENTWISE_PASSES
    from moecc_runtime.worker.kernels import rmsnorm

    elem = torch.empty((), dtype=dt).element_size()
    passes = ELEMENTWISE_PASSES["rmsnorm"] + ELEMENTWISE_PASSES["add"]
    w = torch.ones(hidden, device=dev).to(dt)

    def one(nbytes: float) -> tuple[float, float]:
        rows = max(1, int(nbytes // (passes * hidden * elem)))
        pool = max(2, min(64, s.weight_pool_bytes // (2 * rows * hidden * elem)))
        xs = [(torch.randn(rows, hidden, device=dev).to(dt), torch.randn(rows, hidden, device=dev).to(dt))
              for _ in range(pool)]
        turn = [0]

        def call():
            turn[0] += 1
            x, r = xs[turn[0] % pool]
            return rmsnorm(x, w, 1e-6) + r

        sec, first = timer.per_call(call)
        return passes * rows * hidden * elem / sec, first

    return _curve([float(passes * n * hidden * elem) for n in s.glue_rows], one, s.slow_call_s)


def _host_copy_curve(torch, s: _Settings) -> list[list[float]]:
    """Bytes/s of the CPU copy engine's transfer: ctypes.memmove (one thread, the GIL
    released) on a worker thread, from a rotating source pool larger than the caches."""
    import ctypes
    import threading

    biggest = max(s.copy_sizes)
    src = torch.ones(max(biggest, s.weight_pool_bytes), dtype=torch.uint8)
    dst = torch.ones(biggest, dtype=torch.uint8)
    timer = _Timer(lambda: None, s)
    counter = [0]

    def one(nbytes: float) -> tuple[float, float]:
        n = int(nbytes)
        slots = src.numel() // n
        out: list[tuple[float, float]] = []

        def call() -> None:
            counter[0] += 1
            i = counter[0] % slots
            ctypes.memmove(dst.data_ptr(), src.data_ptr() + i * n, n)

        def work() -> None:
            out.append(timer.per_call(call))

        t = threading.Thread(target=work)
        t.start()
        t.join()
        sec, first = out[0]
        return nbytes / sec, first

    return _curve(s.copy_sizes, one, s.slow_call_s)


def _cpu_copy_overlap(torch, s: _Settings, hidden: int, inter: int, trials: int) -> float:
    """1 - steal, where steal is the compute time one second of copying costs on this CPU,
    measured on the runtime's own path: experts of the model's MLP shape (memory-mapped, as
    the runtime reads weights) run through the runtime's gated MLP at a decode step's rows per
    expert, once in place and once streamed through two slots by the runtime's CopyEngine
    (the next expert's memmove beside the current expert's compute, prefetch depth 1);
    steal = (streamed - in place) / (the same copies done alone). Median of `trials`.

    On a 2-core VM the copy thread takes a core from torch's two and contends for memory
    bandwidth; measured steal there is 1.2-1.8 (a copy costs compute more than its own
    length), where a bare GEMM beside a copy loop showed 0.8-1.1. Clamped to [-2, 1]."""
    import statistics

    from moecc_runtime.memory.copy_engine import CopyEngine
    from moecc_runtime.worker.kernels import gated_mlp
    from moecc_runtime.memory.streaming import Copier

    per = 3 * hidden * inter * 4
    pool = max(3, min(16, 2 * s.weight_pool_bytes // per))
    rows = 64 if s.gemm_dim < 2048 else 128  # tokens per expert in a batched decode step
    ws = _mapped_experts(torch, torch.float32, hidden, inter, pool)
    for w in ws:  # first touch: map the pages (the runtime's first step does this)
        for t in w:
            t.sum()
    slots = [tuple(torch.empty(*sh) for sh in _expert_shapes(hidden, inter)) for _ in range(2)]
    x = torch.randn(rows, hidden)
    copier = Copier(torch.device("cpu"), 0)  # the runtime's CPU transfer: a memmove per tensor

    def fill(slot, w):
        return lambda: copier.copy(list(zip(w, slot)), None)

    def in_place(k: int) -> float:
        t0 = time.perf_counter()
        for e in range(k):
            gated_mlp(x, *ws[e % pool], "silu")
        return time.perf_counter() - t0

    def streamed(k: int, engine) -> float:
        t0 = time.perf_counter()
        ticket = engine.submit("expert", per, fill(slots[0], ws[0]))
        for e in range(k):
            nxt = engine.submit("expert", per, fill(slots[(e + 1) % 2], ws[(e + 1) % pool])) if e + 1 < k else None
            ticket.wait()
            gated_mlp(x, *slots[e % 2], "silu")
            ticket = nxt
        return time.perf_counter() - t0

    def copies(k: int) -> float:
        t0 = time.perf_counter()
        for e in range(k):
            fill(slots[e % 2], ws[e % pool])()
        return time.perf_counter() - t0

    engine = CopyEngine(torch.device("cpu"))
    try:
        in_place(2)
        k = max(4, min(64, int(0.2 / max(in_place(2) / 2, 1e-6))))  # ~0.2 s per timing
        steals = []
        for _ in range(trials):
            a, b, c = in_place(k), streamed(k, engine), copies(k)
            steals.append((b - a) / c if c > 0 else 0.0)
    finally:
        engine.close()
    return max(-2.0, min(1.0, 1.0 - statistics.median(steals)))


class SpeedCanary:
    """How fast this machine is right now, on the work that dominates a batched MoE step:
    the runtime's gated MLP at a decode step's rows per expert over memory-mapped experts of
    one model's shape (the profile's "mlp" curve at one point). A shared VM's speed moves by
    a quarter within a minute (other tenants on the host); a benchmark compares the canary
    before and after a measured run with the canary at profile time to know whether the run
    saw the machine that was profiled. CPU only (a GPU's speed does not wander so)."""

    def __init__(self, hidden: int, inter: int, rows: int = 128, pool_bytes: int = 512 << 20,
                 clock: Callable[[], float] = time.perf_counter):
        import torch

        self._torch, self._clock = torch, clock  # clock: a test's fake one times nothing real
        pool = max(2, min(16, pool_bytes // (3 * hidden * inter * 4)))
        self._ws = _mapped_experts(torch, torch.float32, hidden, inter, pool)
        for w in self._ws:  # first touch: map the pages, as a run's first step does
            for t in w:
                t.sum()
        self._x = torch.randn(rows, hidden)

    def seconds(self, duration_s: float = 2.0) -> float:
        """Median seconds of one expert call over about `duration_s` of calls."""
        from moecc_runtime.worker.kernels import gated_mlp

        times: list[float] = []
        end = self._clock() + duration_s
        with self._torch.inference_mode():
            while self._clock() < end or len(times) < 5:
                t = self._clock()
                gated_mlp(self._x, *self._ws[len(times) % len(self._ws)], "silu")
                times.append(self._clock() - t)
        return statistics.median(times)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return PRESETS["cpu"].device_memory_bytes


def _scaled(base: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """Per-dtype peaks: measured where measured; otherwise base scaled by measured/base
    float32 when float32 was measured, else base."""
    factor = measured["float32"] / base["float32"] if "float32" in measured else 1.0
    return {dt: measured.get(dt, base[dt] * factor) for dt in base}


def measure(device: str = "auto", dtypes: Sequence[str] = ("float32",), quick: bool = False,
            mlp_shapes: Sequence[tuple[str, int, int]] = ()) -> HardwareProfile:
    """Measure this machine; returns a profile with source "measured" and every curve
    filled (positive, finite rates; sizes increasing).

    `device`: "auto" (CUDA when visible, else CPU), "cuda" or "cpu". `dtypes`: which dtypes
    the GEMM and attention curves are measured in (names or aliases, see normalize_dtype).
    Peaks: device_flops[dt] is the measured GEMM curve's maximum for measured dtypes; other
    dtypes come from the local preset (resolve_hardware(None); on CPU scaled by measured/
    preset float32). On CPU, cpu_flops = device_flops and cpu_attention = attention; on
    CUDA, cpu_flops comes from one CPU float32 GEMM point scaled by the preset's dtype ratios.
    `quick`: smaller sizes and fewer points (a few seconds on 2 cores, for tests).
    `mlp_shapes`: (dtype, hidden, intermediate) of models whose expert MLP is also measured
    as a whole (the "mlp" curves; `moecc profile --model DIR`).
    Raises HardwareError for an unknown device or dtype, or "cuda" without a CUDA device.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise HardwareError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise HardwareError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    names = list(dict.fromkeys(normalize_dtype(d) for d in dtypes)) or ["float32"]
    s = _settings(device, quick)
    cuda = device == "cuda"
    cs = _settings("cpu", quick)  # sizes for the CPU-side measurements
    host_timer = _Timer(lambda: None, cs)
    timer = _Timer(torch.cuda.synchronize, s) if cuda else host_timer
    base = resolve_hardware(None) if cuda else copy.deepcopy(PRESETS["cpu"])

    with torch.inference_mode():
        gemm = {dt: _gemm_curve(torch, device, getattr(torch, dt), s, timer) for dt in names}
        mlp = {f"{normalize_dtype(dt)}:{h}x{i}": _mlp_curve(torch, device, getattr(torch, normalize_dtype(dt)), h, i,
                                                            s, timer) for dt, h, i in mlp_shapes}
        attention = {dt: _attention_curve(torch, device, getattr(torch, dt), s, timer) for dt in names}
        glue_hidden = mlp_shapes[0][1] if mlp_shapes else 4096
        elementwise = {dt: _elementwise_curve(torch, device, getattr(torch, dt), glue_hidden, s, timer)
                       for dt in names}
        if cuda:
            cpu_attention = {dt: _attention_curve(torch, "cpu", getattr(torch, dt), cs, host_timer)
                             for dt in names}
            h2d = _copy_curve(torch, "cpu", "cuda", True, s, timer)
            d2h = _copy_curve(torch, "cuda", "cpu", True, s, timer)
            host_bw = _memory_bandwidth(torch, "cpu", cs.big_copy_bytes, host_timer)
            device_bw = _memory_bandwidth(torch, "cuda", s.big_copy_bytes * 4, timer)
            cpu_point = _gemm_curve(torch, "cpu", torch.float32, replace(cs, gemm_tokens=(256,)), host_timer)
            cpu_fp32 = {"float32": cpu_point[-1][1]} if cpu_point else {}
            device_name = torch.cuda.get_device_name(0)
            memory = int(torch.cuda.get_device_properties(0).total_memory)
            overlap = 1.0  # a DMA copy engine
        else:
            cpu_attention = copy.deepcopy(attention)
            h2d = _host_copy_curve(torch, s)
            if not h2d:
                raise HardwareError("host copy measurement failed: no finite copy rate")
            d2h = copy.deepcopy(h2d)
            host_bw = _memory_bandwidth(torch, "cpu", s.big_copy_bytes, timer)
            shape = (mlp_shapes[0][1], mlp_shapes[0][2]) if mlp_shapes else (s.gemm_dim, 2 * s.gemm_dim)
            overlap = _cpu_copy_overlap(torch, s, *shape, trials=1 if quick else 5)
            device_bw = host_bw
            device_name = _cpu_name()
            memory = _host_memory_bytes()

    measured_peaks = {dt: max(r for _, r in pts) for dt, pts in gemm.items() if pts}
    if cuda:
        device_flops = {dt: measured_peaks.get(dt, base.device_flops[dt]) for dt in base.device_flops}
        cpu_flops = _scaled(base.cpu_flops, cpu_fp32)
    else:
        device_flops = _scaled(base.device_flops, measured_peaks)
        cpu_flops = dict(device_flops)
    curves = {
        "gemm": {dt: p for dt, p in gemm.items() if p},
        "attention": {dt: p for dt, p in attention.items() if p},
        "cpu_attention": {dt: p for dt, p in cpu_attention.items() if p},
        "copy": {k: p for k, p in (("h2d", h2d), ("d2h", d2h)) if p},
        "mlp": {k: p for k, p in mlp.items() if p},
        "elementwise": {dt: p for dt, p in elementwise.items() if p},
    }
    return HardwareProfile(
        name=f"measured-{device}" + ("-quick" if quick else ""), source="measured", device_kind=device,
        device_name=device_name, device_memory_bytes=memory, device_flops=device_flops,
        device_bandwidth=device_bw, h2d_bandwidth=h2d[-1][1] if h2d else base.h2d_bandwidth,
        d2h_bandwidth=d2h[-1][1] if d2h else base.d2h_bandwidth, host_bandwidth=host_bw,
        cpu_cores=os.cpu_count() or 1, cpu_flops=cpu_flops,
        curves={k: v for k, v in curves.items() if v}, copy_overlap=round(overlap, 3),
    )


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def busy_warning(window_s: float = 0.25) -> str | None:
    """A warning when other work is using the CPUs right now (over `window_s` seconds, from
    /proc/stat): torch's multi-threaded calls then stall on descheduled threads and rates,
    small sizes most of all, measure far too low. None on a quiet machine or off Linux."""
    try:
        b0, t0 = _cpu_times()
        time.sleep(window_s)
        b1, t1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    busy = (b1 - b0) / max(1, t1 - t0)
    if busy < 0.25:
        return None
    cores = os.cpu_count() or 1
    return (f"warning: the CPUs are {busy:.0%} busy with other work ({cores} cores): rates measured now "
            f"(small sizes most of all) will be too low; profile a quiet machine")


# ---------------------------------------------------------------------------------- summary


def _si(x: float, unit: str) -> str:
    """1.5e11, 'FLOP/s' -> '150.0 GFLOP/s'."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{x:.1f} {unit}"


def summarize(p: HardwareProfile) -> list[str]:
    """A few human-readable lines: device, peak GEMM rate and the rate at 16 tokens per
    dtype, attention rate at the largest measured KV size, copy and memory rates."""
    from moecc.sizes import format_bytes

    lines = [f"{p.name} ({p.source}): {p.device_kind} {p.device_name}, "
             f"{format_bytes(p.device_memory_bytes)} memory, {p.cpu_cores} CPU cores"]
    dts = list(p.curves.get("gemm", {})) or ["float32"]
    for dt in dts:
        lines.append(f"  gemm {dt}: peak {_si(p.device_flops[dt], 'FLOP/s')}, "
                     f"16 tokens {_si(p.gemm_rate(dt, 16), 'FLOP/s')}")
    for kind, where in (("attention", "device"), ("cpu_attention", "cpu")):
        for dt, pts in p.curves.get(kind, {}).items():
            lines.append(f"  attention {dt} ({where}): {_si(pts[-1][1], 'B/s')} "
                         f"at {format_bytes(pts[-1][0])} of KV")
    for dt, pts in p.curves.get("elementwise", {}).items():
        lines.append(f"  elementwise {dt} (norm + add): {_si(pts[-1][1], 'B/s')} at {format_bytes(pts[-1][0])}")
    if "attention" not in p.curves:
        lines.append(f"  attention {dts[0]}: {_si(p.attention_rate(dts[0], 1 << 26), 'B/s')} (estimate)")
    lines.append(f"  copy h2d {_si(p.h2d_bandwidth, 'B/s')}, d2h {_si(p.d2h_bandwidth, 'B/s')} "
                 f"({max(p.copy_overlap, 0):.0%} of copy time can hide behind compute; a copy-second costs compute "
                 f"{1 - p.copy_overlap:.2f} s); "
                 f"memory: device {_si(p.device_bandwidth, 'B/s')}, host {_si(p.host_bandwidth, 'B/s')}")
    if p.calibration:
        lines.append(f"  calibrated on {p.calibration.get('model', 'a model')}: job kind x factor + seconds per job; "
                     f"overhead per layer")
    for mode in ("resident", "streamed"):
        cal = p.calibration.get(mode)
        if cal:
            kinds = ", ".join(f"{k} {f:.2f}x+{cal['job_s'].get(k, 0.0) * 1e6:.0f}µs" for k, f in cal["factor"].items())
            lines.append(f"    {mode}: {kinds}; overhead {cal.get('overhead_layer_s', 0.0) * 1e3:.2f} ms "
                         f"+ {cal.get('overhead_row_s', 0.0) * 1e6:.2f} µs per row")
    return lines
