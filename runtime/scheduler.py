"""Between the HTTP service and the engines: requests are submitted as jobs, tokens flow back.

The service never holds an engine. It submits a `Job` (prompt ids + sampling), waits for it to
start, reads its tokens and may cancel it. This scheduler runs each job alone on a free engine
slot, one worker thread per running job; a batched engine can replace it behind the same
submit / started / iterate / cancel interface.

Two promises the service relies on:
- a job waits at most `queue_timeout` seconds for a slot, then `started()` raises QueueTimeout
  (with a Retry-After estimate);
- a cancelled job (its client went away, or a stop string was reached) stops within one decode
  step and frees its slot: the worker checks between steps.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)
GREEDY_BELOW = 1e-5  # temperatures below this sample like 0 (their limit), never divide by ~0


class QueueTimeout(Exception):
    """No slot freed within the queue time; retry after `retry_after` seconds."""

    def __init__(self, waited: float, retry_after: int):
        super().__init__(f"no free slot within {waited:.1f} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The job was cancelled before it started."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()  # a token that ends the job (eos) after being emitted


_END = object()


class Job:
    """One submitted request. Iterate it for token ids; `finish_reason` is set at the end:
    length | stop (a stop token) | cancelled | error."""

    def __init__(self, prompt: Sequence[int], sampling: Sampling, loop: asyncio.AbstractEventLoop):
        self.prompt = list(prompt)
        self.sampling = sampling
        self.state = "queued"  # queued → running → done (or expired / cancelled while queued)
        self.finish_reason: str | None = None
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None
        self._loop = loop
        self._stop = threading.Event()  # read by the worker between decode steps
        self._started: asyncio.Future = loop.create_future()
        self._tokens: asyncio.Queue = asyncio.Queue()
        self._timer: asyncio.TimerHandle | None = None
        self._scheduler: Scheduler | None = None

    async def started(self) -> None:
        """Returns once the job runs; QueueTimeout or Cancelled if it never will."""
        await asyncio.shield(self._started)

    def cancel(self) -> None:
        """Stop the job: dropped from the queue, or stopped after its current decode step."""
        self._stop.set()
        if self.state == "queued" and self._scheduler is not None:
            self._scheduler._drop(self, Cancelled("cancelled while queued"), "cancelled")

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    async def __aiter__(self) -> AsyncIterator[int]:
        while True:
            item = await self._tokens.get()
            if item is _END:
                return
            yield item

    def _emit(self, item: object) -> None:
        """From the worker thread: hand a token to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._tokens.put_nowait, item)
        except RuntimeError:  # the loop is gone (shutdown): nobody is reading
            self._stop.set()


class Scheduler:
    """One sequence per engine slot, first come first served, bounded queue time."""

    def __init__(self, engines: Sequence, queue_timeout: float = 30.0):
        if not engines:
            raise ValueError("a scheduler needs at least one engine slot")
        self.slots = len(engines)
        self.queue_timeout = queue_timeout
        self._free = list(engines)
        self._queue: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._pool = ThreadPoolExecutor(self.slots, thread_name_prefix="decode")
        self._recent: collections.deque[float] = collections.deque(maxlen=32)  # run seconds
        self.on_token: Callable[[], None] = lambda: None  # called by workers per generated token

    # ---- what the service and /health read ----

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: the queue ahead, at the recent job length."""
        per_job = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(per_job * (1 + len(self._queue) / self.slots)))

    # ---- submission ----

    def submit(self, prompt: Sequence[int], sampling: Sampling) -> Job:
        """Queue a job (call on the event loop); it starts as soon as a slot is free."""
        loop = asyncio.get_running_loop()
        job = Job(prompt, sampling, loop)
        job._scheduler = self
        self._queue.append(job)
        job._timer = loop.call_later(self.queue_timeout, self._expire, job)
        self._dispatch()
        return job

    def _expire(self, job: Job) -> None:
        if job.state == "queued":
            waited = time.perf_counter() - job.queued_at
            self._drop(job, QueueTimeout(waited, self.retry_after()), "expired")

    def _drop(self, job: Job, error: Exception, state: str) -> None:
        job.state = state
        job.finish_reason = "cancelled"
        if job._timer:
            job._timer.cancel()
        with contextlib.suppress(ValueError):  # not queued any more
            self._queue.remove(job)
        if not job._started.done():
            job._started.set_exception(error)
            job._started.exception()  # retrieved here: nobody may await a dropped job
        job._tokens.put_nowait(_END)

    def _dispatch(self) -> None:
        while self._free and self._queue:
            job = self._queue.popleft()
            engine = self._free.pop()
            if job._timer:
                job._timer.cancel()
            job.state, job.started_at = "running", time.perf_counter()
            self._running.add(job)
            job._started.set_result(None)
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._drive, engine, job)
            fut.add_done_callback(lambda f, engine=engine, job=job: self._finished(engine, job, f))

    def _finished(self, engine, job: Job, fut: asyncio.Future) -> None:
        self._running.discard(job)
        job.state = "done"
        job.finish_reason = fut.result() if not fut.cancelled() and fut.exception() is None else "error"
        if job.started_at is not None:
            self._recent.append(time.perf_counter() - job.started_at)
        job._tokens.put_nowait(_END)
        self._free.append(engine)
        self._dispatch()

    # ---- the worker ----

    def _drive(self, engine, job: Job) -> str:
        """Run one job on one engine slot (worker thread); returns the finish reason."""
        s = job.sampling
        temperature = s.temperature if s.temperature >= GREEDY_BELOW else 0.0
        gen = engine.generate(job.prompt, s.max_tokens, temperature, s.seed)
        try:
            for token in gen:  # each step of this loop is one prefill or decode step
                self.on_token()
                if job.cancelled:
                    return "cancelled"
                job._emit(token)
                if token in s.stop_ids:
                    return "stop"
            return "length"
        except Exception:
            log.exception("generation failed (prompt of %d tokens)", len(job.prompt))
            return "error"
        finally:
            gen.close()

    def close(self) -> None:
        """Stop every job (each within one decode step) and wait for the workers: after this,
        no thread touches an engine, so device memory may be released."""
        for job in list(self._queue) + list(self._running):
            job._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
