"""The private attributes ``stabilize/compat.py`` reads exist, with the meaning it relies on,
on the installed Lightning, torch, FSDP2, W&B and datasets: real objects, no run. A version
that renames one fails here, naming it, not deep inside a training run. No other module of
the package reads another library's private names."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from stabilize import compat

ROOT = Path(__file__).resolve().parents[1]


def test_lightning_counters_and_wandb_logger_internals(tmp_path):
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path)  # fmt: skip
    assert compat.batches_that_stepped(trainer) == 0, L.__version__
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for t in (progress.current, progress.total):
        t.ready = t.started = t.processed = t.completed = 3
    compat.uncount_batch(trainer)
    assert (progress.total.ready, progress.current.completed) == (2, 2)
    lg = WandbLogger(save_dir=tmp_path, mode="offline", anonymous=None)
    assert isinstance(compat.wandb_init_kwargs(lg), dict) and not compat.wandb_started(lg)


def test_grad_scaler_internals_without_a_host_sync():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    assert compat.scaler_scale(scaler) is None  # before its first scale()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    assert not compat.scaler_unscaled(scaler, opt)
    scaler.unscale_(opt)
    assert compat.scaler_unscaled(scaler, opt)  # a second unscale_ would raise
    assert compat.scaler_scale(scaler).item() == 256.0
    found = compat.found_inf_per_device(scaler, opt)
    assert sum(v.item() for v in found.values()) == 1.0  # the inf the step will skip on
    scaler.step(opt)
    scaler.update()
    assert not compat.scaler_unscaled(scaler, opt)  # a new step: unscale_ is due again


def test_torch_and_datasets_internals():
    dst, src = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.arange(3.0)]
    compat.foreach_copy_(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert compat.dynamo_config().recompile_limit >= 1
    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    assert isinstance(compat.dataset_fingerprint(ds), str) and compat.dataset_fingerprint(ds)


def test_fsdp2_gathered_parameters_on_one_gloo_rank(tmp_path):
    """FSDP2's gathered parameters, from a real ``fully_shard`` over a 1-rank gloo group (in
    a subprocess: a process group in this one would outlive the test)."""
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from stabilize import compat
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model[0]); fully_shard(model)
        assert list(compat.fsdp_gathered_params(model)) == []  # no forward yet
        model(torch.ones(1, 4)).sum().backward()
        names = sorted(n for n, _ in compat.fsdp_gathered_params(model))
        print(names)
        w = model[0].weight  # a DTensor: its local shard is the whole weight on 1 rank
        assert compat.dtensor_local(w).shape == (4, 4) and compat.dtensor_local(w.grad) is not None
        assert compat.dtensor_local(torch.ones(2)) is None
        dist.destroy_process_group()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'0.weight'" in r.stdout and "'1.bias'" in r.stdout, r.stdout


def test_no_other_module_reads_another_librarys_private_names():
    """The names compat.py reads appear nowhere else in the package."""
    names = set(re.findall(r"\._([a-z][a-z_]+)", (ROOT / "stabilize" / "compat.py").read_text()))
    names -= {"dynamo"}  # torch._dynamo is imported there; the word is common
    found = []
    for p in sorted((ROOT / "stabilize").rglob("*.py")):
        if p.name == "compat.py":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#")[0]
            found += [f"{p.relative_to(ROOT)}:{i}: _{n}" for n in names
                      if re.search(rf"\w(?<!self)\._{n}\b", code) and "``" not in code]  # fmt: skip
    assert not found, found
