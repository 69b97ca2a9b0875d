"""Serving: the `dsv4 serve` process (`main`, and `rank_launcher` for `--ranks N`), the engine
over the programs and KV slots (`engine`, `batcher`, `scheduler`), and the HTTP service —
/health, /metrics and the OpenAI surface (/v1/models, /v1/completions, /v1/chat/completions,
each whole or streamed as SSE).

FastAPI + uvicorn. What a client sends can never make it answer 5xx: bodies are capped (413 beyond
`Limits.max_body_bytes`, judged from Content-Length before a byte is kept; a body up to 4 MiB over
is read to its end and dropped first, so the 413 is not lost to a reset), parsed and tokenized off
the event loop (so /health answers during a large one), and every fault is a 4xx naming the field
(api). A request waits at most `Limits.queue_timeout` seconds for a slot (503 with Retry-After); a
client that disconnects has its job cancelled, which frees the slot within one decode step. Every
response is counted by endpoint and status in /metrics (499 = the client went away first).
Requests go to a runtime.serve.scheduler.Scheduler; the service never holds an engine.

    api        request bodies → validated requests, or ApiError
    http       safe JSON, status counting, capped bodies, disconnect watching
    responses  tokens → settled text with stop strings; the OpenAI response shapes
    metrics    the Prometheus registry
    app        the routes
    server     bind (before registration) and serve (until a drained SIGTERM/SIGINT)
    recent     its own rates and latency quantiles over the last 10 s and minute (/health, the summary)

Its log (runtime.log), its /health value (runtime.contract) and a rank's usage (runtime.usage) sit
at runtime's top: the launch writes and reads them too.

Importing this package imports nothing (the rank launcher needs no torch and no FastAPI).
"""
