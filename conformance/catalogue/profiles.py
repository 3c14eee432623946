"""The named profiles (quick ⊂ standard ⊂ full) and the short dtype names of scenario ids.

A leaf of the catalogue package: every area's catalogue module builds its scenarios with these,
and the package's `__init__` (which lists those modules) re-exports them.
"""

from __future__ import annotations

PROFILES = ("quick", "standard", "full")
# What a scenario lists in `profiles`: the cheapest profile it belongs to, and every larger one.
QUICK, STANDARD, FULL = (frozenset(PROFILES[i:]) for i in range(len(PROFILES)))
# Short dtype names used in scenario ids.
SHORT_DTYPE = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}
