"""Shared test set-up: GPU tests skip cleanly where CUDA is absent, and ``pytest -m gpu`` collects
with only torch and pytest installed.

Modules with GPU tests import no test-only package (expecttest, hypothesis, filecheck), directly
or through the test modules they import. Under a ``-m`` expression naming ``gpu``, a module that
does (CPU-only tests) is left out of collection when the package is missing, instead of stopping
collection with an ImportError.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

TEST_ONLY_PACKAGES = ("expecttest", "hypothesis", "filecheck")
_ROOT = Path(__file__).resolve().parent.parent
_IMPORT = re.compile(r"^(?:from|import)\s+([\w.]+)", re.MULTILINE)


def _missing_packages() -> frozenset[str]:
    return frozenset(p for p in TEST_ONLY_PACKAGES if not _importable(p))


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:
        return False


def _imports_missing(path: Path, missing: frozenset[str], seen: set[Path]) -> bool:
    """Whether ``path`` imports a package of ``missing``, directly or through modules under tests/."""
    if path in seen or not path.is_file():
        return False
    seen.add(path)
    names = _IMPORT.findall(path.read_text(encoding="utf-8", errors="replace"))
    if any(n.split(".")[0] in missing for n in names):
        return True
    local = [_ROOT.joinpath(*n.split(".")).with_suffix(".py") for n in names if n.startswith("tests.")]
    local += [path.parent / f"{n}.py" for n in names if "." not in n]  # helpers beside the module
    return any(_imports_missing(p, missing, seen) for p in local)


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if "gpu" not in (config.getoption("markexpr", "") or ""):
        return None
    missing = _missing_packages()
    if missing and _imports_missing(Path(collection_path), missing, set()):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.kwargs.get("count", 1)
        if n < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {n}"))
