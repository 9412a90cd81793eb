"""Config checks shared by every dataclass: one wording for every bad value.

Rule of the house: an invalid setting fails with the key, the value and what is allowed,
as a ``ConfigError`` (a ``ValueError``), so that the CLIs can print it on one line with exit
code 2 while a genuine bug's ``ValueError`` still gets its traceback.

Every float setting is finite (``norm.eps=inf`` trained to the uniform
loss, ``optim.lr=inf`` ended in a stability abort): the helpers below reject inf and NaN,
and ``build_dataclass`` checks every float field of the config it builds, nested ones too,
unless the field is marked ``metadata=ALLOW_NONFINITE``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """An invalid setting: the message names the key, the value and what is allowed."""


# field(default=..., metadata=ALLOW_NONFINITE): a float setting where inf / NaN has a meaning.
ALLOW_NONFINITE = {"allow_nonfinite": True}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; allowed: {list(allowed)}")


def check_positive(key: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if not _is_number(value) or not isinstance(value, kind) or not 0 < value < math.inf:
        what = "a positive integer" if integer else "a positive finite number"
        raise ConfigError(f"{key}={value!r} is not allowed; must be {what}")


def check_count(key: str, value: Any) -> None:
    """A whole number >= 0 (0 usually means off)."""
    if not _is_number(value) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}={value!r} is not allowed; must be an integer >= 0")


def check_range(key: str, value: Any, lo: float, hi: float) -> None:
    """lo <= value < hi (NaN is never in range; inf only below an inf ``hi``, i.e. never)."""
    if not _is_number(value) or not lo <= value < hi:
        raise ConfigError(f"{key}={value!r} is not allowed; must be in [{lo}, {hi})")


def check_finite(key: str, value: Any) -> None:
    """A float is finite (ints always are; other types are someone else's check)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} is not allowed; must be a finite number")


def check_finite_fields(obj: Any, key: str) -> None:
    """Every float field of a dataclass instance, recursively, is finite (unless marked
    ``ALLOW_NONFINITE``); lists and tuples of floats are checked element by element."""
    for f in dataclasses.fields(obj):
        if f.metadata.get("allow_nonfinite"):
            continue
        value = getattr(obj, f.name)
        name = f"{key}.{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_finite_fields(value, name)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check_finite(f"{name}[{i}]", v)
        else:
            check_finite(name, value)


def build_dataclass(cls: type, values: Any, key: str) -> Any:
    """``cls(**values)`` for a mapping, with unknown keys named; instances pass through.
    Either way every float in it must be finite."""
    if isinstance(values, cls):
        check_finite_fields(values, key)
        return values
    if not isinstance(values, dict):
        raise ConfigError(f"{key}={values!r} is not allowed; expected a mapping of settings")
    allowed = list(cls.__dataclass_fields__)
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a known setting; allowed: {allowed}")
    # checked before construction too: a __post_init__ might compute with an inf first
    for name, v in values.items():
        if not cls.__dataclass_fields__[name].metadata.get("allow_nonfinite"):
            check_finite(f"{key}.{name}", v)
    obj = cls(**values)
    check_finite_fields(obj, key)
    return obj
