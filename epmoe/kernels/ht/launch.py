"""Launch settings of the `ht` kernels: `HtLaunch`, and `ht_launch`, a pure function of the row size and
the device that picks them.

The numbers behind the constants are in BENCHMARKS.md (`ht`, "What we tried: ht dispatch" and "What we
tried: ht combine"; 2 H200s, 4096 and 8192 tokens of D 7168, K 8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

# share of the SMs that run a dispatch send program: the numbering and layout kernels run beside the send
# kernel, and with every SM sending they finish late (fp8 dense dispatch ready at 4096 tokens: 128-131 µs
# on 132 SMs, 116-118 on 106, 114-115 on 92)
SEND_SM_SHARE = 0.8
# combine programs an SM and warps of each; their registers are capped so that they all fit on an SM
# (`registers_per_thread`): left to itself, ptxas of triton 3.6 gives the combine 145 registers (three
# programs an SM), which is slower
COMBINE_PER_SM = 6
COMBINE_WARPS = 4
# 32-bit registers of an SM (every NVIDIA GPU since Volta, H100 / H200 included)
SM_REGISTERS = 65536
# combine: columns per gathered load, elements (rows x columns) per program step and item, and how many
# waves of tickets its local items trail its remote ones. A program spends ~20 µs on an item of two rows of
# D 7168 (K 8: its share of the HBM rate over the bytes it gathers), so the ticket order's tail costs
# about half an item: small items (one row of D 7168) beat larger ones despite more fences and flags.
COMBINE_CHUNK = 2048
COMBINE_STEP = 2048
COMBINE_LAG = 1.5


@dataclass(frozen=True)
class HtLaunch:
    """Launch config of the ht kernels (the same on every rank, fixed for a workspace's lifetime: flags
    count one signal per program and call, and the combine's ready flags are per item of its rows).

    programs, num_warps: persistent programs of the dispatch send kernel, and warps of each; `rows(D)`
        rows per program step there.
    combine_programs, combine_warps: programs of the combine kernel (they take items by ticket, so any
        number is deadlock-free), and warps of each.
    combine_registers: the most registers a combine thread may take (ptxas's maxnreg, up to the 255 a
        thread can have; None: ptxas's own choice), so that combine_programs fit on the SMs at once.
    combine_chunk, combine_step: the combine gathers rows in column chunks of combine_chunk elements,
        combine_step elements (rows x chunk) at a time; an item of its work is that many rows
        (`combine_tiles`).
    combine_lag: how far, in waves of combine_programs tickets, the combine's local items (sums of this
        rank's tokens) trail its remote items (partial rows sent to the peers), so that a local item
        rarely waits for the peers' partials.
    """

    programs: int
    num_warps: int
    combine_programs: int
    combine_warps: int
    combine_chunk: int = 1024
    combine_step: int = 2048
    combine_lag: float = 1.0
    combine_registers: int | None = None

    def __post_init__(self) -> None:
        for name in ("programs", "combine_programs"):
            if getattr(self, name) < 1:
                raise ValueError(f"HtLaunch.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_warps", "combine_warps", "combine_chunk", "combine_step"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"HtLaunch.{name} must be a power of two, got {value}")
        if not 0 <= self.combine_lag < float("inf"):  # a negative lag would hand out local items early
            raise ValueError(f"HtLaunch.combine_lag must be finite and >= 0, got {self.combine_lag}")
        if self.combine_registers is not None and not 1 <= self.combine_registers <= 255:
            raise ValueError(f"HtLaunch.combine_registers must be None or in [1, 255], got {self.combine_registers}")

    @staticmethod
    def rows(hidden: int) -> int:
        """Rows a dispatch send program has in flight per step: about 16K elements of (padded) row."""
        return max(1, min(4, 16384 // triton.next_power_of_2(hidden)))

    def combine_tiles(self, hidden: int) -> tuple[int, int]:
        """(columns per gathered load, rows per step and item) of the combine kernel for rows of `hidden`."""
        chunk = min(triton.next_power_of_2(hidden), self.combine_chunk)
        return chunk, max(1, self.combine_step // chunk)

    def combine_lag_iterations(self, world_size: int) -> int:
        """combine_lag in iterations of the ticket order (world_size tickets each)."""
        return -(-int(self.combine_lag * self.combine_programs) // world_size)


def ht_launch(row_bytes: int, device: torch.device) -> HtLaunch:
    """Pure function of the row size and the device: on a GPU `gpu_launch` for its SMs; a few programs
    under the interpreter."""
    if device.type != "cuda":
        return HtLaunch(programs=2, num_warps=1, combine_programs=3, combine_warps=1, combine_chunk=COMBINE_CHUNK,
                        combine_step=COMBINE_STEP, combine_lag=COMBINE_LAG)
    return gpu_launch(row_bytes, torch.cuda.get_device_properties(device).multi_processor_count)


def gpu_launch(row_bytes: int, sms: int) -> HtLaunch:
    """`ht_launch` on a GPU of `sms` SMs (a pure function of both: tests compile with it): dispatch send
    programs on SEND_SM_SHARE of the SMs, one each, of 8 warps for rows of 4 KB and more; COMBINE_PER_SM
    combine programs of COMBINE_WARPS warps per SM, their registers capped at what lets them all fit,
    items of COMBINE_STEP elements in chunks of COMBINE_CHUNK, local items COMBINE_LAG waves behind."""
    return HtLaunch(programs=max(1, int(SEND_SM_SHARE * sms)), num_warps=8 if row_bytes >= 4096 else 4,
                    combine_programs=COMBINE_PER_SM * sms, combine_warps=COMBINE_WARPS,
                    combine_registers=registers_per_thread(COMBINE_PER_SM, COMBINE_WARPS),
                    combine_chunk=COMBINE_CHUNK, combine_step=COMBINE_STEP, combine_lag=COMBINE_LAG)


def registers_per_thread(programs: int, warps: int) -> int:
    """The most registers a thread of `programs` programs of `warps` warps each may take for them all to
    fit on one SM (SM_REGISTERS; ptxas allocates in steps of 8 a thread, at most 255)."""
    return min(255, SM_REGISTERS // (programs * warps * 32) // 8 * 8)
