"""Layout of computed attention operands: a fused q / k is stored [B, S, H, D] and read as a view.

Part of ``fuse-elementwise`` (``spmd.passes.fuse_elementwise`` calls ``attention_operand_layouts``
once its fusions exist). A Llama layer computes q and k by a rotary-embedding fusion from the
projection's [B, S, H * D] rows; the fusion's value is the [B, H, S, D] operand of the attention
call, stored row-major, and the attention kernels give their output the memory order of q. The
output's transpose back to [B, S, H, D] and reshape to [B, S, H * D] then copy the whole
activation once per layer (a strided copy kernel: about 108 µs a layer for Llama-2-7B shapes at
4 × 2048 on an H200, slower than the attention's own reads).

XLA's layout assignment (xla/service/layout_assignment.cc) would give the fusion a {B, S, H, D}
physical layout. spmd's values are row-major, so the same effect is had by rewriting

    %q = bf16[B,H,S,D] fusion(...), calls=%c
    %a = bf16[B,H,S,D] custom-call(%q, %k, %v), custom_call_target="attention"

into a fusion whose computation ends in the transpose to [B, S, H, D] (the generated kernel
writes that order), followed by the transpose back, which ``spmd.passes.views`` runs as a view::

    %q = bf16[B,S,H,D] fusion(...), calls=%c'     (root: transpose(root of %c), dimensions={0,2,1,3})
    %q.t = bf16[B,H,S,D] transpose(%q), dimensions={0,2,1,3}
    %a = bf16[B,H,S,D] custom-call(%q.t, %k, %v), custom_call_target="attention"

The attention output then has [B, S, H, D] memory and ``spmd.runtime.aliasing.layout_views``
runs its reshape as a view (no copy). k gets the same layout when it is a fusion too, so that the
q and k rotary fusions keep equal dims and ``multi-output-fusion`` still merges them into one
kernel. Rewritten only where the transpose back would copy (H > 1 and S > 1: a decode step's
[B, H, 1, D] transposes as a view already) and where the fusion's only user is the attention
call (another reader would see the new layout through a transpose of its own). Values are
unchanged: only the memory order of the fusion's result differs.
"""

from __future__ import annotations

from spmd.ir.builder import Builder
from spmd.ir.hlo import Computation, Instruction, Module, Shape
from spmd.passes.fuse_update_slice import is_update_root
from spmd.passes.simplify import output_ids

#: Attention custom-call targets whose output follows q's memory order (inference attention).
_TARGETS = frozenset({"attention"})
_PERM = (0, 2, 1, 3)  # [B, H, S, D] <-> [B, S, H, D]; its own inverse


def attention_operand_layouts(module: Module, builder: Builder, comp: Computation) -> int:
    """Rewrite the q / k loop fusions of ``comp``'s attention calls to [B, S, H, D] (module
    docstring); returns how many fusions were rewritten. ``comp`` is changed in place."""
    from spmd.passes.fuse_elementwise import absorb_user  # that module calls this function

    done = 0
    for call in [i for i in comp.instructions if _is_attention(i)]:
        for index in (0, 1):  # q, then k
            users, outputs = comp.users(), output_ids(comp)
            f = call.operands[index]
            if not _rewritable(f, call, users, outputs) or is_update_root(f.attrs["calls"].root):
                continue
            b, h, s, d = f.shape.dims
            with builder.insert_before(call):
                to_bshd = builder.add("transpose", [f], {"dimensions": _PERM},
                                      shape=Shape(f.shape.dtype, (b, s, h, d)), name=f"{f.name}.bshd",
                                      sharding=f.sharding, stream_id=f.stream_id)
                back = builder.add("transpose", [to_bshd], {"dimensions": _PERM}, shape=f.shape,
                                   name=f"{f.name}.t", sharding=f.sharding, stream_id=f.stream_id)
            call.operands = [back if k == index else o for k, o in enumerate(call.operands)]
            absorb_user(module, builder, comp, f, to_bshd)
            done += 1
    return done


def _is_attention(inst: Instruction) -> bool:
    if inst.opcode != "custom-call" or inst.attrs.get("custom_call_target") not in _TARGETS:
        return False
    dims = inst.shape.dims if not inst.shape.is_tuple else ()
    return len(dims) == 4 and dims[1] > 1 and dims[2] > 1


def _rewritable(f: Instruction, call: Instruction, users: dict, outputs: set[int]) -> bool:
    """A non-tuple kLoop fusion of rank 4 with S > 1 whose only user is ``call`` (once)."""
    return (f.opcode == "fusion" and not f.shape.is_tuple and len(f.shape.dims) == 4 and f.shape.dims[1] > 1
            and f.shape.dims[2] > 1 and f.attrs.get("kind", "kLoop") == "kLoop" and users.get(f) == [call]
            and id(f) not in outputs and f.stream_id == call.stream_id)
