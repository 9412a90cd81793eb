"""Bad inputs are refused on one line, with exit code 2, before anything is written
(issue 12, items 5, 6 and 8); stabilize-report reads around unreadable input (item 9).

Most cases run ``stabilize.train.main`` in this process, exactly as the console script does
(real Hydra composition, real checks, ``sys.exit``): a subprocess costs ~10 s of Lightning
import each. A few real subprocesses prove the wiring of the installed command (stderr free
of tracebacks). torchrun's exit codes through scripts/launch.sh: tests/test_launch.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from stabilize.exits import file_error, meaning, one_line
from stabilize.launch import exit_code
from stabilize.report import main as report_main
from stabilize.run.config import RunConfig
from stabilize.train import relaunch_subdir

from conftest import FAST, cli, run_cli

BASE = [*FAST, "logger=none", "trainer.max_steps=10"]

# (overrides, what the one line must say). "{inputs}" is the directory of the files below.
CASES = [
    # item 6: every float is finite
    (["norm.eps=inf"], ["norm.eps=inf", "must be a finite number"]),
    (["norm.eps=nan"], ["norm.eps=nan", "must be a finite number"]),
    (["optim.lr=inf"], ["optim.lr=inf", "must be a finite number"]),
    (["optim.lr=nan"], ["optim.lr=nan", "must be a finite number"]),
    (["optim.lr=1e400"], ["optim.lr=inf", "must be a finite number"]),  # parsed as inf
    (["optim.eps=inf"], ["optim.eps=inf", "must be a finite number"]),
    (["optim.grad_clip=inf"], ["optim.grad_clip=inf", "must be a finite number"]),
    (["optim.weight_decay=nan"], ["optim.weight_decay=nan", "must be a finite number"]),
    (["precision.init_scale=inf"], ["precision.init_scale=inf", "must be a finite number"]),
    (["model.init_std=inf"], ["model.init_std=inf", "must be a finite number"]),
    (["model.dropout=nan"], ["model.dropout=nan", "must be a finite number"]),
    (["monitor.grad_spike.threshold=inf"], ["monitor.grad_spike.threshold=inf", "finite"]),
    (["monitor.activation.threshold=nan"], ["monitor.activation.threshold=nan", "finite"]),
    (
        ["rollback.remedy.lower_lr.factor=nan"],
        ["rollback.remedy.lower_lr.factor=nan", "must be a finite number"],
    ),
    (["data.val_fraction=inf"], ["data.val_fraction=inf", "must be a finite number"]),
    (
        ["fault=grad_spike", "fault.step=3", "fault.factor=inf"],
        ["fault.factor=inf", "must be a finite number"],
    ),
    # item 5: fault drills that cannot fire
    (["fault=nan_loss", "fault.step=11"], ["fault.step=11", "trainer.max_steps=10", "1 .. 10"]),
    (["fault=activation_drift", "fault.step=20"], ["fault.step=20", "1 .. 10"]),
    (["fault=nan_loss", "fault.step=3", "fault.rank=-1"], ["fault.rank=-1", "null (every rank)"]),
    (["fault=nan_loss", "fault.step=3", "fault.rank=1"], ["fault.rank=1", "1 process", "0 .. 0"]),
    (
        ["fault=inf_grad", "fault.step=3", "fault.param=h.9.nope"],
        ["fault.param='h.9.nope'", "'wte.weight'", "h.0.attn.c_attn.weight", "h.1"],
    ),
    (["fault=activation_drift", "fault.layer=5"], ["fault.layer=5", "0 .. 1"]),
    (["fault.kind=cosmic_ray"], ["fault.kind='cosmic_ray'", "'nan_loss'"]),
    # item 8: the data and the model agree; the data files are usable
    (["model.vocab_size=100"], ["model.vocab_size=100", "'bytes' tokenizer", ">= 256"]),
    (["data=hub"], ["data.name=None", "data.source='hub'", "a dataset name"]),
    (["data=local", "data.paths=[{inputs}/empty.txt]"], ["empty.txt", "is empty", "allowed"]),
    (["data=local", "data.paths=[{inputs}/nope.txt]"], ["nope.txt", "no such file"]),
    (["data=local", "data.paths=[{inputs}/short.txt]"], ["too small", "block_size=64"]),
    (["data=local", "data.paths=[{inputs}/table.csv]"], ["suffix", "'.csv'", "'.txt'"]),
    (["data.batch_size=0"], ["data.batch_size=0", "positive integer"]),
    # resume paths
    (["resume={inputs}/nope.ckpt"], ["nope.ckpt", "no such checkpoint file", "'auto'"]),
    (["resume={inputs}/notes.txt"], ["notes.txt", "not a checkpoint", "'auto'"]),
    (["resume={inputs}/tensor.ckpt"], ["tensor.ckpt", "not a checkpoint", "state_dict"]),
    (["resume={inputs}"], ["no such checkpoint file"]),
    (["resume={inputs}/dcp.ckpt"], ["dcp.ckpt", "sharded (FSDP)", "trainer.strategy=fsdp"]),
    # choices and ranges
    (["norm.type=groupnorm"], ["norm.type='groupnorm'", "'rmsnorm'"]),
    (["precision.name=fp8"], ["precision.name='fp8'", "'bf16-mixed'"]),
    (["trainer.max_steps=0"], ["trainer.max_steps=0", "positive integer"]),
    (["trainer.strategy=tp"], ["trainer.strategy='tp'", "'ddp'"]),
    (["optim.schedule=step"], ["optim.schedule='step'", "'cosine'"]),
    (["logger.mode=loud"], ["logger.mode='loud'", "'offline'"]),
    (["logger.layer_panels=-2"], ["logger.layer_panels=-2", "integer >= -1"]),
    (["model.fp32_modules=[nope]"], ["model.fp32_modules: 'nope' is not allowed", "'h.0.ln_1'"]),
    (["model.loss_dtype=bf16"], ["model.loss_dtype='bf16'", "'logits'"]),
    (["optim.master_dtype=bf16"], ["optim.master_dtype='bf16'", "'param'"]),
    (["trainer.grad_reduce_dtype=fp8"], ["trainer.grad_reduce_dtype='fp8'", "'bf16'"]),
    (
        ["optim.master_dtype=fp32", "trainer.strategy=fsdp"],
        ["optim.master_dtype='fp32' is not allowed with trainer.strategy='fsdp'", "ddp"],
    ),
    (["fault=biased_round", "fault.site=h.9"], ["fault.site='h.9' is not a module", "'h.0.ln_1'"]),
    (["fault=biased_round", "fault.bits=30"], ["fault.bits=30 is not allowed", "[0, 22]"]),
    (["optim.state_dtype=fp8"], ["optim.state_dtype='fp8'", "'bf16'"]),
    (["optim.accumulate_grad_batches=0"], ["optim.accumulate_grad_batches=0", "positive integer"]),
    (["trainer.compile=true", "norm.reduction_dtype=fp16"], ["trainer.compile=true", "'fp32'"]),
    (["model.block_size=-1"], ["model.block_size=-1", "positive integer"]),
    # Hydra's own errors: an unknown group option, an unknown key, an unresolvable value
    (["norm=groupnorm"], ["norm/groupnorm", "Available options in 'norm': layernorm"]),
    (["precision=fp8"], ["precision/fp8", "fp16-mixed"]),
    # (an unknown key: its group and the close matches, never Hydra's "use +typo=1")
    (["typo=1"], ["typo=1 is not allowed", "not a setting of the top level", "allowed:"]),
    (["model.n_layerz=3"], ["model.n_layerz=3", "'model' group", "did you mean model.n_layer?"]),
    (["name=${oc.env:STABILIZE_NO_SUCH_VAR}"], ["STABILIZE_NO_SUCH_VAR"]),
    # the formats beyond 16 bits (stabilize/quant/config.py), before anything is built
    (["quant=fp7"], ["quant/fp7", "Available options in 'quant'", "fp8_delayed"]),
    (["quant=fp8_delayed", "quant.layers=[nomatch*]"], ["quant.layers='nomatch*'", "allowed:"]),
    (["quant=fp8_delayed", "quant.history=0"], ["quant.history=0", "an int >= 1"]),
    (["quant=fp8_delayed", "quant.margin=-1"], ["quant.margin=-1", "an int >= 0"]),
    (["quant=mxfp8", "quant.scale_rounding=up"], ["quant.scale_rounding='up'", "rceil"]),
    (["quant=mxfp8", "model.d_model=72"], ["quant.layers includes h.0.attn.c_attn", "32"]),
    (["quant=nvfp4", "norm.reduction_dtype=fp16"], ["quant=nvfp4 with norm.reduction_dtype=fp16"]),
    (["quant=fp8_delayed", "quant.nvfp4.sr=true"], ["quant.nvfp4.sr=true", "quant=nvfp4"]),
    # a Hugging Face model: its Linears' names and widths from the model keys, before the run
    (["model=hf", "quant=fp8_delayed", "quant.layers=[h.*]"], ["quant.layers='h.*'", "allowed:"]),
    (
        ["model=hf", "quant=mxfp8", "model.d_model=72", "model.n_head=2"],
        ["quant.layers includes model.layers.0.self_attn.q_proj", "32"],
    ),
    (
        ["model=hf", "fault=biased_round", "fault.site=lm_head.nope"],
        ["fault.site=", "lm_head.nope"],
    ),
]


@pytest.fixture
def inputs(tmp_path):
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("hello world")
    (d / "table.csv").write_text("text\nhello\n")
    (d / "notes.txt").write_text("not a checkpoint")
    torch.save(torch.zeros(3), d / "tensor.ckpt")
    (d / "dcp.ckpt").mkdir()  # the shape of an FSDP checkpoint (lit/fsdp.py)
    torch.save({"stabilize": {}}, d / "dcp.ckpt" / "meta.pt")
    return d


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime: "nothing written" is an equal tree."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def one_message(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("stabilize-train: "), err
    return lines[0]


@pytest.mark.parametrize(("overrides", "says"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_input_is_one_line_exit_2_and_writes_nothing(
    overrides, says, inputs, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = [o.replace("{inputs}", str(inputs)) for o in [*BASE, *overrides]]
    before = tree(tmp_path)
    code, err = cli([*args, f"hydra.run.dir={tmp_path}/run"], tmp_path, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2, err
    for s in says:
        assert s in line, (s, line)
    assert tree(tmp_path) == before  # no run dir, no config.json, csv/, snapshots/, .hydra/


def test_a_dir_holding_a_run_keeps_its_files_on_a_config_error(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "csv" / "version_0" / "metrics.csv").write_text("step\n1\n")
    (run / "checkpoints").mkdir()  # resume=auto needs one to go on from (run/rundir.py)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"checked after the settings")
    (run / ".hydra").mkdir()  # the run's first launch's record: what the report names it by
    (run / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.001\n")
    before = tree(run)
    # resume=auto: a fresh launch here would be refused first (the run dir's identity)
    args = [*BASE, "optim.lr=inf", "resume=auto", f"hydra.run.dir={run}"]
    code, err = cli(args, tmp_path, monkeypatch, capsys)
    assert code == 2 and "optim.lr=inf" in one_message(err)
    after = tree(run)
    # Hydra recorded this launch in .hydra/relaunch-*/ (removed again) and appended to its
    # log; everything else, the first launch's .hydra/ included, is as it was
    # (the .hydra dir's own mtime moved with that: its files are what must not)
    assert {k: v for k, v in after.items() if "train" not in k and k != ".hydra"} == {
        k: v for k, v in before.items() if k != ".hydra"
    }
    assert not list((run / ".hydra").glob("relaunch-*"))


def test_the_relaunch_record_is_decided_once_per_dir(tmp_path):
    """Hydra resolves hydra.output_subdir at every access: its save, then the clean-up after
    a config error must name the same directory, seconds later and after config.json."""
    held, fresh = tmp_path / "held", tmp_path / "fresh"
    held.mkdir()
    fresh.mkdir()
    (held / "config.json").write_text("{}")
    first = relaunch_subdir(str(held))
    assert first.startswith("/relaunch-") and relaunch_subdir(str(fresh)) == ""
    time.sleep(1.1)  # the record's name has one-second resolution
    (fresh / "config.json").write_text("{}")  # the app writes it after Hydra's save
    assert relaunch_subdir(str(held)) == first and relaunch_subdir(str(fresh)) == ""


def test_a_run_dir_that_cannot_be_made_is_named(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = cli([*BASE, f"hydra.run.dir={blocker}/run"], tmp_path, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2 and str(blocker) in line and "run dir cannot be made" in line


def test_a_full_disk_names_the_file(tmp_path, monkeypatch, capsys):
    """ENOSPC from a real write (/dev/full): the error carries no file name, the message
    does."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").symlink_to("/dev/full")
    code, err = cli([*BASE, f"hydra.run.dir={run}"], tmp_path, monkeypatch, capsys)
    line = one_message(err)
    assert code == 1
    assert "No space left on device" in line and str(run / "config.json") in line


def test_file_error_names_the_file_of_a_failed_write():
    with pytest.raises(OSError) as e, open("/dev/full", "w") as f:
        f.write("x" * 100_000)
        f.flush()
    assert e.value.filename is None  # what Python gives: no file
    assert file_error(e.value) == "No space left on device: /dev/full"


def test_one_line_and_meanings():
    hydra = "Could not find 'norm/x'\n\nAvailable options in 'norm':\n\tlayernorm\n\trmsnorm"
    assert (
        one_line(hydra)
        == "Could not find 'norm/x'; Available options in 'norm': layernorm, rmsnorm"
    )
    assert [meaning(c) for c in (0, 1, 2, 3, -9)] == [
        "done",
        "crashed",
        "config error",
        "aborted",
        "crashed",
    ]
    # torchrun's failures, root cause first -> the launch's code
    assert exit_code([3, -15]) == 3 and exit_code([2, -15]) == 2
    assert exit_code([-15, 3]) == 3 and exit_code([1, -15]) == 1 and exit_code([-9]) == 1


def test_floats_are_finite_also_when_built_in_code():
    from stabilize.run.config import OptimConfig

    with pytest.raises(ValueError, match=r"optim.lr=inf is not allowed; must be a positive finite"):
        OptimConfig(lr=float("inf"))
    with pytest.raises(ValueError, match=r"monitor.loss_spike.min_ratio=inf .* finite"):
        RunConfig.from_dict({"monitor": {"loss_spike": {"min_ratio": float("inf")}}})


# ---- the installed command, in real subprocesses -------------------------------------------
@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["norm.eps=inf"], 2, "norm.eps=inf is not allowed"),
        (["norm=groupnorm"], 2, "Available options in 'norm'"),
    ],
)
def test_the_command_prints_one_line_and_exits_with_the_code(args, code, says, tmp_path):
    r = run_cli(["stabilize-train", *BASE, *args, "hydra.run.dir=run"], cwd=tmp_path)
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    ours = [line for line in r.stderr.splitlines() if line.startswith("stabilize-train:")]
    assert len(ours) == 1 and says in ours[0], r.stderr
    assert list(tmp_path.iterdir()) == []


# ---- stabilize-report on unreadable input (item 9) ------------------------------------------
ROLLBACK_EVENTS = [
    {"kind": "rollback", "monitor": "nonfinite", "step": 5, "message": "loss is nan",
     "extra": {"localization": []}, "global_step": 5},
    {"kind": "rollback", "monitor": "rollback", "step": 5, "message": "rolled back",
     "extra": {"restored_step": 4, "remedy": "skip_data"}, "global_step": 5},
]  # fmt: skip


def _run_dir(path: Path, events: list[str]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(RunConfig().to_dict()))
    (path / "events.jsonl").write_text("\n".join(events) + "\n")
    return path


def test_report_names_malformed_event_lines_and_reports_the_rest(tmp_path, capsys):
    lines = [json.dumps(e) for e in ROLLBACK_EVENTS]
    lines += ['{"kind": "warn", "monitor"', "[1, 2]", '{"kind": "warn", "monitor": "x"}']
    lines += ['{"kind": "warn", "monitor": "activation", "step": "soon"}']
    run = _run_dir(tmp_path / "a", lines)  # no csv/: rollbacks, but no metric rows
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    md = (tmp_path / "out" / "report.md").read_text()
    for where in ("events.jsonl:3: not JSON", "events.jsonl:4: not a JSON object"):
        assert where in err and where in md
    assert "events.jsonl:5: no ['step']" in md and "events.jsonl:6: step='soon'" in md
    assert "no metric rows" in md
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary[0]["rollbacks"] == 1 and summary[0]["first_nonfinite"] == 5


def test_report_keeps_the_rows_before_an_unreadable_metrics_csv_line(tmp_path, capsys):
    run = _run_dir(tmp_path / "a", [json.dumps(e) for e in ROLLBACK_EVENTS])
    csv_dir = run / "csv" / "version_0"
    csv_dir.mkdir(parents=True)
    good = "step,train/loss,train/step\n0,5.5,1\n1,5.0,2\n"
    (csv_dir / "metrics.csv").write_bytes(good.encode() + b"2,\xff\xfe,3\n" * 3000)
    (run / "audit.jsonl").write_text('{"step": 2}\n')
    (run / "result.json").write_text("{truncated")
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "metrics.csv" in err and "unreadable" in err
    assert "audit.jsonl:1: no ['rel_err_median'" in err and "result.json: unreadable" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # both rows before the bad line kept: the final loss is the mean of the last steps'
    assert summary[0]["final_loss"] == (5.5 + 5.0) / 2 and summary[0]["status"] == "unknown"
