"""A small expression language for the local runner: Argo ``depends``, govaluate ``when``, expr-lang.

One tokenizer and one recursive-descent parser cover what the compiled workflows use:
``||``/``&&``/``!`` (and ``or``/``and``/``not``), comparisons (``== != < > <= >=``, ``in``),
``+ - * / %``, quoted strings, numbers, ``true``/``false``, dotted names, ``x['key']``, lists and
the calls ``asInt``, ``asFloat``, ``string``, ``int``, ``float``, ``len``, ``sprig.add``/``sprig.int``.
Nothing is passed to ``eval``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class ExprError(ValueError):
    """An expression that cannot be parsed or evaluated; the message names the expression."""


@dataclass(frozen=True)
class _Tok:
    kind: str  # "num" | "str" | "name" | "op" | "end"
    text: str
    value: Any = None


_OPS = ("==", "!=", "<=", ">=", "&&", "||", "<", ">", "!", "(", ")", "[", "]", ",", "+", "-", "*", "/", "%", ".")
_NUM = re.compile(r"\d+(\.\d+)?([eE][+-]?\d+)?")


def tokenize(text: str, *, dashed_names: bool = False) -> list[_Tok]:
    """Split ``text`` into tokens.

    Args:
        text: The expression.
        dashed_names: Allow ``-`` and ``.`` inside names (Argo ``depends``: ``train-segment.Failed``).

    Returns:
        The tokens, ending with an ``end`` token.
    """
    name_re = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*" if dashed_names else r"[A-Za-z_][A-Za-z0-9_]*")
    out: list[_Tok] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if c in "'\"`":
            j = text.find(c, i + 1)
            if j < 0:
                raise ExprError(f"unterminated string in {text!r}")
            out.append(_Tok("str", text[i : j + 1], text[i + 1 : j]))
            i = j + 1
            continue
        m = _NUM.match(text, i)
        if m:
            s = m.group(0)
            out.append(_Tok("num", s, float(s) if ("." in s or "e" in s.lower()) else int(s)))
            i = m.end()
            continue
        m = name_re.match(text, i)
        if m:
            out.append(_Tok("name", m.group(0)))
            i = m.end()
            continue
        for op in _OPS:
            if text.startswith(op, i):
                out.append(_Tok("op", op))
                i += len(op)
                break
        else:
            raise ExprError(f"unexpected character {c!r} at {i} in {text!r}")
    out.append(_Tok("end", ""))
    return out


# AST nodes are tuples: ("lit", v) ("name", dotted) ("un", op, x) ("bin", op, a, b) ("call", fname, args)
# ("index", x, key) ("list", items).
_Node = tuple


class _Parser:
    def __init__(self, text: str, dashed: bool):
        self.text = text
        self.toks = tokenize(text, dashed_names=dashed)
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def accept(self, *texts: str) -> str | None:
        t = self.peek()
        if (t.kind == "op" or (t.kind == "name" and t.text in ("and", "or", "not", "in"))) and t.text in texts:
            self.i += 1
            return t.text
        return None

    def expect(self, text: str) -> None:
        if self.accept(text) is None:
            raise ExprError(f"expected {text!r} at {self.peek().text!r} in {self.text!r}")

    def parse(self) -> _Node:
        node = self.or_()
        if self.peek().kind != "end":
            raise ExprError(f"unexpected {self.peek().text!r} in {self.text!r}")
        return node

    def or_(self) -> _Node:
        node = self.and_()
        while self.accept("||", "or"):
            node = ("bin", "||", node, self.and_())
        return node

    def and_(self) -> _Node:
        node = self.not_()
        while self.accept("&&", "and"):
            node = ("bin", "&&", node, self.not_())
        return node

    def not_(self) -> _Node:
        if self.accept("!", "not"):
            return ("un", "!", self.not_())
        return self.cmp()

    def cmp(self) -> _Node:
        node = self.add()
        while True:
            op = self.accept("==", "!=", "<=", ">=", "<", ">", "in")
            if op is None:
                return node
            node = ("bin", op, node, self.add())

    def add(self) -> _Node:
        node = self.mul()
        while op := self.accept("+", "-"):
            node = ("bin", op, node, self.mul())
        return node

    def mul(self) -> _Node:
        node = self.unary()
        while op := self.accept("*", "/", "%"):
            node = ("bin", op, node, self.unary())
        return node

    def unary(self) -> _Node:
        if self.accept("-"):
            return ("un", "-", self.unary())
        return self.postfix()

    def postfix(self) -> _Node:
        node = self.primary()
        while True:
            if self.accept("["):
                key = self.or_()
                self.expect("]")
                node = ("index", node, key)
            elif self.accept("."):
                t = self.take()
                if t.kind != "name":
                    raise ExprError(f"expected a name after '.' in {self.text!r}")
                node = ("index", node, ("lit", t.text))
            elif self.peek().text == "(" and _dotted(node) is not None:
                self.take()
                fname = _dotted(node)
                args = []
                if not self.accept(")"):
                    args.append(self.or_())
                    while self.accept(","):
                        args.append(self.or_())
                    self.expect(")")
                node = ("call", fname, args)
            else:
                return node

    def primary(self) -> _Node:
        t = self.take()
        if t.kind in ("num", "str"):
            return ("lit", t.value)
        if t.kind == "name":
            if t.text in ("true", "false"):
                return ("lit", t.text == "true")
            if t.text in ("nil", "null"):
                return ("lit", None)
            return ("name", t.text)
        if t.text == "(":
            node = self.or_()
            self.expect(")")
            return node
        if t.text == "[":
            items = []
            if not self.accept("]"):
                items.append(self.or_())
                while self.accept(","):
                    items.append(self.or_())
                self.expect("]")
            return ("list", items)
        raise ExprError(f"unexpected {t.text or 'end of expression'!r} in {self.text!r}")


def parse(text: str, *, dashed_names: bool = False) -> _Node:
    """Parse ``text`` into a small AST (tuples); raise ExprError with the expression on a syntax error."""
    return _Parser(text, dashed_names).parse()


def _num(v: Any) -> float | int:
    if isinstance(v, bool):
        raise ExprError(f"expected a number, got {v!r}")
    if isinstance(v, int | float):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                pass
    raise ExprError(f"expected a number, got {v!r}")


def _truthy(v: Any, text: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v in ("true", "false"):
        return v == "true"
    raise ExprError(f"{text!r}: expected a boolean, got {v!r}")


def _as_int(v: Any) -> int:
    return int(_num(v))


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "asInt": _as_int,
    "int": _as_int,
    "sprig.int": _as_int,
    "sprig.atoi": _as_int,
    "asFloat": lambda v: float(_num(v)),
    "float": lambda v: float(_num(v)),
    "string": lambda v: _to_str(v),
    "toString": lambda v: _to_str(v),
    "sprig.toString": lambda v: _to_str(v),
    "len": len,
    "sprig.add": lambda a, b: _num(a) + _num(b),
    "sprig.sub": lambda a, b: _num(a) - _num(b),
    "min": min,
    "max": max,
}


def _to_str(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


class _Eval:
    def __init__(self, text: str, names: Mapping[str, Any]):
        self.text = text
        self.names = names

    def lookup(self, name: str) -> Any:
        if name in self.names:
            return self.names[name]
        raise ExprError(f"unknown name {name!r} in {self.text!r} (quote string values: '{name}')")

    def ev(self, n: _Node) -> Any:
        kind = n[0]
        if kind == "lit":
            return n[1]
        if kind == "list":
            return [self.ev(x) for x in n[1]]
        if kind == "name":
            return self.lookup(n[1])
        if kind == "index":
            # A dotted name may be a key of the environment as a whole ("lastRetry.exitCode").
            dotted = _dotted(n)
            if dotted is not None and dotted in self.names:
                return self.names[dotted]
            base = self.ev(n[1])
            key = self.ev(n[2])
            try:
                return base[key]
            except (KeyError, IndexError, TypeError):
                raise ExprError(f"{self.text!r}: no {key!r} in {_dotted(n[1]) or 'value'}") from None
        if kind == "call":
            fname = n[1]
            fn = FUNCTIONS.get(fname)
            if fn is None:
                raise ExprError(f"unknown function {fname!r} in {self.text!r}")
            return fn(*[self.ev(a) for a in n[2]])
        if kind == "un":
            v = self.ev(n[2])
            return (not _truthy(v, self.text)) if n[1] == "!" else -_num(v)
        op, a_node, b_node = n[1], n[2], n[3]
        if op == "||":
            return _truthy(self.ev(a_node), self.text) or _truthy(self.ev(b_node), self.text)
        if op == "&&":
            return _truthy(self.ev(a_node), self.text) and _truthy(self.ev(b_node), self.text)
        a, b = self.ev(a_node), self.ev(b_node)
        if op in ("==", "!="):
            eq = _equal(a, b)
            return eq if op == "==" else not eq
        if op == "in":
            if not isinstance(b, list | str | dict):
                raise ExprError(f"{self.text!r}: 'in' needs a list, got {b!r}")
            return any(_equal(a, x) for x in b) if isinstance(b, list) else a in b
        if op == "+" and isinstance(a, str) and isinstance(b, str):
            return a + b
        if op in ("<", ">", "<=", ">="):
            if isinstance(a, str) and isinstance(b, str):
                x, y = a, b
            else:
                x, y = _num(a), _num(b)
            return {"<": x < y, ">": x > y, "<=": x <= y, ">=": x >= y}[op]
        x, y = _num(a), _num(b)
        if op == "+":
            return x + y
        if op == "-":
            return x - y
        if op == "*":
            return x * y
        if op == "/":
            return x / y
        return x % y


def _dotted(n: _Node) -> str | None:
    if n[0] == "name":
        return n[1]
    if n[0] == "index" and n[2][0] == "lit" and isinstance(n[2][1], str):
        base = _dotted(n[1])
        return None if base is None else f"{base}.{n[2][1]}"
    return None


def _equal(a: Any, b: Any) -> bool:
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return type(a) is type(b) and a == b


def evaluate(text: str, names: Mapping[str, Any] | None = None) -> Any:
    """Evaluate an expression over ``names`` (dotted keys such as ``lastRetry.exitCode`` or nested dicts).

    Raises:
        ExprError: on a syntax error, an unknown name or function, or a type mismatch.
    """
    try:
        return _Eval(text, names or {}).ev(parse(text))
    except ZeroDivisionError:
        raise ExprError(f"division by zero in {text!r}") from None


def evaluate_bool(text: str, names: Mapping[str, Any] | None = None) -> bool:
    """Evaluate ``text`` and require a boolean result (``when``, ``retryStrategy.expression``)."""
    return _truthy(evaluate(text, names), text)


# Argo task results a ``depends`` clause can name, as predicates over a finished task's phase.
_RESULTS: dict[str, frozenset[str]] = {
    "Succeeded": frozenset({"Succeeded"}),
    "Failed": frozenset({"Failed"}),
    "Errored": frozenset({"Error"}),
    "Skipped": frozenset({"Skipped"}),
    "Omitted": frozenset({"Omitted"}),
    "Daemoned": frozenset(),
    "Completed": frozenset({"Succeeded", "Failed"}),
    "Any": frozenset({"Succeeded", "Failed", "Error", "Skipped", "Omitted"}),
    "AnySucceeded": frozenset({"Succeeded"}),
    "AllFailed": frozenset({"Failed", "Error"}),
}
_BARE = frozenset({"Succeeded", "Skipped"})


def depends_tasks(text: str) -> list[str]:
    """The task names a ``depends`` clause refers to, in order of appearance."""
    out: list[str] = []
    for t in tokenize(text, dashed_names=True):
        if t.kind == "name" and t.text not in ("and", "or", "not", "true", "false"):
            task = _split_result(t.text)[0]
            if task not in out:
                out.append(task)
    return out


def _split_result(name: str) -> tuple[str, str | None]:
    task, dot, result = name.rpartition(".")
    if dot and result in _RESULTS:
        return task, result
    return name, None


def evaluate_depends(text: str, phases: Mapping[str, str]) -> bool:
    """Whether a ``depends`` clause holds, given the final phase of every task it names.

    ``task`` alone means ``task.Succeeded || task.Skipped`` (Argo's rule).

    Raises:
        ExprError: on a syntax error or a task without a phase.
    """
    names: dict[str, bool] = {}
    for task_ref in depends_tasks(text):
        if task_ref not in phases:
            raise ExprError(f"depends {text!r}: task {task_ref!r} has not finished or does not exist")
    for t in tokenize(text, dashed_names=True):
        if t.kind != "name" or t.text in ("and", "or", "not", "true", "false"):
            continue
        task, result = _split_result(t.text)
        allowed = _BARE if result is None else _RESULTS[result]
        names[t.text] = phases[task] in allowed
    return evaluate_bool_dashed(text, names)


def evaluate_bool_dashed(text: str, names: Mapping[str, Any]) -> bool:
    """Evaluate a boolean expression whose names may contain ``-`` and ``.`` (``depends``)."""
    return _truthy(_Eval(text, names).ev(parse(text, dashed_names=True)), text)
