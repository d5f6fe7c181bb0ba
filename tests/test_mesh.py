import pickle

import pytest
import torch

from spmd.ir.sharding import MeshShape
from spmd.mesh import Mesh


def test_one_axis_takes_all_devices():
    mesh = Mesh.create(("tp",), devices="cpu:4")
    assert mesh.shape == MeshShape(("tp",), (4,))
    assert mesh.platform == "cpu" and mesh.kind == "cpu"
    assert mesh.device_ids == (0, 1, 2, 3)
    assert mesh.devices == (torch.device("cpu"),) * 4
    assert mesh.num_devices == 4
    assert repr(mesh) == "Mesh({'tp': 4}, devices=cpu:0-3)"


def test_dict_axes_row_major():
    mesh = Mesh.create({"dp": 2, "tp": 4}, devices="cpu:8")
    assert mesh.axis_names == ("dp", "tp")
    assert mesh.axis_sizes == (2, 4)
    assert mesh.axis_size("tp") == 4
    assert mesh.shape.coords(5) == {"dp": 1, "tp": 1}
    assert repr(mesh) == "Mesh({'dp': 2, 'tp': 4}, devices=cpu:0-7)"


def test_pairs_of_names_and_sizes():
    assert Mesh.create((("dp", 2), ("tp", 2)), devices="cpu:4") == Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")


def test_bare_cpu_and_string_axis():
    assert Mesh.create({"a": 2, "b": 3}, devices="cpu").num_devices == 6
    assert Mesh.create("x", devices="cpu").num_devices == 1
    assert repr(Mesh.create("x", devices="cpu")) == "Mesh({'x': 1}, devices=cpu:0)"


def test_device_list_of_cpu_devices():
    mesh = Mesh.create(("x",), devices=[torch.device("cpu")] * 3)
    assert mesh.device_ids == (0, 1, 2) and mesh.platform == "cpu"
    assert Mesh.create("x", devices=[torch.device("cpu", 1), torch.device("cpu", 0)]).device_ids == (0, 1)
    with pytest.raises(ValueError, match="distinct devices"):  # the same virtual device twice
        Mesh.create("x", devices=[torch.device("cpu", 0), torch.device("cpu", 0)])


def test_equality_and_hash_key_caches():
    a = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    b = Mesh.create({"dp": 2, "tp": 2}, devices="cpu:4")
    c = Mesh.create({"tp": 2, "dp": 2}, devices="cpu:4")
    d = Mesh.create({"x": 4}, devices="cpu:4")
    assert a == b and hash(a) == hash(b)
    assert a != c and a != d
    assert {a: 1}[b] == 1
    assert pickle.loads(pickle.dumps(a)) == a


def test_sizes_product_mismatch():
    msg = r"axes: sizes \{'dp': 2, 'tp': 3\} multiply to 6 devices, but devices gives 4"
    with pytest.raises(ValueError, match=msg):
        Mesh.create({"dp": 2, "tp": 3}, devices="cpu:4")


def test_several_axes_need_sizes():
    with pytest.raises(ValueError, match="pass a dict name -> size"):
        Mesh.create(("dp", "tp"), devices="cpu:4")


def test_duplicate_axis_names():
    with pytest.raises(ValueError, match=r"unique axis names.*\['x'\] repeated"):
        Mesh.create(("x", "x"), devices="cpu:4")
    with pytest.raises(ValueError, match=r"unique axis names.*\['x'\] repeated"):
        Mesh.create((("x", 2), ("x", 2)), devices="cpu:4")
    with pytest.raises(ValueError, match="must be unique"):
        Mesh(MeshShape(("x", "x"), (2, 2)), "cpu", (0, 1, 2, 3))


def test_mesh_larger_than_gpus_present():
    present = Mesh.local_devices_count("cuda")
    if present == 0:
        with pytest.raises(ValueError, match=r"devices: 'cuda:1' asks for 1 CUDA devices, but no CUDA device is"):
            Mesh.create("tp", devices="cuda:1")
        with pytest.raises(ValueError, match=r"no CUDA device is present; got \[0\]"):
            Mesh.create("tp", devices=[0])
        return
    with pytest.raises(ValueError, match=f"needs {present + 1} CUDA devices, but {present} are present"):
        Mesh.create("tp", devices=f"cuda:{present + 1}")
    with pytest.raises(ValueError, match=f"expected CUDA ordinals < {present}"):
        Mesh.create("tp", devices=[present])


def test_negative_cuda_ordinal_is_a_value_error():
    with pytest.raises(ValueError, match=r"devices: expected non-negative CUDA ordinals, got \[-1\]"):
        Mesh.create(("tp",), devices=[-1])
    with pytest.raises(ValueError, match=r"devices: expected non-negative CUDA ordinals, got \[0, -2\]"):
        Mesh.create({"tp": 2}, devices=[0, -2])


@pytest.mark.parametrize("bad", ["tpu:4", "cpu:0", "cpu:x", "cuda:-1", "cpu:\u00b2", "cpu:\u0663", "cpu: 2", "cpu:2\n"])
def test_bad_device_strings(bad):
    with pytest.raises(ValueError, match="devices: expected"):
        Mesh.create("tp", devices=bad)


def test_device_by_partition_id():
    mesh = Mesh.create(("tp",), devices="cpu:4")
    assert mesh.device(3) == torch.device("cpu")
    for bad in (4, -1):
        with pytest.raises(ValueError, match=f"partition_id: expected 0 <= partition_id < 4 .*, got {bad}"):
            mesh.device(bad)
    with pytest.raises(TypeError, match="partition_id: expected an int, got str '0'"):
        mesh.device("0")


def test_bad_types_and_sizes():
    with pytest.raises(TypeError, match="axes"):
        Mesh.create(4, devices="cpu:4")
    with pytest.raises(ValueError, match="sizes >= 1"):
        Mesh.create({"x": 0}, devices="cpu:4")
    with pytest.raises(ValueError, match="all 'cpu' or all 'cuda'"):
        Mesh.create("x", devices=[torch.device("cpu"), torch.device("meta")])
    with pytest.raises(ValueError, match="platform"):
        Mesh(MeshShape(("x",), (2,)), "tpu", (0, 1))
    with pytest.raises(ValueError, match="needs 2 devices, got 3"):
        Mesh(MeshShape(("x",), (2,)), "cpu", (0, 1, 2))


def test_repr_of_permuted_cuda_ids():
    mesh = Mesh(MeshShape(("x",), (4,)), "cuda", (0, 2, 1, 3))
    assert repr(mesh) == "Mesh({'x': 4}, devices=cuda:[0,2,1,3])"
    assert mesh.devices[1] == torch.device("cuda", 2)


def test_local_devices_count():
    assert Mesh.local_devices_count("cpu") >= 1
    assert Mesh.local_devices_count("cuda") == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    with pytest.raises(ValueError, match="platform"):
        Mesh.local_devices_count("tpu")


@pytest.mark.gpu
def test_cuda_mesh():
    mesh = Mesh.create("tp", devices="cuda")
    assert mesh.platform == "cuda"
    assert mesh.devices[0] == torch.device("cuda", 0)
    assert Mesh.create("tp", devices=[0]).device_ids == (0,)


def test_direct_constructor_checks_its_fields():
    shape = MeshShape(("tp",), (2,))
    with pytest.raises(TypeError, match=r"shape must be a .*MeshShape, got tuple \('tp',\); build meshes with "
                                        r"Mesh\.create"):
        Mesh(("tp",), "cpu", [0, 1])
    with pytest.raises(TypeError, match=r"device_ids must be a tuple of int device ordinals, got str '01'"):
        Mesh(shape, "cpu", "01")
    with pytest.raises(TypeError, match=r"device_ids must be .* got tuple \(0, '1'\)"):
        Mesh(shape, "cpu", (0, "1"))
    with pytest.raises(TypeError, match=r"platform must be one of \('cpu', 'cuda'\), got NoneType"):
        Mesh(shape, None, (0, 1))
    with pytest.raises(ValueError, match=r"needs 2 devices, got 3 device ids; build meshes with Mesh\.create"):
        Mesh(shape, "cpu", (0, 1, 2))
    made = Mesh(shape, "cpu", [0, 1])  # the fields themselves: a list of ids is kept as a tuple
    assert made == Mesh.create(("tp",), "cpu:2") and hash(made) == hash(Mesh.create(("tp",), "cpu:2"))
    assert made.device_ids == (0, 1)


@pytest.mark.parametrize("count", [str(10**30), "1000000000", "9" * 5000, "4097"],
                         ids=["10**30", "10**9", "5000-digits", "4097"])
def test_virtual_cpu_device_count_is_capped(count):
    """A count beyond ``MAX_CPU_DEVICES`` is a ValueError before anything is allocated (a huge one
    used to be an OverflowError, or gigabytes of device ids)."""
    from spmd.mesh import MAX_CPU_DEVICES

    with pytest.raises(ValueError, match=f"devices: expected at most {MAX_CPU_DEVICES} virtual CPU devices, got "):
        Mesh.create(("x",), devices=f"cpu:{count}")
    with pytest.raises(ValueError, match="got 1000000000 \\(devices='cpu'\\)"):
        Mesh.create({"x": 10**9}, devices="cpu")
    assert Mesh.create(("x",), devices="cpu:0008").num_devices == 8
