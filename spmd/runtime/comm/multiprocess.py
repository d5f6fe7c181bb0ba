"""Collectives over a mesh that spans processes: local devices in-process, other processes via ``torch.distributed``.

Each process drives ``pids`` (its partitions, ordered by (rank, local device)). For every
collective:

- replica groups whose members are all local run on the local communicator (the virtual-CPU or
  CUDA peer-copy/NCCL paths, one-shot all-reduces included), with partition ids renumbered to
  local indices;
- groups spanning processes are bucketed by the set of processes they touch (groups of one bucket
  run as one stacked ``torch.distributed`` call). all-reduce / reduce-scatter in ``gather`` mode
  (the default on the CPU, see ``reduce_mode``) all-gather the operands and add them in group
  order, bit-identical to one process; in ``reduce`` mode (the default on CUDA) they first reduce
  the local members, then reduce across processes: on one host one all-reduce (or
  ``reduce_scatter_tensor`` into a preallocated buffer when each process holds one member in group
  order; a one-shot all-reduce (``CollectiveSpec.algorithm``) of a sum on one host runs PyTorch's
  symmetric-memory one-shot kernel, ``spmd.runtime.comm.symmetric``, where it is available), across
  hosts hierarchically — intra-host all-reduce then inter-host all-reduce between
  processes of equal intra-host index (the 2-D all-reduce of Horovod / NCCL's tree-ring split).
  all-gather stacks the local members (zero-padded to the same count per process) and calls
  ``all_gather_into_tensor`` into a preallocated buffer;
- all-to-all and collective-permute pieces that cross processes go as one
  ``batch_isend_irecv``; local pieces are copied.

Sub-groups are created once per set of ranks (``new_group(use_local_synchronization=True)``: only
members call it), in program order, which is the same on every rank once the program fingerprint
check (``spmd.distributed.fingerprint``) has passed. Cross-process tensors live on the first
local device. Every cross-process call is bounded by the run's timeout; a failure becomes a
``DistributedTimeoutError`` naming the op, the program and the ranks that did not arrive
(``spmd.distributed.guard``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from spmd.distributed.guard import guarded, subgroup
from spmd.runtime.comm.base import chunk_index, reduce_stack
from spmd.runtime.comm.nan_reduce import run_nan_safe
from spmd.runtime.comm.symmetric import DTYPES as SYMM_DTYPES
from spmd.runtime.comm.symmetric import one_shot_sum, symm_mem_supported, symmetric_buffer
from spmd.runtime.thunks import CollectiveSpec

Tensor = torch.Tensor
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor). is deprecated",
                        category=FutureWarning)
REDUCE_ENV = "SPMD_DISTRIBUTED_REDUCE"
_OPS = {"add": dist.ReduceOp.SUM, "multiply": dist.ReduceOp.PRODUCT,
        "maximum": dist.ReduceOp.MAX, "minimum": dist.ReduceOp.MIN}


class MultiProcessCommunicator:
    """Collectives for this process's partitions of a multi-process mesh.

    Args:
      pids: this process's partition ids (ascending).
      process_ids: per partition id, the rank that drives it (``Mesh.process_ids``).
      local: the communicator of the local devices (local index == position in ``pids``).
      state: the ``spmd.distributed`` state (rank, hosts, store, timeout).
    The attribute ``program`` (set by the compiler) names the program in errors.
    """

    def __init__(self, pids: Sequence[int], process_ids: Sequence[int], local: Any, state: Any) -> None:
        self.pids = tuple(pids)
        self.local_index = {p: k for k, p in enumerate(self.pids)}
        self.proc = tuple(process_ids)
        self.local, self.state, self.program = local, state, "?"
        self.rank = state.info.rank
        self.comm_id = state.next_id("comm")
        self.reduce_mode = reduce_mode(local_is_cuda=bool(getattr(local, "devices", None)))
        self.calls = -1  # index of the running collective (the same on every rank: one program everywhere)
        self._symm: dict[tuple, tuple[Tensor, str]] = {}  # (procs, shape, dtype) -> symmetric buffer, group name
        self._symm_reason: str | None = None  # why symmetric memory cannot serve here ("" when it can)

    def run(self, spec: CollectiveSpec, inputs: Sequence[Tensor], stream_id: int, envs: Sequence[Any]) -> list[Tensor]:
        """Run ``spec``; ``inputs[k]`` is the operand of ``pids[k]``; returns one fresh tensor per local device."""
        if envs:
            for env in envs:
                torch.cuda.set_stream(env.streams[stream_id])
        self.calls += 1
        return run_nan_safe(spec, inputs, lambda sp, x: self._dispatch(sp, x, stream_id, envs))

    def _dispatch(self, spec: CollectiveSpec, x: list[Tensor], stream_id: int, envs: Sequence[Any]) -> list[Tensor]:
        out: list = [None] * len(x)
        if spec.kind in ("collective-permute", "all-to-all"):
            self._point_to_point(spec, x, out)
        elif spec.kind in ("all-gather", "all-reduce", "reduce-scatter"):
            self._grouped(spec, x, out, stream_id, envs)
        else:
            raise ValueError(f"collective kind: expected one of all-gather, reduce-scatter, all-reduce, all-to-all, "
                             f"collective-permute, got {spec.kind!r}")
        for k, t in enumerate(out):
            if t is None:  # not a member of any group: XLA leaves no defined value; zeros like the local paths
                out[k] = torch.zeros(spec.out_dims, dtype=spec.dtype, device=x[k].device)
        return out

    # ------------------------------------------------------------- grouped
    def _grouped(self, spec: CollectiveSpec, x: list[Tensor], out: list, stream_id: int, envs) -> None:
        local_groups, buckets = [], {}
        for g in spec.groups:
            procs = tuple(sorted({self.proc[p] for p in g}))
            if procs == (self.rank,):
                local_groups.append(tuple(self.local_index[p] for p in g))
            elif self.rank in procs:
                buckets.setdefault(procs, []).append(g)
        if local_groups:
            sub = dataclasses.replace(spec, groups=tuple(local_groups))
            for k, t in enumerate(self.local.run(sub, x, stream_id, envs)):
                if t is not None and any(k in g for g in local_groups):
                    out[k] = t
        for procs, groups in buckets.items():
            if spec.kind == "all-gather":
                self._gather(spec, x, out, procs, groups)
            else:
                self._reduce(spec, x, out, procs, groups)

    def _lead(self, x: list[Tensor]) -> torch.device:
        return x[0].device

    def _reduce(self, spec, x, out, procs, groups) -> None:
        if self.reduce_mode == "gather":
            for g, members in zip(groups, self._collect(x, procs, groups), strict=True):
                total = reduce_stack(members, spec.reduce_op)
                self._deliver(spec, x, out, g, total)
            return
        lead = self._lead(x)
        parts = [reduce_stack([x[self.local_index[p]].to(lead) for p in g if p in self.local_index], spec.reduce_op)
                 for g in groups]
        stacked = torch.stack(parts)
        if self._one_scatter(spec, procs, groups):
            chunks = self._reduce_scatter(spec, stacked, procs)
            for g, chunk in zip(groups, chunks, strict=True):
                p = next(p for p in g if p in self.local_index)
                out[self.local_index[p]] = chunk.to(x[self.local_index[p]].device)
            return
        one_shot = self._one_shot(spec, stacked, procs)
        if one_shot is None:
            self._all_reduce(spec, stacked, procs)
        else:
            stacked = one_shot
        for b, g in enumerate(groups):
            self._deliver(spec, x, out, g, stacked[b])

    def _one_shot(self, spec, stacked: Tensor, procs) -> Tensor | None:
        """``stacked`` summed over ``procs`` by the symmetric-memory one-shot kernel, or None where it does
        not apply (not a one-shot sum, several hosts, a dtype or device it does not serve). The buffer of
        each (procs, shape, dtype) is rendezvoused at its first use, which every rank of ``procs`` reaches
        in the same collective (one program everywhere)."""
        if spec.kind != "all-reduce" or spec.algorithm != "one-shot" or spec.reduce_op != "add":
            return None
        if stacked.dtype not in SYMM_DTYPES or not stacked.numel():
            return None
        if len({self.state.info.node_of_rank[r] for r in procs}) != 1:  # the kernel reads peers over NVLink
            return None
        if self._symm_reason is None:
            self._symm_reason = symm_mem_supported(stacked.device)
        if self._symm_reason:
            return None
        key = (procs, tuple(stacked.shape), stacked.dtype)
        if key not in self._symm:
            name = subgroup(self.state, procs).group_name
            try:
                with guarded(self, "symmetric-memory rendezvous", procs):
                    self._symm[key] = (symmetric_buffer(stacked.shape, stacked.dtype, stacked.device, name), name)
            except RuntimeError as e:  # unsupported here (every rank alike): the process-group all-reduce
                self._symm_reason = f"symmetric-memory set-up failed: {e}"
                warnings.warn(f"one-shot all-reduces run as process-group all-reduces: {self._symm_reason}",
                              stacklevel=2)
                return None
        with guarded(self, "all-reduce (one-shot)", procs):
            return one_shot_sum(*self._symm[key], stacked)

    def _deliver(self, spec, x, out, g, total: Tensor) -> None:
        """Give each local member of ``g`` the reduced ``total`` (all-reduce) or its chunk (reduce-scatter)."""
        for j, p in enumerate(g):
            k = self.local_index.get(p)
            if k is None:
                continue
            if spec.kind == "reduce-scatter":
                start, size = chunk_index(tuple(total.shape), spec.dim, len(g), j)
                piece = total.narrow(spec.dim, start, size)
            else:
                piece = total
            out[k] = piece.to(x[k].device, copy=True, memory_format=torch.contiguous_format)

    def _one_scatter(self, spec, procs, groups) -> bool:
        """Whether a reduce-scatter can be one ``reduce_scatter_tensor``: one group, one member per process in rank
        order, no host hierarchy."""
        if spec.kind != "reduce-scatter" or len(groups) != 1 or not _hosts_flat(self.state.info, procs):
            return False
        return [self.proc[p] for p in groups[0]] == list(procs)

    def _reduce_scatter(self, spec, stacked: Tensor, procs) -> list[Tensor]:
        total = stacked[0].movedim(spec.dim, 0).contiguous()
        n = len(procs)
        if total.shape[0] % n:
            raise ValueError(f"dim {spec.dim} of size {total.shape[0]} is not divisible into {n} equal chunks")
        buf = torch.empty((total.shape[0] // n, *total.shape[1:]), dtype=total.dtype, device=total.device)
        unsupported = False
        with guarded(self, "reduce-scatter", procs):
            try:
                dist.reduce_scatter_tensor(buf, total, op=_OPS[spec.reduce_op], group=subgroup(self.state, procs))
            except RuntimeError as e:  # gloo of older PyTorch: raised on every rank before any message
                if "support" not in str(e):
                    raise
                unsupported = True
        if unsupported:
            with guarded(self, "reduce-scatter (as all-reduce)", procs):
                dist.all_reduce(total, op=_OPS[spec.reduce_op], group=subgroup(self.state, procs))
            me = procs.index(self.rank)
            buf = total[me * buf.shape[0]:(me + 1) * buf.shape[0]]
        return [buf.movedim(0, spec.dim).contiguous()]

    def _all_reduce(self, spec, stacked: Tensor, procs) -> None:
        op = _OPS[spec.reduce_op]
        info = self.state.info
        if _hosts_flat(info, procs):
            with guarded(self, spec.kind, procs):
                dist.all_reduce(stacked, op=op, group=subgroup(self.state, procs))
            return
        intra, inter = _hierarchy(info, procs, self.rank)
        with guarded(self, f"{spec.kind} (intra-host)", intra):
            if len(intra) > 1:
                dist.all_reduce(stacked, op=op, group=subgroup(self.state, intra))
        with guarded(self, f"{spec.kind} (inter-host)", inter):
            dist.all_reduce(stacked, op=op, group=subgroup(self.state, inter))

    def _gather(self, spec, x, out, procs, groups) -> None:
        for g, members in zip(groups, self._collect(x, procs, groups), strict=True):
            total = torch.cat(members, dim=spec.dim)
            for p in g:
                k = self.local_index.get(p)
                if k is not None:
                    out[k] = total.to(x[k].device, copy=True)

    def _collect(self, x, procs, groups) -> list[list[Tensor]]:
        """Per group, every member's operand in group order (one ``all_gather_into_tensor`` per bucket)."""
        lead = self._lead(x)
        members = [{r: [p for p in g if self.proc[p] == r] for r in procs} for g in groups]
        width = max(len(m) for mg in members for m in mg.values())
        shape = tuple(x[0].shape)
        mine = torch.zeros((len(groups), width, *shape), dtype=x[0].dtype, device=lead)
        for b, mg in enumerate(members):
            for i, p in enumerate(mg[self.rank]):
                mine[b, i].copy_(x[self.local_index[p]])
        flat = torch.empty((len(procs) * len(groups), *mine.shape[1:]), dtype=mine.dtype, device=lead)
        with guarded(self, "all-gather", procs):
            dist.all_gather_into_tensor(flat, mine, group=subgroup(self.state, procs))
        everyone = flat.view(len(procs), *mine.shape)
        where = {r: i for i, r in enumerate(procs)}
        return [[everyone[where[self.proc[p]], b, mg[self.proc[p]].index(p)] for p in g]
                for b, (g, mg) in enumerate(zip(groups, members, strict=True))]

    # ------------------------------------------------------- point to point
    def _point_to_point(self, spec, x, out) -> None:
        """Every (source pid, target pid, piece) move: local ones copied, remote ones batched send/recv."""
        lead = self._lead(x)
        moves = _moves(spec, tuple(x[0].shape) if x else ())
        ops, recvs, peers = [], [], set()
        received: dict[tuple[int, int], list] = {}
        for tag, (src, dst, key, sl) in enumerate(moves):
            s_local, d_local = src in self.local_index, dst in self.local_index
            if s_local and d_local:
                received.setdefault((dst, key[0]), []).append((key, x[self.local_index[src]][sl].clone()))
            elif s_local:
                piece = x[self.local_index[src]][sl].to(lead).contiguous()
                ops.append(dist.P2POp(dist.isend, piece, self.proc[dst], tag=tag))
                peers.add(self.proc[dst])
            elif d_local:
                shape = _slice_shape(tuple(x[0].shape), sl)
                buf = torch.empty(shape, dtype=x[0].dtype, device=lead)
                ops.append(dist.P2POp(dist.irecv, buf, self.proc[src], tag=tag))
                recvs.append(((dst, key[0]), key, buf))
                peers.add(self.proc[src])
        if ops:
            with guarded(self, spec.kind, tuple(sorted(peers | {self.rank}))):
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
        for slot, key, buf in recvs:
            received.setdefault(slot, []).append((key, buf))
        for (dst, _), pieces in received.items():
            k = self.local_index[dst]
            pieces.sort(key=lambda kv: kv[0])
            if spec.kind == "collective-permute":
                out[k] = pieces[0][1].to(x[k].device, copy=True)
            else:
                out[k] = torch.cat([t.to(x[k].device) for _, t in pieces], dim=spec.concat_dim)


def reduce_mode(local_is_cuda: bool) -> str:
    """``$SPMD_DISTRIBUTED_REDUCE``: ``"gather"`` or ``"reduce"``; default ``"reduce"`` on CUDA, else ``"gather"``.

    ``gather``: all-reduce / reduce-scatter across processes all-gather the operands and add them in
    replica-group order, as the single-process runtime does: results are bit-identical to one
    process (n times the bytes of a ring; the right trade for the CPU and small groups).
    ``reduce``: reduce the local members, then ``torch.distributed`` reductions (hierarchical
    across hosts): bandwidth-optimal, results equal up to summation order.
    Raises ValueError for another value.
    """
    raw = os.environ.get(REDUCE_ENV, "")
    if raw and raw not in ("gather", "reduce"):
        raise ValueError(f"{REDUCE_ENV}: expected 'gather' or 'reduce', got {raw!r}")
    return raw or ("reduce" if local_is_cuda else "gather")


def _moves(spec: CollectiveSpec, dims: tuple[int, ...]) -> list[tuple[int, int, tuple, tuple]]:
    """(source pid, target pid, sort key (target slot, order), source slice) of every piece, in one global order."""
    full = tuple(slice(None) for _ in dims)
    if spec.kind == "collective-permute":
        return [(src, dst, (0, 0), full) for src, dst in spec.pairs]
    moves = []
    for g in spec.groups:
        n = len(g)
        for s, src in enumerate(g):
            for d, dst in enumerate(g):
                start, size = chunk_index(dims, spec.split_dim, n, d)
                sl = tuple(slice(start, start + size) if i == spec.split_dim else slice(None) for i in range(len(dims)))
                moves.append((src, dst, (0, s), sl))
    return moves


def _slice_shape(dims: tuple[int, ...], sl: tuple) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for n, s in zip(dims, sl, strict=True))


def _hosts_flat(info, procs) -> bool:
    """Whether ``procs`` need no hierarchy: one host, or hosts of unequal process counts (flat fallback)."""
    nodes = [info.node_of_rank[r] for r in procs]
    counts = {n: nodes.count(n) for n in nodes}
    return len(counts) == 1 or len(set(counts.values())) != 1 or max(counts.values()) == 1


def _hierarchy(info, procs, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(this rank's host peers in ``procs``, the ranks of equal intra-host index on every host)."""
    node = info.node_of_rank
    by_node: dict[int, list[int]] = {}
    for r in procs:
        by_node.setdefault(node[r], []).append(r)
    intra = tuple(by_node[node[rank]])
    position = intra.index(rank)
    inter = tuple(sorted(rs[position] for rs in by_node.values()))
    return intra, inter
