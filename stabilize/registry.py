"""One registry for every extension point: a name -> a class (or instance) and its config.

Norm types (``norm.type``), monitors (``monitor.<name>``), remedies (``rollback.ladder``,
``rollback.remedy.<name>``), fault kinds (``fault.kind``) and tokenizers (``data.tokenizer``)
are each one ``Registry``. It gives every extension point the same rules:

- a name is registered once: the same value again is a no-op, another one is refused with
  the name and who registered it first;
- an unknown name fails with the one wording of the house (``check_choice``: the key, the
  value and the registered names, in registration order);
- what a name may be configured with is its config dataclass (``config(name)``), so a
  group's settings come from what is registered, never from a list kept elsewhere
  (``build_sections``: one config section per registered name that has a config).

No torch, Lightning or Hydra here: every layer of the package can use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from stabilize.validate import ConfigError, build_dataclass, check_choice

T = TypeVar("T")


def origin(value: Any) -> str:
    """``module.qualname`` of a class or function, else of the instance's class (or what
    its ``registered_by`` says)."""
    if isinstance(getattr(value, "registered_by", None), str):
        return value.registered_by
    obj = value if hasattr(value, "__qualname__") else type(value)
    return f"{obj.__module__}.{obj.__qualname__}"


class Names(Sequence[str]):
    """A registry's names in registration order, read live: a name registered after
    ``from ... import NORM_TYPES`` is in it too."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def __getitem__(self, i):
        return tuple(self._registry)[i]

    def __len__(self) -> int:
        return len(self._registry)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._registry))

    def __contains__(self, name) -> bool:
        return name in self._registry

    def __repr__(self) -> str:
        return repr(tuple(self._registry))


class Sections(dict):
    """name -> that name's config dataclass instance, also readable as attributes
    (``cfg.remedy.skip_data.batches``). ``dataclasses.asdict`` keeps the type: turn it into a
    ``dict`` where only plain types may go (a checkpoint loaded with ``weights_only``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no section {name!r}; have {list(self)}") from None


_ON_CHANGE: list[Callable[[], None]] = []


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every change of any registry (a name added or removed), so that
    what is built from the registered names follows them (the Hydra config nodes of their
    settings, stabilize/config_store.py); no registry need be imported for it. The same
    ``fn`` again: a no-op."""
    if fn not in _ON_CHANGE:
        _ON_CHANGE.append(fn)


class Registry(Mapping[str, T], Generic[T]):
    """name -> value (a class, an instance or a factory), each with an optional config
    dataclass. A read-only mapping; ``register`` and ``unregister`` change it."""

    def __init__(self, key: str, *, reserved: Sequence[str] = ()):
        self.key = key
        """The setting the names are values of (``norm.type``, ``fault.kind``, ...)."""
        self.reserved = tuple(reserved)
        self._values: dict[str, T] = {}
        self._configs: dict[str, type | None] = {}
        self.names: Sequence[str] = Names(self)

    # ---- changing it --------------------------------------------------------------------
    def register(self, name: str, value: T, config: type | None = None) -> T:
        """Add ``name``; returns ``value``. The same value and config again: a no-op."""
        if not isinstance(name, str) or not name or name in self.reserved:
            reserved = f" (reserved: {list(self.reserved)})" if self.reserved else ""
            raise ValueError(f"{self.key}={name!r} is not allowed; must be a name{reserved}")
        if name in self._values:
            if self._values[name] is value and self._configs[name] is config:
                return value
            raise ValueError(
                f"{self.key}={name!r} is already registered by {origin(self._values[name])}"
            )
        self._values[name] = value
        self._configs[name] = config
        self._changed()
        return value

    def unregister(self, name: str) -> T:
        """Remove ``name`` (tests registering their own clean up with this)."""
        check_choice(self.key, name, self._values)
        del self._configs[name]
        value = self._values.pop(name)
        self._changed()
        return value

    def _changed(self) -> None:
        for fn in _ON_CHANGE:
            fn()

    # ---- reading it ---------------------------------------------------------------------
    def lookup(self, name: str, key: str | None = None) -> T:
        """The value registered as ``name``; an unknown name fails with the registered ones
        (``key``: the setting to name in the message, default ``self.key``)."""
        check_choice(key or self.key, name, self._values)
        return self._values[name]

    def config(self, name: str, key: str | None = None) -> type | None:
        """The config dataclass registered with ``name`` (None: it has no settings)."""
        self.lookup(name, key)
        return self._configs[name]

    def configured(self) -> list[str]:
        """The names that have a config dataclass, in registration order."""
        return [n for n, c in self._configs.items() if c is not None]

    def build_sections(
        self,
        values: Any,
        key: str,
        *,
        also_allowed: Sequence[str] = (),
        prepare: Callable[[str, Any], Any] | None = None,
    ) -> Sections:
        """One config per name with a config dataclass, from ``values[name]`` (a mapping of
        settings built on the dataclass's defaults, or an instance); a name left out takes
        its dataclass's defaults. A section of no such name is refused with the allowed
        ones (``also_allowed``: other keys the caller's mapping may hold, for the message).
        ``prepare(name, value)`` may rewrite a section's value first."""
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise ConfigError(f"{key}={values!r} is not allowed; expected a mapping of settings")
        names = self.configured()
        unknown = sorted(set(values) - set(names))
        if unknown:
            allowed = [*also_allowed, *names]
            raise ConfigError(f"{key}.{unknown[0]} is not a known setting; allowed: {allowed}")
        out = Sections()
        for name in names:
            value = values.get(name, {})
            if prepare is not None:
                value = prepare(name, value)
            out[name] = build_dataclass(self._configs[name], value, f"{key}.{name}")
        return out

    # ---- Mapping ----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"<registry {self.key}: {list(self._values)}>"
