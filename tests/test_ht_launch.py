"""Tests of the `ht` launch settings (epmoe/kernels/ht/launch.py): what HtLaunch refuses, the combine's
register cap, and ht_launch's rule on an H200."""
from __future__ import annotations

import pytest

from epmoe.kernels.ht import HtLaunch, gpu_launch, registers_per_thread


@pytest.mark.parametrize("field,value,match", [
    ("combine_lag", -1.0, "combine_lag"), ("combine_lag", float("nan"), "combine_lag"),
    ("combine_step", 3000, "power of two"), ("combine_chunk", 1000, "power of two"),
    ("combine_warps", 3, "power of two"), ("combine_programs", 0, ">= 1"), ("programs", 0, ">= 1"),
    ("combine_registers", 0, "combine_registers"), ("combine_registers", 256, "combine_registers")])
def test_launch_settings_are_checked(field, value, match):
    good = dict(programs=2, num_warps=1, combine_programs=3, combine_warps=1)
    HtLaunch(**good)
    HtLaunch(**good, combine_registers=128)
    with pytest.raises(ValueError, match=match):
        HtLaunch(**{**good, field: value})


def test_combine_register_cap_fits_its_programs():
    """Four programs of 4 warps an SM: 128 registers a thread, six (the default): 80; the cap is a multiple of
    8 and at most 255."""
    assert registers_per_thread(4, 4) == 128
    assert registers_per_thread(6, 4) == 80  # 85 rounded down
    assert registers_per_thread(3, 4) == 168  # 170 rounded down to ptxas's step
    assert registers_per_thread(1, 1) == 255


def test_gpu_launch_on_an_h200():
    """ht_launch's GPU rule on 132 SMs: what `epmoe bench dispatch` reports running on the H200s."""
    assert gpu_launch(2 * 7168, 132) == HtLaunch(programs=105, num_warps=8, combine_programs=792, combine_warps=4,
                                                 combine_registers=80, combine_chunk=2048, combine_step=2048,
                                                 combine_lag=1.5)
    assert gpu_launch(2 * 1024, 132).num_warps == 4

