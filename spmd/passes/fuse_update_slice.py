"""In-place dynamic-update-slice fusions: the rules fuse-elementwise applies to a ``dynamic-update-slice`` root.

A decode step writes each layer's new key and value rows into the KV cache with a
dynamic-update-slice at the position; the key is the output of the rotary embedding. Unfused,
that is three kernels per layer (the rotary embedding, the k write, the v write). XLA fuses a
dynamic-update-slice with the elementwise producers of its update into one loop fusion that
iterates over the *update* only and stores into the buffer of operand 0 in place
(``CanEmitFusedDynamicUpdateSliceInPlaceForGpu`` in xla/service/gpu/ir_emission_utils.cc), and
its multi-output fusion puts sibling in-place updates at the same position into one kernel.

fuse-elementwise (``spmd.passes.fuse_elementwise``) applies these rules:

- a ``dynamic-update-slice`` of an entry parameter may root a group (``is_update_root``); it is
  never a producer inside another group;
- the group grows only through operand 1 (the update): operand 0 (the buffer updated in place)
  and the start indices stay inputs of the fusion (``grown_operands``);
- the group becomes a fusion when it has at least ``min_kernels`` kernel-launching members, or
  when it has a producer at all (views: a transposed slice of a merged Q/K/V product) and a
  sibling update (same start instructions, same update dims, same stream) does fuse
  (``dus_sibling_fuses``): multi-output-fusion then merges the two into one kernel
  (``spmd.passes.multi_output_fusion``). A dynamic-update-slice whose update is a dot keeps the
  runtime's dot-into-slice peephole (``spmd.runtime.fusions``).

The runtime (``spmd.runtime.kernels_fusion_update``) runs such a fusion as one kernel that
computes the update and stores it into the buffer at the clamped starts, over operand 0's memory
where the lowering gives that buffer as the destination (a donated KV cache), else into a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmd.ir.hlo import Computation, Instruction
from spmd.passes.cse import instruction_key

DUS = "dynamic-update-slice"


def is_update_root(inst: Instruction) -> bool:
    """An array ``dynamic-update-slice`` of a parameter (a KV cache, state the caller may donate)
    with a non-empty update of the buffer's dtype: may root a fusion.

    Only parameters: buffer assignment runs an unfused dynamic-update-slice of an intermediate
    value in place in the arena (a windowed einsum's accumulator), while a fusion's result is
    memory of its own (a copy of the whole buffer); a parameter is copied either way unless donated.
    """
    if inst.opcode != DUS or inst.shape.is_tuple or inst.shape.numel == 0 or inst.operands[0].opcode != "parameter":
        return False
    update = inst.operands[1]
    return update.shape.numel > 0 and update.shape.dtype == inst.shape.dtype


def grown_operands(inst: Instruction, root: Instruction) -> Sequence[Instruction]:
    """The operands of group member ``inst`` that a group rooted at ``root`` may absorb."""
    if inst is root and inst.opcode == DUS:
        return inst.operands[1:2]
    return inst.operands


def update_key(inst: Instruction) -> tuple:
    """Equal for in-place updates at the same position over the same iteration space: start
    indices that compute the same value (each cache write's copy of the position arithmetic,
    which cse after fuse-elementwise merges), the same update dims, the same stream."""
    memo: dict[int, tuple] = {}
    return (tuple(value_key(s, memo) for s in inst.operands[2:]), inst.operands[1].shape.dims, inst.stream_id)


def value_key(inst: Instruction, memo: dict[int, tuple], depth: int = 0) -> tuple:
    """Equal for instructions that compute the same value by the same expression (parameters and,
    past a depth of 16, other values by identity)."""
    key = memo.get(id(inst))
    if key is None:
        if inst.opcode == "parameter" or depth > 16:
            key = ("id", id(inst))
        else:
            op, shape, _, attrs, sharding, stream = instruction_key(inst)
            key = (op, shape, tuple(value_key(o, memo, depth + 1) for o in inst.operands), attrs, sharding, stream)
        memo[id(inst)] = key
    return key


class UpdateSiblings:
    """Which dynamic-update-slice keys have a member whose group would fuse on its own.

    Computed once, on the entry before any group is taken (a prediction: later groups only
    shrink what a group can absorb, so a sibling counted here might end unfused; its partner is
    then a fusion of one kernel, as the unfused update was).
    """

    def __init__(self, comp: Computation, users: dict, taken: set[int], min_kernels: int) -> None:
        from spmd.passes.fuse_elementwise import _grow

        self.fusing: set[tuple] = set()
        for inst in comp.instructions:
            if is_update_root(inst) and id(inst) not in taken and _grow(inst, users, taken).kernels >= min_kernels:
                self.fusing.add(update_key(inst))


def dus_sibling_fuses(group, siblings: UpdateSiblings) -> bool:
    """A dynamic-update-slice group with a producer whose sibling update fuses (see the module docstring)."""
    root = group.root
    return is_update_root(root) and len(group.members) > 1 and update_key(root) in siblings.fusing


def update_roots(body: Computation) -> list[Instruction] | None:
    """The dynamic-update-slice outputs of a fused computation (its root, or every element of a
    ``tuple`` root), or None where any output is something else."""
    root = body.root
    outs = list(root.operands) if root.opcode == "tuple" else [root]
    return outs if all(o.opcode == DUS for o in outs) else None


def absorb_reshape_siblings(module, comp: Computation) -> int:
    """Give update fusions' siblings the update's iteration space; the number of fusions rewritten.

    A loop fusion whose only user is a reshape to the dims of an in-place update of a fusion it
    shares an operand with (the rotary embedding of q, [B, H, 1, 2, D/2] reshaped to [B, H, 1, D],
    beside the k / v cache write over [B, KV, 1, D] with KV = H) computes the reshaped value itself
    (the reshape was a view: the bytes are the same), so that multi-output-fusion can merge it into
    the update's kernel, whose loop then runs over one index space for all its stores.
    """
    from spmd.ir.builder import Builder
    from spmd.passes.fuse_elementwise import CHEAP_OPCODES, absorb_user

    spaces: dict[tuple, set[int]] = {}
    for f in comp.instructions:
        roots = update_roots(f.attrs["calls"]) if _is_array_loop_fusion(f) else None
        if roots is not None:
            key = (roots[0].operands[1].shape.dims, f.stream_id)
            spaces.setdefault(key, set()).update(id(o) for o in f.operands
                                                 if o.opcode not in CHEAP_OPCODES and o.shape.numel > 1)
    if not spaces:
        return 0
    users, root = comp.users(), comp.root
    outputs = {id(root), *(id(o) for o in root.operands)} if root.opcode == "tuple" else {id(root)}
    builder, done = Builder(module, comp), 0
    for f in list(comp.instructions):
        if not _is_array_loop_fusion(f) or update_roots(f.attrs["calls"]) is not None or id(f) in outputs:
            continue
        (r, *rest) = users.get(f) or [None]
        if r is None or rest or r.opcode != "reshape" or r.stream_id != f.stream_id:
            continue
        shared = spaces.get((r.shape.dims, f.stream_id), set())
        if any(id(o) in shared for o in f.operands):
            absorb_user(module, builder, comp, f, r)
            users = comp.users()
            done += 1
    return done


def _is_array_loop_fusion(f: Instruction) -> bool:
    return (f.opcode == "fusion" and f.attrs.get("kind") == "kLoop" and not f.shape.is_tuple
            and f.shape.numel > 0)
