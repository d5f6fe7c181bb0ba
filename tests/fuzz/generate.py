"""Random test cases: a program of 1-12 ops plus mesh, shardings, options, donation and argument kinds.

``generate_case(draw, seed)`` makes every decision through ``draw`` (``tests.fuzz.draw``), so the
same function backs the hypothesis tests (which shrink) and the seeded sweep.

Features (``ALL_FEATURES``, ``default_features()``) switch parts of the generator on; ``KNOWN_OPEN`` names features
that hit a recorded, not yet fixed bug: the CI slice
leaves them out (``ci_features()``) until the fix lands, the sweep keeps them.
"""

from __future__ import annotations

import os

import torch

from tests.fuzz.builder import Builder
from tests.fuzz.case import Case
from tests.fuzz.draw import Draw
from tests.fuzz.ops import CORE_OPS, op_unary
from tests.fuzz.ops_fusion import FUSION_OPS
from tests.fuzz.ops_new import NEW_OPS

#: new_ops: the ops other branches are adding (UnsupportedOpError on main);
#: donation: donate_argnums in ~20% of programs; donate_unread: donation may include an argument
#: the program never reads; constraints: with_sharding_constraint on intermediates; threads: the
#: first call of ~10% of the programs without donation is made from 3 threads at once; fusions:
#: the skinny RMS-norm / SwiGLU products and product + activation pairs the lowering fuses.
ALL_FEATURES = frozenset({"new_ops", "donation", "donate_unread", "constraints", "threads", "fusions"})

#: Features excluded from the CI slice because of an open, recorded bug (feature -> finding).
KNOWN_OPEN: dict[str, str] = {}

MESHES_1D = (2, 1, 4, 3, 8, 6)
MESHES_2D = ((2, 2), (1, 2), (2, 1), (2, 3), (3, 2), (2, 4), (4, 2))
MAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.float16)
ARG_MODES = ("tensor", "put", "reshard", "auto")


def default_features() -> frozenset[str]:
    """ALL_FEATURES, less ``new_ops`` when SPMD_FUZZ_NEW_OPS=0."""
    if os.environ.get("SPMD_FUZZ_NEW_OPS", "1") == "0":
        return ALL_FEATURES - {"new_ops"}
    return ALL_FEATURES


def op_kinds() -> list[str]:
    """Every op kind the generator knows (for ``exclude_ops``)."""
    return [k for k, _, _ in CORE_OPS + NEW_OPS + FUSION_OPS]


def ci_features() -> frozenset[str]:
    """The features of the CI slice: the defaults less the KNOWN_OPEN ones."""
    return default_features() - set(KNOWN_OPEN)


def draw_mesh(d: Draw, device: str, cuda_devices: int) -> tuple[tuple[str, int], ...]:
    """((axis, size), ...): a 1-d or (35%) 2-d CPU mesh of 1-8 devices; on CUDA one axis of ``cuda_devices``."""
    if device == "cuda":
        return (("tp", cuda_devices),)
    if d.boolean(0.35):
        a, c = d.choice(MESHES_2D)
        return (("dp", a), ("tp", c))
    return ((d.choice(("tp", "x")), d.choice(MESHES_1D)),)


def generate_case(d: Draw, seed: int, *, device: str = "cpu", features: frozenset[str] | None = None,
                  max_ops: int = 12, cuda_devices: int = 1, exclude_ops: frozenset[str] = frozenset()) -> Case:
    """A random ``Case`` (every decision drawn from ``d``; input data seeded from ``seed``).

    ``exclude_ops``: op kinds (the names in ``CORE_OPS`` / ``NEW_OPS``) never drawn.
    """
    features = default_features() if features is None else features
    mesh_axes = draw_mesh(d, device, cuda_devices)
    b = Builder(d, seed, features, mesh_axes)
    dtype = d.choice(MAIN_DTYPES)
    for _ in range(d.integer(1, 3)):
        b.new_input(b.random_shape(), dtype)
    table = [op for op in CORE_OPS if op[0] != "constraint" or "constraints" in features]
    if "new_ops" in features:
        table += NEW_OPS
    if "fusions" in features:
        table += FUSION_OPS
    weighted = [(k, g) for k, g, w in table if k not in exclude_ops for _ in range(w)]
    d.count_at = len(d.choices)
    n_ops = d.integer(1, max_ops)
    tries = 0
    while len(b.ops) < n_ops and tries < 4 * n_ops:
        tries += 1
        d.mark()
        b.attempt(*d.choice(weighted))
    d.mark()
    for _ in range(20):  # at least one op (bounded: a draw sequence may reject every unary op)
        if b.ops or b.attempt("unary", op_unary):
            break
    if not b.ops:
        b.emit(f"{b.inputs[0].name}.sum()")  # a float input's sum: always small and finite
        b.ops.append("reduce")
    outputs = _draw_outputs(b)
    n_in = len(b.inputs)
    in_specs = tuple(None if d.boolean(0.15) else b.random_spec(i.shape) for i in b.inputs)
    out_specs = None
    if d.boolean(0.7):
        shapes = {v.name: v.shape for v in b.values}
        out_specs = tuple(b.random_spec(shapes[o]) for o in outputs)
    options = _draw_options(d)
    packed: tuple[str, ...] = ()
    if n_in > 1 and d.boolean(0.2):  # weights in one dict argument, as params pytrees are passed
        packed = tuple(x.name for x in b.inputs[1:] if d.boolean(0.7))
    n_pos = n_in - len(packed) + bool(packed)
    donate: tuple[int, ...] = ()
    if "donation" in features and d.boolean(0.25):
        read = {i for i, x in enumerate(b.inputs) if any(_reads(line, x.name) for line in b.lines)}
        ok = [any(k in read for k in range(n_in) if _position(b.inputs, packed, k) == pos) for pos in range(n_pos)]
        allowed = [pos for pos in range(n_pos) if "donate_unread" in features or ok[pos]]
        donate = tuple(pos for pos in allowed if d.boolean(0.6))
    modes = tuple(d.choice(ARG_MODES) for _ in range(n_in))
    pre = tuple(b.random_spec(i.shape) if m in ("reshard", "auto") else None for i, m in zip(b.inputs, modes))
    return Case(inputs=tuple(b.inputs), body=tuple(b.lines), outputs=outputs, ops=tuple(b.ops),
                mesh_axes=mesh_axes, device=device, in_specs=in_specs, out_specs=out_specs, options=options,
                donate=donate, arg_modes=modes, pre_specs=pre, features=frozenset(features), packed=packed,
                threads=3 if "threads" in features and not donate and d.boolean(0.1) else 1)


def _position(inputs, packed: tuple[str, ...], k: int) -> int:
    if inputs[k].name in packed:
        return len(inputs) - len(packed)
    return sum(1 for i in inputs[:k] if i.name not in packed)


def _reads(line: str, name: str) -> bool:
    import re

    return re.search(rf"\b{name}\b", line) is not None


def _draw_outputs(b: Builder) -> tuple[str, ...]:
    computed = [v.name for v in b.values if not v.name.startswith("x")]
    outs = [computed[-1]]
    # Extra outputs: mostly values nothing else reads (so little of the program is dead code).
    sinks = [n for n in computed[:-1] if not any(_reads(line.split("=", 1)[-1], n) for line in b.lines)]
    for _ in range(b.d.choice((0, 1, 2, 3))):
        pool = sinks if sinks and b.d.boolean(0.8) else computed
        other = pool[b.d.integer(0, len(pool) - 1)]
        if other not in outs:
            outs.append(other)
    if b.d.boolean(0.05):
        outs.append(b.inputs[b.d.integer(0, len(b.inputs) - 1)].name)
    return tuple(outs)


def _draw_options(d: Draw) -> tuple:
    opts = []
    we = d.choice(("auto", "on", "off"))
    if we != "auto":
        opts.append(("windowed_einsum", we))
    bidi = d.choice((None, True, False))
    if bidi is not None:
        opts.append(("bidirectional", bidi))
    streams = d.choice((None, 1, 2, 3))
    if streams is not None:
        opts.append(("num_compute_streams", streams))
    for name in ("merge_dots", "fuse_attention", "fuse_elementwise"):
        if d.boolean(0.3):
            opts.append((name, False))
    if d.boolean(0.3):
        opts.append(("verify", True))
    if d.boolean(0.2):
        opts.append(("cuda_graphs", False))
    return tuple(opts)
