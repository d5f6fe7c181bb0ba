"""spmd.generation.placement: one placement of a model's parameters per mesh and shardings, while held and unchanged."""

import gc
import weakref

import torch

import spmd
from spmd import PartitionSpec as P
from spmd.generation.placement import place_params
from spmd.models.llama_lm import llama_lm


def _shardings(model, mesh, spec=None):
    spec = P() if spec is None else spec
    return {fqn: spmd.NamedSharding(mesh, spec) for fqn, _ in model.named_parameters()}


def test_placement_is_shared_while_held_and_the_parameters_are_unchanged():
    model = llama_lm(small=True, seed=2)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:2")
    first = place_params(model, _shardings(model, mesh))
    assert place_params(model, _shardings(model, mesh)) is first
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(first.arrays[fqn].to_torch(), p.detach(), rtol=0, atol=0)
    other_layout = place_params(model, _shardings(model, mesh, P("tp")))
    assert other_layout is not first
    other_model = llama_lm(small=True, seed=2)
    assert place_params(other_model, _shardings(other_model, mesh)) is not first


def test_an_updated_parameter_is_placed_again_and_the_old_copy_kept():
    model = llama_lm(small=True, seed=2)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    first = place_params(model, _shardings(model, mesh))
    name = "layers.0.mlp.up_proj.weight"
    old = first.arrays[name].to_torch()
    with torch.no_grad():
        model.get_parameter(name).mul_(-3.0)  # in place: a new _version
    second = place_params(model, _shardings(model, mesh))
    assert second is not first
    torch.testing.assert_close(second.arrays[name].to_torch(), model.get_parameter(name).detach(), rtol=0, atol=0)
    torch.testing.assert_close(first.arrays[name].to_torch(), old, rtol=0, atol=0)
    with torch.no_grad():
        model.get_parameter(name).data = torch.randn_like(old)  # new storage
    assert place_params(model, _shardings(model, mesh)) is not second


def test_placement_is_freed_with_its_last_holder():
    model = llama_lm(small=True, seed=2)
    mesh = spmd.Mesh.create(("tp",), devices="cpu:1")
    placed = place_params(model, _shardings(model, mesh))
    ref = weakref.ref(placed)
    del placed
    gc.collect()
    assert ref() is None
    assert place_params(model, _shardings(model, mesh)) is not None
