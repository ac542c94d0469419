"""The `ll` kernels' sm_90 builds (tests/compile_ll.py, run without a GPU)."""
import pytest

from compile_run import OTHER_TRITONS, assert_compiles


@pytest.mark.parametrize("triton_dir", [None] + OTHER_TRITONS)
def test_kernels_compile_for_hopper(triton_dir):
    """The ll kernels compile for sm_90 (H100/H200) with the launch settings used there: no spills,
    16-byte vector stores on the rows (tests/compile_ll.py; with the installed triton, or the one in
    triton_dir)."""
    assert_compiles("compile_ll.py", triton_dir)
