"""XLA HLO sharding text <-> values.

``XlaSharding`` is the device-level sharding of XLA's ``HloSharding``
(xla/hlo/ir/hlo_sharding.h), in its text form (``HloSharding::ToString``):

  ``{replicated}``                               every device holds the whole value
  ``{maximal device=0}``                         one device holds it
  ``{devices=[2,1]0,1}``                         tiled: tile-assignment dims, then the
                                                 device of each tile, row-major
  ``{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}``
                                                 the last tile dim is a replication group
  ``{devices=[4,2]<=[8]}``                       iota device list 0..7
  ``{devices=[2,4]<=[4,2]T(1,0)}``               iota(8) reshaped to [4,2], transposed by
                                                 (1,0), then read as the [2,4] tile array

The iota forms are XLA's ``IotaTileAssignment``: devices
``iota(prod(r)).reshape(r).transpose(perm).reshape(tile_dims)``. Printing
uses the canonical iota form (no size-1 dims, dims adjacent through the
transpose merged, as XLA canonicalizes) whenever the device list is a
transposed iota, and the explicit list otherwise; so ``{devices=[2,1]0,1}``
parses to the same value as, and prints as, ``{devices=[2,1]<=[2]}``.

Extension for pending sums. XLA has no spelling for a partial value, so this
module extends XLA's subgroup syntax (``last_tile_dims={manual, replicated}``)
with a ``partial`` subgroup type: the trailing tile dims named in
``last_tile_dims={...}`` are, in order, a ``partial`` group (the devices of one
tile whose values must be summed) and a ``replicated`` group. For example a
rank-2 value that is a pending sum over ``tp=4``::

    {devices=[1,1,4]<=[4] last_tile_dims={partial}}

and on mesh ``{dp=2,tp=2}`` a rank-1 value, not split, partial over
``tp`` and replicated over ``dp``::

    {devices=[1,2,2]<=[2,2]T(1,0) last_tile_dims={partial, replicated}}

A lone trailing ``replicated`` group prints as XLA does, ``last_tile_dim_replicate``.

Conversion to ``TensorSharding`` (``from_xla_text``) needs the mesh: each tile
dim (and each subgroup dim) is matched to an ordered group of mesh axes whose
device order (partition ids are row-major over the mesh axes,
``MeshShape.coords``) reproduces the tile assignment. Mesh axes of size 1 are
never named by the result (they cannot be told apart from replication).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass

from spmd.ir.sharding import MeshShape, TensorSharding

SUBGROUP_TYPES = ("partial", "replicated")


@dataclass(frozen=True)
class XlaSharding:
    """One XLA array sharding.

    Fields:
      kind: ``"replicated"``, ``"maximal"`` or ``"tiled"``.
      device: the device of a maximal sharding (else None).
      tile_dims: tile-assignment dims of a tiled sharding (tensor dims, then
        the subgroup dims listed in ``last_tile_dims``).
      devices: the device of each tile, row-major over ``tile_dims``.
      last_tile_dims: subgroup types of the trailing tile dims, a subsequence
        of ``("partial", "replicated")``.

    Raises ValueError when the fields are inconsistent.
    """

    kind: str
    device: int | None = None
    tile_dims: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    last_tile_dims: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("replicated", "maximal", "tiled"):
            raise ValueError(f"kind: expected 'replicated', 'maximal' or 'tiled', got {self.kind!r}")
        if (self.kind == "maximal") != (self.device is not None):
            raise ValueError(f"device: expected a device exactly for a maximal sharding, got {self}")
        if self.kind != "tiled":
            if self.tile_dims or self.devices or self.last_tile_dims:
                raise ValueError(f"a {self.kind} sharding has no tile assignment, got {self}")
            return
        if math.prod(self.tile_dims) != len(self.devices) or not self.tile_dims:
            raise ValueError(f"tile dims {list(self.tile_dims)} need {math.prod(self.tile_dims)} devices, "
                             f"got {len(self.devices)}")
        if sorted(self.devices) != list(range(len(self.devices))):
            raise ValueError(f"devices: expected a permutation of 0..{len(self.devices) - 1}, got {list(self.devices)}")
        if tuple(t for t in SUBGROUP_TYPES if t in self.last_tile_dims) != self.last_tile_dims:
            raise ValueError(f"last_tile_dims: expected a subsequence of {SUBGROUP_TYPES}, got {self.last_tile_dims}")
        if len(self.last_tile_dims) > len(self.tile_dims):
            raise ValueError(f"last_tile_dims {self.last_tile_dims} name more dims than tile dims {self.tile_dims}")

    @staticmethod
    def replicated() -> XlaSharding:
        """``{replicated}``."""
        return XlaSharding("replicated")

    @staticmethod
    def maximal(device: int) -> XlaSharding:
        """``{maximal device=<device>}``."""
        return XlaSharding("maximal", device=device)

    @staticmethod
    def tiled(tile_dims, devices, last_tile_dims=()) -> XlaSharding:
        """A tiled sharding; ``devices`` row-major over ``tile_dims``. Raises ValueError if inconsistent."""
        return XlaSharding("tiled", None, tuple(tile_dims), tuple(devices), tuple(last_tile_dims))

    @property
    def last_tile_dim_replicate(self) -> bool:
        """True when a trailing tile dim is a replication group."""
        return "replicated" in self.last_tile_dims

    @property
    def tensor_rank(self) -> int:
        """Number of tensor dims a tiled sharding covers (tile dims less subgroup dims)."""
        return len(self.tile_dims) - len(self.last_tile_dims)

    @staticmethod
    def parse(text: str) -> XlaSharding:
        """Parse XLA sharding text (see the module docstring). Raises ValueError on bad text."""
        return _parse(text.strip())

    def __str__(self) -> str:
        if self.kind == "replicated":
            return "{replicated}"
        if self.kind == "maximal":
            return f"{{maximal device={self.device}}}"
        out = "{devices=[" + ",".join(map(str, self.tile_dims)) + "]" + _devices_text(self.devices)
        if self.last_tile_dims == ("replicated",):
            out += " last_tile_dim_replicate"
        elif self.last_tile_dims:
            out += " last_tile_dims={" + ", ".join(self.last_tile_dims) + "}"
        return out + "}"


# ------------------------------------------------------------------ parsing

_TILED = re.compile(
    r"devices=\[(?P<dims>[0-9,\s]+)\]\s*"
    r"(?:<=\[(?P<iota>[0-9,\s]+)\](?:\s*T\((?P<perm>[0-9,\s]+)\))?|(?P<list>[0-9][0-9,\s]*?))"
    r"(?P<rest>(?:\s+[a-z_]+(?:=\{[^}]*\})?)*)"
)
_METADATA = re.compile(r"\s*metadata=\{[^{}]*\}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> XlaSharding:
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"sharding text: expected '{{...}}', got {text!r}")
    body = _METADATA.sub("", text[1:-1]).strip()
    if body == "replicated":
        return XlaSharding.replicated()
    m = re.fullmatch(r"maximal\s+device=(\d+)", body)
    if m:
        return XlaSharding.maximal(int(m.group(1)))
    m = _TILED.fullmatch(body)
    if not m:
        raise ValueError(f"sharding text: expected {{replicated}}, {{maximal device=N}} or {{devices=[...]...}}, "
                         f"got {text!r}")
    dims = _ints(m.group("dims"))
    if m.group("iota") is not None:
        reshape = _ints(m.group("iota"))
        perm = _ints(m.group("perm")) if m.group("perm") else tuple(range(len(reshape)))
        if sorted(perm) != list(range(len(reshape))):
            raise ValueError(f"sharding text: T{perm} is not a permutation of {len(reshape)} dims in {text!r}")
        devices = _iota_devices(reshape, perm)
    else:
        devices = _ints(m.group("list"))
    return XlaSharding.tiled(dims, devices, _parse_suffix(m.group("rest"), text))


def _parse_suffix(rest: str, text: str) -> tuple[str, ...]:
    rest = rest.strip()
    if not rest:
        return ()
    if rest == "last_tile_dim_replicate":
        return ("replicated",)
    m = re.fullmatch(r"last_tile_dims=\{([a-z_,\s]*)\}", rest)
    if m:
        types = tuple(t.strip() for t in m.group(1).split(","))
        if all(t in SUBGROUP_TYPES for t in types):
            return types
    raise ValueError(f"sharding text: unsupported suffix {rest!r} in {text!r}; expected "
                     f"last_tile_dim_replicate or last_tile_dims={{partial, replicated}}")


def _iota_devices(reshape: tuple[int, ...], perm: tuple[int, ...]) -> tuple[int, ...]:
    """``iota(prod(reshape)).reshape(reshape).transpose(perm).flatten()``."""
    strides = [math.prod(reshape[i + 1:]) for i in range(len(reshape))]
    out_sizes = [reshape[p] for p in perm]
    out_strides = [strides[p] for p in perm]
    grid = itertools.product(*(range(n) for n in out_sizes))
    return tuple(sum(i * s for i, s in zip(idx, out_strides, strict=True)) for idx in grid)


def _iota_form(devices: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Canonical (reshape dims, perm) when ``devices`` is a transposed iota, else None.

    Canonical as XLA's ``IotaTileAssignment``: no size-1 dims, and dims that
    stay adjacent through the transpose are merged. Found by reading the list
    as a mixed-radix linear map, minor dim first.
    """
    n = len(devices)
    sizes, strides, block = [], [], 1  # output dims minor to major
    while block < n:
        stride = devices[block] - devices[0] if block < n else 0
        run = 1
        while block * (run + 1) <= n and devices[block * run] == devices[0] + run * stride:
            run += 1
        if run == 1 or n % (block * run):
            return None
        sizes.append(run)
        strides.append(stride)
        block *= run
    sizes.reverse()
    strides.reverse()
    if devices[0] != 0 or any(s <= 0 for s in strides):
        return None
    order = sorted(range(len(sizes)), key=lambda j: -strides[j])  # input dims, major first
    reshape = tuple(sizes[j] for j in order)
    if [strides[j] for j in order] != [math.prod(reshape[i + 1:]) for i in range(len(reshape))]:
        return None
    perm = tuple(order.index(j) for j in range(len(sizes)))
    if _iota_devices(reshape, perm) != devices:
        return None
    return reshape, perm


def _devices_text(devices: tuple[int, ...]) -> str:
    form = _iota_form(devices)
    if form is None:
        return ",".join(map(str, devices))
    reshape, perm = form
    if perm == tuple(range(len(perm))):
        return f"<=[{len(devices)}]"
    return "<=[" + ",".join(map(str, reshape)) + "]T(" + ",".join(map(str, perm)) + ")"


# -------------------------------------------------------- TensorSharding <->


def _device_order(mesh: MeshShape, axes: tuple[str, ...]) -> tuple[int, ...]:
    """Partition ids listed row-major over ``axes`` (major first; mesh axes left out must have size 1)."""
    sizes = [mesh.size(a) for a in axes]
    base = dict.fromkeys(mesh.axis_names, 0)
    grid = itertools.product(*(range(s) for s in sizes))
    return tuple(mesh.partition_id({**base, **dict(zip(axes, idx, strict=True))}) for idx in grid)


@functools.lru_cache(maxsize=4096)
def to_xla_text(ts: TensorSharding, mesh: MeshShape) -> str:
    """XLA sharding text of ``ts`` on ``mesh`` (iota form when possible).

    Tile dims are the tensor dims' split counts, then a ``partial`` group when
    ``ts`` has partial axes of size > 1, then a ``replicated`` group for the
    remaining axes when their product is > 1. Prints ``{replicated}`` when
    nothing is split or partial. Raises ValueError for an axis not in ``mesh``.
    """
    for a in ts.used_axes():
        mesh.size(a)  # raises for an unknown axis
    nontrivial = lambda axes: tuple(a for a in axes if mesh.size(a) > 1)  # noqa: E731
    dims = [nontrivial(d) for d in ts.dims]
    partial = nontrivial(ts.partial)
    rest = tuple(a for a in mesh.axis_names if a not in ts.used_axes() and mesh.size(a) > 1)
    if not partial and not any(dims):
        return "{replicated}"
    groups, types = list(dims), []
    if partial:
        groups.append(partial)
        types.append("partial")
    if rest:
        groups.append(rest)
        types.append("replicated")
    order = tuple(a for g in groups for a in g)
    tile_dims = [mesh.axes_size(g) for g in groups]
    return str(XlaSharding.tiled(tile_dims, _device_order(mesh, order), types))


@functools.lru_cache(maxsize=4096)
def from_xla_text(text: str, mesh: MeshShape, rank: int | None = None) -> TensorSharding:
    """``TensorSharding`` on ``mesh`` of XLA sharding ``text``.

    Args:
      text: XLA sharding text (see the module docstring).
      mesh: the mesh the device ids refer to (partition ids, row-major).
      rank: the tensor rank; needed for ``{replicated}``, checked otherwise.
    Raises:
      ValueError: maximal shardings; a device count other than the mesh's; a
        tile assignment no grouping of mesh axes reproduces; a rank mismatch
        or a missing rank for ``{replicated}``; malformed text.
    """
    xs = XlaSharding.parse(text)
    if xs.kind == "maximal":
        raise ValueError(f"sharding {text!r}: a maximal (single-device) sharding has no mesh-axis reading")
    if xs.kind == "replicated":
        if rank is None:
            raise ValueError(f"sharding {text!r}: rank is needed to read {{replicated}}, got rank=None")
        return TensorSharding.replicated(rank)
    if rank is not None and rank != xs.tensor_rank:
        raise ValueError(f"sharding {text!r}: covers {xs.tensor_rank} tensor dims, expected rank {rank}")
    if len(xs.devices) != mesh.num_devices:
        raise ValueError(f"sharding {text!r}: uses {len(xs.devices)} devices, expected the mesh's "
                         f"{mesh.num_devices} ({mesh})")
    axes = tuple(a for a in mesh.axis_names if mesh.size(a) > 1)
    for groups in _groupings(mesh, axes, xs.tile_dims):
        if _device_order(mesh, tuple(a for g in groups for a in g)) == xs.devices:
            dims = tuple(groups[: xs.tensor_rank])
            partial = groups[xs.tensor_rank] if "partial" in xs.last_tile_dims else ()
            return TensorSharding(dims, partial)
    raise ValueError(f"sharding {text!r}: its device order matches no assignment of the axes of mesh {mesh} "
                     f"to its tile dims {list(xs.tile_dims)}")


def _groupings(mesh: MeshShape, axes: tuple[str, ...], targets: tuple[int, ...]):
    """Every way to give each target size an ordered group of distinct ``axes`` with that product, using all."""
    if not targets:
        if not axes:
            yield []
        return
    for k in range(len(axes) + 1):
        for group in itertools.permutations(axes, k):
            if mesh.axes_size(group) != targets[0]:
                continue
            left = tuple(a for a in axes if a not in group)
            for tail in _groupings(mesh, left, targets[1:]):
                yield [tuple(group)] + tail
