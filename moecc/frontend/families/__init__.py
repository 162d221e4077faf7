"""The MoE families moecc reads: one file each, listed here by explicit import.

Every family-specific table of the frontend reads this registry: the architectures
load_config accepts and the architecture a config without `architectures` gets
(frontend/config.py), the fields config_checks checks (frontend/config_checks.py), the
tensor-name aliases (frontend/weights.py), the quantization methods read for one family
only (frontend/quantization.py), lowering's MLA rope default (frontend/lowering.py), the
tiny test checkpoints (moecc/testing/checkpoints.py) and the per-family test lists
(tests/e2e/test_equivalence.py, test_checkpoints.py, test_real_configs.py, ...).

To add a family (3 files):
  1. moecc/frontend/families/<model_type>.py: `FAMILY = Family(...)` (family.py says
     what each field means; copy the closest family): model_type, architecture, the
     config fields moecc reads, path aliases, the tiny test config, the test layouts,
     and the published configs with their parameter counts;
  2. this file: import it and add it to FAMILIES (the order is the tests' and replay's);
  3. examples/configs/<name>/config.json: the published config.json, named in `published`.
The equivalence test, test checkpoints, config checks and replay then cover it. A family
whose layers moecc cannot lower or split yet (a new attention, router or expert kind;
norms after attention, as FlexOlmo's, which passes/split_modules.py refuses) also needs
that op in frontend/lowering.py, the passes and the runtime's kernels, and its own test
case where the equivalence test does not cover it; an integer config field config_checks
does not know gets its least value in the family's `minima`.
"""

from __future__ import annotations

from moecc.frontend.families import deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe
from moecc.frontend.families.family import Family

__all__ = ["FAMILIES", "Family", "family", "names"]

FAMILIES: tuple[Family, ...] = (mixtral.FAMILY, qwen3_moe.FAMILY, qwen2_moe.FAMILY, olmoe.FAMILY,
                                deepseek_v2.FAMILY, deepseek_v3.FAMILY, gpt_oss.FAMILY)
_BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}


def family(model_type: object) -> Family | None:
    """needs: config.json's model_type (any value). guarantees: its Family, or None when
    moecc does not read that family (or model_type is not a string)."""
    return _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def names() -> tuple[str, ...]:
    """The model_types of every family, in registry order."""
    return tuple(_BY_MODEL_TYPE)
