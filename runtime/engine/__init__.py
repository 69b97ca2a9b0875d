"""The decode engine: prefill and decode steps over the registered programs and KV slots, a job's
sampling, and the rows and routed experts exchanged across ranks. Below `launch` (registration
builds the engine) and `serve` (whose scheduler drives it); imports no HTTP.

    engine     prefill, decode steps, speculative verify (MTP)
    sampling   a job's `Sampling` parameters and the per-sequence `Sampler`
    dispatch   rows gathered and routed experts exchanged across ranks

Importing this package imports nothing.
"""
