"""Package discovery for setuptools (the rest of the metadata is in pyproject.toml).

Every package under `moecc/` ships as itself and every package under `runtime/` as
`moecc_runtime` (the runtime's import name), found on disk rather than listed by hand, so
a new subpackage can never be left out of a wheel. The runtime's native kernels (host
attention, the sampler's host pass, the formats' dequantize, the element-wise host passes:
experts, rope, rmsnorm; and the fused routed expert on AMX) are the extension modules, all
optional.
"""

import sys

from setuptools import Extension, find_packages, setup

RUNTIME_DIR, RUNTIME_NAME = "runtime", "moecc_runtime"

packages = find_packages(include=["moecc", "moecc.*"]) + [
    RUNTIME_NAME + name[len(RUNTIME_DIR):] for name in find_packages(include=[RUNTIME_DIR, RUNTIME_DIR + ".*"])
]

# The host attention kernel (runtime/native/paged_attention.c): plain C and pthreads, no torch
# headers, so it builds with any C compiler against any torch; the runtime loads it through
# ctypes. Optional: without a compiler the install still succeeds and the runtime falls back to
# attention over gathered KV (`moecc_runtime.native.available()` says which).
# The sampler's host pass (runtime/native/sample_rows.c) is built the same way; both include
# runtime/native/vec8.h and cpu.h. The attention kernel's AVX2 and AVX-512 builds (attend_isa.h
# over vec8.h / vec16.h) come from function target attributes, not compiler flags, so one compile
# serves any x86-64 CPU (the kernel picks a build at run time) and a compiler without AVX-512
# support still builds the rest.
def native(name: str, contract: str = "fast") -> Extension:
    return Extension(
        f"{RUNTIME_NAME}.native.{name}",
        sources=[f"{RUNTIME_DIR}/native/{name.lstrip('_')}.c"],
        depends=[f"{RUNTIME_DIR}/native/{h}"
                 for h in ("vec8.h", "vec16.h", "cpu.h", "attend_isa.h", "attend_lanes16.h", "dequant_wide.h", "bf16.h",
                           "bf16_lanes.h", "row_items.h", "py_args.h", "amx.h", "amx_gemm.h", "expert_slots.h", "exp16.h",
                           "prompt_items.h")],
        extra_compile_args=["-O3", "-std=c11", f"-ffp-contract={contract}"] if sys.platform != "win32" else ["/O2"],
        libraries=["m"] if sys.platform != "win32" else [],
        optional=True,
    )


# runtime/native/dequant.c: the formats' host dequantize; expert_rows.c: the element-wise passes
# around an expert's GEMMs; rope.c: rotary embedding; rmsnorm.c: the norm; kv_write.c: a step's K/V
# rows scattered into the paged pool; expert_amx.c: a routed expert's whole MLP on AMX tiles (its
# target attribute needs GCC 11 / Clang 12; older compilers build a stub that declines);
# linear_amx.c: a dense bf16 projection on the same tiles; expert_fp32.c: a layer's routed
# experts in fp32 on AVX-512;
# prompt_amx.c / prompt_fp32.c: fresh prompts' causal attention on AMX tiles (bf16) / AVX-512 (fp32). Those
# built with contract="off" have no fused multiply-adds outside their products: they round as
# torch's passes do.
setup(packages=packages, package_dir={RUNTIME_NAME: RUNTIME_DIR},
      ext_modules=[native("_paged_attention"), native("_sample_rows"),
                   native("_dequant"), native("_expert_rows", contract="off"),
                   native("_rope", contract="off"), native("_rmsnorm", contract="off"),
                   native("_expert_amx", contract="off"), native("_expert_fp32", contract="off"),
                   native("_prompt_amx"), native("_prompt_fp32", contract="off"), native("_kv_write"),
                   native("_linear_amx", contract="off")])
