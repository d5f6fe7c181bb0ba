"""Printer and parser of HLO-lite text, a subset of XLA's HLO text format.

``print_module(parse_module(s)) == s`` for every ``s`` that ``print_module``
produced. The parser also reads XLA dumps in the subset: names with or without
``%``, layouts (``f32[8,16]{1,0}``, ignored), shape-prefixed operands
(``add(f32[] %a, f32[] %b)``), ``/* comments */``, slices without stride
(``[0:4]``), padding without interior (``0_1x2_3``), iota replica groups
(``[2,2]<=[4]``) and ``backend_config`` as a quoted JSON string. Attributes not
in ``ATTRIBUTE_TYPES`` are kept as their raw text and printed back verbatim.

Example::

    HloModule mlp, num_partitions=4, mesh={tp=4}

    %add.f32 (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %sum = f32[] add(%a, %b)
    }

    ENTRY %main (x: f32[8,16], w: f32[16,32]) -> f32[8,32] {
      %x = f32[8,16] parameter(0), sharding={replicated}
      %w = f32[16,32] parameter(1), sharding={devices=[1,4]<=[4]}
      ROOT %dot = f32[8,32] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    }

Attributes print in a canonical order: ``ATTRIBUTE_TYPES`` order, then raw
attributes in insertion order, then ``sharding``, ``stream_id``, ``metadata``.
The module header carries ``num_partitions``, ``mesh`` (axis name = size) and,
when set, ``is_partitioned=true``; without ``mesh=`` the mesh is one axis ``x``
of ``num_partitions`` devices. Format reference:
https://github.com/openxla/xla/blob/main/xla/hlo/parser/hlo_parser.cc
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from spmd.ir.hlo import ATTRIBUTE_TYPES, DTYPES, OPCODES, Computation, Instruction, Module, Shape, SourceLocation
from spmd.ir.sharding import MeshShape
from spmd.ir.text_values import (
    ATTRIBUTE_KINDS,
    COMMENT_RE,
    COMPARISON_DIRECTIONS,
    INT_RE,
    KEY_RE,
    NAME_RE,
    OPCODE_RE,
    CompRef,
    Cursor,
    HloParseError,
    decode_attr,
    decode_location,
    parse_mesh,
    parse_operands,
)

__all__ = [
    "ATTRIBUTE_KINDS", "COMPARISON_DIRECTIONS", "HloParseError", "format_literal", "parse_module", "print_instruction",
    "print_module",
]

_INLINE_ATTRS = ("parameter_number", "literal")  # printed inside opcode(...)
_ORDER = {k: i for i, k in enumerate(k for k in ATTRIBUTE_TYPES if k not in _INLINE_ATTRS)}
_RAW_ORDER = len(_ORDER)


# ----------------------------------------------------------------------------- printer
def _fmt_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


def _fmt_nested(v: Any) -> str:
    if isinstance(v, list):
        return "{" + ", ".join(_fmt_nested(x) for x in v) + "}"
    return _fmt_scalar(v)


def format_literal(t: torch.Tensor) -> str:
    """Literal text of a tensor: ``1.5``, ``-inf``, ``{1, 2}``, ``{{1, 2}, {3, 4}}``.

    Floats print as Python's ``repr`` of the exact value (bf16/f16/f32 widen
    exactly to a Python float), so parsing gives back the same bits (NaN
    payloads aside).
    """
    return _fmt_nested(t.detach().cpu().tolist())


def _fmt_ints(v: tuple[int, ...]) -> str:
    return "{" + ",".join(map(str, v)) + "}"


def _fmt_attr(key: str, v: Any) -> str:
    kind = ATTRIBUTE_KINDS.get(key, "raw")
    if kind == "raw" or (isinstance(v, str) and kind not in ("string", "direction")):
        return str(v)
    if kind == "ints":
        return _fmt_ints(v)
    if kind in ("groups", "pairs"):
        return "{" + ",".join(_fmt_ints(g) for g in v) + "}"
    if kind == "slice":
        return "{" + ", ".join(f"[{a}:{b}:{c}]" for a, b, c in v) + "}"
    if kind == "padding":
        return "x".join(f"{a}_{b}_{c}" for a, b, c in v) if v else "{}"
    if kind == "comp":
        return "%" + v.name
    if kind == "string":
        return json.dumps(v)
    if kind == "json":
        return json.dumps(v, separators=(",", ":"))
    if kind == "bool":
        return "true" if v else "false"
    return str(v)  # int, direction


def _fmt_location(loc: SourceLocation) -> str:
    parts = []
    if loc.op_name:
        parts.append(f"op_name={json.dumps(loc.op_name)}")
    if loc.source_file:
        parts.append(f"source_file={json.dumps(loc.source_file)}")
    if loc.source_line:
        parts.append(f"source_line={loc.source_line}")
    return "{" + " ".join(parts) + "}"


def _fmt_sharding(sharding: Any, mesh: MeshShape | None) -> str:
    if mesh is None:
        return str(sharding)
    from spmd.ir.xla_sharding import to_xla_text

    text = to_xla_text(sharding, mesh)
    return text if text.startswith("{") else "{" + text + "}"


def print_instruction(inst: Instruction, mesh: MeshShape | None = None) -> str:
    """One instruction as HLO text, without ``ROOT`` and indentation.

    ``mesh`` converts ``inst.sharding`` to XLA sharding text; without it a
    sharding prints in ``TensorSharding``'s readable (non-parseable) form.
    """
    a = inst.attrs
    if inst.opcode == "parameter":
        inner = str(a.get("parameter_number", ""))
    elif inst.opcode == "constant" and "literal" in a:
        inner = format_literal(a["literal"])
    else:
        inner = ", ".join(["%" + o.name for o in inst.operands])
    parts = [f"%{inst.name} = {inst.shape} {inst.opcode}({inner})"]
    keys = [k for k in a if k not in _INLINE_ATTRS]
    if len(keys) > 1:
        keys.sort(key=lambda k: _ORDER.get(k, _RAW_ORDER))
    parts.extend(f"{k}={_fmt_attr(k, a[k])}" for k in keys)
    if inst.sharding is not None:
        parts.append("sharding=" + _fmt_sharding(inst.sharding, mesh))
    if inst.stream_id is not None:
        parts.append(f"stream_id={inst.stream_id}")
    if inst.location is not None:
        parts.append("metadata=" + _fmt_location(inst.location))
    return ", ".join(parts)


def _print_computation(comp: Computation, mesh: MeshShape, entry: bool) -> str:
    sig = ", ".join(f"{p.name}: {p.shape}" for p in comp.parameters)
    result = str(comp.root.shape) if comp.root is not None else "()"
    lines = [f"{'ENTRY ' if entry else ''}%{comp.name} ({sig}) -> {result} {{"]
    for inst in comp.instructions:
        prefix = "  ROOT " if inst is comp.root else "  "
        lines.append(prefix + print_instruction(inst, mesh))
    lines.append("}")
    return "\n".join(lines)


def print_module(m: Module) -> str:
    """The module as HLO text (ends with a newline); ``parse_module`` reads it back exactly."""
    header = f"HloModule {m.name}, num_partitions={m.num_partitions}, mesh={m.mesh}"
    if m.is_partitioned:
        header += ", is_partitioned=true"
    blocks = [header]
    blocks.extend(_print_computation(c, m.mesh, False) for c in m.computations)
    blocks.append(_print_computation(m.entry, m.mesh, True))
    return "\n\n".join(blocks) + "\n"


# ----------------------------------------------------------------------------- parser
_N = r"%?[A-Za-z_][\w.\-]*"
_FAST_HEAD = re.compile(rf"[ \t]*(ROOT[ \t]+)?({_N})[ \t]*=[ \t]*([a-z]+\d*)\[([\d,]*)\][ \t]+([a-z][a-z\-]*)"
                        rf"\(((?:[ \t]*{_N}[ \t]*,)*[ \t]*{_N}[ \t]*)?\)")
_FAST_ATTR = re.compile(r'[ \t]*,[ \t]*([A-Za-z_]\w*)=([^,{}\[\]()"\s]+|\{[^{}"]*\})[ \t]*(?=,|$)')
_FAST_KINDS = frozenset({"int", "ints", "comp", "raw"})
_SHAPES: dict[tuple[str, str], Shape] = {}


def _fast_head(c: Cursor) -> tuple[Instruction, bool, list, int] | None:
    """The common ``%n = f32[..] op(%a, %b)`` head by one regex; None if it needs the general path."""
    m = _FAST_HEAD.match(c.s)
    if m is None or m.group(5) not in OPCODES or m.group(5) == "constant" or m.group(3) not in DTYPES:
        return None
    key = (m.group(3), m.group(4))
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) > 4096:
            _SHAPES.clear()
        shape = _SHAPES[key] = Shape(key[0], tuple(int(d) for d in key[1].split(",")) if key[1] else ())
    col = m.start(6) + 1
    operands = [(o.strip().lstrip("%"), col) for o in m.group(6).split(",")] if m.group(6) else []
    c.pos = m.end()
    inst = Instruction(m.group(2).lstrip("%"), m.group(5), shape, (), {})
    return inst, m.group(1) is not None, operands, m.start(2)


def _general_head(c: Cursor) -> tuple[Instruction, bool, list, int]:
    is_root = c.eat("ROOT ")
    name_col = c.pos
    name = c.match(NAME_RE, "an instruction name").group(1)
    c.expect("=")
    shape = c.shape()
    c.ws()
    op_start = c.pos
    opcode = c.match(OPCODE_RE, "an opcode").group()
    if opcode not in OPCODES:
        raise c.error("a known opcode", op_start)
    attrs: dict[str, Any] = {}
    operands = parse_operands(c, opcode, shape, attrs)
    return Instruction(name, opcode, shape, (), attrs), is_root, operands, name_col


def _fast_attr(inst: Instruction, key: str, value: str, refs: list, lineno: int, col: int) -> bool:
    """Decode a simple attribute value without a cursor; False if the general decoder is needed."""
    kind = "stream" if key == "stream_id" else ATTRIBUTE_KINDS.get(key, "raw" if key not in _SPECIAL else "")
    try:
        if kind == "int" and INT_RE.fullmatch(value):
            inst.attrs[key] = int(value)
        elif kind == "stream" and INT_RE.fullmatch(value):
            inst.stream_id = int(value)
        elif kind == "ints" and value.startswith("{"):
            items = [x.strip() for x in value[1:-1].split(",")] if value[1:-1].strip() else []
            if not all(INT_RE.fullmatch(x) for x in items):
                return False
            inst.attrs[key] = tuple(int(x) for x in items)
        elif kind == "comp":
            if not NAME_RE.fullmatch(value):
                return False
            ref = CompRef(value.lstrip("%"), lineno, col)
            refs.append((inst, key, ref))
            inst.attrs[key] = ref
        elif kind == "raw":
            inst.attrs[key] = value
        else:
            return False
    except ValueError:
        return False
    return True


_SPECIAL = frozenset({"sharding", "metadata", "stream_id"})


def _parse_instruction(c: Cursor, mesh: MeshShape, refs: list) -> tuple[Instruction, bool, list, int]:
    head = _fast_head(c)
    if head is None:
        c.pos = 0
        head = _general_head(c)
    inst = head[0]
    s, n = c.s, len(c.s)
    while True:
        m = _FAST_ATTR.match(s, c.pos)
        if m is not None and m.group(1) in inst.attrs:
            raise c.error(f"attribute {m.group(1)} once", m.start(1), "a second one")
        if m is not None and _fast_attr(inst, m.group(1), m.group(2), refs, c.lineno, m.start(2) + 1):
            c.pos = m.end()
            continue
        if c.at_end():
            return head
        c.expect(",")
        key = c.match(KEY_RE, "an attribute name").group()
        if key in inst.attrs:
            raise c.error(f"attribute {key} once", c.pos - len(key), "a second one")
        c.expect("=")
        c.ws()
        start = c.pos
        raw = c.skip_balanced()
        sub = Cursor(s[:start + len(raw)] if start + len(raw) < n else s, c.lineno, start)
        _set_attr(inst, key, raw, sub, mesh, refs)
        if not sub.at_end():
            raise sub.error(f"end of the {key} value")


def _set_attr(inst: Instruction, key: str, raw: str, sub: Cursor, mesh: MeshShape, refs: list) -> None:
    if key == "stream_id":
        inst.stream_id = int(sub.match(INT_RE, "an integer stream id").group())
    elif key == "metadata":
        inst.location = decode_location(sub)
    elif key == "sharding" and not raw.startswith("{{"):
        inst.sharding = _parse_sharding(sub, raw, mesh, None if inst.shape.is_tuple else inst.shape.rank)
    else:
        value = decode_attr(sub, key, raw)
        if isinstance(value, CompRef):
            refs.append((inst, key, value))
        inst.attrs[key] = value


def _parse_sharding(c: Cursor, raw: str, mesh: MeshShape, rank: int | None) -> Any:
    from spmd.ir.xla_sharding import from_xla_text

    try:
        value = from_xla_text(raw, mesh, rank)
    except ValueError as e:
        raise c.error(f"a sharding over mesh {mesh} ({e})") from None
    c.pos = len(c.s)
    return value


def _parse_header(c: Cursor) -> tuple[str, MeshShape, bool]:
    c.expect("HloModule")
    name = c.match(NAME_RE, "a module name").group(1)
    num_partitions, mesh, partitioned = None, None, False
    while not c.at_end():
        c.expect(",")
        key = c.match(KEY_RE, "a module attribute").group()
        c.expect("=")
        if key == "num_partitions":
            c.ws()
            np_pos = c.pos
            num_partitions = int(c.match(INT_RE, "an integer").group())
        elif key == "mesh":
            mesh = parse_mesh(c)
        elif key == "is_partitioned":
            partitioned = c.match(re.compile(r"true|false"), "true or false").group() == "true"
        else:
            c.skip_balanced()
    if mesh is None:
        mesh = MeshShape(("x",), (num_partitions or 1,))
    elif num_partitions is not None and num_partitions != mesh.num_devices:
        raise c.error(f"num_partitions={mesh.num_devices} to match mesh={mesh}", np_pos, str(num_partitions))
    return name, mesh, partitioned


def _parse_comp_header(c: Cursor) -> tuple[str, bool]:
    entry = c.eat("ENTRY ")
    name = c.match(NAME_RE, "a computation name").group(1)
    if c.peek() == "(":
        c.skip_group()
    if c.eat("->"):
        c.shape()
    c.expect("{")
    if not c.at_end():
        raise c.error("end of line after '{'")
    return name, entry


def _finish_computation(name: str, body: list, lineno: int) -> Computation:
    by_name: dict[str, Instruction] = {}
    for inst, _, _, c, col in body:
        if inst.name in by_name:
            raise HloParseError(c.lineno, col + 1, "a unique instruction name", repr(inst.name))
        by_name[inst.name] = inst
    root = None
    for inst, is_root, operands, c, _ in body:
        for op_name, col in operands:
            if op_name not in by_name:
                at = c.s.find(op_name, col - 1)
                at -= 1 if at > 0 and c.s[at - 1] == "%" else 0
                raise HloParseError(c.lineno, at + 1, f"an instruction of computation %{name}", repr(op_name))
            inst.operands.append(by_name[op_name])
        if is_root:
            if root is not None:
                raise HloParseError(c.lineno, 1, "one ROOT per computation", "a second ROOT")
            root = inst
    if not body:
        raise HloParseError(lineno, 1, f"instructions in computation %{name}", "'}'")
    return Computation(name, [b[0] for b in body], root if root is not None else body[-1][0])


def parse_module(text: str) -> Module:
    """Parse HLO text into a Module.

    Raises HloParseError (a ValueError) giving ``line:column``, what was
    expected and what was found.
    """
    lines = text.split("\n")
    header, mesh, comps, entry, refs = None, None, [], None, []
    i = 0
    while i < len(lines):
        line = COMMENT_RE.sub(lambda m: " " * len(m.group()), lines[i])
        i += 1
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        c = Cursor(line, i)
        if header is None:
            header, mesh, partitioned = _parse_header(c)
            continue
        name, is_entry = _parse_comp_header(c)
        body = []
        while True:
            if i >= len(lines):
                raise HloParseError(len(lines), 1, f"'}}' closing computation %{name}", "end of text")
            line = COMMENT_RE.sub(lambda m: " " * len(m.group()), lines[i])
            i += 1
            if not line.strip() or line.strip().startswith("//"):
                continue
            if line.strip().startswith("}"):
                break
            c = Cursor(line, i)
            c.ws()
            inst, is_root, operands, col = _parse_instruction(c, mesh, refs)
            body.append((inst, is_root, operands, c, col))
        comp = _finish_computation(name, body, i)
        if is_entry:
            if entry is not None:
                raise HloParseError(i, 1, "one ENTRY computation", f"a second one, %{name}")
            entry = comp
        comps.append(comp)
    if header is None or not comps:
        raise HloParseError(len(lines), 1, "'HloModule name' and an ENTRY computation", "end of text")
    entry = entry if entry is not None else comps[-1]
    by_name = {comp.name: comp for comp in comps}
    for inst, key, ref in refs:
        if ref.name not in by_name:
            raise HloParseError(ref.lineno, ref.col, "the name of a computation of the module", repr(ref.name))
        inst.attrs[key] = by_name[ref.name]
    others = [comp for comp in comps if comp is not entry]
    return Module(header, entry, others, mesh, partitioned)
