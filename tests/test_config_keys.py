"""Every config key's meaning, default and allowed values, from the settings dataclasses
alone: ``stabilize-train --keys PREFIX`` and docs/config.md (stabilize/run/keys.py).

The table is built from the live registries here (the test process has them loaded); the
CLI's cached path, and that it loads no torch, is tests/test_startup.py's.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

import pytest
from doc_commands import doc_command

from conftest import ROOT


@pytest.fixture(scope="module")
def table():
    from stabilize.train import key_table

    return key_table()


def by_key(table, option=""):
    from stabilize.run.keys import keys_of

    return {k.key: k for k in keys_of(table) if k.option == option}


def test_docs_config_md_is_what_the_source_gives(table):
    from stabilize.run.keys import markdown

    want = markdown(table).splitlines()
    have = (ROOT / "docs" / "config.md").read_text().splitlines()
    stale = next((i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b), None)
    if stale is None and len(have) != len(want):
        stale = min(len(have), len(want))
    assert stale is None, (
        f"docs/config.md is stale from line {stale + 1} (run python scripts/config_doc.py):"
        f"\nhave: {have[stale] if stale < len(have) else '<end>'}"
        f"\nwant: {want[stale] if stale < len(want) else '<end>'}"
    )


def test_every_setting_has_a_docstring(table):
    from stabilize.run.keys import keys_of

    missing = [f"{k.owner} ({k.key})" for k in keys_of(table) if not k.meaning]
    assert not missing, (
        "settings without a docstring (a string literal right after the field): "
        + ", ".join(missing)
    )


@dataclass
class Undocumented:
    documented: int = 1
    """Said once, here."""
    bare: int = 2


@dataclass
class Quieter(Undocumented):
    documented: int = 3  # a new default keeps its base's words


def test_a_field_without_a_docstring_has_no_meaning():
    from stabilize.run.field_docs import field_docs

    assert field_docs(Quieter) == {"documented": "Said once, here."}  # ``bare``: none


def compose(*overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import stabilize.train  # noqa: F401  stores the config nodes, registers the resolvers

    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=list(overrides)))


def leaves(values, known, prefix=""):
    """The composed config's keys: a mapping's entries, down to the table's keys."""
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in known:
            yield from leaves(v, known, key + ".")
        else:
            yield key


def test_the_table_has_every_key_the_config_composes_and_no_other(table):
    from stabilize.config_store import nodes

    bare = by_key(table)
    assert sorted(leaves(compose(), bare)) == sorted(bare)  # nothing missing, nothing made up
    hf = {**bare, **by_key(table, "model=hf")}
    assert set(leaves(compose("model=hf"), hf)) <= set(hf)
    # fault=<kind> composes its kind's node (configs/fault/<kind>.yaml sets only ``kind``)
    for name, node in nodes().items():
        if name.startswith("base_fault_"):
            option = f"fault={name.removeprefix('base_fault_')}"
            known = {**bare, **by_key(table, option)}
            unlisted = set(leaves({"fault": node}, known)) - set(known)
            assert not unlisted, f"{option}: keys the table does not list: {sorted(unlisted)}"


def test_allowed_values_are_read_off_the_checks(table):
    from stabilize.faults.config import FAULTS
    from stabilize.norms.registry import NORM_TYPES
    from stabilize.rollback import REMEDIES

    keys = by_key(table)
    allowed = {k: keys[k].allowed for k in keys}
    assert allowed["norm.type"] == " | ".join(NORM_TYPES)  # the live registry
    assert allowed["fault.kind"] == " | ".join(FAULTS)  # a registry lookup, not a check_*
    assert allowed["rollback.ladder"] == "each: " + " | ".join(REMEDIES)
    assert allowed["optim.beta1"] == "[0, 1)"
    assert allowed["monitor.loss_scale.max_consecutive_skips"] == "an integer >= 1"
    assert allowed["monitor.grad_spike.threshold"] == "> 0"  # the base class's f-string key
    # a check under ``if self.x != -1`` / ``is not None`` holds for the other values only
    assert allowed["trainer.keep_checkpoints"] == "-1, or an integer >= 1"
    assert allowed["trainer.final_eval_tokens"] == "null, or an integer >= 1"
    assert allowed["trainer.devices"] == "auto, or an integer >= 1"
    # what a class raises itself, in its message's words
    assert allowed["logger.layer_panels"] == "an integer >= -1 (-1: never group)"
    assert allowed["monitor.attn_logit.window"] == "an integer >= 1; >= 4"
    assert by_key(table, "fault=biased_round")["fault.bits"].allowed == "an int in [0, 22]"
    assert allowed["verbose"] == "true | false"


def test_defaults_are_the_dataclasses_and_what_stabilize_train_composes(table):
    keys = by_key(table)
    assert keys["trainer.max_steps"].default == 500
    assert keys["trainer.max_steps"].composed == "300"  # configs/experiment/main.yaml
    assert keys["data.seed"].composed == "${seed}"  # follows the run's seed
    assert keys["optim.beta1"].composed is None  # the same value: nothing to say
    # a kind's knob is listed under its option, with its own default and words
    spike = by_key(table, "fault=grad_spike")["fault.factor"]
    assert (spike.default, spike.meaning) == (100.0, "Gradients multiplied by this.")


def run_keys(argv, monkeypatch, capsys):
    from stabilize.train import main

    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_the_readme_keys_command(monkeypatch, capsys):
    """README "One run": ``stabilize-train --keys monitor.loss_scale``, as written."""
    argv = shlex.split(doc_command("keys-loss-scale"))
    assert argv[0] == "stabilize-train"
    code, out, err = run_keys(argv, monkeypatch, capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert [x.split(" = ")[0] for x in lines] == [
        "monitor.loss_scale.enabled",
        "monitor.loss_scale.floor",
        "monitor.loss_scale.max_consecutive_skips",
    ]
    assert lines[2] == (
        "monitor.loss_scale.max_consecutive_skips = 10  More scaler skips in a row than "
        "this: roll back. [allowed: an integer >= 1]"
    )


def test_keys_names_a_prefix_no_key_has_and_its_close_matches(monkeypatch, capsys):
    code, out, err = run_keys(["stabilize-train", "--keys=monitor.loss_scal"], monkeypatch,
                              capsys)  # fmt: skip
    assert (code, out) == (2, "")
    assert err == (
        "stabilize-train: --keys monitor.loss_scal: no such key; did you mean "
        "monitor.loss_scale, monitor.loss_scale.floor or monitor.loss_spike?\n"
    )
    code, _, err = run_keys(["stabilize-train", "--keys", "zzz"], monkeypatch, capsys)
    assert code == 2 and err.startswith("stabilize-train: --keys zzz: no such key; the sections")
