"""``Builder``: grows a random program one op at a time, checking every line in eager PyTorch.

Each op generator (``tests.fuzz.ops``) picks operands among the live values, may add new inputs
(weights, biases, masks, index tensors), and emits source lines. ``Builder.emit`` runs a line on
the concrete inputs right away; a line that PyTorch rejects, or whose result is not a small finite
tensor, is dropped (with any inputs added for it), so every program the generator returns runs in
eager PyTorch in its own dtypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.fuzz.case import InputSpec, prelude
from tests.fuzz.draw import Draw, EmptyRange

MAX_NUMEL = 4096
MAX_ABS = 1e4
DIM_SIZES = (2, 4, 3, 8, 1, 6, 5, 16, 7, 12)


class Reject(Exception):
    """An op generator found nothing to do (no suitable operand); the builder draws another op."""


@dataclass
class Value:
    """A live value of the program: its name and its eager value (in the program's own dtypes).

    ``exact``: the data are an input's, unchanged except for views/slices (so order statistics and
    comparisons of it are the same in every precision: indices, masks and sorts use these only).
    """

    name: str
    t: torch.Tensor
    exact: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def rank(self) -> int:
        return self.t.dim()

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    @property
    def is_float(self) -> bool:
        return self.t.is_floating_point()


class Builder:
    """The program under construction. ``d`` is the Draw every random decision goes through."""

    def __init__(self, d: Draw, seed: int, features: frozenset[str], mesh_axes: tuple[tuple[str, int], ...]) -> None:
        self.d = d
        self.mesh_axes = mesh_axes
        self.seed = seed
        self.features = features
        self.inputs: list[InputSpec] = []
        self.values: list[Value] = []
        self.lines: list[str] = []
        self.ops: list[str] = []
        self.ns = prelude()
        self.rejected = 0
        self._n = 0

    # ------------------------------------------------------------ inputs and values

    def new_input(self, shape, dtype: torch.dtype, high: int = 0) -> str:
        """Add an argument of ``shape`` / ``dtype`` (an index tensor in [0, high) when high > 0); its name."""
        name = f"x{len(self.inputs)}"
        spec = InputSpec(name, tuple(int(s) for s in shape), dtype, self.seed * 100 + len(self.inputs), high)
        self.inputs.append(spec)
        t = spec.make()
        self.ns[name] = t
        self.values.append(Value(name, t, exact=True))
        return name

    def random_shape(self, rank: int | None = None) -> tuple[int, ...]:
        rank = self.d.choice((2, 3, 1, 4, 0)) if rank is None else rank
        shape = [self.d.choice(DIM_SIZES) for _ in range(rank)]
        while shape and math.prod(shape) > MAX_NUMEL // 4:  # leave room: results may grow
            shape[shape.index(max(shape))] = 2
        return tuple(shape)

    def random_spec(self, shape) -> tuple:
        """A PartitionSpec entry tuple for ``shape`` over the mesh axes: per dim None, an axis or
        (on 2-d meshes, rarely) two axes; each axis at most once; trailing Nones sometimes dropped.
        Dims need not divide by the axis size (uneven shards)."""
        free = [n for n, _ in self.mesh_axes]
        spec: list = []
        for _ in shape:
            if not free or self.d.boolean(0.55):
                spec.append(None)
                continue
            axis = free.pop(self.d.integer(0, len(free) - 1))
            if free and self.d.boolean(0.15):
                spec.append((axis, free.pop(0)))
            else:
                spec.append(axis)
        while spec and spec[-1] is None and self.d.boolean(0.5):
            spec.pop()
        return tuple(spec)

    def pick(self, pred=lambda v: True, what: str = "operand") -> Value:
        """A live value satisfying ``pred`` (most recent first, so chains are likely); Reject if none."""
        cands = [v for v in reversed(self.values) if pred(v)]
        if not cands:
            raise Reject(what)
        # The most recent value is the simplest answer (programs become chains); earlier ones stay reachable.
        if len(cands) == 1 or not self.d.boolean(0.4):
            return cands[0]
        return cands[self.d.integer(0, len(cands) - 1)]

    def pick_float(self, min_rank: int = 0, max_rank: int = 8) -> Value:
        return self.pick(lambda v: v.is_float and min_rank <= v.rank <= max_rank, "float operand")

    # ------------------------------------------------------------ emitting

    def fresh(self) -> str:
        self._n += 1
        return f"v{self._n - 1}"

    def emit(self, expr: str | None, *, exact: bool = False, stmts: tuple[str, ...] = ()) -> Value:
        """Append ``stmts`` (``{name}`` = the new value's name) then ``name = expr``; run them; the new Value.

        Raises Reject when eager PyTorch rejects the line or the result is not a finite tensor of
        at most MAX_NUMEL elements with |values| <= MAX_ABS (floats).
        """
        name = self.fresh()
        lines = [s.replace("{name}", name) for s in stmts] + ([f"{name} = {expr}"] if expr else [])
        try:
            for line in lines:
                exec(line, self.ns)
            t = self.ns[name]
        except Exception as e:  # noqa: BLE001 - a generator guess PyTorch does not accept
            raise Reject(f"eager rejected {lines}: {e}") from None
        if not isinstance(t, torch.Tensor) or t.numel() > MAX_NUMEL or t.numel() == 0 or t.dim() > 5:
            raise Reject("result too large or not a tensor")
        if t.is_floating_point() and not (torch.isfinite(t).all() and t.abs().max() <= MAX_ABS):
            raise Reject("result not finite or too large")
        self.lines.extend(lines)
        v = Value(name, t, exact)
        self.values.append(v)
        return v

    def attempt(self, kind: str, gen) -> bool:
        """Run one op generator; on Reject roll back inputs and lines it added. True if it emitted."""
        state = (len(self.inputs), len(self.values), len(self.lines), self._n)
        try:
            gen(self)
        except (Reject, EmptyRange):
            ni, nv, nl, nn = state
            del self.inputs[ni:], self.values[nv:], self.lines[nl:]
            self._n = nn
            self.rejected += 1
            return False
        self.ops.append(kind)
        return True


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (ascending)."""
    return [k for k in range(1, n + 1) if n % k == 0]

