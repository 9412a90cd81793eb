"""More bad inputs end on one line: a full disk at a checkpoint write
(exit 1, the file named), a corpus in another encoding, a GPU that is not there, online W&B
without a key, a hub dataset offline, a run name that leaves runs/, a resume typo found
before the corpus is tokenized, Hydra's unknown keys without its '+' advice, and run names
that are not markdown in report.md.

Like tests/test_errors.py, the config errors run ``stabilize.train.main`` in this process
(real Hydra composition, real checks, ``sys.exit``) and compare the tree before and after
("nothing written"). The full disk is a real OS error in a real subprocess: a file-size
limit (``RLIMIT_FSIZE``) below a checkpoint's size, so the kernel refuses the write (EFBIG).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_errors import BASE, ROLLBACK_EVENTS, _run_dir, one_message, tree

from stabilize.data import DataConfig, load_corpus
from stabilize.data.corpus import undecodable
from stabilize.io import verify
from stabilize.report import main as report_main
from stabilize.report import markdown
from stabilize.run.config import LoggerConfig, RunConfig
from stabilize.run.preflight import check_wandb_login
from stabilize.train import run
from stabilize.validate import ConfigError

from conftest import FAST, cli, compose_run

LATIN1 = "plain ascii text, line after line.\n" * 50 + "un café crème, s'il vous plaît\n"
BAD_AT = LATIN1.index("é")  # the first byte that is not UTF-8: every byte before it is ASCII
LATIN1_JSONL = '{"text": "x"}\n{"text": "café"}\n'.encode("latin-1")


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    (d / "latin1.txt").write_bytes(LATIN1.encode("latin-1"))
    (d / "latin1.jsonl").write_bytes(LATIN1_JSONL)
    torch.save({"state_dict": {}, "epoch": 0}, d / "lightning.ckpt")  # not ours: no model step
    return d


# (overrides, what the one line must say). "{files}" is the fixture's directory; the token
# cache is outside the compared tree ("work/") unless a case puts it in ("{work}/cache").
CASES = [
    # a corpus in another encoding: the file, the byte, the way out
    (
        ["data=local", "data.paths=[{files}/latin1.txt]"],
        ["latin1.txt", f"does not decode as utf-8 at byte {BAD_AT}", "data.encoding=latin-1"],
    ),
    (
        ["data=local", "data.paths=[{files}/latin1.jsonl]"],
        ["latin1.jsonl", f"utf-8 at byte {LATIN1_JSONL.index(0xE9)}", "data.encoding=latin-1"],
    ),
    (["data.encoding=latin-9000"], ["data.encoding='latin-9000'", "a text encoding Python"]),
    (["data.encoding=rot13"], ["data.encoding='rot13'", "'utf-8', 'latin-1'"]),
    # a hub dataset that is not in the cache, with the hub off (conftest: HF_DATASETS_OFFLINE)
    (
        ["data=hub", "data.name=stabilize-no-such-dataset"],
        ["data.name='stabilize-no-such-dataset'", "not in the local cache", "(offline"],
    ),
    # names that would leave runs/ (the run dir is given here: refused all the same)
    (["name=a/b"], ["name='a/b'", "one directory under runs/", "without '/'"]),
    (["name=.."], ["name='..'", "'..'"]),
    # resume=PATH: checked before the data (a corpus that would fail itself comes second)
    (
        ["data=local", "data.paths=[{files}/latin1.txt]", "resume={files}/nope.ckpt"]
        + ["data.cache_dir={work}/cache"],  # nothing tokenized: no cache entry, no lock file
        ["resume=", "nope.ckpt", "no such checkpoint file"],
    ),
    (["resume={files}/nope.ckpt", "data.cache_dir={work}/cache"], ["nope.ckpt"]),
    (["resume={files}/lightning.ckpt"], ["lightning.ckpt", "not written by stabilize-train"]),
    # Hydra's unknown keys: where, and what was meant
    (["typo=1"], ["typo=1 is not allowed", "not a setting of the top level", "allowed: hydra"]),
    (["model.n_layerz=3"], ["'model' group", "did you mean model.n_layer?"]),
    (["fault=nan_loss", "fault.stepp=3"], ["fault.stepp=3", "did you mean fault.step?"]),
    (["model.n_layer.x=3"], ["model.n_layer.x=3 is not allowed", "model.n_layer holds a value"]),
]


@pytest.mark.parametrize(("overrides", "says"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_more_bad_inputs_are_one_line_exit_2_and_write_nothing(
    overrides, says, files, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    if not any(o.startswith("data.cache_dir=") for o in overrides):
        overrides = [*overrides, f"data.cache_dir={tmp_path}/cache"]  # a failed build's lock
    args = [*BASE, *overrides, f"hydra.run.dir={work}/run"]
    args = [o.replace("{files}", str(files)).replace("{work}", str(work)) for o in args]
    before = tree(work)
    code, err = cli(args, work, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2, err
    for s in says:
        assert s in line, (s, line)
    assert "use +" not in line and " +" not in line  # Hydra's advice: refused here
    assert tree(work) == before


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: nothing to refuse")
def test_a_gpu_run_without_cuda_is_refused(accelerator, tmp_path, monkeypatch, capsys):
    before = tree(tmp_path)
    args = [*BASE, f"trainer.accelerator={accelerator}", f"hydra.run.dir={tmp_path}/run"]
    code, err = cli(args, tmp_path, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2 and f"trainer.accelerator='{accelerator}'" in line, line
    assert "'cpu' or 'auto'" in line and tree(tmp_path) == before


@pytest.fixture
def fresh_wandb():
    """wandb keeps one settings object (and the session's key) per process: a test that
    changes HOME and WANDB_MODE gets a fresh one, and leaves one built from the next test's
    environment."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_online_wandb_without_a_key_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys, fresh_wandb
):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc, no ~/.config/wandb/settings
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    before, before_home = tree(work), tree(home)
    args = [*BASE, "logger=wandb", "logger.mode=online", f"hydra.run.dir={work}/run"]
    code, err = cli(args, work, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2, err
    assert "logger.mode='online'" in line
    assert "without a W&B API key" in line and "`wandb login`" in line
    assert "logger.mode=offline" in line
    assert tree(home) == before_home and tree(work) == before  # wandb's lookup wrote nothing
    # the variable wins over the setting, and is named when it is what asks for online
    monkeypatch.setenv("WANDB_MODE", "online")
    args[args.index("logger.mode=online")] = "logger.mode=offline"
    code, err = cli(args, work, monkeypatch, capsys)
    assert code == 2 and "WANDB_MODE=online" in one_message(err)


def test_a_key_from_wandb_login_passes_the_check(tmp_path, monkeypatch, fresh_wandb):
    """`wandb login` leaves the key in ~/.netrc for W&B's host: no refusal then."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    online = RunConfig(logger=LoggerConfig(mode="online"))
    with pytest.raises(ConfigError, match="without a W&B API key"):
        check_wandb_login(online)
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    check_wandb_login(online)  # found: nothing raised


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "multirun"])
def test_a_name_that_leaves_runs_is_refused_and_nothing_is_made(
    sweep, tmp_path, monkeypatch, capsys
):
    """runs/${name}/<id> (and multirun/${name}/<time>): Hydra makes that dir before the app
    runs, so the refusal comes from the run-dir guard, before Hydra makes it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.delenv("STABILIZE_RUN_DIR", raising=False)
    monkeypatch.delenv("STABILIZE_SWEEP_DIR", raising=False)
    before = tree(tmp_path)
    args = [*(["-m"] if sweep else []), *BASE, "name=../../escape"]
    code, err = cli(args, work, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2 and "name='../../escape' is not allowed" in line, err
    assert not (tmp_path / "escape").exists()  # work/runs/../../escape
    assert tree(tmp_path) == before


def test_a_non_utf8_corpus_reads_with_its_encoding(files):
    cfg = DataConfig(source="local", paths=[str(files / "latin1.txt")], encoding="latin-1")
    ds = load_corpus(cfg)
    assert "un café crème" in "\n\n".join(ds["text"])
    with pytest.raises(ConfigError, match=r"data.encoding='base64' is not allowed"):
        DataConfig(encoding="base64")  # a codec, but bytes to bytes


def test_the_bad_byte_is_found_across_read_chunks(tmp_path):
    """The offset is the file's, also when a multi-byte character straddles two chunks."""
    f = tmp_path / "big.txt"
    head = b"a" * ((1 << 20) - 1) + "é".encode() + b"b" * 10  # é: bytes 2**20-1 and 2**20
    f.write_bytes(head + b"\xff tail")
    assert undecodable([str(f)], "utf-8") == (str(f), len(head), "invalid start byte")
    assert undecodable([str(f)], "latin-1") is None


# ---- a full disk at a checkpoint write: a real OS error, in a real subprocess -------------
def _file_size_limit(limit: int):
    def preexec() -> None:  # in the child, before exec: writes past `limit` fail (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_checkpoint_write_that_fails_names_the_file_and_keeps_the_last_one(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    small = [o for o in FAST if not o.startswith(("trainer.max_steps", "trainer.limit_val"))]
    small += ["logger=none", f"data.cache_dir={cache}", "trainer.limit_val_batches=1"]
    small += ["trainer.final_eval_batches=0"]
    # launch 1, unlimited: 2 steps, last.ckpt at step 2 (and the token cache is built)
    run(compose_run(run_dir, [*small, "trainer.max_steps=2"]))
    last = run_dir / "checkpoints" / "last.ckpt"
    kept = last.read_bytes()
    assert last.stat().st_size > 4 << 20  # the tiny model + AdamW: ~5 MB, over the limit
    # launch 2 goes on to step 4 with no file allowed past 1 MiB: its checkpoint is refused
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    args = ["stabilize-train", *small, "trainer.max_steps=4", "resume=auto"]
    r = subprocess.run(
        [*args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_file_size_limit(1 << 20),
    )
    assert r.returncode == 1, r.stderr[-3000:]  # the run crashed: not a config error
    assert "Traceback" not in r.stderr and "unexpected pos" not in r.stderr, r.stderr
    ours = [x for x in r.stderr.splitlines() if x.startswith("stabilize-train:")]
    assert ours == [f"stabilize-train: File too large: {last}"], r.stderr
    assert last.read_bytes() == kept and verify(last)  # the old one, whole
    assert not list(last.parent.glob(".*.tmp-*"))  # the torn temporary is gone
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and "File too large" in result["error"]


# ---- report.md: a run's name is text, not markdown ----------------------------------------
def _cells(row: str) -> list[str]:
    """A table row's cells, split on the pipes markdown splits on (not on escaped ones)."""
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_a_run_named_with_markdown_characters_renders_literally(tmp_path):
    markdown_it = pytest.importorskip("markdown_it")
    name = "a|b*c_"
    run_dir = _run_dir(tmp_path / name, [json.dumps(e) for e in ROLLBACK_EVENTS])
    out = tmp_path / "out"
    assert report_main([str(run_dir), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    table = md.split("## Per run")[1].split("\n\n")[1].splitlines()
    assert len(_cells(table[2])) == len(_cells(table[0])) == 16
    assert _cells(table[2])[0].strip() == r"a\|b\*c\_"
    assert md.count(r"### a\|b\*c\_") == 2  # its rollbacks and its chain of events
    # rendered as GitHub does: one row of 16 cells, the name as it is, no emphasis
    html = markdown_it.MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(md)
    body = html.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<td>") == 16 and "<td>a|b*c_</td>" in body
    assert html.count("<h3>a|b*c_</h3>") == 2 and "b<em>" not in html
    assert f"<code>{name}</code>" in html  # "Runs:": a code span


def test_a_backslash_or_backtick_in_a_name_stays_literal():
    markdown_it = pytest.importorskip("markdown_it")
    render = markdown_it.MarkdownIt("commonmark").enable("table").render
    html = render(markdown.table([["arm", "loss"], ["x\\|y", "1"]]))  # x\|y: not x\ | y
    assert html.count("<td>") == 2 and "<td>x\\|y</td>" in html
    assert render(markdown.code("a`b")) == "<p><code>a`b</code></p>\n"
