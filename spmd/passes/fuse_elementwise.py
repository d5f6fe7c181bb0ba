"""fuse-elementwise: chains of elementwise ops, broadcasts, reductions and norms become one ``fusion``.

After partitioning, a transformer layer still runs one kernel per elementwise op: the bias add
after an all-reduce, the residual add, the LayerNorm, the GELU, the mask arithmetic. Each is a
full pass over memory plus a launch. This pass groups them as XLA's loop fusion does
(xla/service/instruction_fusion.cc, "kLoop" fusions): a consumer absorbs its producers when
every user of the producer is in the group, and duplicates cheap producers (broadcast, reshape,
transpose, slice, scalar constants, iota) that have other users, as well as cheap elementwise
producers (add, multiply, ..., and the activations silu and gelu) whose users can all fuse
them (each consumer recomputes the producer, whose own kernel then goes away: a residual add
read by a LayerNorm and by the next residual add; SwiGLU's silu(gate) read by the forward's
product and by the backward). A recomputed producer takes its own operands as inputs (one level: recomputing
a chain of residual sums in every layer's norm would read every earlier layer's output), except a
widening ``convert`` whose users can all fuse it, which is recomputed as well (the MSE loss's
``pred - target`` on 16-bit values widened to float32, read by the loss and by its gradient: no
convert kernel, no float32 copy stored). An
``add`` of a single-use dot and a bias or residual is left to the runtime's addmm (but a float32
bias add read only by fusing ops joins their fusion, see ``_is_addmm_operand``). A fusion
whose only user is a transpose absorbs it (``absorb_transposes``: the kernel writes the
transposed order), and a fusion computing an attention call's q or k writes [B, S, H, D] order
(``spmd.passes.attention_layout``: the attention output's reshape is then a view). Each group
with at least two ops that would launch a kernel becomes::

    %fusion = f32[8,128,384] fusion(%all-reduce, %bias, %residual), kind=kLoop, calls=%fused_computation

where ``%fused_computation`` holds the group's instructions on parameters. The runtime
(``spmd.runtime.kernels_fusion``) runs the called computation as one generated kernel
(PyTorch Inductor on CUDA devices), or op by op elsewhere.

Fusible: elementwise opcodes, broadcast, reshape, transpose, slice, concatenate (of at most 8
operands, and only as a producer inside a consumer's group: a concatenate feeding a collective
is no group root), ``pad`` without interior or negative padding, constants, iota, reduce (add /
maximum / minimum) and the custom calls ``gelu``, ``silu``, ``layer-norm``, ``softmax``. A
concatenate or pad launches a kernel of its own when unfused; fused, it is a select between
its operands (and the fill value) per output element (Inductor's pointwise cat: rotary
embeddings' ``cat(-x2, x1)`` then costs no kernel beside the multiply-adds that read it; its
backward, the pads ``simplify`` makes of ``slice_scatter`` into zeros, likewise; XLA's loop
fusion takes both). A ``dynamic-update-slice`` roots a group grown through its update only, its
buffer updated in place (``spmd.passes.fuse_update_slice``: a KV-cache write with the rotary
embedding that produces it). Not fused: dots (cuBLAS), collectives, gathers, dynamic slices, other pads,
longer concatenates (collective buckets), other custom calls, anything with a tuple shape or no
elements, values the lowering folds on
the host (``spmd.passes.views.folded_instructions``: small values computed only from constants
and partition-id) and ops inside called computations. Members of a group share one stream id,
and the group has at least one operand. An ``add`` of a single-use dot and a broadcast (a
bias) or a residual of the dot's shape is left to the runtime's addmm peephole (one GEMM that
accumulates into the other operand), except a float32 bias add whose users all fuse (Inductor's
choice, ``_is_addmm_operand``).

Example (one device)::

    %b = f32[8,128,384] broadcast(%bias), dimensions={2}
    %x = f32[8,128,384] add(%all-reduce, %b)
    %y = f32[8,128,384] add(%x, %residual)
    %ln = f32[8,128,384] custom-call(%y, %w, %beta), custom_call_target="layer-norm", ...

becomes ``%fusion = f32[8,128,384] fusion(%all-reduce, %bias, %residual, %w, %beta), kind=kLoop,
calls=%fused_computation`` with the four instructions (and the broadcast) inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd.ir.builder import Builder
from spmd.ir.hlo import ELEMENTWISE_OPCODES, Computation, Instruction, Module
from spmd.passes.attention_layout import attention_operand_layouts
from spmd.passes.cse import cse_computation
from spmd.passes.folding import folded_instructions
from spmd.passes.fuse_update_slice import UpdateSiblings, dus_sibling_fuses, grown_operands, is_update_root
from spmd.passes.simplify import output_ids

#: ``random`` (spmd.ir.random) is int64 arithmetic that wraps modulo 2**64; Inductor's generated
#: kernel gives the same bits as the op-by-op kernels (tests/runtime/test_random_fusion.py).
FUSIBLE_CUSTOM_CALLS = frozenset({"gelu", "silu", "layer-norm", "softmax", "random"})
#: Ops that cost no kernel of their own (views or literals): duplicated into a group when shared.
CHEAP_OPCODES = frozenset({"broadcast", "reshape", "transpose", "slice", "constant", "iota"})
_FUSIBLE_OPCODES = ELEMENTWISE_OPCODES | CHEAP_OPCODES | frozenset({"reduce"})
_NO_ROOT_OPCODES = CHEAP_OPCODES | frozenset({"concatenate"})  # fused into a consumer's group only
#: A concatenate of more operands (a collective bucket) stays one ATen ``cat`` kernel: Inductor
#: lowers a longer cat as a copy kernel per operand (``max_pointwise_cat_inputs``).
MAX_FUSED_CONCAT_OPERANDS = 8
_REDUCERS = frozenset({"add", "maximum", "minimum"})
#: Elementwise ops cheap enough to recompute in every consumer fusion (XLA duplicates such
#: producers when all their users can fuse them, so that the producer's own kernel goes away).
DUPLICABLE_OPCODES = frozenset({"add", "subtract", "multiply", "negate", "maximum", "minimum", "select",
                                "compare", "convert", "abs"})
#: Custom calls recomputed the same way: an activation whose value the forward's gated product and
#: the backward both read (SwiGLU's silu(gate)) is recomputed in both fusions instead of being
#: a kernel whose result is stored and read twice (Inductor recomputes it as well).
DUPLICABLE_CUSTOM_CALLS = frozenset({"silu", "gelu"})
FUSED_COMPUTATION = "fused_computation"


def is_fusible(inst: Instruction) -> bool:
    """Whether ``inst`` may be part of a loop fusion (see the module docstring)."""
    if inst.shape.is_tuple or inst.shape.numel == 0:
        return False
    op = inst.opcode
    if op == "custom-call":
        return inst.attrs.get("custom_call_target") in FUSIBLE_CUSTOM_CALLS
    if op == "reduce":
        root = inst.attrs["to_apply"].root
        return root is not None and root.opcode in _REDUCERS and len(inst.operands) == 2
    if op == "constant":
        return inst.shape.numel == 1
    if op == "pad":
        return all(lo >= 0 and hi >= 0 and interior == 0 for lo, hi, interior in inst.attrs["padding"])
    if op == "concatenate":  # Inductor's pointwise cat takes up to 8 inputs (else a copy per input)
        return len(inst.operands) <= MAX_FUSED_CONCAT_OPERANDS
    return op in _FUSIBLE_OPCODES


def launches_kernel(inst: Instruction) -> bool:
    """Whether ``inst`` would run a kernel of its own if left unfused (not a view or literal)."""
    return inst.opcode not in CHEAP_OPCODES


@dataclass(frozen=True)
class FuseElementwise:
    """The fuse-elementwise pass (see the module docstring).

    enabled: False leaves every module unchanged (``CompileOptions.fuse_elementwise``).
    min_kernels: the fewest kernel-launching ops a group needs to become a fusion (default 2).

    ``run(module)`` rewrites the entry computation in place and returns the module.
    Raises ValueError (in ``run``) for a module that is not partitioned.
    """

    name: ClassVar[str] = "fuse-elementwise"
    enabled: bool = True
    min_kernels: int = 2

    def run(self, module: Module) -> Module:
        if not module.is_partitioned:
            raise ValueError(f"module {module.name!r} is not partitioned; fuse-elementwise runs after spmd-partition")
        if not self.enabled:
            return module
        comp = module.entry
        users = _live_users(comp)  # kept up to date as groups are taken (``_retire``)
        taken: set[int] = set(folded_instructions(comp))  # the lowering computes these on the host
        groups: list[_Group] = []
        updates = UpdateSiblings(comp, users, taken, self.min_kernels)
        for inst in reversed(comp.instructions):
            if id(inst) in taken or not (is_fusible(inst) or is_update_root(inst)) or inst.opcode in _NO_ROOT_OPCODES:
                continue
            if (not users[inst] and inst is not comp.root) or _is_addmm_operand(inst, None, users):
                continue  # dead (every user recomputes it), or left for the addmm peephole
            group = _grow(inst, users, taken)
            if (group.kernels >= self.min_kernels or dus_sibling_fuses(group, updates)) and group.inputs:
                groups.append(group)
                taken.update(id(m) for m in group.moved)
                _retire(group, users, comp.root)
        builder = Builder(module, comp)
        for group in groups:
            _outline(module, builder, comp, group)
        if groups and absorb_transposes(module, builder, comp) + attention_operand_layouts(module, builder, comp):
            _drop_unused_computations(module)
        if groups:
            comp.remove_dead()
            # equal chains (each layer's position arithmetic, say) became equal fusions: keep one
            cse_computation(comp, merge_scalar_broadcasts=True, structural_calls=True)
            _drop_unused_computations(module)
        return module


def absorb_transposes(module: Module, builder: Builder, comp: Computation) -> int:
    """A fusion whose only user is a transpose computes the transposed value itself; the number absorbed.

    The fused kernel then writes its result in the transposed order (one generated kernel,
    any output order), so readers that need the transposed value row-major, as a reshape that
    merges the transposed dims (the [B, H, S, D] -> [B*S, H*D] of attention's dq / dk after the
    rotary backward), read it as a view instead of a copy. Output values are left alone.
    """
    users, outputs = comp.users(), output_ids(comp)
    done = 0
    for t in list(comp.instructions):
        f = t.operands[0] if t.opcode == "transpose" else None
        if (f is None or f.opcode != "fusion" or users.get(f) != [t] or is_update_root(f.attrs["calls"].root)
                or id(t) in outputs or id(f) in outputs
                or f.stream_id != t.stream_id):
            continue
        absorb_user(module, builder, comp, f, t)
        users = comp.users()
        done += 1
    return done


def absorb_user(module: Module, builder: Builder, comp: Computation, f: Instruction, t: Instruction) -> Instruction:
    """Replace fusion ``f`` and its only user ``t`` (a transpose or reshape of it) by one fusion whose
    called computation ends in ``t``'s op; returns the new fusion (placed where ``t`` was)."""
    old = f.attrs["calls"]
    body = Builder.new_computation(module, FUSED_COMPUTATION)
    clones: dict[int, Instruction] = {}
    for i in old.instructions:
        if i.opcode == "parameter":
            clones[id(i)] = body.param(i.shape, name=i.name, number=i.attrs["parameter_number"])
        else:
            clones[id(i)] = body.add(i.opcode, [clones[id(o)] for o in i.operands], i.attrs, shape=i.shape,
                                     name=i.name, location=i.location)
    body.set_root(body.add(t.opcode, [clones[id(old.root)]], dict(t.attrs), shape=t.shape, name=t.name,
                           location=t.location))
    with builder.insert_before(t):
        new = builder.add("fusion", list(f.operands), dict(f.attrs, calls=body.computation), shape=t.shape,
                          name="fusion", sharding=t.sharding, stream_id=t.stream_id, location=f.location)
    comp.replace_all_uses(t, new)
    comp.instructions = [i for i in comp.instructions if i is not t and i is not f]
    return new


def _drop_unused_computations(module: Module) -> None:
    """Forget fused computations no instruction calls any more (their fusions were merged)."""
    called = {id(v) for c in module.all_computations() for i in c.instructions for v in i.attrs.values()
              if isinstance(v, Computation)}
    module.computations[:] = [c for c in module.computations if id(c) in called]


@dataclass
class _Group:
    """A fusion group: its root, members in program order, and which of them are moved."""

    root: Instruction
    members: list[Instruction]          # every instruction of the group (moved and duplicated)
    moved: list[Instruction]            # members whose every user is in the group
    inputs: list[Instruction]           # operands from outside the group, first use first
    kernels: int


def _grow(root: Instruction, users: dict, taken: set[int]) -> _Group:
    """The largest group rooted at ``root`` under the module docstring's rules."""
    inside: set[int] = {id(root)}
    moved: set[int] = {id(root)}
    stack = [root]
    while stack:
        inst = stack.pop()
        for p in grown_operands(inst, root):
            if id(p) in inside or id(p) in taken or not is_fusible(p) or p.stream_id != root.stream_id:
                continue
            if _is_addmm_operand(p, inst, users):
                continue
            if all(id(u) in moved for u in users[p]):
                moved.add(id(p))
            elif p.opcode not in CHEAP_OPCODES and ((id(inst) not in moved and not _widening_convert(p))
                                                    or not _duplicable(p, users, root.stream_id)):
                # a recomputed producer reads its own operands as inputs: recomputing whole
                # chains (each layer's residual sum from the embedding on) grows with depth;
                # a widening convert below it is recomputed too (it reads fewer bytes than its result)
                continue
            inside.add(id(p))
            stack.append(p)
    members = [i for i in _program_order(root, inside)]
    inputs: list[Instruction] = []
    for m in members:
        for o in m.operands:
            if id(o) not in inside and o not in inputs:
                inputs.append(o)
    kernels = sum(1 for m in members if launches_kernel(m))
    return _Group(root, members, [m for m in members if id(m) in moved], inputs, kernels)


def _live_users(comp: Computation) -> dict[Instruction, list[Instruction]]:
    """Map instruction -> its users that the root reaches (dead code reads nothing)."""
    live: set[int] = set()
    stack = [comp.root]
    while stack:
        inst = stack.pop()
        if id(inst) not in live:
            live.add(id(inst))
            stack.extend(inst.operands)
    return {inst: [u for u in us if id(u) in live] for inst, us in comp.users().items()}


def _retire(group: _Group, users: dict, entry_root: Instruction) -> None:
    """Update ``users`` to the entry as it will be once ``group`` is outlined.

    Moved members go, and so do duplicated members left without users (every user was moved
    into a fusion that recomputes them); a placeholder ``fusion`` (not fusible) reads every
    input. Later groups then neither move nor duplicate a producer that a fusion still reads,
    and never root a group at a value nothing reads any more.
    """
    gone, dead = list(group.moved), {id(m) for m in group.moved}
    members = {id(m) for m in group.members}
    while gone:
        m = gone.pop()
        for o in dict.fromkeys(m.operands):
            users[o] = [u for u in users[o] if u is not m]
            if id(o) in members and id(o) not in dead and not users[o] and o is not entry_root:
                dead.add(id(o))
                gone.append(o)
    fusion = Instruction(f"{group.root.name}.fusion", "fusion", group.root.shape, stream_id=group.root.stream_id)
    for x in group.inputs:
        users[x].append(fusion)


def _duplicable(p: Instruction, users: dict, stream_id: int | None) -> bool:
    """A cheap elementwise producer whose every user may fuse it: recomputed in each consumer."""
    cheap = p.opcode in DUPLICABLE_OPCODES or (p.opcode == "custom-call"
                                               and p.attrs.get("custom_call_target") in DUPLICABLE_CUSTOM_CALLS)
    return cheap and all(_takes_producer(u, users, stream_id) for u in users[p])


def _widening_convert(p: Instruction) -> bool:
    """A ``convert`` to a type at least as wide as its operand's (bf16 -> f32: the loss reading a
    16-bit target and prediction in float32). Recomputed below a recomputed producer: each fusion
    then reads the narrow operand, and the wide value is neither a kernel nor stored."""
    if p.opcode != "convert" or p.operands[0].shape.is_tuple:
        return False
    return p.shape.torch_dtype.itemsize >= p.operands[0].shape.torch_dtype.itemsize


def _takes_producer(u: Instruction, users: dict, stream_id: int | None, depth: int = 0) -> bool:
    """Whether ``u`` can recompute a producer inside a fusion: a fusible kernel on the stream, or a
    view-like op (no group root of its own) whose users all can. A reshape that only dots read
    cannot: the producer would keep its own kernel for it, and recomputing it elsewhere would
    only cut the chain below it off into a fusion of its own."""
    if not is_fusible(u) or u.stream_id != stream_id:
        return False
    if u.opcode not in _NO_ROOT_OPCODES:
        return True
    return depth < 4 and all(_takes_producer(w, users, stream_id, depth + 1) for w in users.get(u, ()))


def _is_addmm_operand(p: Instruction, user: Instruction, users: dict) -> bool:
    """``p`` is an ``add`` of a single-use dot and a bias or a residual (any value of the dot's
    shape and dtype): the runtime runs it as one addmm (cuBLAS accumulates into C).

    Except a float32 bias add (a broadcast operand) whose users all fuse and launch kernels (the residual add before a
    LayerNorm, a GELU): that bias add goes into their fusion and the dot runs as a plain GEMM, as
    Inductor does (``unfuse_bias_add_to_pointwise`` in torch/_inductor/fx_passes/post_grad.py;
    it keeps the fused addmm for 16-bit types): cuBLASLt's bias-epilogue kernels have no split-K
    for a narrow float32 output with a long contraction (MiniLM's [1024, 1536] x [1536, 384]),
    which cuBLAS's plain GEMM heuristics pick.
    """
    if p.opcode != "add" or user is p:
        return False
    for k, o in enumerate(p.operands):
        other = p.operands[1 - k]
        if o.opcode != "dot" or len(users.get(o, ())) != 1:
            continue
        if other.opcode == "broadcast" and _bias_fuses_downstream(p, users):
            return False
        if other.opcode in CHEAP_OPCODES | {"parameter"} or (
                other.shape.dims == o.shape.dims and other.shape.dtype == o.shape.dtype == p.shape.dtype):
            return True
    return False


def _bias_fuses_downstream(p: Instruction, users: dict) -> bool:
    """A float32 ``add`` whose users are all fusible ops that launch kernels (see ``_is_addmm_operand``)."""
    us = users.get(p, ())
    return (p.shape.dtype == "f32" and bool(us)
            and all(is_fusible(u) and launches_kernel(u) and u.stream_id == p.stream_id for u in us))


def _program_order(root: Instruction, inside: set[int]) -> list[Instruction]:
    """The group's members in a def-before-use order (post-order from the root)."""
    order: list[Instruction] = []
    seen: set[int] = set()
    stack: list[tuple[Instruction, bool]] = [(root, False)]
    while stack:
        inst, done = stack.pop()
        if done:
            order.append(inst)
            continue
        if id(inst) in seen:
            continue
        seen.add(id(inst))
        stack.append((inst, True))
        for o in reversed(inst.operands):
            if id(o) in inside and id(o) not in seen:
                stack.append((o, False))
    return order


def _outline(module: Module, builder: Builder, comp: Computation, group: _Group) -> None:
    """Move ``group`` into a new fused computation and put a ``fusion`` instruction in its root's place."""
    body = Builder.new_computation(module, FUSED_COMPUTATION)
    clones: dict[int, Instruction] = {}
    for n, x in enumerate(group.inputs):
        clones[id(x)] = body.param(x.shape, name=f"param_{n}", number=n)
    for m in group.members:
        clones[id(m)] = body.add(m.opcode, [clones[id(o)] for o in m.operands], m.attrs, shape=m.shape,
                                 name=m.name, location=m.location)
    body.set_root(clones[id(group.root)])
    root = group.root
    with builder.insert_before(root):
        fusion = builder.add("fusion", group.inputs, {"kind": "kLoop", "calls": body.computation},
                             shape=root.shape, name="fusion", sharding=root.sharding,
                             stream_id=root.stream_id, location=root.location)
    comp.replace_all_uses(root, fusion)
