"""The `ht` kernels' sm_90 builds (tests/compile_ht.py, run without a GPU)."""
import pytest

from compile_run import OTHER_TRITONS, assert_compiles


@pytest.mark.parametrize("triton_dir", [None] + OTHER_TRITONS)
def test_kernels_compile_for_hopper(triton_dir):
    """The ht kernels compile for sm_90 (H100/H200) with the launch configs used there: no spills (the
    combine, under its register cap: a few words), 16-byte vector stores on the big rows
    (tests/compile_ht.py; with the installed triton, or the one in triton_dir)."""
    assert_compiles("compile_ht.py", triton_dir)

