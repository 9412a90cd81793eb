"""Config checks shared by every dataclass: one wording for every bad value.

Rule of the house: an invalid setting fails with the key, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; allowed: {list(allowed)}")


def check_positive(key: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        what = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{key}={value!r} is not allowed; must be {what}")


def check_range(key: str, value: Any, lo: float, hi: float) -> None:
    """lo <= value < hi."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value < hi:
        raise ValueError(f"{key}={value!r} is not allowed; must be in [{lo}, {hi})")


def build_dataclass(cls: type, values: Any, key: str) -> Any:
    """``cls(**values)`` for a mapping, with unknown keys named; instances pass through."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise ValueError(f"{key}={values!r} is not allowed; expected a mapping of settings")
    allowed = list(cls.__dataclass_fields__)
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValueError(f"{key}.{unknown[0]} is not a known setting; allowed: {allowed}")
    return cls(**values)
