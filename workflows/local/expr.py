"""The expressions the compiled workflows use, for the local runner: Argo ``depends``, ``when``, retry expressions.

``python -m workflows.build`` writes three kinds: ``depends`` clauses (``task``, ``task.Failed || task.Errored``),
``when`` conditions over substituted strings (``'retry' == 'retry' || 'retry' == 'hand-over'``) and retry
expressions (``lastRetry.status == 'Error' || asInt(lastRetry.exitCode) == 69``). This covers exactly their
language: ``||``, ``&&``, ``!``, parentheses, the comparisons ``== != < > <= >=``, quoted strings, integers,
``true``/``false``, dotted names and ``asInt``. Anything else is refused with the expression named
(``tests/test_local_engine.py`` parses every expression of argo/ with it). Nothing is passed to ``eval``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ExprError(ValueError):
    """An expression that cannot be parsed or evaluated; the message names the expression."""


@dataclass(frozen=True)
class _Tok:
    kind: str  # "num" | "str" | "name" | "op" | "end"
    text: str
    value: Any = None


_OPS = ("==", "!=", "<=", ">=", "&&", "||", "<", ">", "!", "(", ")")
_NUM = re.compile(r"\d+")


def tokenize(text: str, *, dashed_names: bool = False) -> list[_Tok]:
    """Split ``text`` into tokens, ending with an ``end`` token.

    ``dashed_names`` allows ``-`` inside names (Argo ``depends``: ``train-segment.Failed``).
    """
    name_re = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*" if dashed_names else r"[A-Za-z_][A-Za-z0-9_.]*")
    out: list[_Tok] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "'\"":
            j = text.find(c, i + 1)
            if j < 0:
                raise ExprError(f"unterminated string in {text!r}")
            out.append(_Tok("str", text[i : j + 1], text[i + 1 : j]))
            i = j + 1
        elif m := _NUM.match(text, i):
            out.append(_Tok("num", m.group(0), int(m.group(0))))
            i = m.end()
        elif m := name_re.match(text, i):
            out.append(_Tok("name", m.group(0)))
            i = m.end()
        else:
            op = next((op for op in _OPS if text.startswith(op, i)), None)
            if op is None:
                raise ExprError(f"unexpected character {c!r} at {i} in {text!r}")
            out.append(_Tok("op", op))
            i += len(op)
    out.append(_Tok("end", ""))
    return out


class _Eval:
    """Recursive descent over the tokens, evaluating as it parses (the expressions are a line each)."""

    def __init__(self, text: str, names: Mapping[str, Any], dashed: bool):
        self.text, self.names = text, names
        self.toks = tokenize(text, dashed_names=dashed)
        self.i = 0

    def accept(self, *ops: str) -> str | None:
        t = self.toks[self.i]
        if t.kind == "op" and t.text in ops:
            self.i += 1
            return t.text
        return None

    def run(self) -> Any:
        value = self.or_()
        if self.toks[self.i].kind != "end":
            raise ExprError(f"unexpected {self.toks[self.i].text!r} in {self.text!r}")
        return value

    def or_(self) -> Any:
        value = self.and_()
        while self.accept("||"):
            right = self.and_()  # both sides are parsed (and checked) whatever the left one is
            value = _truthy(value, self.text) or _truthy(right, self.text)
        return value

    def and_(self) -> Any:
        value = self.not_()
        while self.accept("&&"):
            right = self.not_()
            value = _truthy(value, self.text) and _truthy(right, self.text)
        return value

    def not_(self) -> Any:
        if self.accept("!"):
            return not _truthy(self.not_(), self.text)
        return self.cmp()

    def cmp(self) -> Any:
        value = self.primary()
        while op := self.accept("==", "!=", "<=", ">=", "<", ">"):
            value = _compare(op, value, self.primary(), self.text)
        return value

    def primary(self) -> Any:
        t = self.toks[self.i]
        self.i += 1
        if t.kind in ("num", "str"):
            return t.value
        if t.text == "(":
            value = self.or_()
            if not self.accept(")"):
                raise ExprError(f"expected ')' at {self.toks[self.i].text!r} in {self.text!r}")
            return value
        if t.kind != "name":
            raise ExprError(f"unexpected {t.text or 'end of expression'!r} in {self.text!r}")
        if t.text in ("true", "false"):
            return t.text == "true"
        if self.accept("("):
            if t.text != "asInt":
                raise ExprError(f"unknown function {t.text!r} in {self.text!r}")
            arg = self.or_()
            if not self.accept(")"):
                raise ExprError(f"asInt takes one argument in {self.text!r}")
            return _as_int(arg)
        if t.text in self.names:
            return self.names[t.text]
        raise ExprError(f"unknown name {t.text!r} in {self.text!r} (quote string values: '{t.text}')")


def _as_int(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    try:
        return int(str(v))
    except ValueError:
        raise ExprError(f"asInt: not an integer: {v!r}") from None


def _truthy(v: Any, text: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v in ("true", "false"):
        return v == "true"
    raise ExprError(f"{text!r}: expected a boolean, got {v!r}")


def _compare(op: str, a: Any, b: Any, text: str) -> bool:
    if op in ("==", "!="):
        return (type(a) is type(b) and a == b) is (op == "==")
    if type(a) is not type(b) or isinstance(a, bool):
        raise ExprError(f"{text!r}: cannot order {a!r} and {b!r}")
    return {"<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b}[op]


def evaluate(text: str, names: Mapping[str, Any] | None = None) -> Any:
    """Evaluate an expression over ``names`` (dotted keys such as ``lastRetry.exitCode``).

    Raises:
        ExprError: on a syntax error, an unknown name or function, or a type mismatch.
    """
    return _Eval(text, names or {}, dashed=False).run()


def evaluate_bool(text: str, names: Mapping[str, Any] | None = None) -> bool:
    """Evaluate ``text`` and require a boolean result (``when``, ``retryStrategy.expression``)."""
    return _truthy(evaluate(text, names), text)


# Argo task results a ``depends`` clause can name, as the task phases they stand for (Argo's "Depends" docs).
_RESULTS = {r: r for r in ("Succeeded", "Failed", "Skipped", "Omitted")} | {"Errored": "Error"}
_BARE = frozenset({"Succeeded", "Skipped"})


def _split_result(name: str) -> tuple[str, str | None]:
    task, dot, result = name.rpartition(".")
    if dot and result in _RESULTS:
        return task, result
    return name, None


def depends_tasks(text: str) -> list[str]:
    """The task names a ``depends`` clause refers to, in order of appearance."""
    out: list[str] = []
    for t in tokenize(text, dashed_names=True):
        if t.kind == "name" and t.text not in ("true", "false"):
            task = _split_result(t.text)[0]
            if task not in out:
                out.append(task)
    return out


def evaluate_depends(text: str, phases: Mapping[str, str]) -> bool:
    """Whether a ``depends`` clause holds, given the final phase of every task it names.

    ``task`` alone means ``task.Succeeded || task.Skipped`` (Argo's rule).

    Raises:
        ExprError: on a syntax error or a task without a phase.
    """
    names: dict[str, bool] = {}
    for t in tokenize(text, dashed_names=True):
        if t.kind != "name" or t.text in ("true", "false"):
            continue
        task, result = _split_result(t.text)
        if task not in phases:
            raise ExprError(f"depends {text!r}: task {task!r} has not finished or does not exist")
        names[t.text] = phases[task] in (_BARE if result is None else {_RESULTS[result]})
    return _truthy(_Eval(text, names, dashed=True).run(), text)
