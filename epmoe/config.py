"""MoE layer configuration.

Shape letters: T tokens on this rank, D hidden size, F expert intermediate size, E global experts,
L local experts, K top-k, R ranks.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

QUANT_MODES = (None, "fp8_block")
SCORINGS = ("softmax", "sigmoid")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_BLOCK = 128  # fp8_block: weights scaled per 128x128 block, activations per token per 128 columns


def repr_hash(obj: object) -> int:
    """A 62-bit hash of repr(obj), the same in every process (Python's hash() of a str is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 2


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shapes, precision and routing settings of one MoE layer; the same on every rank.

    Args:
        num_experts: E, routed experts in the whole layer (all ranks together).
        top_k: K, experts chosen per token, 1 <= K <= E.
        hidden_size: D, model width.
        intermediate_size: F, each expert's hidden width (w13 is [2F, D], w2 is [D, F]).
        dtype: activation and weight dtype (bfloat16, float16 or float32).
        quant: None, or "fp8_block" (fp8 e4m3 weights with one fp32 scale per 128x128 block and
            activations quantized per token per 128 columns).
        max_tokens_per_rank: the most tokens one dispatch moves per rank; FusedMoE cuts larger inputs
            into chunks of this size, and fixed-buffer dispatchers size their buffers from it.
        scoring: routing score function, "softmax" (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" (DeepSeek-V3).
        renormalize: rescale the chosen top-k weights of each token to sum to 1.
        num_groups: split the experts into this many groups for grouped top-k (None: no grouping).
        topk_groups: how many groups each token may pick its experts from (needs num_groups).
        routed_scaling_factor: FusedMoE multiplies the routed experts' output by this (through the top-k
            weights, before the combine's float32 sum is rounded to dtype).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype = torch.bfloat16
    quant: str | None = None
    max_tokens_per_rank: int = 4096
    scoring: str = "softmax"
    renormalize: bool = True
    num_groups: int | None = None
    topk_groups: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "max_tokens_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"MoEConfig.dtype must be one of {FLOAT_DTYPES}, got {self.dtype}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"MoEConfig.quant must be one of {QUANT_MODES}, got {self.quant!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoEConfig.scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"MoEConfig.renormalize must be a bool, got {self.renormalize!r}")
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ValueError("MoEConfig.num_groups and topk_groups must be given together")
        if self.num_groups is not None:
            for name in ("num_groups", "topk_groups"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"MoEConfig.{name} must be an int or None, got {value!r}")
            if self.num_groups < 1 or self.num_experts % self.num_groups:
                raise ValueError(
                    f"MoEConfig.num_groups={self.num_groups} must divide num_experts={self.num_experts}")
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(
                    f"MoEConfig.topk_groups={self.topk_groups} must be in [1, num_groups={self.num_groups}]")
            if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
                raise ValueError(
                    f"MoEConfig: topk_groups={self.topk_groups} groups of {self.num_experts // self.num_groups}"
                    f" experts hold fewer than top_k={self.top_k} experts")
        scaling = self.routed_scaling_factor
        if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not 0 < scaling < math.inf:
            raise ValueError(f"MoEConfig.routed_scaling_factor must be a finite number > 0, got {scaling!r}")

    def local_experts(self, world_size: int) -> int:
        """L = E / R, the experts each rank owns (rank r owns [r*L, (r+1)*L))."""
        if world_size < 1 or self.num_experts % world_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the world size {world_size}")
        return self.num_experts // world_size

    def fingerprint(self) -> int:
        """A 62-bit hash of every field, the same in every process: ranks exchange it to find out that one of
        them was built from another config (before rows of other sizes cross)."""
        return repr_hash(self)

    @property
    def row_bytes(self) -> int:
        """Bytes of one activation row in `dtype`."""
        return self.hidden_size * torch.empty((), dtype=self.dtype).element_size()
