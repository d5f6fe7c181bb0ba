"""HLO text of partitioned test programs for the runtime tests."""

from __future__ import annotations

from spmd.ir.hlo import Module
from spmd.ir.text import parse_module

SUM = """%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] maximum(%a, %b)
}
"""


def _groups(groups) -> str:
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def _dims(d) -> str:
    return ",".join(map(str, d))


def collective(kind: str, mesh: str, n: int, in_dims, out_dims, groups=None, pairs=None,
               dim: int = 0, split: int = 0, concat: int = 0, reduce: str = "sum",
               stream_id: int | None = None) -> Module:
    """``ROOT = multiply(C(x), x')``-style program: one collective between two kernels."""
    attrs = []
    if kind in ("all-gather", "reduce-scatter"):
        attrs.append(f"dimensions={{{dim}}}")
    if kind in ("all-reduce", "reduce-scatter"):
        attrs.append(f"to_apply=%{reduce}")
    if kind == "all-to-all":
        attrs.append(f"split_dimension={split}, concat_dimension={concat}")
    if groups is not None:
        attrs.append(f"replica_groups={_groups(groups)}")
    if pairs is not None:
        attrs.append(f"source_target_pairs={_groups(pairs)}")
    if stream_id is not None:
        attrs.append(f"stream_id={stream_id}")
    i, o = _dims(in_dims), _dims(out_dims)
    text = f"""HloModule c, num_partitions={n}, mesh={{{mesh}}}, is_partitioned=true

{SUM}
ENTRY %main (x: f32[{i}]) -> f32[{o}] {{
  %x = f32[{i}] parameter(0)
  %e = f32[{i}] exponential(%x)
  %c = f32[{o}] {kind}(%e), {", ".join(attrs)}
  ROOT %r = f32[{o}] multiply(%c, %c)
}}
"""
    return parse_module(text)


def windowed_all_gather_dot(n: int, m: int = 4, k: int = 16, f: int = 8, dtype: str = "f32",
                            async_dot: bool = False, cp_stream: int = 2) -> Module:
    """All-gather(x) @ w as a ring of collective-permutes, results written with dynamic-update-slice.

    x: [m, k] shard per device (global rows split n ways), w: [k, f] replicated. Step ``i``:
    device ``p`` holds the chunk of device ``(p + i) % n``, multiplies it by w and writes the
    product at rows ``((p + i) % n) * m`` of the [n*m, f] result, while the next chunk moves
    (collective-permute p -> p-1 on stream ``cp_stream``). With ``async_dot`` every dot runs
    in an async-start on stream 1.
    """
    pairs = _groups([(p, (p - 1) % n) for p in range(n)])
    lines = [
        f"  %x = {dtype}[{m},{k}] parameter(0)",
        f"  %w = {dtype}[{k},{f}] parameter(1)",
        "  %pid = u32[] partition-id()",
        "  %pid32 = s32[] convert(%pid)",
        f"  %nn = s32[] constant({n})",
        f"  %mm = s32[] constant({m})",
        "  %zero = s32[] constant(0)",
        f"  %z = {dtype}[] constant(0)",
        f"  %buf.0 = {dtype}[{n * m},{f}] broadcast(%z), dimensions={{}}",
        "  %chunk.0 = " + f"{dtype}[{m},{k}] copy(%x)",
    ]
    bodies = []
    for i in range(n):
        lines.append(f"  %i.{i} = s32[] constant({i})")
        lines.append(f"  %s.{i} = s32[] add(%pid32, %i.{i})")
        lines.append(f"  %r.{i} = s32[] remainder(%s.{i}, %nn)")
        lines.append(f"  %off.{i} = s32[] multiply(%r.{i}, %mm)")
        if i + 1 < n:
            lines.append(f"  %cp.{i} = ({dtype}[{m},{k}], {dtype}[{m},{k}]) collective-permute-start(%chunk.{i}), "
                         f"source_target_pairs={pairs}, stream_id={cp_stream}")
        if async_dot:
            bodies.append(f"""%body.{i} (a: {dtype}[{m},{k}], b: {dtype}[{k},{f}]) -> {dtype}[{m},{f}] {{
  %a.{i} = {dtype}[{m},{k}] parameter(0)
  %b.{i} = {dtype}[{k},{f}] parameter(1)
  ROOT %d.{i} = {dtype}[{m},{f}] dot(%a.{i}, %b.{i}), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
""")
            start_shape = f"(({dtype}[{m},{k}], {dtype}[{k},{f}]), {dtype}[{m},{f}])"
            lines.append(f"  %ds.{i} = {start_shape} async-start(%chunk.{i}, %w), "
                         f"calls=%body.{i}, stream_id=1")
            lines.append(f"  %dot.{i} = {dtype}[{m},{f}] async-done(%ds.{i}), stream_id=1")
        else:
            lines.append(f"  %dot.{i} = {dtype}[{m},{f}] dot(%chunk.{i}, %w), lhs_contracting_dims={{1}}, "
                         "rhs_contracting_dims={0}")
        lines.append(f"  %buf.{i + 1} = {dtype}[{n * m},{f}] dynamic-update-slice(%buf.{i}, %dot.{i}, %off.{i}, %zero)")
        if i + 1 < n:
            lines.append(f"  %chunk.{i + 1} = {dtype}[{m},{k}] collective-permute-done(%cp.{i}), stream_id={cp_stream}")
    lines[-1] = "  ROOT " + lines[-1].lstrip()
    text = (f"HloModule wag, num_partitions={n}, mesh={{x={n}}}, is_partitioned=true\n\n" + "\n".join(bodies)
            + ("\n" if bodies else "")
            + f"ENTRY %main (x: {dtype}[{m},{k}], w: {dtype}[{k},{f}]) -> {dtype}[{n * m},{f}] {{\n"
            + "\n".join(lines) + "\n}\n")
    return parse_module(text)
