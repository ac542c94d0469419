"""Triton kernels of the `ht` dispatcher: peer stores into symmetric buffers, device-side signals.

Every peer buffer is reached through an int64 table of its address on each rank (`HtPeers`; the shared
convention of epmoe/kernels/sync.py). Buffers that change per call exist twice (parity = epoch % 2, the
epoch being a device counter in the workspace), flags are monotonic: a sender adds 1 per signalling
program (or once) per call and a receiver waits until a flag reaches epoch * programs, or (the combine's
per-item flags) the sender stores the epoch and the receiver waits until it is there.

    launch.py   HtLaunch and ht_launch: the launch settings, a pure function of row size and device
    buffers.py  HtBuffers / HtPeers: one rank's workspace, the launchers' frozen arguments
    send.py     the sender: numbering of the (token, rank) pairs and the rows' kernel; the rows' wait
    layout.py   the receiver's layout (count / scan / place on the layout engine) and the batch size word
    combine.py  the combine kernel of ticketed remote and local items
"""
from .launch import HtLaunch, gpu_launch, ht_launch, registers_per_thread

__all__ = ["HtLaunch", "gpu_launch", "ht_launch", "registers_per_thread"]
