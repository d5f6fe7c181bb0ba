"""``SPMD_PDL`` is parsed without Triton (``spmd.runtime.pdl_env``) and checked at compile time on any mesh."""

import re

import pytest

from spmd.runtime.pdl_env import pdl_mode


@pytest.mark.parametrize("value,expected", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("0", "0"), ("1", "1")])
def test_pdl_mode_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("SPMD_PDL", raising=False)
    else:
        monkeypatch.setenv("SPMD_PDL", value)
    assert pdl_mode() == expected


@pytest.mark.parametrize("value", ["2", "on", "true", " 1", "AUTO"])
def test_pdl_mode_rejects_other_values_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("SPMD_PDL", value)
    with pytest.raises(ValueError, match=re.escape(f"SPMD_PDL: expected one of ('auto', '0', '1'), got {value!r}")):
        pdl_mode()
