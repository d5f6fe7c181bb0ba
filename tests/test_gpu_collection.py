"""``pytest -m gpu`` collects with only torch and pytest installed (the GPU machines have no
expecttest, hypothesis or filecheck): run collection in a child whose imports of them fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKER = '''
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("expecttest", "hypothesis", "filecheck"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, _Block())
'''


def test_gpu_tests_collect_without_test_only_packages(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:hypothesispytest",
           "tests/runtime", "tests/passes"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tests/runtime/test_kernels_fusion_gpu.py::" in proc.stdout
    assert "error" not in proc.stdout.splitlines()[-1].lower()
