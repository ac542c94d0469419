"""Runs a tests/compile_*.py check (sm_90 builds of Triton kernels, no GPU needed) in a process without
TRITON_INTERPRET, with the installed triton or another one (OTHER_TRITONS)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SKIP_EXIT = 3  # the compile scripts' exit code for "this Triton cannot be driven this way"

# Other Tritons to compile with besides the installed one: folders, os.pathsep-separated, each holding a
# triton package (`pip install --target DIR --no-deps triton==X`). .ci/run passes the GPU machine's
# (3.6), whose ptxas allocates registers differently (the ht combine: 145 against 110 uncapped).
OTHER_TRITONS = [d for d in os.environ.get("EPMOE_OTHER_TRITONS", "").split(os.pathsep) if d]


def assert_compiles(script: str, triton_dir: str | None = None) -> None:
    """Run tests/`script` (with the triton in triton_dir first on the path, if given); skip where a GPU
    runs the kernels themselves or the script says this Triton cannot be driven; fail on its failure."""
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the kernels themselves")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*([triton_dir] if triton_dir else []), str(ROOT), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script)], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == SKIP_EXIT:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
