"""Read W&B offline run files (``wandb/offline-run-*/run-*.wandb``) without a W&B account.

The file is a 7-byte W&B header (``:W&B``, a 2-byte magic, a version byte) followed by
records in the LevelDB log format: 32 KiB blocks, each record chunk with a 7-byte header
(crc32c, little-endian length, chunk type FULL/FIRST/MIDDLE/LAST), a block tail shorter than
a header being padding. Each record is a ``wandb_internal_pb2.Record`` protobuf. Recent
wandb releases read these in Go only, so this reader is ours.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing ':W&B' header)")
    pos = _HEADER
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:  # zero fill at the end of a block
            pos += left_in_block
            continue
        yield kind, data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length


def records(path: str | Path):
    """Yield every ``Record`` in a .wandb file, reassembling multi-chunk records."""
    buf = b""
    for kind, chunk in _chunks(Path(path).read_bytes()):
        if kind in (_FULL, _FIRST):
            buf = chunk
        else:
            buf += chunk
        if kind in (_FULL, _LAST):
            r = pb.Record()
            r.ParseFromString(buf)
            yield r
            buf = b""


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    path: Path
    run_id: str = ""
    name: str = ""  # the display name (``wandb.init(name=...)``)
    project: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, str]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # define_metric's records
    finished: bool = False  # the exit record is there: the run's file is complete

    def series(self, key: str) -> list[Any]:
        return [row[key] for row in self.history if key in row]


def read_offline_run(run_dir: str | Path, wait_s: float = 0.0) -> OfflineRun:
    """Parse one ``offline-run-*`` directory (or its .wandb file). The file is written by
    W&B's own service process, which may still be writing its tail after ``finish()``
    returned on a loaded machine: with ``wait_s`` it is read again until its exit record is
    there (or the time is up; a crashed run never gets one). A record cut mid-write (the
    writer's tail, read too soon) is read again the same way."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = _read_once(Path(run_dir))
        except DecodeError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
            continue
        if out.finished or time.monotonic() >= deadline:
            return out
        time.sleep(0.2)


def _read_once(run_dir: Path) -> OfflineRun:
    f = run_dir if run_dir.suffix == ".wandb" else next(run_dir.glob("run-*.wandb"))
    out = OfflineRun(path=f)
    for r in records(f):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.project, out.name = r.run.run_id, r.run.project, r.run.display_name
            out.group, out.job_type, out.tags = r.run.run_group, r.run.job_type, list(r.run.tags)
            for item in r.run.config.update:
                out.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in r.config.update:
                out.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            out.history.append({_item_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            for item in r.summary.update:
                out.summary[_item_key(item)] = json.loads(item.value_json)
        elif kind == "metric":
            m = r.metric
            ops = ("min", "max", "mean", "last", "first", "none")
            out.metrics.append({"name": m.name or m.glob_name, "glob": bool(m.glob_name),
                                "hidden": m.options.hidden, "step_metric": m.step_metric,
                                "summary": [o for o in ops if getattr(m.summary, o)]})  # fmt: skip
        elif kind == "alert":
            out.alerts.append({"title": r.alert.title, "text": r.alert.text})
        elif kind == "exit":
            out.finished = True
    # W&B stores config values as {"value": v, "desc": ...}
    out.config = {
        k: v.get("value", v) if isinstance(v, dict) else v
        for k, v in out.config.items()
        if not k.startswith("_")
    }
    return out


def find_offline_runs(root: str | Path) -> list[Path]:
    return sorted(Path(root).rglob("offline-run-*"))
