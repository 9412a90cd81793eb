"""A repro bundle is safe to receive: tampered copies of a real bundle, each with its
manifest's SHA-256s recomputed (anyone can: a checksum is not a signature), tried as an
attacker or a careless user would. In every case the replay exits 2 with one line, a marker
file proves that nothing the bundle named ran, and nothing is written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.drills import DRILL_MONITORS
from stabilize.replay import main as replay_main
from stabilize.train import run

from conftest import FAST, compose_run, run_cli

# the grad-spike run of tests/test_replay.py: one bundle, at step 8
BASE = [*FAST, "logger=none", "trainer.max_steps=10", "trainer.val_check_interval=100",
        "trainer.checkpoint_every_n_steps=100", *DRILL_MONITORS, "fault=grad_spike",
        "fault.step=8", "fault.factor=1e4"]  # fmt: skip


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("trusted")
    run(compose_run(d, BASE))
    (b,) = sorted((d / "bundles").iterdir())
    return b


def _remanifest(b: Path, extra: dict | None = None) -> None:
    """Recompute every listed file's size and SHA-256, as anyone can."""
    man = json.loads((b / "manifest.json").read_text())
    files = {**man["files"], **(extra or {})}
    for name in list(files):
        f = (b / name) if not name.startswith("/") else Path(name)
        if f.exists():
            files[name] = {"bytes": f.stat().st_size,
                           "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}  # fmt: skip
    (b / "manifest.json").write_text(json.dumps({**man, "files": files}))


def _tampered(bundle: Path, tmp_path: Path, host: dict | None = None) -> Path:
    b = tmp_path / "received" / bundle.name
    shutil.copytree(bundle, b)
    if host is not None:
        meta = json.loads((b / "meta.json").read_text())
        meta["host"] = host
        (b / "meta.json").write_text(json.dumps(meta))
        _remanifest(b)
    return b


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _refused(capsys, tmp_path: Path, argv: list[str], *words: str) -> str:
    before = _tree(tmp_path)
    capsys.readouterr()
    assert replay_main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("stabilize-replay: ") and "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert _tree(tmp_path) == before  # nothing written
    return lines[0]


def test_code_named_in_meta_json_is_not_run_without_the_users_flag(bundle, tmp_path):
    """``host.module = subprocess:run`` with ``args = [touch, MARKER]``: at 83f9843 the replay
    imported and called it. Now, in a fresh process, it names the code and runs nothing."""
    marker = tmp_path / "MARKER"
    host = {"kind": "lightning", "module": "subprocess:run",
            "hparams": {"args": ["touch", str(marker)]}, "model_path": ""}  # fmt: skip
    b = _tampered(bundle, tmp_path, host)
    for flags in ([], ["--bisect"], ["--data"]):
        r = run_cli(["stabilize-replay", *flags, str(b)], cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r.stderr
        assert "imports module subprocess:run, named by its meta.json" in lines[0]
        assert "--trust-code" in lines[0] and "--factory" in lines[0]
        assert not marker.exists()


def test_a_guards_bundle_names_both_its_factory_and_its_loss(bundle, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    host = {"kind": "guard", "factory": "os:system", "loss": "subprocess:call", "model_path": ""}
    b = _tampered(bundle, tmp_path, host)
    line = _refused(capsys, tmp_path, [str(b)], "model factory os:system", "loss subprocess:call")
    assert "--loss pkg.mod:fn" in line
    # the user's own factory does not make the bundle's loss trusted
    _refused(capsys, tmp_path, ["--factory", "collections:OrderedDict", str(b)],
             "loss subprocess:call")  # fmt: skip
    assert not marker.exists()


def test_a_class_payload_in_the_hyperparameters_is_never_imported(bundle, tmp_path, capsys):
    """``{"__class__": "subprocess:Popen", ...}`` as a hyperparameter, under ``--bisect``, even
    with ``--trust-code`` (which trusts the module, not values): refused before any import."""
    marker = tmp_path / "MARKER"
    payload = {"__class__": "subprocess:Popen", "args": ["touch", str(marker)]}
    host = {"kind": "lightning", "module": "collections:OrderedDict",
            "hparams": {"cfg": payload}, "model_path": ""}  # fmt: skip
    b = _tampered(bundle, tmp_path, host)
    _refused(capsys, tmp_path, ["--bisect", str(b)], "imports module collections:OrderedDict")
    line = _refused(capsys, tmp_path, ["--bisect", "--trust-code", str(b)],
                    "hparams.cfg.__class__='subprocess:Popen' is not a config class")  # fmt: skip
    assert "nothing was imported" in line and not marker.exists()


def test_a_config_class_is_rebuilt_through_the_registry_only():
    """The registry's classes come back as themselves; the path in the file is a key."""
    from stabilize.model.config import GPTConfig
    from stabilize.replay.rebuild import CannotRebuild, rebuild_value

    cfg = GPTConfig.preset("tiny")
    got = rebuild_value({"c": {"__class__": "stabilize.model.config:GPTConfig", **cfg.to_dict()}})
    assert got["c"] == cfg
    with pytest.raises(CannotRebuild, match="builtins:eval"):
        rebuild_value({"c": {"__class__": "builtins:eval"}})
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2)
    from stabilize.stability.driven import plain

    back = rebuild_value(plain({"config": llama}))["config"]
    assert type(back) is transformers.LlamaConfig and back.hidden_size == 64


@pytest.mark.parametrize("entry", ["../outside/state.pt", "/ABS/state.pt", "./state.pt"])
def test_a_manifest_entry_out_of_the_bundle_is_refused(bundle, tmp_path, capsys, entry):
    """At 83f9843 a manifest listing ``../outside/state.pt`` verified the outside copy while
    the bundle's own ``state.pt`` (zeroed weights) was loaded: "reproduces: yes"."""
    b = _tampered(bundle, tmp_path)
    outside = tmp_path / "received" / "outside"
    outside.mkdir()
    shutil.copy(b / "state.pt", outside / "state.pt")
    state = torch.load(b / "state.pt", weights_only=True)
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    torch.save(state, b / "state.pt")  # the swapped file, unlisted now
    name = entry.replace("/ABS", str(outside)) if entry.startswith("/ABS") else entry
    man = json.loads((b / "manifest.json").read_text())
    man["files"].pop("state.pt")
    (b / "manifest.json").write_text(json.dumps(man))
    _remanifest(b, {name: {}})
    if not name.startswith(("/", "..")):  # './state.pt' names the swapped file itself
        assert (b / name).exists()
    _refused(capsys, tmp_path, [str(b)], "manifest.json: the entry", "a bundle is one closed")


def test_a_file_the_manifest_does_not_list_is_refused(bundle, tmp_path, capsys):
    b = _tampered(bundle, tmp_path)
    (b / "sitecustomize.py").write_text("open('MARKER', 'w')\n")
    _refused(capsys, tmp_path, [str(b)], "sitecustomize.py", "not listed in the manifest")


def test_a_symbolic_link_in_the_bundle_is_refused(bundle, tmp_path, capsys):
    b = _tampered(bundle, tmp_path)
    outside = tmp_path / "elsewhere.pt"
    shutil.move(b / "state.pt", outside)
    os.symlink(outside, b / "state.pt")
    _remanifest(b)
    _refused(capsys, tmp_path, [str(b)], "state.pt: a symbolic link")


def test_a_swapped_or_truncated_file_is_refused(bundle, tmp_path, capsys):
    """Swapped and not re-manifested: damaged. Truncated and re-manifested: at 83f9843 a
    torch zip traceback; now one line saying it does not load."""
    b = _tampered(bundle, tmp_path)
    raw = (b / "state.pt").read_bytes()
    (b / "state.pt").write_bytes(raw[: len(raw) // 2])
    _refused(capsys, tmp_path, [str(b)], "state.pt: ", "bytes, the manifest says")
    _remanifest(b)
    _refused(capsys, tmp_path, [str(b)], "state.pt: does not load as a torch file")
    _refused(capsys, tmp_path, ["--bisect", str(b)], "state.pt: does not load")


class _Payload:
    """Unpickled, it would run a shell command: what a swapped ``state.pt`` can hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_swapped_file_holding_code_is_refused_before_it_runs(bundle, tmp_path, capsys):
    """``state.pt`` swapped for a pickle that calls ``os.system``, its manifest recomputed:
    the file is whole, so only ``weights_only`` stands between it and the shell."""
    b = _tampered(bundle, tmp_path)
    marker = tmp_path / "MARKER"
    state = torch.load(b / "state.pt", weights_only=True)
    torch.save({**state, "extra": _Payload(marker)}, b / "state.pt")
    _remanifest(b)
    for flags in ([], ["--bisect"], ["--data"]):
        _refused(capsys, tmp_path, [*flags, str(b)], "state.pt is refused: it needs the global",
                 "system")  # fmt: skip
    assert not marker.exists()


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("step", "7", "'step' is '7'; must be int"),
        ("recorded", {"loss": "x", "grad_norm": 1.0, "loss_scale": 1.0}, "recorded.loss is 'x'"),
        ("host", {"kind": "pickle"}, "host.kind is 'pickle'; allowed: gpt, lightning, guard"),
        ("config", None, "'config' must be the run's config"),
    ],
)
def test_a_meta_json_of_the_wrong_shape_is_refused(bundle, tmp_path, capsys, field, value, words):
    b = _tampered(bundle, tmp_path)
    meta = json.loads((b / "meta.json").read_text())
    meta[field] = value
    (b / "meta.json").write_text(json.dumps(meta))
    _remanifest(b)
    _refused(capsys, tmp_path, [str(b)], "meta.json: ", words)


def test_the_untampered_bundle_replays_and_no_flag_is_needed_for_our_gpt(bundle, capsys):
    assert replay_main([str(bundle)]) == 0
    assert capsys.readouterr().out.strip().endswith("reproduces: yes")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--factory", "nope", "DIR"], "--factory='nope' is not 'pkg.mod:Name'"),
        (["--trust-code", "--gap", "DIR", "--reference", "x"], "--trust-code goes with a bundle"),
        (["--bisect", "DIR"], "manifest.json: missing"),
        (["--data", "DIR/nothere"], "nothere: missing (a bundle is a run's bundles/step-"),
    ],
)
def test_bad_replay_flags_are_one_line(tmp_path, capsys, argv, words):
    d = tmp_path / "dir"
    d.mkdir()
    _refused(capsys, tmp_path, [a.replace("DIR", str(d)) for a in argv], words)


def test_two_rollbacks_of_one_step_keep_both_bundles(tmp_path):
    """The README's one run rolls step 11 back twice (lower_lr, then fp32_reduction): each
    rollback's bundle is its own directory; at 83f9843 the second overwrote the first."""
    import json as _json

    run(compose_run(tmp_path, ["model=tiny", "norm=rmsnorm", "norm.placement=post",
                               "norm.eps=1e-5", "norm.reduction_dtype=fp16",
                               "precision=fp16-mixed", "trainer.max_steps=12", "logger=none",
                               "trainer.val_check_interval=100",
                               "trainer.final_eval_batches=1"]))  # fmt: skip
    events = [_json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    rolled = [e for e in events if e["monitor"] == "rollback"]
    assert len(rolled) == 2 and {e["step"] for e in rolled} == {11}, rolled
    names = sorted(p.name for p in (tmp_path / "bundles").iterdir())
    assert names == ["step-000011-loss_scale", "step-000011-loss_scale-2"], names
    for name in names:  # both whole, both replayable
        assert replay_main([str(tmp_path / "bundles" / name)]) in (0, 1)


def test_a_script_module_with_a_factory_beside_it_is_rebuilt_by_the_factory():
    """``StabilityCallback(factory=...)`` is the way out for a module defined in a script:
    the replay names (and, trusted, imports) the factory, never the ``__main__`` class."""
    from stabilize.replay.rebuild import CannotRebuild, CodeChoice, rebuild_module

    host = {"kind": "lightning", "module": "__main__:MyLM", "factory": "collections:OrderedDict",
            "hparams": {}, "model_path": ""}  # fmt: skip
    with pytest.raises(CannotRebuild, match="imports factory collections:OrderedDict"):
        rebuild_module(host)
    with pytest.raises(CannotRebuild, match="__main__:MyLM is defined in a script"):
        rebuild_module({**host, "factory": None})
    module, _ = rebuild_module(host, CodeChoice(trust_code=True))
    assert type(module).__name__ == "OrderedDict"  # the factory ran, called with no hparams


def test_the_next_command_a_foreign_bundle_is_given_carries_the_code_flags(bundle, tmp_path):
    """A follow-up command that a replay or a report prints for a foreign bundle repeats the
    flags that let its code be imported: without them, it would be refused."""
    from stabilize.replay.rebuild import CodeChoice, code_flags
    from stabilize.report.load import Run
    from stabilize.report.single import _bundles

    assert code_flags(CodeChoice()) == ""
    assert code_flags(CodeChoice(factory="m:f", loss="m:g")) == "--factory m:f --loss m:g "
    assert code_flags(CodeChoice(trust_code=True)) == "--trust-code "
    run_dir = tmp_path / "run"
    ours = run_dir / "bundles" / bundle.name
    shutil.copytree(bundle, ours)
    theirs = _tampered(bundle, tmp_path, {"kind": "guard", "factory": "m:build", "loss": "m:f"})
    shutil.move(theirs, run_dir / "bundles" / "step-000009-grad_spike")
    got = {d.name: flag for d, _, flag in _bundles(Run("r", "", {}, [], path=run_dir))}
    assert got == {bundle.name: "", "step-000009-grad_spike": "--trust-code "}
