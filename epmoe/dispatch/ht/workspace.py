"""The `ht` dispatcher's symmetric workspace (set up once), and what its parts share (`HtSetup`).

Buffers that change per call exist twice, chosen by the parity of a device epoch (epmoe/kernels/ht/buffers.py
lists them with their shapes). Why two copies suffice: with at most two dispatches not yet combined on
every rank, source A's dispatch n+2 writes only A's own regions ([parity, A, ...]) at each peer B. B reads
rows of that region of call n only for tokens with pairs on B; A's combine n then waited for B's remote
combine items of those tokens (the combine's local items wait for them), which B ran after its experts on
call n (the last reads of those rows, through the row index), and A's dispatch n+2 follows A's combine n.
The region's counts, ids and weights are read only by B's layout n, which ends before B's dispatch n+1,
which A's dispatch n+1 waited for. So a receive region is never overwritten while a rank still reads it.
Likewise a peer's combine n+2 writes this rank's comb region of parity n only after its dispatch n+2
received this rank's rows of call n+2, sent after this rank's combine n had read that region; and a ready
stamp of a later epoch is released after the same item of the earlier one, so it also means that item is
here. This needs the experts to run on the stream that later issues the combine (so that the combine
follows their reads), and it is not enforced: a third dispatch before the first one's combine overwrites
rows that may still be read. Calls must alternate send/receive per phase on every rank, and the batch's
rows are valid until its combine.

Shape letters: R ranks, C capacity (cfg.max_tokens_per_rank), D hidden size, K top-k, G = ceil(D / 128).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import MoEConfig
from ...kernels.ht.buffers import HtBuffers, HtPeers
from ...kernels.ht.combine import combine_items
from ...kernels.ht.launch import HtLaunch
from ...kernels.layout import LayoutBlocks
from ...kernels.sync import DeviceWait
from ...quant import FP8_DTYPE, num_groups
from ...symm import BufferSpec, Workspace


def ht_specs(cfg: MoEConfig, world_size: int, launch: HtLaunch) -> list[BufferSpec]:
    """The workspace of one rank (the same on every rank): HtBuffers' buffers, per-call ones twice."""
    R, C, D, K = world_size, cfg.max_tokens_per_rank, cfg.hidden_size, cfg.top_k
    fp8 = cfg.quant == "fp8_block"
    specs = [BufferSpec("recv_x", (2, R, C, D), FP8_DTYPE if fp8 else cfg.dtype)]
    if fp8:
        specs.append(BufferSpec("recv_scale", (2, R, C, num_groups(D)), torch.float32))
    return specs + [
        BufferSpec("recv_ids", (2, R, C, K), torch.int32),
        BufferSpec("recv_w", (2, R, C, K), torch.float32),
        BufferSpec("recv_count", (2, R), torch.int32),
        BufferSpec("pairs", (2, R), torch.int32),  # (token, slot) pairs each rank sends here, per parity
        BufferSpec("chunks", (2, R), torch.int32),  # each rank's caller's chunk count, per parity
        BufferSpec("comb", (2, R, C, D), cfg.dtype),
        BufferSpec("comb_ready", (R, combine_items(C, D, launch)), torch.int64),
        # the combine's tickets and finished programs, and the error flag of every wait (local)
        BufferSpec("control", (3,), torch.int32),
        BufferSpec("dispatch_flag", (R,), torch.int64),
        BufferSpec("meta_flag", (R,), torch.int64),
        BufferSpec("number_done", (1,), torch.int32),  # programs of the numbering kernel done (local)
        BufferSpec("dispatch_seq", (1,), torch.int64),
        BufferSpec("combine_seq", (1,), torch.int64),
    ]


def ht_buffers(ws: Workspace) -> HtBuffers:
    """This rank's views of an `ht_specs` workspace and the address tables of its buffers."""
    return ws.views(HtBuffers, rank=ws.rank, peers=ws.tables(HtPeers))


@dataclass(frozen=True)
class HtSetup:
    """What the parts of one rank's `ht` dispatcher (schedule, row transport, combine) share, fixed at
    construction: its buffers, the launch settings (the same on every rank), how its device-side waits
    give up (the error flag is buffers.control[2]), and the layout's blocking."""

    buffers: HtBuffers
    launch: HtLaunch
    wait: DeviceWait
    num_local_experts: int
    blocks: LayoutBlocks
    device: torch.device

    @property
    def max_recv_rows(self) -> int:
        """Rows of the batch in sync_free mode, and of its row index buffer: every received (row, slot)
        pair could be valid (R * C * K; a token may repeat an expert id)."""
        b = self.buffers
        return b.world_size * b.capacity * b.recv_ids.shape[3]
