"""Every key of ``stabilize-train``'s config with its meaning, its default and what it
allows: ``stabilize-train --keys PREFIX`` and docs/config.md (scripts/config_doc.py).

One source: the settings dataclasses. A key's default is its field's, its meaning the
field's docstring and its allowed values the checks the dataclass runs (``field_docs.py``);
the sections follow the config's layout and the registries (one section per registered
monitor, remedy with settings and fault kind with knobs), as the config nodes do
(stabilize/config_store.py). ``stabilize/train.py`` adds what a bare ``stabilize-train``
composes where its config files set another value (``with_composed``).

Building the table imports the dataclasses' modules (torch and the data stack), which
``--keys`` must not wait for, as ``--help`` does not: ``cached_table`` keeps it in a file
keyed by the source's hash, beside the config nodes' cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabilize.paths import default_cache_dir
from stabilize.run.field_docs import allowed_values, class_intro, field_docs, show

# A section Hydra puts elsewhere than its dataclass does: the norm is a top-level group,
# moved into model.norm by RunConfig.from_dict.
HYDRA_PREFIX = {"model.norm": "norm"}
# An optional section (a field that defaults to None) and the group option that sets it:
# configs/model/hf.yaml puts the HFConfig node at model.hf.
OPTIONS = {"model.hf": "model=hf"}


@dataclass
class Key:
    """One setting, as ``--keys`` prints it and docs/config.md lists it."""

    key: str
    """As written on the command line (``norm.eps``, ``monitor.loss_scale.floor``)."""
    default: Any
    """The dataclass's default."""
    meaning: str
    """The field's docstring on one line ("": it has none, which a test refuses)."""
    allowed: str = ""
    """What its checks allow, in words ("": nothing cheap to read)."""
    option: str = ""
    """The group option that brings the key (``fault=grad_spike``); "": every config has it."""
    composed: str | None = None
    """What a bare ``stabilize-train`` composes, where its config files set another value."""
    owner: str = ""
    """``module.Class.field``, for a message about the field."""


@dataclass
class Section:
    name: str
    """The keys' common prefix ("" for train.yaml's own keys)."""
    option: str
    intro: str
    """The first paragraph of the section's docstring."""
    keys: list[Key] = field(default_factory=list)


def build_table() -> list[Section]:
    """Every section, in the config's order, from the live dataclasses and registries."""
    from stabilize.run.config import RunConfig

    out: list[Section] = []
    _add_dataclass(RunConfig, "", "", out)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"  # no default: Hydra's mandatory value (config_store.defaults)


def _add_dataclass(
    cls: type,
    prefix: str,
    option: str,
    out: list[Section],
    intro: str | None = None,
    only: typing.Callable[[str, Any], bool] | None = None,
) -> None:
    """A section of ``cls``'s leaf fields, then its sub-sections (``only(field name,
    default)``: the fields to list)."""
    from stabilize.faults.config import FaultConfig
    from stabilize.monitors import MonitorConfig
    from stabilize.rollback import RollbackConfig

    section = Section(prefix, option, class_intro(cls) if intro is None else intro)
    out.append(section)
    fields = [f for f in dataclasses.fields(cls) if only is None or only(f.name, _default(f))]
    keys = {f.name: _join(prefix, f.name) for f in fields}
    docs, allowed = field_docs(cls), allowed_values(cls, keys)
    later: list[tuple[typing.Callable[..., None], tuple]] = []  # sub-sections, in order
    for f in fields:
        key, value = keys[f.name], _default(f)
        if isinstance(value, FaultConfig):
            later.append((_add_faults, (key, out)))
        elif dataclasses.is_dataclass(value):
            later.append((_add_dataclass, (type(value), HYDRA_PREFIX.get(key, key), option, out)))
        elif isinstance(value, MonitorConfig):
            later.append((_add_monitors, (key, out)))
        elif cls is RollbackConfig and f.name == "remedy":
            later.append((_add_remedies, (key, out)))
        else:
            words = ["true | false"] if f.type in ("bool", bool) else allowed.get(f.name, [])
            owner = f"{_name(cls)}.{f.name}"
            doc = docs.get(f.name, "")
            section.keys.append(Key(key, value, doc, "; ".join(words), option, owner=owner))
            if value is None and (sub := _optional_dataclass(cls, f.name)) is not None:
                later.append((_add_dataclass, (sub, key, OPTIONS.get(key, ""), out)))
    for add, args in later:
        add(*args)


def _add_monitors(prefix: str, out: list[Section]) -> None:
    """``monitor.enabled``, then one section per registered monitor (a ``flag`` one is
    written as a bare bool: its key is the section's, its meaning its ``enabled``'s)."""
    from stabilize.monitors import MONITORS, MonitorConfig

    doc = field_docs(MonitorConfig).get("enabled", "")
    enabled = Key(f"{prefix}.enabled", MonitorConfig().enabled, doc, "true | false",
                  owner=f"{_name(MonitorConfig)}.enabled")  # fmt: skip
    out.append(Section(prefix, "", class_intro(MonitorConfig), [enabled]))
    for name, entry in MONITORS.items():
        key = f"{prefix}.{name}"
        if entry.flag:
            doc = field_docs(entry.config).get("enabled", "")
            flag = Key(key, entry.config().enabled, doc, "true | false",
                       owner=f"{_name(entry.config)}.enabled")  # fmt: skip
            out.append(Section(key, "", class_intro(entry.config), [flag]))
        else:
            _add_dataclass(entry.config, key, "", out)


def _add_remedies(prefix: str, out: list[Section]) -> None:
    from stabilize.rollback import REMEDIES

    for name in REMEDIES.configured():
        _add_dataclass(REMEDIES.config(name), f"{prefix}.{name}", "", out)


def _add_faults(prefix: str, out: list[Section]) -> None:
    """The keys every kind has, then each kind's own knobs (those its dataclass adds or
    gives another default or meaning), under the option ``fault=<kind>``."""
    from stabilize.faults.config import FAULTS, FaultConfig

    _add_dataclass(FaultConfig, prefix, "", out)
    common = {f.name: _default(f) for f in dataclasses.fields(FaultConfig)}
    common_docs = field_docs(FaultConfig)
    for kind in FAULTS:
        cls = FAULTS.config(kind)
        if cls is FaultConfig:
            continue
        docs = field_docs(cls)

        def own(name: str, value: Any, docs=docs) -> bool:
            if name == "kind":  # its node sets kind=<kind> (the option says so)
                return False
            return name not in common or (value, docs.get(name)) != (
                common[name],
                common_docs.get(name),
            )

        intro = class_intro(cls) or class_intro(FAULTS[kind])
        _add_dataclass(cls, prefix, f"{prefix}={kind}", out, intro=intro, only=own)


def _optional_dataclass(cls: type, name: str) -> type | None:
    """The dataclass of an optional section (``hf: HFConfig | None``), else None."""
    try:
        hint = typing.get_type_hints(cls)[name]
    except Exception:  # an annotation that does not resolve: not a section
        return None
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def keys_of(table: list[Section]) -> list[Key]:
    return [k for s in table for k in s.keys]


# ---- the composed config -------------------------------------------------------------------
_ABSENT = object()


def lookup(values: Any, key: str) -> Any:
    """The value at a dotted key of a nested mapping (``_ABSENT`` if there is none)."""
    for part in key.split("."):
        if not isinstance(values, dict) or part not in values:
            return _ABSENT
        values = values[part]
    return values


def with_composed(table: list[Section], composed: dict[str, Any]) -> list[Section]:
    """The table, each key's ``composed`` set where ``composed`` (a bare ``stabilize-train``'s
    config, interpolations unresolved) holds another value than its default."""
    for k in keys_of(table):
        value = lookup(composed, k.key)
        shown = None if value is _ABSENT or k.option else _show_value(value)
        k.composed = None if shown == _show_value(k.default) else shown  # as written
    return table


# ---- selecting and showing -----------------------------------------------------------------
class UnknownPrefix(LookupError):
    """No key is or starts with the prefix; the message names the close matches."""


def select(table: list[Section], prefix: str) -> list[Key]:
    """The keys that are ``prefix`` or lie under it (all of them for "")."""
    prefix = prefix.strip(".")
    keys = [k for k in keys_of(table) if not prefix or k.key == prefix
            or k.key.startswith(prefix + ".")]  # fmt: skip
    if keys:
        return keys
    names = {k.key for k in keys_of(table)}
    names |= {k.rsplit(".", i)[0] for k in names for i in range(1, k.count(".") + 1)}
    close = difflib.get_close_matches(prefix, sorted(names), n=3, cutoff=0.6)
    if close:
        said = ", ".join(close[:-1]) + " or " + close[-1] if len(close) > 1 else close[0]
        raise UnknownPrefix(f"--keys {prefix}: no such key; did you mean {said}?")
    tops = sorted({n.split(".")[0] for n in names if "." in n})
    raise UnknownPrefix(f"--keys {prefix}: no such key; the sections: {', '.join(tops)}")


def _show_value(value: Any) -> str:
    """A default as it is written in an override (lists and mappings too)."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_show_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show_value(v)}" for k, v in value.items()) + "}"
    if value == "":
        return '""'
    return show(value)


def context(k: Key) -> str:
    """Where the default holds: under a group option, or what stabilize-train composes."""
    if k.option:
        return f"with {k.option}"
    return f"stabilize-train: {k.composed}" if k.composed is not None else ""


def line(k: Key) -> str:
    """``key = default (context)  meaning [allowed: ...]``: one line of ``--keys``."""
    where = f" ({context(k)})" if context(k) else ""
    allowed = f" [allowed: {k.allowed}]" if k.allowed else ""
    return f"{k.key} = {_show_value(k.default)}{where}  {k.meaning}{allowed}"


# ---- docs/config.md ------------------------------------------------------------------------
HEADER = """# Config keys

Every key of `stabilize-train`'s config, section by section: its default, what it allows
and what it means. Written by `python scripts/config_doc.py` from the settings dataclasses
(each field's default, its docstring and the checks it runs on construction), so do not
edit it by hand: tests/test_config_keys.py checks that it is current. At the command line,
`stabilize-train --keys PREFIX` prints the same for the keys under a prefix, one a line.

*default* is the dataclass's, which every file of `configs/` starts from; "stabilize-train:
X" beside it is what a bare `stabilize-train` composes instead, where the default options
of `configs/train.yaml` set another value (`${...}`: it follows that key). A section "with
`fault=<kind>`" holds the keys that exist under that option only. *allowed* is what the
dataclass checks on construction (blank: nothing that reads in a few words; checks across
keys, such as `fault.step` against `trainer.max_steps`, are not listed).
"""


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and outside code spans ``<`` too (Markdown
    would take ``runs/<name>`` for an HTML tag and drop it)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def markdown(table: list[Section]) -> str:
    """docs/config.md: a table per section."""
    parts = [HEADER.strip()]
    for s in table:
        if not s.keys:
            continue
        title = f"`{s.name}`" if s.name else "train.yaml's own keys"
        parts.append(f"## {title}" + (f", with `{s.option}`" if s.option else ""))
        if s.intro.strip("`.") != s.name:  # "``rollback.remedy.z_loss``." says nothing new
            parts.append(_cell(s.intro))
        rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
        for k in s.keys:
            default = f"`{_show_value(k.default)}`"
            if k.composed is not None:
                default += f" (stabilize-train: `{k.composed}`)"
            rows.append(f"| `{k.key}` | {_cell(default)} | {_cell(k.allowed)} | "
                        f"{_cell(k.meaning)} |")  # fmt: skip
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


# ---- the cache -----------------------------------------------------------------------------
KEEP = 8  # cache files kept: the newest sources' (other checkouts, other venvs)


def cached_table(digest: str) -> list[Section]:
    """The table from the cache file of the source whose hash is ``digest``, else built
    (the dataclasses load) and written there (atomically: concurrent launches may)."""
    path = default_cache_dir() / "config-keys" / f"{digest}.json"
    try:
        return [Section(**{**s, "keys": [Key(**k) for k in s["keys"]]})
                for s in json.loads(path.read_text())]  # fmt: skip
    except (OSError, ValueError, TypeError, KeyError):
        pass
    table = build_table()
    with contextlib.suppress(OSError):  # a read-only home: built each time, still correct
        _write(path, json.dumps([dataclasses.asdict(s) for s in table]))
    return table


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    for f in sorted(path.parent.glob("*.json"), key=lambda f: f.stat().st_mtime)[:-KEEP]:
        f.unlink(missing_ok=True)  # earlier sources' tables (each edit makes one)
