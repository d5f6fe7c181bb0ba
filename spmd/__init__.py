"""spmd: an SPMD compiler and runtime for PyTorch programs on many GPUs.

Write an ordinary PyTorch function, say how its inputs are sharded over a
device mesh, and run one compiled program on every device::

    import spmd
    from spmd import Mesh, PartitionSpec as P

    mesh = Mesh.create(("tp",), devices="cpu:4")
    f = spmd.jit(mlp, mesh=mesh, in_shardings=(P(), P(None, "tp"), P("tp", None)), out_shardings=P())
    y = f(x, w1, w2)          # a ShardedArray; y.to_torch() is the global value
"""

from spmd import distributed, metrics, train
from spmd.array import ShardedArray, device_put
from spmd.compiled import Compiled
from spmd.frontend.constraint import with_sharding_constraint
from spmd.generation import Generator, Sampling, generate
from spmd.jit import Jitted, Lowered, jit
from spmd.mesh import Mesh
from spmd.parallelize import parallelize
from spmd.passes.pipeline import CompileOptions
from spmd.sharding import NamedSharding, PartitionSpec
from spmd.trace import trace, tracing

__all__ = [
    "Compiled",
    "CompileOptions",
    "Generator",
    "Jitted",
    "Lowered",
    "Mesh",
    "NamedSharding",
    "PartitionSpec",
    "Sampling",
    "ShardedArray",
    "device_put",
    "distributed",
    "generate",
    "jit",
    "metrics",
    "parallelize",
    "trace",
    "tracing",
    "train",
    "with_sharding_constraint",
]
__version__ = "0.1.0"
