"""Test set-up: run Triton kernels on CPU tensors through the interpreter when there is no GPU, and skip
tests marked `gpu` (needs CUDA) or `gpu2` (needs several CUDA devices: gpu_ranks.gpu_test_ranks(),
$EPMOE_GPU_RANKS, default 2) where those are missing, and tests marked `interpreter` (Triton kernels on CPU
tensors) where Triton compiles for the GPU instead (a machine with CUDA, TRITON_INTERPRET unset: one process
runs Triton either way, never both).

TRITON_INTERPRET must be set before triton is first imported, hence here and not in a test module. The
multi-GPU tests' ranks inherit the environment: NVLink multicast stays off there, as on the GPU machines
(epmoe.bench.dispatch.NVLINK_ENV).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from epmoe.bench.dispatch import NVLINK_ENV  # noqa: E402 (after TRITON_INTERPRET)

for _key, _value in NVLINK_ENV.items():
    os.environ.setdefault(_key, _value)


def pytest_collection_modifyitems(config, items):
    from gpu_ranks import gpu_test_ranks
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = gpu_test_ranks()
    for item in items:
        if "gpu2" in item.keywords and gpus < ranks:
            item.add_marker(pytest.mark.skip(reason=f"needs {ranks} CUDA devices, found {gpus}"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        elif "interpreter" in item.keywords and not INTERPRETED:
            item.add_marker(pytest.mark.skip(reason="Triton kernels on CPU tensors: needs TRITON_INTERPRET=1, as "
                                                    "where no GPU is visible (`CUDA_VISIBLE_DEVICES= python -m pytest`)"))
