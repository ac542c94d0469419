"""`ht` dispatcher: high-throughput NVLink dispatch/combine over symmetric memory, no NCCL in the data path.

Dispatch, on the sender: two kernels number its (token, destination rank) pairs with a device prefix
sum and store into every destination, ahead of the rows, the tokens and (token, slot) pairs it will
get, each token's destination-local ids and weights, and its caller's chunk count (the largest comes
back to the host with the batch size, so FusedMoE needs no collective to agree on it), with one signal;
then the rows go, each once per destination rank (fp8-quantized on the way when cfg.quant ==
"fp8_block"), straight into that rank's receive region, and signal. On the receiver, the layout sorts
the received (row, local expert) pairs by expert, with work proportional to the pairs received; the
batch is a row index into the receive buffer (ExpertBatch.row_index_N), so no row is copied again.
Combine: one kernel of ticketed items, remote items sending partial rows back, local items summing this
rank's tokens as the partial rows arrive.

Where each part lives:
    dispatcher.py   HtDispatcher (front: options, validation, phases) and SyncFreeHtDispatcher
    schedule.py     when and on which stream the parts run (SyncFree, InTurn, Overlapped, RowsFirst)
    transport.py    the rows' way: the send kernel (SentRows), dense mode (DenseRows)
    copy_engine.py  dense mode by the GPU's copy engine (CopyEngineRows)
    layout.py       the receiver's layout step and the host's read of the batch size
    combine.py      the combine as the ranks run it (FusedCombine, SplitCombine)
    handles.py      what the phases hand on (HtDispatchPending, HtHandle, HtCombinePending)
    workspace.py    the symmetric workspace, and why two copies of it suffice
The kernels are in epmoe/kernels/ht/.
"""
from .dispatcher import DENSE_MIN_SHARE, HtDispatcher, SyncFreeHtDispatcher, dense_pays

__all__ = ["DENSE_MIN_SHARE", "HtDispatcher", "SyncFreeHtDispatcher", "dense_pays"]
