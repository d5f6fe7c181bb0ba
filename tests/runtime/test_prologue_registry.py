"""The registry of weight prologues: which prologues are equal, and one shared entry per computation and mesh."""

from __future__ import annotations

import spmd
from spmd.ir.text import parse_module
from spmd.runtime.prologue_registry import SharedPrologue, prologue_key, shared_prologue


def _prologue(names=("wq", "wk", "c", "hoisted"), sharding="{devices=[2,1]<=[2]}", dims="1", literal="2.0",
              location=""):
    wq, wk, c, root = names
    return parse_module(f"""\
HloModule {c}.prologue, num_partitions=2, mesh={{tp=2}}, is_partitioned=true

ENTRY %main ({wq}: f32[8,6], {wk}: f32[8,6]) -> (f32[8,12]) {{
  %{wq} = f32[8,6] parameter(0), sharding={sharding}
  %{wk} = f32[8,6] parameter(1), sharding={sharding}
  %two = f32[] constant({literal}), stream_id=0
  %twob = f32[8,6] broadcast(%two), dimensions={{}}, stream_id=0
  %s = f32[8,6] multiply(%{wk}, %twob), stream_id=0
  %{c} = f32[8,12] concatenate(%{wq}, %s), dimensions={{{dims}}}, sharding={sharding}, stream_id=0{location}
  ROOT %{root} = (f32[8,12]) tuple(%{c}), stream_id=0
}}
""")


MESH = spmd.Mesh.create(("tp",), devices="cpu:2")


def test_prologues_differing_in_names_and_locations_are_equal():
    base = prologue_key(_prologue(), MESH)
    renamed = prologue_key(_prologue(("a.q", "b.k", "linear_4.concat", "hoisted.1"),
                                     location=', metadata={op_name="aten.linear.default" source_line=134}'),
                           MESH)
    assert base == renamed
    assert "%v0 = f32[8,6] parameter(0)" in base[0] and "HloModule prologue" in base[0]


def test_prologues_of_other_computations_shardings_or_meshes_differ():
    base = prologue_key(_prologue(), MESH)
    assert prologue_key(_prologue(literal="3.0"), MESH) != base
    assert prologue_key(_prologue(sharding="{replicated}"), MESH) != base
    assert prologue_key(_prologue(dims="0"), MESH) != base
    swapped = spmd.Mesh(MESH.shape, MESH.platform, tuple(reversed(MESH.device_ids)))
    assert prologue_key(_prologue(), swapped) != base  # the same computation on other devices


def test_equal_prologues_share_one_entry_while_held():
    built = []

    def build(module):
        built.append(module)
        return object()

    a = shared_prologue(_prologue(), MESH, build)
    b = shared_prologue(_prologue(("p", "q", "r", "t")), MESH, build)
    c = shared_prologue(_prologue(literal="5.0"), MESH, build)
    assert isinstance(a, SharedPrologue) and a is b and c is not a and len(built) == 2
    del a, b, c
    shared_prologue(_prologue(), MESH, build)  # nothing held it: built again
    assert len(built) == 3
