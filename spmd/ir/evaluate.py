"""Reference interpreter for HLO-lite modules: the numerical oracle of the compiler's tests.

``evaluate(module, args)`` runs an unpartitioned module on one device.
``evaluate_spmd(module, per_device_args)`` runs a partitioned module on
``module.num_partitions`` virtual devices in lockstep: instruction by instruction, every
device's value is computed before the next instruction starts. Ordinary instructions run
through ``spmd.runtime.kernels.run_kernel``; collectives, ``partition-id`` and the async
start/done forms are implemented here with plain torch ops over the list of per-device values
(XLA operation semantics, https://openxla.org/xla/operation_semantics).

Value representation: an array value is a ``torch.Tensor``; a tuple value is a Python tuple.
``async-start`` holds ``((operands...), result)``; ``collective-permute-start`` and
``all-gather-start`` hold ``(operand, result)``; ``all-reduce-start`` holds the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.ir.hlo import Computation, Instruction, Module

Tensor = torch.Tensor

_REDUCERS = {
    "add": lambda vals: torch.stack(vals).sum(0),
    "maximum": lambda vals: torch.stack(vals).amax(0),
    "minimum": lambda vals: torch.stack(vals).amin(0),
    "multiply": lambda vals: torch.stack(vals).prod(0),
}


def evaluate(module: Module, args: Sequence[Tensor]) -> list[Tensor]:
    """Run an unpartitioned ``module`` on one device.

    Args:
      module: a module with ``is_partitioned == False``; ``Sharding`` custom calls are identity.
      args: one tensor per entry parameter, of the parameter's (global) shape and dtype.
    Returns:
      The root's value as a list: one tensor, or one per element of a tuple root.
    Raises:
      ValueError: ``module`` is partitioned, or ``args`` does not match the parameters.
    """
    if module.is_partitioned:
        raise ValueError(f"module {module.name!r} is partitioned; use evaluate_spmd")
    return [out[0] for out in _outputs(_run(module.entry, [list(args)], module))]


def evaluate_spmd(module: Module, per_device_args: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """Run a partitioned ``module`` on ``len(per_device_args)`` virtual devices in lockstep.

    Args:
      module: a partitioned module (shapes are per-device padded shard shapes).
      per_device_args: indexed by partition id, then parameter number; each tensor has the
        parameter's shard shape.
    Returns:
      ``out[i][d]``: output ``i`` (one, or one per tuple-root element) on device ``d``.
    Raises:
      ValueError: the number of devices is not ``module.num_partitions``, or the arguments do
        not match the parameters.
    """
    n = module.num_partitions
    if len(per_device_args) != n:
        raise ValueError(f"per_device_args: expected {n} devices (module.num_partitions), "
                         f"got {len(per_device_args)}")
    return _outputs(_run(module.entry, [list(a) for a in per_device_args], module))


def _outputs(root_values: list) -> list[list[Tensor]]:
    """Per-device root values -> per-output lists of per-device tensors."""
    if isinstance(root_values[0], tuple):
        return [[dev[i] for dev in root_values] for i in range(len(root_values[0]))]
    return [list(root_values)]


def _check_args(comp: Computation, args: list[list]) -> None:
    params = comp.parameters
    for dev, dev_args in enumerate(args):
        if len(dev_args) != len(params):
            raise ValueError(f"args of device {dev}: expected {len(params)} tensors for the "
                             f"parameters of %{comp.name}, got {len(dev_args)}")
        for p, a in zip(params, dev_args, strict=False):
            if isinstance(a, Tensor) and tuple(a.shape) != p.shape.dims:
                raise ValueError(f"argument for %{p.name}: expected shape {p.shape}, "
                                 f"got {tuple(a.shape)} {a.dtype}")


def _run(comp: Computation, args: list[list], module: Module) -> list:
    """Run ``comp`` on every device; ``args[d]`` are device d's parameter values.

    Returns the root value of every device.
    """
    _check_args(comp, args)
    n = len(args)
    env: dict[int, list] = {}
    for inst in comp.instructions:
        ops = [env[id(o)] for o in inst.operands]
        env[id(inst)] = _step(inst, ops, args, n, module)
    return env[id(comp.root)]


def _step(inst: Instruction, ops: list[list], args: list[list], n: int, module: Module) -> list:
    """Per-device values of ``inst`` given per-device operand values ``ops[k][d]``."""
    from spmd.runtime.kernels import run_kernel

    op = inst.opcode
    per_dev = [[o[d] for o in ops] for d in range(n)]
    if op == "parameter":
        return [args[d][inst.attrs["parameter_number"]] for d in range(n)]
    if op == "partition-id":
        return [torch.tensor(d, dtype=torch.uint32) for d in range(n)]
    if op == "tuple":
        return [tuple(v) for v in per_dev]
    if op == "get-tuple-element":
        return [v[0][inst.attrs["index"]] for v in per_dev]
    if op == "custom-call" and inst.attrs.get("custom_call_target") == "Sharding":
        return [v[0] for v in per_dev]
    if op in _COLLECTIVES:
        return _COLLECTIVES[op](inst, ops[0] if ops else [], n, module)
    if op in _ASYNC:
        return _ASYNC[op](inst, ops, n, module)
    if op == "fusion":
        return _run(inst.attrs["calls"], per_dev, module)
    return [run_kernel(inst, v) for v in per_dev]


# --------------------------------------------------------------------------- collectives
def _groups(inst: Instruction, n: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups of a collective; empty means one group of all devices."""
    groups = inst.attrs.get("replica_groups") or ((tuple(range(n))),)
    return tuple(tuple(g) for g in groups)


def _reducer(inst: Instruction):
    comp = inst.attrs.get("to_apply")
    kind = comp.root.opcode if comp is not None else "add"
    if kind not in _REDUCERS:
        raise NotImplementedError(f"%{inst.name}: to_apply root {kind!r} is not add/maximum/minimum/multiply")
    return _REDUCERS[kind]


def _all_gather(inst: Instruction, vals: list[Tensor], n: int, module: Module) -> list[Tensor]:
    dim = inst.attrs["dimensions"][0]
    out: list = [None] * n
    for g in _groups(inst, n):
        full = torch.cat([vals[d] for d in g], dim=dim)
        for d in g:
            out[d] = full
    return out


def _all_reduce(inst: Instruction, vals: list[Tensor], n: int, module: Module) -> list[Tensor]:
    reduce = _reducer(inst)
    out: list = [None] * n
    for g in _groups(inst, n):
        total = reduce([vals[d] for d in g]).to(vals[g[0]].dtype)
        for d in g:
            out[d] = total
    return out


def _reduce_scatter(inst: Instruction, vals: list[Tensor], n: int, module: Module) -> list[Tensor]:
    reduce = _reducer(inst)
    dim = inst.attrs["dimensions"][0]
    out: list = [None] * n
    for g in _groups(inst, n):
        total = reduce([vals[d] for d in g]).to(vals[g[0]].dtype)
        for k, piece in enumerate(torch.chunk(total, len(g), dim=dim)):
            out[g[k]] = piece.contiguous()
    return out


def _all_to_all(inst: Instruction, vals: list[Tensor], n: int, module: Module) -> list[Tensor]:
    split, concat = inst.attrs["split_dimension"], inst.attrs["concat_dimension"]
    out: list = [None] * n
    for g in _groups(inst, n):
        pieces = {d: torch.chunk(vals[d], len(g), dim=split) for d in g}
        for j, dst in enumerate(g):
            out[dst] = torch.cat([pieces[src][j] for src in g], dim=concat)
    return out


def _collective_permute(inst: Instruction, vals: list[Tensor], n: int, module: Module) -> list[Tensor]:
    out = [torch.zeros_like(v) for v in vals]
    for src, tgt in inst.attrs["source_target_pairs"]:
        out[tgt] = vals[src].clone()
    return out


_COLLECTIVES = {
    "all-gather": _all_gather,
    "all-reduce": _all_reduce,
    "reduce-scatter": _reduce_scatter,
    "all-to-all": _all_to_all,
    "collective-permute": _collective_permute,
}


# --------------------------------------------------------------------------- async forms
def _start_pair(fn):
    """``*-start`` whose value is ``(operand, result)``."""
    def start(inst: Instruction, ops: list[list], n: int, module: Module) -> list:
        res = fn(inst, ops[0], n, module)
        return [(ops[0][d], res[d]) for d in range(n)]
    return start


def _all_reduce_start(inst: Instruction, ops: list[list], n: int, module: Module) -> list:
    return _all_reduce(inst, ops[0], n, module)


def _done(inst: Instruction, ops: list[list], n: int, module: Module) -> list:
    vals = ops[0]
    return [v[1] if isinstance(v, tuple) else v for v in vals]


def _async_start(inst: Instruction, ops: list[list], n: int, module: Module) -> list:
    """Run the ``calls`` computation on every device (in lockstep) with the operands."""
    body = inst.attrs["calls"]
    per_dev_args = [[o[d] for o in ops] for d in range(n)]
    res = _run(body, per_dev_args, module)
    return [(tuple(per_dev_args[d]), res[d]) for d in range(n)]


_ASYNC = {
    "all-gather-start": _start_pair(_all_gather),
    "collective-permute-start": _start_pair(_collective_permute),
    "all-reduce-start": _all_reduce_start,
    "async-start": _async_start,
    "all-gather-done": _done,
    "collective-permute-done": _done,
    "all-reduce-done": _done,
    "async-done": _done,
}


def output_shardings(module: Module) -> list:
    """Global shardings of a partitioned module's outputs (one per tuple-root element).

    Raises ValueError when an output carries no sharding.
    """
    root = module.entry.root
    outs = root.operands if root.opcode == "tuple" else [root]
    for o in outs:
        if o.sharding is None:
            raise ValueError(f"output %{o.name} of module {module.name!r} has no sharding")
    return [o.sharding for o in outs]


def evaluate_sharded(module: Module, global_args: Sequence[Tensor],
                     out_dims: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """Run a partitioned ``module`` on global arguments and return global outputs.

    Shards each argument by its parameter's ``sharding`` (``shard_tensor``: padding rows are
    zero), runs ``evaluate_spmd`` and reassembles output ``i`` (global dims ``out_dims[i]``,
    e.g. from the unpartitioned module's root) from its per-device pieces with
    ``unshard_tensors`` and the output's global sharding (padding dropped).
    Raises ValueError when a parameter or output has no sharding, or counts do not match.
    """
    from spmd.ir.sharding import shard_tensor, unshard_tensors

    mesh = module.mesh
    params = module.entry.parameters
    if len(global_args) != len(params):
        raise ValueError(f"global_args: expected {len(params)} tensors, got {len(global_args)}")
    for p in params:
        if p.sharding is None:
            raise ValueError(f"parameter %{p.name} of module {module.name!r} has no sharding")
    shardings = output_shardings(module)
    if len(out_dims) != len(shardings):
        raise ValueError(f"out_dims: expected {len(shardings)} entries, got {len(out_dims)}")
    per_dev = [[shard_tensor(a, p.sharding, mesh, d) for a, p in zip(global_args, params, strict=False)]
               for d in range(mesh.num_devices)]
    outs = evaluate_spmd(module, per_dev)
    return [unshard_tensors(vals, s, mesh, tuple(dims))
            for vals, s, dims in zip(outs, shardings, out_dims, strict=True)]
