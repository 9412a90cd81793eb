"""The public API's misuse (``stabilize.Guard``, ``stabilize.StabilityCallback``) is answered
by one exception whose message is one line naming the argument, its value and what is
allowed; a refused setting is refused before anything is written (no run dir, no file).

Tables, each row a misuse and words its message must hold: the Guard's settings, its calls
out of order, the callback's settings, and the callback's ``model`` path and ``blocks`` glob
refused at the set-up of a real (tiny) Lightning fit."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stabilize
from stabilize.stability.driven import StabilityConfigError
from stabilize.validate import ConfigError


class _Net(nn.Module):
    """Embedding, two residual blocks of a norm and a linear, a head: what the probe watches."""

    def __init__(self, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in "ab")
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _data(n: int = 4):
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 32, (n * 4, 9), generator=g)
    return [(seq[i : i + 4, :-1], seq[i : i + 4, 1:]) for i in range(0, n * 4, 4)]


def _files(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _one_line(err: pytest.ExceptionInfo, words: list[str]) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    for w in words:
        assert w in msg, (w, msg)
    return msg


def _a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("not a dir")
    return f


# ---- Guard(...) settings: refused before anything is written --------------------------------
# (kwargs over a good Guard's, or a callable of tmp_path giving them; the error; its words)
GUARD_SETTINGS = [
    ({"model": nn.Identity()}, StabilityConfigError, ["model=", "Identity", "no parameters"]),
    ({"optimizer": None}, ConfigError, ["optimizer=None", "allowed", "torch.optim.Optimizer"]),
    ({"scaler": 3}, ConfigError, ["scaler=3", "allowed", "GradScaler"]),
    (
        lambda t: {"run_dir": _a_file(t)},
        ConfigError,
        ["afile' is not allowed: it is a file", "run_dir=", "allowed", "directory"],
    ),
    (
        lambda t: {"run_dir": _a_file(t) / "run"},
        ConfigError,
        ["afile/run' is not allowed: '", "afile' is a file", "run_dir=", "allowed"],
    ),
    ({"run_dir": 12}, ConfigError, ["run_dir=12", "allowed", "path"]),
    ({"run_dir": None}, ConfigError, ["run_dir=None", "allowed", "path"]),
    ({"rollback": "yes"}, ConfigError, ["rollback='yes'", "allowed", "RollbackConfig"]),
    ({"monitor": "yes"}, ConfigError, ["monitor='yes'", "allowed", "MonitorConfig"]),
    ({"fault": "yes"}, ConfigError, ["fault='yes'", "allowed"]),
    ({"rollback": {"nope": 1}}, ConfigError, ["rollback.nope", "allowed", "snapshot_every"]),
    (
        {"fault": {"kind": "nan_loss", "step": 2}},
        StabilityConfigError,
        ["fault.kind='nan_loss'", "allowed"],
    ),
    ({"factory": "nope:fn"}, ConfigError, ["factory='nope:fn'", "nope", "import", "allowed"]),
    ({"factory": "nofn"}, ConfigError, ["factory='nofn'", "pkg.mod:fn", "allowed"]),
    (
        {"factory": "os:nothere"},
        ConfigError,
        ["factory='os:nothere'", "no attribute", "allowed"],
    ),
    ({"factory": "os:sep"}, ConfigError, ["factory='os:sep'", "not callable", "allowed"]),
    (
        {"factory": "__main__:build"},
        ConfigError,
        ["factory='__main__:build'", "script", "allowed"],
    ),
    ({"factory": 12}, ConfigError, ["factory=12", "allowed", "pkg.mod:fn"]),
    ({"loss_fn": "lm_loss"}, ConfigError, ["loss_fn='lm_loss'", "allowed", "callable"]),
    ({"clip": -1.0}, ConfigError, ["clip=-1.0", "allowed", ">= 0"]),
    ({"clip": float("nan")}, ConfigError, ["clip=nan", "allowed"]),
    ({"log_every": 0}, ConfigError, ["log_every=0", "positive integer"]),
    ({"blocks": 3}, ConfigError, ["blocks=3", "allowed", "glob"]),
    ({"blocks": "nope.*"}, ValueError, ["blocks='nope.*'", "matches no module"]),
]


@pytest.mark.parametrize(
    ("kw", "exc", "words"), GUARD_SETTINGS, ids=[w[0] for *_, w in GUARD_SETTINGS]
)
def test_a_bad_guard_setting_is_one_line_and_writes_nothing(tmp_path, kw, exc, words):
    kw = kw(tmp_path) if callable(kw) else kw
    model = _Net()
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "run_dir": tmp_path / "run", "loss_fn": _loss, **kw}  # fmt: skip
    before = _files(tmp_path)
    with pytest.raises(exc) as err:
        stabilize.Guard(args.pop("model"), args.pop("optimizer"), args.pop("scaler", None),
                        **args)  # fmt: skip
    _one_line(err, words)
    assert _files(tmp_path) == before


# ---- the Guard's calls out of order: refused, nothing written by the refused call -----------
# each misuse calls mark() just before the call to be refused (close() writes its own files)
def _before_any_batch(guard, model, mark):
    loss = _loss(model, _data()[0])
    loss.backward()
    mark()
    guard.before_step(loss)


def _float_loss(guard, model, mark):
    for batch in guard.batches(_data()):
        _loss(model, batch).backward()
        mark()
        guard.before_step(3.0)


def _per_token_loss(guard, model, mark):
    for batch in guard.batches(_data()):
        x, y = batch
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
        loss.mean().backward()
        mark()
        guard.before_step(loss)


def _judged_then(between):
    """A batch judged, then ``between(guard)``, then before_step again for it."""

    def misuse(guard, model, mark):
        for batch in guard.batches(_data()):
            loss = _loss(model, batch)
            loss.backward()
            guard.before_step(loss)
            between(guard)
            mark()
            guard.before_step(loss)

    return misuse


def _draw_after_close(guard, model, mark):
    guard.close()
    mark()
    for batch in guard.batches(_data()):
        _loss(model, batch).backward()


GUARD_CALLS = {
    "before any batch": (
        _before_any_batch,
        ["Guard.before_step", "before any batch", "allowed", "guard.batches"],
    ),
    "a float loss": (_float_loss, ["Guard.before_step(loss=3.0)", "allowed", "torch.Tensor"]),
    "a per-token loss": (
        _per_token_loss,
        ["Guard.before_step(loss=", "[32]", "allowed", "one-element"],
    ),
    "twice for a batch": (
        _judged_then(lambda g: None),
        ["Guard.before_step", "twice for one batch", "allowed", "once per batch"],
    ),
    "step after close": (
        _judged_then(lambda g: g.close()),
        ["Guard.before_step", "after Guard.close()", "allowed", "new Guard"],
    ),
    "draw after close": (
        _draw_after_close,
        ["Guard.batches", "after Guard.close()", "allowed", "new Guard"],
    ),
}


@pytest.mark.parametrize(("misuse", "words"), GUARD_CALLS.values(), ids=GUARD_CALLS.keys())
def test_a_guard_call_out_of_order_is_one_line_and_writes_nothing(tmp_path, misuse, words):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    guard = stabilize.Guard(model, opt, run_dir=run, loss_fn=_loss,
                            rollback={"snapshot_every": 1})  # fmt: skip
    seen: list[set[str]] = []

    def mark():  # the start's durable snapshot is written in the background: landed first
        guard.engine.writer.wait()
        seen.append(_files(run))

    with pytest.raises(StabilityConfigError) as err:
        misuse(guard, model, mark)
    _one_line(err, words)
    assert seen and _files(run) == seen[-1]


def test_a_guard_closed_twice_is_still_fine(tmp_path):
    model = _Net()
    guard = stabilize.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            run_dir=tmp_path / "run", loss_fn=_loss)  # fmt: skip
    for batch in guard.batches(_data(2)):
        loss = _loss(model, batch)
        loss.backward()
        assert guard.before_step(loss).apply
    guard.close()
    guard.close()
    assert (tmp_path / "run" / "result.json").exists()


# ---- StabilityCallback(...) settings: refused at construction ---------------------------------
CALLBACK_SETTINGS = [
    ({"rollback": "yes"}, ["rollback='yes'", "allowed", "RollbackConfig", "dict"]),
    ({"monitor": 3}, ["monitor=3", "allowed", "MonitorConfig"]),
    ({"fault": ["nan_loss"]}, ["fault=['nan_loss']", "allowed"]),
    ({"rollback": {"snapshot_every": 2, "nope": 1}}, ["rollback.nope", "allowed"]),
    (lambda t: {"run_dir": _a_file(t)}, ["afile' is not allowed: it is a file", "run_dir="]),
    ({"run_dir": 12}, ["run_dir=12", "allowed", "path"]),
    ({"accumulate": 0}, ["accumulate=0", "positive integer"]),
    ({"model": 12}, ["model=12", "allowed", "nn.Module", "attribute path"]),
    ({"blocks": ["h.*"]}, ["blocks=['h.*']", "allowed", "glob"]),
    ({"factory": "nope:fn"}, ["factory='nope:fn'", "nope", "import", "allowed"]),
    ({"factory": "os.path:"}, ["factory='os.path:'", "pkg.mod:fn", "allowed"]),
    ({"skip_items": ["12"]}, ["data.skip_items[0]='12'", "allowed", "INDEX:HASH"]),
]


@pytest.mark.parametrize(
    ("kw", "words"), CALLBACK_SETTINGS, ids=[w[0] for _, w in CALLBACK_SETTINGS]
)
def test_a_bad_callback_setting_is_one_line_at_construction(tmp_path, kw, words):
    kw = kw(tmp_path) if callable(kw) else kw
    before = _files(tmp_path)
    with pytest.raises(ConfigError) as err:
        stabilize.StabilityCallback(**{"run_dir": tmp_path / "run", **kw})
    _one_line(err, words)
    assert _files(tmp_path) == before


def test_one_skip_items_entry_may_be_given_as_a_string(tmp_path):
    cb = stabilize.StabilityCallback(run_dir=tmp_path, skip_items="3:0123456789abcdef")
    assert list(cb.engine.skip_items) == ["3:0123456789abcdef"]


# ---- the callback's model path and blocks: refused at set-up, before the run dir is made ---
class _Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        self.drop = nn.Dropout(0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(self.drop(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


FIT_SETTINGS = [
    (
        {"model": "net.nothere"},
        ["model='net.nothere'", "_Lit", "nothere", "allowed", "['net', 'drop']"],
    ),
    ({"model": "net.0.weight"}, ["model='net.0.weight'", "not an nn.Module", "allowed"]),
    ({"model": "drop"}, ["model='drop'", "Dropout", "no parameters", "allowed"]),
    ({"blocks": "nope.*"}, ["blocks='nope.*'", "matches no module"]),
]


@pytest.mark.parametrize(("kw", "words"), FIT_SETTINGS, ids=[w[0] for _, w in FIT_SETTINGS])
def test_a_bad_model_or_blocks_is_refused_at_setup_before_the_run_dir_is_made(tmp_path, kw, words):
    run = tmp_path / "run"
    cb = stabilize.StabilityCallback(run_dir=run, **kw)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, callbacks=[cb],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=4)
    with pytest.raises(ValueError) as err:
        trainer.fit(_Lit(), data)
    _one_line(err, words)
    assert not run.exists()


def test_a_fault_layer_past_the_blocks_is_one_line_and_writes_nothing(tmp_path):
    """A planted fault naming a block the model does not have: the key, the value and the
    blocks there are, before the run dir is made (was an IndexError)."""
    blocks = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    fault = {"kind": "stream_drift", "layer": 5, "step": 2, "target": 300.0}
    with pytest.raises(ConfigError) as err:
        stabilize.Guard(blocks, opt, run_dir=tmp_path / "run", fault=fault)
    _one_line(err, ["fault.layer=5", "2 residual blocks", "allowed: 0 to 1"])
    assert not (tmp_path / "run").exists()
