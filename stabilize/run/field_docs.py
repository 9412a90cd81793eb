"""What a settings class says about its fields, read off its own source with ``ast``.

- A field's meaning is its attribute docstring: the string literal right after it in the
  class body (the nearest class of the MRO that documents it: a subclass that only changes
  a default keeps its base's words).
- What a field allows is read off the checks its class runs on construction
  (``__post_init__`` and a fault kind's ``check``): the ``check_*`` helpers of
  ``stabilize/validate.py``, a registry the value is looked up in (``FAULTS.config(kind)``),
  and the "is not allowed; allowed: ..." of a message the class raises itself. The check's
  own arguments are evaluated (a registry's names are read live), so the words cannot drift
  from what is enforced; a check under a condition on another setting is left out rather
  than stated as if it always held.

Nothing here holds a second copy of any of it: stabilize/run/keys.py builds the key table
of ``stabilize-train --keys`` and docs/config.md from these two functions.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import sys
import textwrap
from functools import cache
from typing import Any

from stabilize.registry import Registry

UNKNOWN = "\0"  # a part of a key or message that is only known at run time
_NESTED = ast.Constant(None)  # a condition that is not one ``if`` on the field itself


@cache
def _class_node(cls: type) -> ast.ClassDef | None:
    """The class's own source as an AST (None: no source, e.g. a class built at run time)."""
    if cls is object:
        return None
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, ast.ClassDef) else None


def one_line(text: str) -> str:
    """A docstring on one line; Sphinx's double backticks as Markdown's single ones (a path
    broken after a ``/`` at the end of a line is joined again)."""
    return " ".join(re.sub(r"/\n\s*", "/", text).split()).replace("``", "`")


def class_intro(cls: type) -> str:
    """The first paragraph of the class's own docstring, on one line ("" if it has none:
    a dataclass's generated signature is not a docstring)."""
    node = _class_node(cls)
    doc = ast.get_docstring(node) if node is not None else None
    return one_line(doc.split("\n\n")[0]) if doc else ""


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring, on one line, from the nearest class that documents it."""
    out: dict[str, str] = {}
    for klass in cls.__mro__:
        node = _class_node(klass)
        if node is None:
            continue
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and documented
                and isinstance(after.value.value, str)
            ):
                out.setdefault(stmt.target.id, one_line(after.value.value))
    return out


def allowed_values(cls: type, fields: dict[str, str]) -> dict[str, list[str]]:
    """Field name -> what its checks allow, in words. ``fields``: field name -> its full
    key (``optim.lr``), which the checks' own keys are matched against."""
    out: dict[str, list[str]] = {}
    for method in ("__post_init__", "check"):
        owner = next((k for k in cls.__mro__ if method in vars(k)), None)
        node = _class_node(owner) if owner is not None else None
        if node is None:
            continue
        for fn in node.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == method:
                _Reader(vars(sys.modules[owner.__module__]), fields, out).block(fn.body, {}, None)
    return out


_RAISED = re.compile(
    r"^(?P<key>[^=\s]+)=\0 is not allowed; (?:allowed: |must be |expected )(?P<what>[^\0]+)$"
)


def show(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


class _Reader:
    """Walks a check method's statements, with the values of loop variables that run over
    literal tuples (``for key in ("lr", "eps"): check_positive(f"optim.{key}", ...)``)."""

    def __init__(self, module: dict[str, Any], fields: dict[str, str], out):
        self.module, self.fields, self.out = module, fields, out

    def block(self, stmts: list[ast.stmt], env: dict[str, Any], guard: ast.expr | None):
        for s in stmts:
            if isinstance(s, ast.For):
                values = self._eval(s.iter, env)
                if isinstance(s.target, ast.Name) and isinstance(values, tuple | list):
                    for v in values:
                        self.block(s.body, {**env, s.target.id: v}, guard)
                else:  # a loop over the value itself (a list's items): its names unknown
                    self.block(s.body, env, guard)
            elif isinstance(s, ast.If):
                self.block(s.body, env, s.test if guard is None else _NESTED)
                self.block(s.orelse, env, _NESTED)  # an else: never one field's guard
            elif isinstance(s, ast.With | ast.Try):
                self.block(s.body, env, guard)
            elif isinstance(s, ast.Raise):
                self._raised(s, env)
            else:
                for node in ast.walk(s):
                    if isinstance(node, ast.Call):
                        self._call(node, env, guard)

    def _eval(self, node: ast.expr, env: dict[str, Any]) -> Any:
        """A check's argument that does not read ``self``: a literal, a module constant, a
        registry (None when it cannot be evaluated here)."""
        if any(isinstance(n, ast.Name) and n.id == "self" for n in ast.walk(node)):
            return None
        try:
            code = compile(ast.Expression(node), "<check>", "eval")
            return eval(code, self.module, dict(env))  # noqa: S307  the class's own source
        except Exception:  # a name bound at run time (a local): not readable here
            return None

    def _text(self, node: ast.expr, env: dict[str, Any]) -> str | None:
        """A key or message as written, its run-time parts as ``UNKNOWN``."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if not isinstance(node, ast.JoinedStr):
            return None
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                name = v.value.id if isinstance(v.value, ast.Name) else None
                parts.append(str(env[name]) if name in env else UNKNOWN)
        return "".join(parts)

    def _field(self, key: str) -> tuple[str, bool] | None:
        """The field a check's key names, and whether it checks each item of a list."""
        if not re.search("[a-z]", key.replace(UNKNOWN, "")):
            return None  # a key made at run time: it could name any field
        pattern = ".+".join(re.escape(p) for p in key.split(UNKNOWN))
        for name, full in self.fields.items():
            if re.fullmatch(pattern, full):
                return name, False
            if re.fullmatch(pattern, f"{full}[{UNKNOWN}]"):
                return name, True
        return None

    def _add(self, field: tuple[str, bool] | None, what: str, guard: str = "") -> None:
        if field is not None:
            name, each = field
            words = f"{guard}{'each: ' if each else ''}{what}"
            if words not in self.out.setdefault(name, []):
                self.out[name].append(words)

    def _raised(self, s: ast.Raise, env: dict[str, Any]) -> None:
        exc = s.exc
        if isinstance(exc, ast.Call) and exc.args:
            m = _RAISED.match(self._text(exc.args[0], env) or "")
            if m:
                self._add(self._field(m["key"]), m["what"])

    def _call(self, call: ast.Call, env: dict[str, Any], guard: ast.expr | None) -> None:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in ("config", "lookup") and call.args:
            registry = self._eval(func.value, env)
            arg = call.args[0]
            if isinstance(registry, Registry) and _self_attr(arg):
                self._add(self._field(self.fields.get(arg.attr, "?")), _choices(registry))
            return
        name = func.id if isinstance(func, ast.Name) else None
        if name not in _WORDS or not call.args:
            return
        key = self._text(call.args[0], env)
        if key is None:
            return
        args = [self._eval(a, env) for a in call.args[2:]]
        kw = {k.arg: self._eval(k.value, env) for k in call.keywords}
        given = [*call.args[2:], *(k.value for k in call.keywords)]
        if any(
            v is None and not _is_none(a) for a, v in zip(given, [*args, *kw.values()], strict=True)
        ):
            return  # an argument known only at run time: the words would be a guess
        field = self._field(key)
        prefix = self._guard(guard, field[0] if field else None, env)
        if prefix is not None:
            self._add(field, _WORDS[name](*args, **kw), prefix)

    def _guard(self, guard: ast.expr | None, name: str | None, env: dict[str, Any]):
        """What a check under ``if`` means for its field: "" (no condition), "null, or "
        (``if self.x is not None``), "-1, or " (``if self.x != -1``); None for any other
        condition (the check does not always hold, so it is not stated)."""
        if guard is None:
            return ""
        ok = isinstance(guard, ast.Compare) and len(guard.ops) == 1 and _self_attr(guard.left)
        if not ok or guard.left.attr != name:
            return None
        op, right = guard.ops[0], guard.comparators[0]
        if isinstance(op, ast.IsNot) and isinstance(right, ast.Constant) and right.value is None:
            return "null, or "
        if isinstance(op, ast.NotEq):
            value = self._eval(right, env)
            return None if value is None else f"{show(value)}, or "
        return None


def _self_attr(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _choices(allowed: Any) -> str:
    return " | ".join(show(a) for a in allowed)


def _range(lo: Any, hi: Any) -> str:
    return f">= {show(lo)}" if hi == math.inf else f"[{show(lo)}, {show(hi)})"


def _int_range(lo: Any = 0, hi: Any = None) -> str:
    return f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"


# check helper -> its words (from the arguments after the key and the value), as its
# error message says them (stabilize/validate.py; data/config.py's check_int)
_WORDS = {
    "check_choice": _choices,
    "check_positive": lambda integer=False: "an integer >= 1" if integer else "> 0",
    "check_count": lambda: "an integer >= 0",
    "check_range": _range,
    "check_int": _int_range,
}
