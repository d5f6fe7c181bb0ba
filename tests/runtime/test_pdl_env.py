"""``SPMD_PDL`` is parsed without Triton (``spmd.runtime.pdl_env``) and checked at compile time on any mesh."""

import re

import pytest

from spmd.runtime.pdl_env import pdl_flag


@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("0", False), ("1", True)])
def test_pdl_flag_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("SPMD_PDL", raising=False)
    else:
        monkeypatch.setenv("SPMD_PDL", value)
    assert pdl_flag() is expected


@pytest.mark.parametrize("value", ["2", "on", "true", " 1"])
def test_pdl_flag_rejects_other_values_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("SPMD_PDL", value)
    with pytest.raises(ValueError, match=re.escape(f"SPMD_PDL: expected one of ('0', '1'), got {value!r}")):
        pdl_flag()
