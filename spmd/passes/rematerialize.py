"""rematerialize: recompute values at their far uses instead of keeping them live (activation recomputation).

A training program (forward + backward in one graph, ``spmd.frontend.joint``) keeps the forward's
activations live until the backward reads them. This pass shortens those lifetimes the way XLA's
HloRematerialization (xla/service/hlo_rematerialization.cc) does: for a value whose uses are
separated by a long stretch of the schedule (at least ``min_gap`` instructions in which nothing
reads it), the uses after the gap read a recomputed copy, cloned right before the first of them.
A copy is built only from values that are live at that point anyway (entry parameters, constants,
or values some instruction reads at or after it); an operand that is not is itself recomputed,
up to ``max_chain`` cloned instructions per site (XLA's multi-instruction "block" remat). So a
rewrite never lengthens another value's lifetime: the kept value's bytes are freed over the gap
at the cost of recomputing it.

Which instructions may be recomputed is the policy (``mode``):

- ``"selective"``: everything but matrix products, convolutions, sorts, gathers / scatters and
  communication: elementwise ops, broadcasts and other shape ops, reductions, norms, softmax,
  GELU / SiLU, random values and the ``fusion`` instructions of fuse-elementwise (made of those).
  This is the "save the matmuls" policy of PyTorch's selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) and of Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", 2022.
- ``"full"``: also dots, convolutions and gathers (embedding lookups): every activation that a
  chain from live values can reach is recomputed (activation checkpointing, Chen et al.,
  "Training Deep Nets with Sublinear Memory Cost", 2016; ``torch.utils.checkpoint``).
- ``"none"``: the module is left unchanged.

Communication is never recomputed (a collective would run twice), nor are outputs. Random values
(dropout masks) are recomputed exactly: a ``random`` custom call is a pure function of its key
operands, global element indices and its stream attribute (``spmd.ir.random``), so the copy
equals the original bit for bit.

The pass runs on the partitioned entry computation after cse and fuse-elementwise (both would
merge the copies back into the originals: fuse-elementwise merges equal fusions) and merge-dots
(which would merge a recomputed dot with the dots sharing its operands, live from the first of
them), so it recomputes whole ``fusion`` instructions (elementwise chains, reductions, norms,
softmax: the cheap class); it keeps the order of the original instructions; the copies get the names of their
originals with a ``.remat<k>`` suffix and the originals' shardings and streams.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.hlo import ELEMENTWISE_OPCODES, Instruction, Module
from spmd.passes.folding import folded_instructions
from spmd.passes.views import VIEW_OPCODES

__all__ = ["MODES", "Rematerialize"]

MODES = ("none", "selective", "full")

_CHEAP = ELEMENTWISE_OPCODES | frozenset({
    "broadcast", "reshape", "transpose", "slice", "concatenate", "pad", "reverse", "iota", "reduce",
    "dynamic-slice", "bitcast-convert", "reduce-precision", "fusion",
})
_CHEAP_CALLS = frozenset({"softmax", "layer-norm", "gelu", "silu", "random"})
_FULL_ONLY = frozenset({"dot", "gather"})
_FULL_ONLY_CALLS = frozenset({"conv1d", "attention", "attention-forward"})


def recomputable(inst: Instruction, mode: str) -> bool:
    """Whether ``mode``'s policy lets ``inst`` be recomputed (see the module docstring)."""
    if mode == "none":
        return False
    if inst.shape.is_tuple:
        return False
    op = inst.opcode
    if op == "custom-call":
        target = inst.attrs.get("custom_call_target")
        return target in _CHEAP_CALLS or (mode == "full" and target in _FULL_ONLY_CALLS)
    return op in _CHEAP or (mode == "full" and op in _FULL_ONLY)


@dataclass(frozen=True)
class Rematerialize:
    """The rematerialize pass (see the module docstring).

    Fields:
      mode: "none", "selective" or "full".
      min_gap: a value is recomputed for the uses after a stretch of at least this many
        instructions of the schedule that do not read it.
      min_bytes: values smaller than this (per device) are kept.
      max_chain: at most this many instructions are cloned for one recomputed value.
      max_rounds: at most this many rounds (each lowers the peak of the live-bytes profile).
      max_copies: each instruction is recomputed at most this many times (views excepted): with 1,
        at most one extra forward, the cost of activation checkpointing (unbounded, every far use
        could get its own copy of a whole chain: on a 2-layer GPT step 118 recomputed dots for 40
        in the program, for a peak 10% lower than with 1).
    Raises:
      ValueError: an unknown ``mode``, or a negative ``min_gap`` / ``min_bytes`` / ``max_chain``.
    """

    name: ClassVar[str] = "rematerialize"
    mode: str = "none"
    min_gap: int = 16
    min_bytes: int = 1
    max_chain: int = 64
    max_rounds: int = 64
    max_copies: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"remat: expected one of {MODES}, got {self.mode!r}")
        for f in ("min_gap", "min_bytes", "max_chain", "max_rounds", "max_copies"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f}: expected an int >= 0, got {v!r}")

    def run(self, module: Module) -> Module:
        if self.mode == "none":
            return module
        for _ in range(self.max_rounds):
            if not _Remat(module, self).round():
                break
        return module


class _Remat:
    """One round: the live-bytes profile of the current order, and the copies made for its peak."""

    def __init__(self, module: Module, opts: Rematerialize) -> None:
        self.module, self.opts = module, opts
        self.comp = module.entry
        self.order = list(self.comp.instructions)
        self.pos = {id(i): k for k, i in enumerate(self.order)}  # def position (a copy: its site)
        self.readers: dict[int, list[tuple[int, Instruction]]] = {id(i): [] for i in self.order}
        for k, inst in enumerate(self.order):
            for o in inst.operands:
                if id(o) in self.readers:
                    self.readers[id(o)].append((k, inst))
        self.sites: dict[int, list[Instruction]] = {}   # position -> copies inserted before it
        self.folded = folded_instructions(self.comp)
        self.names = names_of(module)
        self.copies = Counter(_original(n) for n in self.names if ".remat" in n)  # per original name
        root = self.comp.root
        self.outputs = {id(root)} | ({id(o) for o in root.operands} if root.opcode == "tuple" else set())

    # ------------------------------------------------------------------ profile
    def members(self, base: Instruction) -> list[Instruction]:
        """``base`` and the views of it (``VIEW_OPCODES`` chains reading it), in def order."""
        out, stack = [], [base]
        while stack:
            m = stack.pop()
            out.append(m)
            stack.extend(u for _, u in self.readers.get(id(m), ()) if u.opcode in VIEW_OPCODES and u.operands[0] is m)
        return out

    def accesses(self, base: Instruction) -> list[int]:
        """Sorted positions where ``base``'s bytes are written or read (reads through its views included)."""
        acc = {self.pos[id(base)]}
        for m in self.members(base):
            acc.update(k for k, u in self.readers.get(id(m), ()) if not (u.opcode in VIEW_OPCODES and
                                                                          u.operands[0] is m))
        return sorted(acc)

    def bases(self) -> list[Instruction]:
        """Values that own bytes: not parameters, constants, folded values, tuples or views."""
        return [i for i in self.order if i.opcode not in ("parameter", "constant", "tuple", "get-tuple-element")
                and i.opcode not in VIEW_OPCODES and not i.shape.is_tuple and i.shape.rank > 0
                and id(i) not in self.folded]

    def peak(self) -> tuple[int, list[tuple[Instruction, list[int]]]]:
        """The position where the most bytes are live, and the values with their accesses."""
        diff = [0] * (len(self.order) + 1)
        values = []
        for b in self.bases():
            acc = self.accesses(b)
            values.append((b, acc))
            diff[acc[0]] += b.shape.size_bytes
            diff[acc[-1] + 1] -= b.shape.size_bytes
        best, live, at = -1, 0, 0
        for k in range(len(self.order)):
            live += diff[k]
            if live > best:
                best, at = live, k
        return at, values

    # ------------------------------------------------------------------ one round
    def round(self) -> bool:
        """Recompute the values live across the peak that the policy allows; whether any was."""
        at, values = self.peak()
        changed = False
        for b, acc in sorted(values, key=lambda v: (-v[0].shape.size_bytes, v[1][0])):  # big, then early first
            if acc[0] < at < acc[-1] and at not in acc:
                changed |= self._try(b, at)
        if changed:
            out: list[Instruction] = []
            for k, inst in enumerate(self.order):
                out.extend(_def_order(self.sites.get(k, [])))
                out.append(inst)
            self.comp.instructions = out
        return changed

    def _try(self, b: Instruction, peak_at: int) -> bool:
        opts = self.opts
        if b.shape.size_bytes < opts.min_bytes or not recomputable(b, opts.mode):
            return False
        members = self.members(b)
        if any(id(m) in self.outputs for m in members):
            return False
        acc = self.accesses(b)
        cut = min(k for k in acc if k > peak_at)
        before = max(k for k in acc if k < peak_at)
        if cut - before <= opts.min_gap:
            return False
        plan: list[Instruction] = []
        copy = self._build(b, cut, plan, {}, root=True)
        if copy is None:
            return False
        self._place(plan, cut)
        self._redirect(b, copy, cut)
        return True

    def _place(self, plan: list[Instruction], cut: int) -> None:
        self.sites.setdefault(cut, []).extend(plan)
        for c in plan:
            self.copies[_original(c.name)] += 1
            self.pos[id(c)] = cut
            self.readers.setdefault(id(c), [])
            for o in c.operands:
                self.readers.setdefault(id(o), []).append((cut, c))

    def _redirect(self, m: Instruction, copy: Instruction, cut: int) -> None:
        """Readers of ``m`` at or after ``cut`` read ``copy``; views of ``m`` made before ``cut`` that are
        read after it are made again from ``copy`` at ``cut``."""
        keep = []
        for k, u in self.readers[id(m)]:
            if k >= cut:
                u.operands = [copy if o is m else o for o in u.operands]
                self.readers[id(copy)].append((k, u))
            elif u.opcode in VIEW_OPCODES and u.operands[0] is m and any(r >= cut for r in self.accesses(u)):
                keep.append((k, u))
                view = self._clone(u, [copy] + u.operands[1:])
                self._place([view], cut)
                self._redirect(u, view, cut)
            else:
                keep.append((k, u))
        self.readers[id(m)] = keep

    def _available(self, inst: Instruction, at: int) -> bool:
        """Live at position ``at`` anyway: a parameter, a value the lowering folds (constants, small
        iotas and masks: persistent), or a value read at or after ``at``."""
        if inst.opcode in ("parameter", "constant") or id(inst) in self.folded:
            return True
        rs = self.readers.get(id(inst), ())
        return self.pos.get(id(inst), at + 1) <= at and max((k for k, _ in rs), default=-1) >= at

    def _build(self, inst: Instruction, at: int, plan: list[Instruction], memo: dict,
               root: bool = False) -> Instruction | None:
        """A value equal to ``inst`` available at ``at``: itself, or a copy appended to ``plan``."""
        if not root and self._available(inst, at):
            return inst
        if id(inst) in memo:
            return memo[id(inst)]
        if not recomputable(inst, self.opts.mode) or len(plan) >= self.opts.max_chain:
            return None
        if inst.opcode not in VIEW_OPCODES and self.copies[_original(inst.name)] >= self.opts.max_copies:
            return None
        operands = []
        for o in inst.operands:
            built = self._build(o, at, plan, memo)
            if built is None:
                return None
            operands.append(built)
        if len(plan) >= self.opts.max_chain:
            return None
        copy = self._clone(inst, operands)
        plan.append(copy)
        memo[id(inst)] = copy
        return copy

    def _clone(self, inst: Instruction, operands: list[Instruction]) -> Instruction:
        k = 0
        while f"{inst.name}.remat{k}" in self.names:
            k += 1
        name = f"{inst.name}.remat{k}"
        self.names.add(name)
        return Instruction(name, inst.opcode, inst.shape, operands, dict(inst.attrs), sharding=inst.sharding,
                           stream_id=inst.stream_id, location=inst.location)


def _original(name: str) -> str:
    """The name of the instruction a copy was made from (``a.remat0.remat1`` -> ``a``)."""
    return name.split(".remat", 1)[0]


def names_of(module: Module) -> set[str]:
    """Every instruction name of ``module`` (copies get fresh ones)."""
    return {i.name for c in module.all_computations() for i in c.instructions}


def _def_order(copies: list[Instruction]) -> list[Instruction]:
    """``copies`` (made at one site) ordered so that each comes after the copies it reads."""
    ids = {id(c) for c in copies}
    done: set[int] = set()
    out: list[Instruction] = []

    def visit(c: Instruction) -> None:
        if id(c) in done:
            return
        done.add(id(c))
        for o in c.operands:
            if id(o) in ids:
                visit(o)
        out.append(c)

    for c in copies:
        visit(c)
    return out
