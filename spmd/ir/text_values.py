"""Line cursor and attribute-value codecs of the HLO-lite text format (used by ``spmd.ir.text``).

``ATTRIBUTE_KINDS`` gives the text codec of each attribute in
``ATTRIBUTE_TYPES``; the decoders here read one value at a ``Cursor`` and
raise ``HloParseError`` with the line and column of what they could not read.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from spmd.ir.hlo import ATTRIBUTE_TYPES, DTYPES, Shape, SourceLocation
from spmd.ir.sharding import MeshShape

_TYPE_KINDS = {
    "int": "int", "tuple[int, ...]": "ints", "str": "string", "Computation": "comp", "bool": "bool",
    "tuple[tuple[int, ...], ...]": "groups", "tuple[tuple[int, int], ...]": "pairs",
}
_NAME_KINDS = {"slice": "slice", "padding": "padding", "direction": "direction", "literal": "literal"}


def _attribute_kind(name: str) -> str:
    if name in _NAME_KINDS:
        return _NAME_KINDS[name]
    t = ATTRIBUTE_TYPES[name].split("#")[0].strip()
    return "json" if t.startswith("dict") else _TYPE_KINDS.get(t, "raw")


# Attribute name -> text codec kind, derived from ATTRIBUTE_TYPES (used by the verifier too).
ATTRIBUTE_KINDS: dict[str, str] = {name: _attribute_kind(name) for name in ATTRIBUTE_TYPES}
COMPARISON_DIRECTIONS = frozenset({"EQ", "NE", "LT", "LE", "GT", "GE"})
class HloParseError(ValueError):
    """A syntax error in HLO text; ``line`` and ``column`` are 1-based."""

    def __init__(self, line: int, column: int, expected: str, found: str) -> None:
        super().__init__(f"line {line}:{column}: expected {expected}, found {found}")
        self.line = line
        self.column = column


_WS = re.compile(r"[ \t]*")
NAME_RE = re.compile(r"%?([A-Za-z_][\w.\-]*)")
KEY_RE = re.compile(r"[A-Za-z_]\w*")
INT_RE = re.compile(r"-?\d+")
_WORD = re.compile(r"[A-Za-z_]\w*")
OPCODE_RE = re.compile(r"[a-z][a-z\-]*")
_ARRAY_SHAPE = re.compile(r"([a-z]+\d*)\[([^\]]*)\]")
_SHAPE_START = re.compile(r"[a-z]+\d*\[|\(")
STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_PLAIN_RUN = re.compile(r'[^,{}\[\]()"]*')
_PAD = re.compile(r"-?\d+_-?\d+(?:_-?\d+)?(?:x-?\d+_-?\d+(?:_-?\d+)?)*")
_LITERAL_TOKEN = re.compile(r"[{},]|[^\s{},]+")
COMMENT_RE = re.compile(r"/\*.*?\*/")


class Cursor:
    """A position in one line of text, with helpers that raise HloParseError."""

    __slots__ = ("s", "pos", "lineno")

    def __init__(self, s: str, lineno: int, pos: int = 0) -> None:
        self.s, self.lineno, self.pos = s, lineno, pos

    def error(self, expected: str, pos: int | None = None, found: str | None = None) -> HloParseError:
        p = self.pos if pos is None else pos
        rest = self.s[p:p + 24]
        return HloParseError(self.lineno, p + 1, expected, found or (repr(rest) if rest else "end of line"))

    def ws(self) -> None:
        self.pos = _WS.match(self.s, self.pos).end()

    def at_end(self) -> bool:
        self.ws()
        return self.pos >= len(self.s)

    def peek(self) -> str:
        self.ws()
        return self.s[self.pos:self.pos + 1]

    def eat(self, tok: str) -> bool:
        self.ws()
        if self.s.startswith(tok, self.pos):
            self.pos += len(tok)
            return True
        return False

    def expect(self, tok: str) -> None:
        if not self.eat(tok):
            raise self.error(repr(tok))

    def match(self, rx: re.Pattern, what: str) -> re.Match:
        self.ws()
        m = rx.match(self.s, self.pos)
        if m is None or m.end() == self.pos:
            raise self.error(what)
        self.pos = m.end()
        return m

    def skip_balanced(self) -> str:
        """Skip one value up to the next top-level ``,`` (or end); return its text."""
        self.ws()
        s, i, depth, start = self.s, self.pos, 0, self.pos
        while i < len(s):
            i = _PLAIN_RUN.match(s, i).end()
            if i >= len(s):
                break
            ch = s[i]
            if ch == '"':
                m = STRING_RE.match(s, i)
                if m is None:
                    raise self.error("closing '\"'", i)
                i = m.end()
                continue
            if ch in "{[(":
                depth += 1
            elif ch in "}])":
                depth -= 1
                if depth < 0:
                    break
            elif depth == 0:
                break
            i += 1
        self.pos = i
        return s[start:i].rstrip()

    def shape(self) -> Shape:
        if self.eat("("):
            elems: list[Shape] = []
            if not self.eat(")"):
                elems.append(self.shape())
                while self.eat(","):
                    elems.append(self.shape())
                self.expect(")")
            return Shape.tuple(elems)
        start = self.pos
        m = self.match(_ARRAY_SHAPE, "a shape like f32[8,16]")
        if m.group(1) not in DTYPES:
            raise self.error(f"an element type in {sorted(DTYPES)}", start)
        dims_text = m.group(2).strip()
        try:
            dims = tuple(int(d) for d in dims_text.split(",")) if dims_text else ()
        except ValueError:
            raise self.error("static dimension sizes", start) from None
        if self.s.startswith("{", self.pos):  # a layout: ignored
            self.skip_group()
        return Shape(m.group(1), dims)

    def skip_group(self) -> str:
        """Skip one bracketed group ``(...)``, ``[...]`` or ``{...}`` starting here; return its text."""
        self.ws()
        s, start, depth, i = self.s, self.pos, 0, self.pos
        while i < len(s):
            ch = s[i]
            if ch == '"':
                m = STRING_RE.match(s, i)
                i = m.end() if m else len(s)
                continue
            depth += 1 if ch in "{[(" else -1 if ch in "}])" else 0
            i += 1
            if depth == 0:
                self.pos = i
                return s[start:i]
        raise self.error("a closing bracket", len(s))

    def ints(self) -> tuple[int, ...]:
        self.expect("{")
        vals: list[int] = []
        if not self.eat("}"):
            vals.append(int(self.match(INT_RE, "an integer").group()))
            while self.eat(","):
                vals.append(int(self.match(INT_RE, "an integer").group()))
            self.expect("}")
        return tuple(vals)


class CompRef:
    """A computation named before it is defined; resolved after the whole text is read."""

    __slots__ = ("name", "lineno", "col")

    def __init__(self, name: str, lineno: int, col: int) -> None:
        self.name, self.lineno, self.col = name, lineno, col


def _dec_groups(c: Cursor) -> tuple[tuple[int, ...], ...]:
    if c.peek() != "[":
        c.expect("{")
        groups: list[tuple[int, ...]] = []
        if not c.eat("}"):
            groups.append(c.ints())
            while c.eat(","):
                groups.append(c.ints())
            c.expect("}")
        return tuple(groups)
    # Iota form [G,S]<=[d0,d1,...]T(perm): iota over dims, transposed, reshaped to G x S.
    shape = _bracket_ints(c)
    c.expect("<=")
    dims = _bracket_ints(c)
    ids = torch.arange(math.prod(dims)).reshape(dims)
    if c.eat("T"):
        c.expect("(")
        perm = [int(c.match(INT_RE, "an integer").group())]
        while c.eat(","):
            perm.append(int(c.match(INT_RE, "an integer").group()))
        c.expect(")")
        ids = ids.permute(perm)
    return tuple(tuple(g) for g in ids.reshape(shape).tolist())


def _bracket_ints(c: Cursor) -> list[int]:
    c.expect("[")
    vals = [int(c.match(INT_RE, "an integer").group())]
    while c.eat(","):
        vals.append(int(c.match(INT_RE, "an integer").group()))
    c.expect("]")
    return vals


def _dec_slice(c: Cursor) -> tuple[tuple[int, int, int], ...]:
    c.expect("{")
    out: list[tuple[int, int, int]] = []
    while not c.eat("}"):
        if out:
            c.expect(",")
        c.ws()
        start = c.pos
        c.expect("[")
        vals = [int(c.match(INT_RE, "an integer").group())]
        while c.eat(":"):
            vals.append(int(c.match(INT_RE, "an integer").group()))
        if len(vals) not in (2, 3):
            raise c.error("[start:limit] or [start:limit:stride]", start)
        c.expect("]")
        out.append((vals[0], vals[1], vals[2] if len(vals) == 3 else 1))
    return tuple(out)


def _dec_padding(c: Cursor) -> tuple[tuple[int, int, int], ...]:
    if c.eat("{"):
        c.expect("}")
        return ()
    text = c.match(_PAD, "padding like 0_1_0x2_3_0").group()
    out = []
    for dim in text.split("x"):
        v = [int(x) for x in dim.split("_")]
        out.append((v[0], v[1], v[2] if len(v) == 3 else 0))
    return tuple(out)


def _dec_json(c: Cursor, raw: str) -> Any:
    try:
        v = json.loads(raw)
        if isinstance(v, str):
            v = json.loads(v) if v.strip().startswith("{") else v
    except json.JSONDecodeError as e:
        raise c.error(f"a JSON object ({e.msg})", c.pos + (e.pos if raw.startswith("{") else 0)) from None
    c.pos = len(c.s)
    return v if isinstance(v, dict) else raw


def decode_location(c: Cursor) -> SourceLocation:
    c.expect("{")
    fields: dict[str, Any] = {}
    while not c.eat("}"):
        key = c.match(KEY_RE, "a metadata key").group()
        c.expect("=")
        if c.peek() == '"':
            fields[key] = json.loads(c.match(STRING_RE, "a string").group())
        else:
            fields[key] = c.match(re.compile(r"[^\s}]+"), "a metadata value").group()
    line = fields.get("source_line", 0)
    return SourceLocation(str(fields.get("op_name", "")), str(fields.get("source_file", "")), int(line))


def decode_attr(c: Cursor, key: str, raw: str) -> Any:
    kind = ATTRIBUTE_KINDS.get(key, "raw")
    if kind == "int":
        return int(c.match(INT_RE, "an integer").group())
    if kind == "ints":
        return c.ints()
    if kind == "groups":
        return _dec_groups(c)
    if kind == "pairs":
        start = c.pos
        pairs = _dec_groups(c)
        if any(len(p) != 2 for p in pairs):
            raise c.error("pairs {{source,target},...}", start)
        return pairs
    if kind == "slice":
        return _dec_slice(c)
    if kind == "padding":
        return _dec_padding(c)
    if kind == "direction":
        start = c.pos
        word = c.match(_WORD, "a comparison direction").group()
        if word not in COMPARISON_DIRECTIONS:
            raise c.error(f"one of {sorted(COMPARISON_DIRECTIONS)}", start)
        return word
    if kind == "string":
        return json.loads(c.match(STRING_RE, "a quoted string").group())
    if kind == "comp":
        col = c.pos
        return CompRef(c.match(NAME_RE, "a computation name").group(1), c.lineno, col + 1)
    if kind == "bool":
        return c.match(re.compile(r"true|false"), "true or false").group() == "true"
    if kind == "json":
        return _dec_json(c, raw)
    c.pos = len(c.s)
    return raw


def _parse_literal(c: Cursor, shape: Shape) -> torch.Tensor:
    end = c.s.find(")", c.pos)
    if end < 0:
        raise c.error("')' after the literal", len(c.s))
    if shape.is_tuple:
        raise c.error("an array-shaped constant", c.pos)
    start, flat = c.pos, []
    for tok in _LITERAL_TOKEN.findall(c.s, c.pos, end):
        if tok in "{},":
            continue
        try:
            flat.append(tok == "true" if tok in ("true", "false") else float(tok) if shape.dtype[0] in "fb"
                        else int(tok))
        except ValueError:
            raise c.error(f"a {shape.dtype} literal value", c.s.find(tok, start)) from None
    if len(flat) != shape.numel:
        raise c.error(f"{shape.numel} literal values for {shape}", start, f"{len(flat)} values")
    c.pos = end
    return torch.tensor(flat, dtype=shape.torch_dtype).reshape(shape.dims)


def parse_operands(c: Cursor, opcode: str, shape: Shape, attrs: dict) -> list[tuple[str, int]]:
    """Parse what is inside ``opcode(...)``; returns operand (name, column) pairs."""
    c.expect("(")
    if opcode == "constant":
        attrs["literal"] = _parse_literal(c, shape)
    elif opcode == "parameter":
        attrs["parameter_number"] = int(c.match(INT_RE, "a parameter number").group())
    elif c.peek() != ")":
        names = []
        while True:
            c.ws()
            if _SHAPE_START.match(c.s, c.pos):
                c.shape()
            col = c.pos + 1
            names.append((c.match(NAME_RE, "an operand name").group(1), col))
            if not c.eat(","):
                break
        c.expect(")")
        return names
    c.expect(")")
    return []


def parse_mesh(c: Cursor) -> MeshShape:
    c.expect("{")
    names, sizes = [], []
    while not c.eat("}"):
        if names:
            c.expect(",")
        names.append(c.match(KEY_RE, "a mesh axis name").group())
        c.expect("=")
        sizes.append(int(c.match(INT_RE, "an axis size").group()))
    try:
        return MeshShape(tuple(names), tuple(sizes))
    except ValueError as e:
        raise c.error(f"a valid mesh ({e})") from None


