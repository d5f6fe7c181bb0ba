"""The compiler pipeline: runs the passes in order, keeps each stage's text, verifies, times.

Stages, in run order (the names ``Lowered.as_text`` accepts)::

    import → propagate-sharding → spmd-partition → simplify → cse → reduce-scatter-creator
           → all-reduce-reuse → sink-scale → windowed-einsum → merge-dots → fuse-attention → hoist-weights
           → split-batch → combine-collectives → fuse-elementwise → rematerialize → multi-output-fusion
           → select-all-reduce → assign-streams → async-collectives → schedule

followed by the ``assign-buffers`` analysis. hoist-weights splits off a *prologue* module
(values computed only from weights, run once per weight version: ``spmd.passes.hoist_weights``);
it is kept in ``PipelineResult.prologue`` (its text in ``prologue_text``, dumped as
``<dir>/<module>.<index>.hoist-weights.prologue.txt``). After each pass the module is
verified when ``CompileOptions.verify`` is on (tests and ``SPMD_VERIFY=1``),
the time spent is recorded in ``spmd.metrics`` (``pass.<name>``), and the
printed module is kept; ``CompileOptions.dump_dir`` (or ``SPMD_DUMP=dir``)
writes it to ``<dir>/<module>.<index>.<stage>.txt``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd import metrics
from spmd.ir.hlo import Module
from spmd.ir.text import print_module
from spmd.ir.verify import verify_module
from spmd.passes.combine_collectives import DEFAULT_BUCKET_SIZE_BYTES, check_bucket_size_bytes

# Weight of an all-gather feeding a dot when a windowed einsum may overlap it with the dot.
HIDDEN_GATHER_DISCOUNT = 0.1

STAGES = ("import", "propagate-sharding", "spmd-partition", "simplify", "cse", "reduce-scatter-creator",
          "all-reduce-reuse", "sink-scale", "windowed-einsum", "merge-dots", "fuse-attention", "hoist-weights",
          "split-batch", "combine-collectives", "fuse-elementwise", "rematerialize", "multi-output-fusion",
          "select-all-reduce", "assign-streams", "async-collectives", "schedule")


@dataclass(frozen=True)
class CompileOptions:
    """Options of one compilation (part of the compile-cache key).

    Attributes:
      windowed_einsum: "auto" (the cost model decides per dot), "on" (always
        decompose eligible all-gather→dot / dot→reduce-scatter pairs) or "off".
      bidirectional: force the bidirectional (True) or unidirectional (False)
        ring; None lets the cost model choose.
      num_compute_streams: extra compute streams for the partial dots of a
        windowed einsum (each partial dot runs on one of them, round-robin);
        None lets the cost model choose per site.
      cuda_graphs: capture the executable into CUDA graphs on GPU meshes; None
        = on where it helps (GPU meshes), False = always eager.
      merge_dots: merge small dots that share an operand into one dot on concatenated
        operands (``spmd.passes.merge_dots``; the stage then leaves the module as is when False).
      fuse_attention: rewrite dot -> scale -> softmax -> dot into one attention custom call
        (``spmd.passes.fuse_attention``).
      fused_attention_grad: in programs that take gradients, import
        ``F.scaled_dot_product_attention`` as fused forward / backward custom calls (flash /
        memory-efficient kernels, ``spmd.frontend.joint_attention``); False traces its math
        definition (dots and a softmax over the ``[..., Sq, Sk]`` scores) instead.
      fuse_elementwise: group chains of elementwise ops, reductions and norms into ``fusion``
        instructions, each run as one generated kernel on GPU (``spmd.passes.fuse_elementwise``).
      multi_output_fusion: merge loop fusions that read the same operand, or feed one another while
        their values are used elsewhere too, into one fusion with several outputs (one kernel: an
        optimizer's moment and parameter updates; ``spmd.passes.multi_output_fusion``).
      hoist_weights: compute values that depend only on weights (``spmd.jit``'s ``weight_argnums``,
        ``spmd.parallelize``'s parameters; merged weights, casts of weights) once per weight
        version instead of on every call (``spmd.passes.hoist_weights``; the runtime caches them
        on the devices, ``spmd.runtime.weight_cache``).
      split_batch_overlap: "auto" (the cost model decides), "on" or "off": run a row-separable
        tensor-parallel program as two interleaved batch halves so that one half's all-reduces run
        under the other half's GEMMs (``spmd.passes.split_batch``).
      remat: activation recomputation (``spmd.passes.rematerialize``): "none" (default), "selective"
        (recompute everything but matrix products, convolutions, gathers and communication at far
        uses: PyTorch's selective activation checkpointing) or "full" (dots too: activation
        checkpointing); recomputed values equal the kept ones, random values included.
      remat_max_copies: how many times remat may recompute one instruction (1: at most one extra
        forward, the cost of activation checkpointing; more copies lower the peak further for more
        compute).
      bucket_size_bytes: combine small independent all-reduces / reduce-scatters of one kind into
        one collective per bucket of at most this many bytes per device (``spmd.passes.
        combine_collectives``; like DDP's gradient buckets); 0 disables.
      async_collectives: run an all-gather / all-reduce / reduce-scatter that has a GEMM it does
        not depend on as an async start / done pair on the communication stream, so the schedule
        pass overlaps them (``spmd.passes.async_collectives``).
      small_all_reduce: "auto" (the cost model decides per program), "on" or "off": run all-reduces
        of at most ``small_all_reduce_max_bytes`` per device as a one-shot reduction (every device
        copies the group's operands into fixed staging buffers and reduces them locally) instead
        of the ring (``spmd.passes.select_all_reduce``).
      small_all_reduce_max_bytes: the size threshold of ``small_all_reduce`` (bytes per device).
      float32_partial_sums: a bf16 / f16 dot whose contracting dims are split over devices
        computes each device's partial product in float32, sums the partials in float32 (twice
        the all-reduce / reduce-scatter bytes) and rounds once, as one device's GEMM does (and
        adds a linear layer's bias before that rounding, as ATen's GEMM epilogue does); False
        sums 16-bit partials (XLA's and PyTorch async tensor parallelism's choice: half the
        bytes, each device's term rounded to 16 bits before the sum).
      dump_dir: write the HLO text after every stage there (also ``SPMD_DUMP``).
      verify: verify the module after every pass (also ``SPMD_VERIFY=1``).
    Raises:
      ValueError: for an unknown ``windowed_einsum``, ``split_batch_overlap``, ``remat`` or
        ``small_all_reduce`` mode, a negative ``small_all_reduce_max_bytes``, a
        ``num_compute_streams`` < 1, or a ``dump_dir`` that is an existing file (or lies under one).
      TypeError: ``bidirectional``, ``cuda_graphs``, ``verify``, ``merge_dots``,
        ``fuse_attention``, ``fused_attention_grad``, ``fuse_elementwise``, ``multi_output_fusion``,
        ``hoist_weights``, ``async_collectives`` or ``float32_partial_sums`` not a bool (or None where
        allowed); ``num_compute_streams``, ``bucket_size_bytes`` or ``small_all_reduce_max_bytes``
        not an int; ``dump_dir`` not a path.
        ValueError: a negative ``bucket_size_bytes``.
    """

    windowed_einsum: str = "auto"
    bidirectional: bool | None = None
    num_compute_streams: int | None = None
    cuda_graphs: bool | None = None
    merge_dots: bool = True
    fuse_attention: bool = True
    fused_attention_grad: bool = True
    fuse_elementwise: bool = True
    multi_output_fusion: bool = True
    hoist_weights: bool = True
    split_batch_overlap: str = "auto"
    remat: str = "none"
    remat_max_copies: int = 1
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    async_collectives: bool = True
    small_all_reduce: str = "auto"
    small_all_reduce_max_bytes: int = 512 * 1024
    float32_partial_sums: bool = True
    dump_dir: str | None = None
    verify: bool | None = None

    def __post_init__(self) -> None:
        if self.windowed_einsum not in ("auto", "on", "off"):
            raise ValueError(f"windowed_einsum must be 'auto', 'on' or 'off', got {self.windowed_einsum!r}")
        if self.remat not in ("none", "selective", "full"):
            raise ValueError(f"remat must be 'none', 'selective' or 'full', got {self.remat!r}")
        c = self.remat_max_copies
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"remat_max_copies must be an int >= 1, got {c!r}")
        if self.split_batch_overlap not in ("auto", "on", "off"):
            raise ValueError(f"split_batch_overlap must be 'auto', 'on' or 'off', got {self.split_batch_overlap!r}")
        if self.small_all_reduce not in ("auto", "on", "off"):
            raise ValueError(f"small_all_reduce must be 'auto', 'on' or 'off', got {self.small_all_reduce!r}")
        m = self.small_all_reduce_max_bytes
        if not isinstance(m, int) or isinstance(m, bool):
            raise TypeError(f"small_all_reduce_max_bytes must be an int (bytes), got {type_name(m)} {m!r}")
        if m < 0:
            raise ValueError(f"small_all_reduce_max_bytes must be >= 0 (bytes), got {m}")
        for name in ("bidirectional", "cuda_graphs", "verify"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, bool)):
                raise TypeError(f"{name} must be True, False or None, got {type_name(value)} {value!r}")
        for name in ("merge_dots", "fuse_attention", "fused_attention_grad", "fuse_elementwise",
                     "multi_output_fusion", "hoist_weights", "async_collectives", "float32_partial_sums"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {type_name(value)} {value!r}")
        check_bucket_size_bytes(self.bucket_size_bytes)
        n = self.num_compute_streams
        if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
            raise TypeError(f"num_compute_streams must be an int >= 1 or None, got {n!r}")
        if n is not None and n < 1:
            raise ValueError(f"num_compute_streams must be >= 1, got {n}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise TypeError(f"dump_dir must be a path (str or os.PathLike) or None, got {self.dump_dir!r}")
        if self.dump_dir is not None:
            check_dump_dir(Path(self.dump_dir), "dump_dir")

    @property
    def verify_enabled(self) -> bool:
        """``verify``, else ``SPMD_VERIFY``: ``1`` on, ``0``, empty or unset off.

        Raises ValueError naming ``SPMD_VERIFY`` for any other value (expected 0 or 1, got it).
        """
        if self.verify is not None:
            return self.verify
        flag = os.environ.get("SPMD_VERIFY", "") or "0"
        if flag not in ("0", "1"):
            raise ValueError(f"SPMD_VERIFY: expected one of ('0', '1'), got {flag!r}")
        return flag == "1"

    @property
    def dump_path(self) -> Path | None:
        """The dump directory (``dump_dir``, else ``SPMD_DUMP``), or None. Raises ValueError as ``check_dump_dir``."""
        if self.dump_dir:
            return check_dump_dir(Path(self.dump_dir), "dump_dir")
        d = os.environ.get("SPMD_DUMP")
        return check_dump_dir(Path(d), "SPMD_DUMP") if d else None


def type_name(value: object) -> str:
    """``value``'s type for error messages: ``str`` for builtins, else qualified (``numpy.bool``)."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_dump_dir(path: Path, what: str) -> Path:
    """``path`` if it is (or can be created as) a directory; returns it.

    Raises ValueError naming ``what`` when ``path`` or one of its parents is an existing
    non-directory (a file): the stage dumps could not be written there.
    """
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "" if p == path else f" (its parent {str(p)!r} is a file)"
                raise ValueError(f"{what}: expected a directory path, got {str(path)!r}, an existing file{where}")
            break
    return path


@dataclass
class PipelineResult:
    """The compiled module, its text after every stage, and time per pass (ms).

    ``prologue`` (with its text) is the module of the hoisted values, or None; ``hoisted`` names
    the main module's parameters it feeds (numbered after the original ones) and
    ``prologue_inputs`` the original parameter numbers it reads (its parameters, in order);
    the first ``prologue_weight_values`` hoisted values read weights, the others are constant-only.
    """

    module: Module
    stage_text: dict[str, str] = field(default_factory=dict)
    pass_ms: dict[str, float] = field(default_factory=dict)
    buffers: Any = None
    prologue: Module | None = None
    prologue_text: str | None = None
    hoisted: tuple[str, ...] = ()
    prologue_inputs: tuple[int, ...] = ()
    prologue_weight_values: int = 0


def build_passes(options: CompileOptions, process_ids: tuple[int, ...] = ()) -> list:
    """The pass objects for ``options``, in run order (``process_ids``: the mesh's, for select-all-reduce)."""
    from spmd.passes.all_reduce_reuse import AllReduceReuse
    from spmd.passes.assign_streams import AssignStreams
    from spmd.passes.async_collectives import AsyncCollectives
    from spmd.passes.combine_collectives import CombineCollectives
    from spmd.passes.cse import CSE
    from spmd.passes.fuse_attention import FuseAttention
    from spmd.passes.fuse_elementwise import FuseElementwise
    from spmd.passes.hoist_weights import HoistWeights
    from spmd.passes.merge_dots import MergeDots
    from spmd.passes.multi_output_fusion import MultiOutputFusion
    from spmd.passes.propagate_sharding import PropagateSharding
    from spmd.passes.reduce_scatter_creator import ReduceScatterCreator
    from spmd.passes.rematerialize import Rematerialize
    from spmd.passes.schedule import Schedule
    from spmd.passes.select_all_reduce import SelectAllReduce
    from spmd.passes.simplify import Simplify
    from spmd.passes.sink_scale import SinkScale
    from spmd.passes.split_batch import SplitBatch
    from spmd.passes.spmd_partition import SpmdPartition
    from spmd.passes.windowed_einsum import WindowedEinsum

    we_kwargs: dict[str, Any] = {"mode": options.windowed_einsum}
    if options.bidirectional is not None:
        we_kwargs["bidirectional"] = options.bidirectional
    streams_kwargs: dict[str, Any] = {"num_compute_streams": options.num_compute_streams}
    # A windowed einsum overlaps an operand all-gather with its dot, so such gathers cost little.
    discount = 1.0 if options.windowed_einsum == "off" else HIDDEN_GATHER_DISCOUNT
    return [
        PropagateSharding(dot_gather_discount=discount, float32_partial_sums=options.float32_partial_sums),
        SpmdPartition(dot_gather_discount=discount, float32_partial_sums=options.float32_partial_sums),
        Simplify(),
        CSE(),
        ReduceScatterCreator(),
        AllReduceReuse(),
        SinkScale(enabled=options.windowed_einsum != "off"),
        WindowedEinsum(**we_kwargs),
        MergeDots(enabled=options.merge_dots),
        FuseAttention(enabled=options.fuse_attention),
        HoistWeights(enabled=options.hoist_weights),
        SplitBatch(mode=options.split_batch_overlap),
        CombineCollectives(bucket_size_bytes=options.bucket_size_bytes),
        FuseElementwise(enabled=options.fuse_elementwise),
        Rematerialize(mode=options.remat, max_copies=options.remat_max_copies),
        MultiOutputFusion(enabled=options.multi_output_fusion and options.fuse_elementwise),
        SelectAllReduce(mode=options.small_all_reduce, max_bytes=options.small_all_reduce_max_bytes,
                        process_ids=tuple(process_ids), cuda_graphs=options.cuda_graphs is not False),
        AssignStreams(**streams_kwargs),
        AsyncCollectives(enabled=options.async_collectives),
        Schedule(),
    ]


def run_pipeline(module: Module, options: CompileOptions, passes: list | None = None,
                 weights: frozenset[int] = frozenset(), process_ids: tuple[int, ...] = ()) -> PipelineResult:
    """Run ``passes`` (default: ``build_passes(options, process_ids)``) over ``module``.

    ``weights``: parameter numbers of weights (not donated) the hoist-weights pass may hoist
    values of (its own ``weights`` field is used when this is empty).

    Raises:
      spmd.ir.verify.VerifyError: when verification is on and a pass produced
        an invalid module (the message names the pass).
    """
    passes = build_passes(options, process_ids) if passes is None else passes
    result = PipelineResult(module)
    verify = options.verify_enabled
    dump = options.dump_path
    _record(result, "import", module, dump, 0)
    if verify:
        verify_module(module)
    for index, p in enumerate(passes, start=1):
        start = time.perf_counter()
        if p.name == "hoist-weights":
            module = _hoist(result, dataclasses.replace(p, weights=frozenset(weights)) if weights else p, module,
                            dump, index)
        elif p.name == "merge-dots" and weights and options.hoist_weights:
            # a concatenation of weights is hoisted (once per weight version): no size threshold
            module = dataclasses.replace(p, weights=weights).run(module)
        elif p.name == "split-batch" and weights:
            module = dataclasses.replace(p, weights=frozenset(weights) | _hoisted(result, module)).run(module)
        else:
            module = p.run(module)
        elapsed = time.perf_counter() - start
        metrics.timer(f"pass.{p.name}").record(elapsed)
        result.pass_ms[p.name] = elapsed * 1e3
        if verify:
            try:
                verify_module(module)
                if p.name == "hoist-weights" and result.prologue is not None:
                    verify_module(result.prologue)
            except ValueError as e:
                raise type(e)(f"after pass {p.name}: {e}") from e
        _record(result, p.name, module, dump, index)
    result.module = module
    return result


def _hoist(result: PipelineResult, p: Any, module: Module, dump: Path | None, index: int) -> Module:
    """Run the hoist-weights pass; keep its prologue (and its text, dumped) in ``result``."""
    split = p.split(module)
    if split.prologue is not None:
        result.prologue, result.hoisted, result.prologue_inputs = split.prologue, split.hoisted, split.inputs
        result.prologue_weight_values = split.num_weight_values
        result.prologue_text = print_module(split.prologue)
        _write(dump, f"{module.name}.{index:02d}.{p.name}.prologue.txt", result.prologue_text)
    return split.main


def _hoisted(result: PipelineResult, module: Module) -> frozenset[int]:
    """Parameter numbers of the hoisted values (shared by every row of the batch, like weights)."""
    names = set(result.hoisted)
    return frozenset(p.attrs["parameter_number"] for p in module.entry.parameters if p.name in names)


def _record(result: PipelineResult, stage: str, module: Module, dump: Path | None, index: int) -> None:
    text = print_module(module)
    result.stage_text[stage] = text
    _write(dump, f"{module.name}.{index:02d}.{stage}.txt", text)


def _write(dump: Path | None, filename: str, text: str) -> None:
    if dump is not None:
        try:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / filename).write_text(text)
        except OSError as e:
            raise ValueError(f"dump_dir / SPMD_DUMP: cannot write the stage dumps to {str(dump)!r}: "
                             f"{e.strerror or e}") from e
