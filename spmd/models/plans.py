"""Tensor-parallel sharding plans: module-name patterns -> parallel styles -> PartitionSpecs.

A ``Plan`` is an ordered list of ``(pattern, style)`` rules over one mesh axis (``tp_axis``).
A pattern is matched segment by segment (split on ``.``) with ``fnmatch`` against module
names and parameter FQNs, so ``*`` stands for exactly one name segment:
``encoder.layer.*.output.dense`` matches ``encoder.layer.3.output.dense`` but not
``encoder.layer.3.attention.output.dense``. A segment may also be ``{a,b,c}`` (any of).
Every parameter takes the style of the first rule that matches it (or its module);
parameters no rule matches are replicated. ``resolve_plan`` turns a plan into
``{parameter FQN: PartitionSpec}`` and checks it against the module and the mesh.

Styles follow ``torch.distributed.tensor.parallel`` (ColwiseParallel, RowwiseParallel,
SequenceParallel) and the Megatron-LM split of Shoeybi et al., "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism" (2019): the first linear
of a block is split by output features (no communication), the second by input features
(its partial sums are reduced once per block).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from spmd.sharding import PartitionSpec

UNITS = ("features", "heads")  # what a style's split dim counts (ParallelStyle.unit)


@dataclass(frozen=True)
class ParallelStyle:
    """How the parameters of one module (or one parameter) are laid out over the tp axis.

    ``unit`` names what the split dim counts: ``"heads"`` means the dim is
    ``heads x head_dim`` (the head size comes from the nearest enclosing module, the split
    module included, with a ``head_dim`` attribute, or a ``num_heads`` / ``n_heads``
    attribute: see ``_head_dim``) and the head count must divide by the axis size; ``"features"``
    means the dim itself must divide by it. Raises ValueError for another ``unit``.
    """

    unit: str = "features"

    def __post_init__(self) -> None:
        if not isinstance(self.unit, str) or self.unit not in UNITS:
            raise ValueError(f"{type(self).__name__}: unit must be one of {UNITS}, got {self.unit!r}")

    def spec(self, leaf: str, ndim: int, axis: str) -> PartitionSpec:
        """The spec of a parameter named ``leaf`` (``weight``/``bias``/...) with ``ndim`` dims."""
        raise NotImplementedError

    def split_dim(self, leaf: str, ndim: int) -> int | None:
        """The dim this style splits for that parameter, or None."""
        spec = self.spec(leaf, ndim, "_")
        return next((d for d, e in enumerate(spec) if e is not None), None)


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """A Linear split by output features: weight [out, in] on dim 0, bias [out] on dim 0.

    Its input is replicated; its output is sharded on the last (feature) dim.
    """

    def spec(self, leaf: str, ndim: int, axis: str) -> PartitionSpec:
        return PartitionSpec(axis) if ndim >= 1 else PartitionSpec()


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """A Linear split by input features: weight [out, in] on dim 1, bias replicated.

    Its input is sharded on the last dim; its output is a partial sum, reduced by the compiler.
    """

    def spec(self, leaf: str, ndim: int, axis: str) -> PartitionSpec:
        return PartitionSpec(None, axis) if ndim == 2 else PartitionSpec()


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """A norm (LayerNorm / RMSNorm) whose input and output are split on ``seq_dim`` over tp.

    Its parameters are replicated. ``spmd.parallelize`` pins the activation layout with
    ``spmd.with_sharding_constraint`` on the module's input and output while tracing, so the
    compiler all-gathers the sequence before the next colwise linear and reduce-scatters the
    partial sums of the rowwise linear (Korthikanti et al., "Reducing Activation Recomputation
    in Large Transformer Models", 2022).
    """

    seq_dim: int = 1

    def spec(self, leaf: str, ndim: int, axis: str) -> PartitionSpec:
        return PartitionSpec()


@dataclass(frozen=True)
class Replicate(ParallelStyle):
    """Every parameter of the module is replicated on every device."""

    def spec(self, leaf: str, ndim: int, axis: str) -> PartitionSpec:
        return PartitionSpec()


@dataclass(frozen=True)
class Plan:
    """Ordered ``(pattern, style)`` rules over mesh axis ``tp_axis`` (first match wins).

    ``rules`` may be any sequence of pairs (kept as a tuple). Raises TypeError for ``rules`` not
    a sequence of ``(str pattern, ParallelStyle)`` pairs (a str is not one) or a non-str ``tp_axis``.
    """

    rules: tuple[tuple[str, ParallelStyle], ...]
    tp_axis: str = "tp"

    def __post_init__(self) -> None:
        if isinstance(self.rules, (str, bytes)) or not isinstance(self.rules, (tuple, list)):
            raise TypeError(f"rules: expected a sequence of (str pattern, ParallelStyle) pairs, "
                            f"got {type(self.rules).__name__} {self.rules!r}")
        if not isinstance(self.tp_axis, str):
            raise TypeError(f"tp_axis: expected a mesh axis name (str), got {type(self.tp_axis).__name__} "
                            f"{self.tp_axis!r}")
        object.__setattr__(self, "rules", tuple(self.rules))
        for rule in self.rules:
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)
                    and isinstance(rule[1], ParallelStyle)):
                raise TypeError(f"rules: expected (str pattern, ParallelStyle) pairs, got {rule!r}")


def _segment_match(name: str, pattern: str) -> bool:
    parts, pats = name.split("."), pattern.split(".")
    if len(parts) != len(pats):
        return False
    for part, pat in zip(parts, pats, strict=True):
        if pat.startswith("{") and pat.endswith("}"):
            if part not in pat[1:-1].split(","):
                return False
        elif not fnmatch.fnmatchcase(part, pat):
            return False
    return True


def _matching_rule(plan: Plan, fqn: str) -> tuple[int, str] | None:
    """(rule index, matched module-or-param name) of the first rule matching param ``fqn``."""
    module_name = fqn.rpartition(".")[0]
    for k, (pattern, _) in enumerate(plan.rules):
        if _segment_match(fqn, pattern):
            return k, fqn
        if module_name and _segment_match(module_name, pattern):
            return k, module_name
    return None


HEAD_COUNT_ATTRS = ("num_heads", "n_heads", "num_attention_heads", "n_head")
WIDTH_ATTRS = ("hidden_size", "embed_dim", "d_model", "n_embd", "dim")


def _head_dim(module: nn.Module, module_name: str, size: int) -> int | None:
    """The head size of the split dim (of ``size`` elements) of ``module_name``'s parameter.

    From the nearest module enclosing ``module_name`` (itself included) that says: its
    ``head_dim``; else its model width over its head count (``hidden_size`` / ``embed_dim`` /
    ``d_model`` / ``n_embd`` / ``dim`` over ``num_heads`` / ``n_heads`` /
    ``num_attention_heads`` / ``n_head``, as ``nn.MultiheadAttention`` and most attention
    modules define them); else ``size`` over its head count. None when no module says.
    """
    parts = module_name.split(".")
    for n in range(len(parts), -1, -1):
        try:
            owner = module.get_submodule(".".join(parts[:n]))
        except AttributeError:
            continue
        hd = getattr(owner, "head_dim", None)
        if isinstance(hd, int) and hd > 0:
            return hd
        heads = next((h for h in (getattr(owner, a, None) for a in HEAD_COUNT_ATTRS)
                      if isinstance(h, int) and h > 0), None)
        if heads is None:
            continue
        width = next((w for w in (getattr(owner, a, None) for a in WIDTH_ATTRS)
                      if isinstance(w, int) and w > 0 and w % heads == 0), None)
        if width is not None:
            return width // heads
        if size % heads == 0:
            return size // heads
    return None


def _mesh_axis_size(mesh, axis: str) -> int:
    shape = getattr(mesh, "shape", mesh)
    if not hasattr(shape, "axis_names"):
        raise TypeError(f"mesh: expected a spmd.Mesh or MeshShape, got {type(mesh).__name__}")
    if axis not in shape.axis_names:
        raise ValueError(f"plan tp_axis: mesh axis {axis!r} is not in the mesh (axes {shape.axis_names})")
    return shape.size(axis)


def _check_divisible(module, name, fqn, style, size, dim, axis, axis_size) -> None:
    if style.unit == "heads":
        hd = _head_dim(module, name, size)
        if hd is None:
            raise ValueError(
                f"{name}: style {type(style).__name__}(unit='heads') needs the head size: set a head_dim "
                f"attribute (or num_heads with hidden_size / embed_dim) on {name!r} or a module enclosing it; "
                f"none found (or use unit='features')")
        if size % hd:
            raise ValueError(f"{name}: dim {dim} of {fqn} has {size} elements, not a multiple of the head size "
                             f"{hd}; expected heads x head_dim")
        count, what = size // hd, "heads"
    else:
        count, what = size, "features"
    if count % axis_size:
        raise ValueError(
            f"{name}: {count} {what} (dim {dim} of {fqn}) are not divisible by mesh axis "
            f"{axis!r} of size {axis_size}; choose a tp size that divides {count}"
        )


def resolve_plan(module: nn.Module, mesh, plan: Plan) -> dict[str, PartitionSpec]:
    """Map every parameter FQN of ``module`` to its ``PartitionSpec`` under ``plan``.

    Args:
      module: the model; parameter FQNs are ``module.named_parameters()`` names.
      mesh: a ``spmd.Mesh`` (or ``MeshShape``) holding ``plan.tp_axis``.
      plan: the rules.
    Returns:
      {fqn: PartitionSpec}, one entry per parameter, in ``named_parameters`` order.
    Raises:
      ValueError: ``plan.tp_axis`` not in the mesh; a rule's pattern matches no parameter or
        module; a split dim (head count or feature count) not divisible by the axis size.
      TypeError: ``plan`` is not a Plan.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a spmd.models.plans.Plan, got {type(plan).__name__}")
    axis, axis_size = plan.tp_axis, _mesh_axis_size(mesh, plan.tp_axis)
    used = [False] * len(plan.rules)
    out: dict[str, PartitionSpec] = {}
    for fqn, p in module.named_parameters():
        hit = _matching_rule(plan, fqn)
        if hit is None:
            out[fqn] = PartitionSpec()
            continue
        k, name = hit
        used[k] = True
        style = plan.rules[k][1]
        leaf = fqn.rpartition(".")[2]
        dim = style.split_dim(leaf, p.ndim)
        if dim is not None:
            _check_divisible(module, fqn.rpartition(".")[0], fqn, style, p.shape[dim], dim, axis, axis_size)
        out[fqn] = style.spec(leaf, p.ndim, axis)
    unused = [plan.rules[k][0] for k, u in enumerate(used) if not u]
    if unused:
        raise ValueError(f"plan: pattern(s) {unused} match no parameter or module of {type(module).__name__}")
    return out


def activation_layouts(module: nn.Module, plan: Plan) -> list[tuple[str, int | None, int | None]]:
    """Activation dims to split over tp, as (module name, input dim or None, output dim or None).

    Empty unless the plan has a ``SequenceParallel`` rule. Then (Megatron sequence parallelism,
    as torch's styles with ``output_layouts``): a ``SequenceParallel`` module has its input and
    output split on ``seq_dim``; a ``ColwiseParallel`` module its output on the last dim; a
    ``RowwiseParallel`` module its output on ``seq_dim`` (its partial sums are reduce-scattered).
    Modules are those whose own name a rule matches first. Dims may be negative.
    """
    sp = [style for _, style in plan.rules if isinstance(style, SequenceParallel)]
    if not sp:
        return []
    seq = sp[0].seq_dim
    out = []
    for name, _ in module.named_modules():
        style = next((st for pattern, st in plan.rules if name and _segment_match(name, pattern)), None)
        if isinstance(style, SequenceParallel):
            out.append((name, style.seq_dim, style.seq_dim))
        elif isinstance(style, ColwiseParallel):
            out.append((name, None, -1))
        elif isinstance(style, RowwiseParallel):
            out.append((name, None, seq))
    return out


def bert_plan(tp_axis: str = "tp") -> Plan:
    """Megatron split of a BERT encoder (``spmd.models.bert`` / Hugging Face names).

    Q/K/V colwise by heads, attention output rowwise by heads, FFN intermediate colwise,
    FFN output rowwise; embeddings and LayerNorms replicated.
    """
    layer = "encoder.layer.*"
    return Plan((
        (f"{layer}.attention.self.{{query,key,value}}", ColwiseParallel(unit="heads")),
        (f"{layer}.attention.output.dense", RowwiseParallel(unit="heads")),
        (f"{layer}.intermediate.dense", ColwiseParallel()),
        (f"{layer}.output.dense", RowwiseParallel()),
        ("embeddings.*", Replicate()),
    ), tp_axis)


def gpt_plan(tp_axis: str = "tp", sequence_parallel: bool = False) -> Plan:
    """Megatron split of ``spmd.models.gpt`` layers; norms are ``SequenceParallel`` if asked."""
    rules = [
        ("layers.*.attn.{q_proj,k_proj,v_proj}", ColwiseParallel(unit="heads")),
        ("layers.*.attn.out_proj", RowwiseParallel(unit="heads")),
        ("layers.*.mlp.fc_in", ColwiseParallel()),
        ("layers.*.mlp.fc_out", RowwiseParallel()),
    ]
    if sequence_parallel:
        rules.append(("layers.*.{ln_1,ln_2}", SequenceParallel()))
    return Plan(tuple(rules), tp_axis)


def llama_plan(tp_axis: str = "tp", sequence_parallel: bool = False) -> Plan:
    """Megatron split of ``spmd.models.llama`` layers.

    K/V projections are split by key/value heads, so ``num_kv_heads`` must divide by the tp
    size (GQA); gate/up colwise, down rowwise.
    """
    rules = [
        ("layers.*.self_attn.{q_proj,k_proj,v_proj}", ColwiseParallel(unit="heads")),
        ("layers.*.self_attn.o_proj", RowwiseParallel(unit="heads")),
        ("layers.*.mlp.{gate_proj,up_proj}", ColwiseParallel()),
        ("layers.*.mlp.down_proj", RowwiseParallel()),
    ]
    if sequence_parallel:
        rules.append(("layers.*.{input_layernorm,post_attention_layernorm}", SequenceParallel()))
    return Plan(tuple(rules), tp_axis)


def llama_lm_plan(num_kv_heads: int, tp_size: int, tp_axis: str = "tp") -> Plan:
    """Megatron split of ``spmd.models.llama_lm.LlamaForCausalLM``.

    Q colwise by heads, O rowwise; K/V colwise by key/value heads when ``num_kv_heads`` divides
    by ``tp_size``, else replicated (every device computes all K/V heads, as when tp exceeds
    the KV head count of a GQA model); gate/up colwise, down rowwise; the LM head colwise over
    the vocabulary; the embedding and norms replicated.
    """
    kv_style = ColwiseParallel(unit="heads") if num_kv_heads % tp_size == 0 else Replicate()
    return Plan((
        ("layers.*.self_attn.q_proj", ColwiseParallel(unit="heads")),
        ("layers.*.self_attn.{k_proj,v_proj}", kv_style),
        ("layers.*.self_attn.o_proj", RowwiseParallel(unit="heads")),
        ("layers.*.mlp.{gate_proj,up_proj}", ColwiseParallel()),
        ("layers.*.mlp.down_proj", RowwiseParallel()),
        ("lm_head", ColwiseParallel()),
    ), tp_axis)
