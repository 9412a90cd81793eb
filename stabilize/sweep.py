"""Sweep members from Hydra overrides, expanded by Hydra's own override parser.

``scripts/sweep.sh`` launches each member as its own torchrun (Hydra's multirun inside
torchrun is broken upstream), so it must expand the sweep itself. Splitting on commas
breaks ``choice(a,b)``, ``range(1,3)`` and quoted values; Hydra's grammar does not. What
the basic sweeper cannot expand (``interval(...)``: a continuous range, for optimizers) is
refused with one line.

    python -m stabilize.sweep norm=layernorm,rmsnorm 'norm.eps=choice(1e-6,1e-3)' seed=range(1,3)

prints one member per line, each override shell-quoted (``eval`` it into an array).
"""

from __future__ import annotations

import itertools
import shlex
import sys


class SweepError(ValueError):
    """An override the sweep cannot expand into members."""


def members(overrides: list[str]) -> list[list[str]]:
    """The cartesian product of every swept override, in command-line order (the last key
    varies fastest, as in Hydra's basic sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise SweepError(str(e).splitlines()[0]) from None
    lists = []
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            lists.append([f"{key}={o.get_value_element_as_str()}"])
        elif o.is_discrete_sweep():
            try:
                lists.append([f"{key}={v}" for v in o.sweep_string_iterator()])
            except HydraException:  # glob(): it lists config groups, which needs a loader
                raise SweepError(
                    f"cannot expand {o.input_line!r}: glob() needs Hydra's config loader "
                    f"(stabilize-train -m); name the options instead: {key}=a,b"
                ) from None
        else:
            raise SweepError(
                f"cannot expand {o.input_line!r}: an interval() is continuous, it has no list "
                f"of members; use choice(...), range(...) or a,b,c"
            )
    return [list(m) for m in itertools.product(*lists)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        found = members(args)
    except SweepError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    for m in found:
        print(" ".join(shlex.quote(o) for o in m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
