"""`epmoe soak`: figures for load held, faults survived and bad inputs refused.

Parts (each a module here, run by `epmoe.soak.run`):
- load: every dispatcher x experts x precision that `list_dispatchers` / `list_experts` allow, many calls
  with random token counts per rank (0 included), uniform and skewed routing, -1 ids and chunking, every
  output compared with the float64 oracle (`epmoe.oracle`); reruns of the same calls hashed for
  determinism; device and host memory sampled over the run (no growth after warm-up).
- graphs: `ll` and `ht(sync_free)` captured in one CUDA graph each (ranks emulated on one GPU) and replayed
  with new routing every time, every replay checked.
- faults: a peer that never arrives, a peer that dies mid-call, a rank with another config, ids out of
  range or a wrong dtype on one rank only; every rank must end with a clear error inside the time-out,
  and a layer on a fresh group must work afterwards.
- bad_inputs: a table of bad inputs at every public entry point and the error each gave.
"""
