"""The public API (issue 36): what ``stabilize`` exports, loaded lazily, so ``import
stabilize`` (and with it ``stabilize-train --help``) loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest

import stabilize

from conftest import ROOT


def test_import_stabilize_loads_no_torch_and_each_name_loads_its_module():
    probe = (
        "import json, sys, stabilize\n"
        "before = 'torch' in sys.modules\n"
        "f = stabilize.swap_norms\n"
        "print(json.dumps([before, 'torch' in sys.modules, f.__module__]))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    before, after, module = json.loads(r.stdout.strip().splitlines()[-1])
    assert (before, after, module) == (False, True, "stabilize.norms.surgery")


def test_the_exported_names_are_the_modules_own():
    assert stabilize.__all__ == [
        "__version__",
        "StabilityCallback",
        "StabilityAbort",
        "Guard",
        "Verdict",
        "HFStabilityCallback",
        "MonitorConfig",
        "RollbackConfig",
        "FaultConfig",
        "find_norms",
        "swap_norms",
        "FoundNorm",
        "inspect_model",
        "ModelMap",
    ]
    for name in stabilize.__all__[1:]:
        assert getattr(stabilize, name) is getattr(sys.modules[stabilize._EXPORTS[name]], name)
        assert name in dir(stabilize)
    assert stabilize.__version__ == version("stabilize")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        stabilize.nope  # noqa: B018


def test_the_entry_points_signatures_are_pinned():
    """A change to these is a change to the public API (docs/your-model.md): it must be
    made here, in the docs and in the version together."""
    import inspect

    def params(f):
        return [(p.name, p.kind.name) for p in inspect.signature(f).parameters.values()]

    pos, kw = "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"
    assert params(stabilize.StabilityCallback.__init__) == [
        ("self", pos), ("monitor", pos), ("rollback", pos), ("fault", pos), ("run_dir", pos),
        ("accumulate", pos), ("model", kw), ("blocks", kw), ("skip_items", kw), ("factory", kw),
        ("layer_panels", kw),
    ]  # fmt: skip
    assert params(stabilize.Guard.__init__) == [
        ("self", pos), ("model", pos), ("optimizer", pos), ("scaler", pos), ("scheduler", kw),
        ("run_dir", kw), ("loss_fn", kw), ("factory", kw), ("clip", kw), ("monitor", kw),
        ("rollback", kw), ("fault", kw), ("log_every", kw), ("blocks", kw),
    ]  # fmt: skip
    assert [p for p, _ in params(stabilize.Guard.before_step)] == ["self", "loss"]
    assert set(stabilize.Verdict.__dataclass_fields__) == {"apply", "step", "loss", "events"}
    assert params(stabilize.HFStabilityCallback.__init__) == [
        ("self", pos), ("run_dir", pos), ("monitor", kw), ("rollback", kw), ("fault", kw),
        ("factory", kw), ("blocks", kw),
    ]  # fmt: skip
