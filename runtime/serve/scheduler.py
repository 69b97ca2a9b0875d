"""Between the HTTP service and the engine: requests are submitted as jobs, tokens flow back.

The service never holds the engine. It submits a `Job` (prompt ids + sampling), waits for it to
start, reads its tokens and may cancel it. Continuous batching: one engine thread
(`runtime.serve.batcher`) runs every active sequence's next token in one decode step (one call per
program); admitted jobs' prompts join the next step (a long one prefills in a step of its own
first; an idle engine first waits a few ms for the rest of a burst, `GATHER_GAP_S`), and finished
ones leave without stalling the rest. A job holds one of the engine's KV slots from admission to
its end. Of several ranks (each holding its own slots' KV), a job goes to the rank with the most
free slots, ties to the one with the least work placed on it.

Two promises the service relies on:
- a job waits at most `queue_timeout` seconds for a slot, then `started()` raises QueueTimeout
  (with a Retry-After estimate);
- a cancelled job (its client went away, or a stop string was reached) stops within one decode
  step and frees its slot: the engine thread checks between steps.

Asyncio state (the queue, futures, token queues) is only touched on the event loop; the engine
thread hands admitted jobs over through a locked inbox and reports back with
`call_soon_threadsafe`, so tokens always arrive before their job's end.
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

from runtime.engine.sampling import Sampling
from runtime.log import failed

log = logging.getLogger(__name__)

IDLE_TICK_S = 1.0  # an idle engine thread wakes this often (engine.idle: keep other ranks alive)
# An idle engine that receives a request waits while more keep arriving, each within GATHER_GAP_S
# of the one before (GATHER_MAX_S at most), so a burst prefills in one step: started at once,
# the first of eight concurrent 32-token prompts on `small` prefilled alone (about 0.3 s on 2
# cores) and the other seven waited for it, then ran a step of their own. A lone request pays
# one gap. (vLLM's scheduler_delay_factor makes the same trade.)
GATHER_GAP_S = 0.004
GATHER_MAX_S = 0.025


class QueueTimeout(Exception):
    """No slot freed within the queue time; retry after `retry_after` seconds."""

    def __init__(self, waited: float, retry_after: int):
        super().__init__(f"no free slot within {waited:.1f} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The job was cancelled before it started."""


class Failed(Exception):
    """The service failed (a rank lost, its weights changed) before the job started."""


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
        # filled by the engine thread before the token they belong to is handed over
        self.token_logprobs: list = []  # runtime.engine.sampling.LogProb per generated token
        self.prompt_logprobs: list | None = None  # per prompt token after the first
        self._timer: asyncio.TimerHandle | None = None
        self._scheduler: Scheduler | None = None
        self._group: list[Job] = [self]  # the request's jobs (its `n` choices), this one among them

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
        """From the engine thread: hand a token to the event loop."""
        self._call(self._tokens.put_nowait, item)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is gone (shutdown): nobody is reading
            self._stop.set()


def _work(job: Job) -> int:
    """What a job asks of its rank, in tokens: its prompt and at most max_tokens more."""
    return len(job.prompt) + job.sampling.max_tokens


class Scheduler:
    """Continuous batching over one engine's slots, first come first served, bounded queue time.

    `max_batch` caps how many sequences run at once (default: every slot); 1 is the
    one-sequence-per-step engine, kept as the bench's baseline. `speculative`: MTP drafts,
    verified by the main model (runtime.serve.batcher)."""

    def __init__(self, engine, queue_timeout: float = 30.0, max_batch: int | None = None,
                 speculative: bool = False, gather: tuple[float, float] = (GATHER_GAP_S, GATHER_MAX_S),
                 **batcher_options):
        from runtime.serve.batcher import Batcher  # torch: only where an engine runs

        if engine.slots < 1 or (max_batch is not None and max_batch < 1):
            raise ValueError("a scheduler needs at least one engine slot")
        self.slots = min(engine.slots, max_batch or engine.slots)  # sequences at once
        self.queue_timeout = queue_timeout
        self.gather = gather  # (gap, most) seconds an idle engine waits for a burst (`_gather`)
        self.batcher = Batcher(engine, self._end, lambda job: self.on_token(job), speculative, **batcher_options)
        self.owner = list(getattr(engine, "owner", [0] * engine.slots))  # each slot's rank
        self.ranks = max(self.owner) + 1
        self.rank_slots = [self.owner.count(r) for r in range(self.ranks)]
        # per rank: its free slots (the last freed is taken first) and the work placed on it (tokens)
        self._free = [[s for s in range(engine.slots) if self.owner[s] == r][::-1] for r in range(self.ranks)]
        self._work = [0] * self.ranks
        self._queue: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._recent: collections.deque[float] = collections.deque(maxlen=32)  # run seconds
        self._inbox: list[tuple[Job, int]] = []
        self._wake = threading.Condition()
        self._closing = False
        self._failed: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_token: Callable[[Job], None] = lambda job: None  # the engine thread, per token handed to a job
        # told (from the engine thread) once the engine thread dies: the service then fails closed
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()

    # ---- what the service and /health read ----

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def failure(self) -> str | None:
        """Why this scheduler admits nothing any more (the service failed, or its engine thread
        died), or None."""
        return self._failed

    @property
    def free_slots(self) -> int:
        return min(sum(map(len, self._free)), self.slots - len(self._running))

    def per_rank(self) -> list[dict]:
        """Each rank's slots, free slots and running sequences (what /health reports)."""
        return [{"rank": r, "slots": n, "free_slots": len(self._free[r]), "running": n - len(self._free[r])}
                for r, n in enumerate(self.rank_slots)]

    @property
    def max_group(self) -> int:
        """The most sequences one request may ask for (`n`): they share a prompt's prefill, so
        they live on one rank."""
        return min(self.slots, max(self.rank_slots))

    def max_groups(self, size: int) -> int:
        """How many groups of `size` sequences (a batch's prompts, each with its choices) the
        service holds at once: each group on one rank, every sequence in a slot."""
        return min(sum(n // size for n in self.rank_slots), self.slots // size)

    def _place(self, jobs: list[Job]) -> list[int] | None:
        """Free slots for `jobs` (one request's sequences) on one rank: the rank with the most
        free slots (ties: the least work placed on it, then the lowest rank); None while no
        rank has that many free."""
        ranks = [r for r in range(self.ranks) if len(self._free[r]) >= len(jobs)]
        if not ranks or self.slots - len(self._running) < len(jobs):
            return None
        rank = max(ranks, key=lambda r: (len(self._free[r]), -self._work[r], -r))
        self._work[rank] += sum(map(_work, jobs))
        return [self._free[rank].pop() for _ in jobs]

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: the queue ahead, at the recent job length."""
        per_job = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(per_job * (1 + len(self._queue) / self.slots)))

    # ---- submission (on the event loop) ----

    def submit(self, prompt: Sequence[int], sampling: Sampling) -> Job:
        """Queue a job (call on the event loop); it starts as soon as a slot is free."""
        return self.submit_group(prompt, [sampling])[0]

    def submit_group(self, prompt: Sequence[int], samplings: Sequence[Sampling]) -> list[Job]:
        """Queue one job per sampling over one prompt (a request's `n` choices): they start
        together, on one rank, and share the prompt's prefill (its KV is copied)."""
        loop = self._loop = asyncio.get_running_loop()
        group = [Job(prompt, sampling, loop) for sampling in samplings]
        for job in group:
            job._scheduler, job._group = self, group
            self._queue.append(job)
            if self._failed is not None:
                self._drop(job, Failed(self._failed), "failed")
                continue
            job._timer = loop.call_later(self.queue_timeout, self._expire, job)
        self._dispatch()
        return group

    def fail(self, reason: str) -> None:
        """The service failed (any thread): every job is answered now — queued ones fail with
        `reason` and none is admitted again; running ones end with an error at once, not at
        their next step, which a lost rank may hold in a collective until the process exits
        (the client would get a dropped connection, not its 503)."""
        self._failed = reason
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                self._loop.call_soon_threadsafe(self._fail_all)

    def _fail_all(self) -> None:
        for job in list(self._queue):
            self._drop(job, Failed(self._failed or "failed"), "failed")
        for job in list(self._running):
            # its slot stays the engine thread's until that step ends (`_finished` frees it);
            # the reader is answered now: what it got so far, then the error
            job._stop.set()
            job.finish_reason = "error"
            job._tokens.put_nowait(_END)

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
        """Give free slots to queued jobs, oldest first; the engine thread prefills them."""
        admitted = []
        while self.free_slots and self._queue and not self._closing and self._failed is None:
            group = [j for j in self._queue[0]._group if j.state == "queued"]  # a member may have left
            slots = self._place(group)
            if slots is None:
                break  # first come first served: the oldest request waits for room on one rank
            for job, slot in zip(group, slots, strict=True):
                self._queue.remove(job)
                if job._timer:
                    job._timer.cancel()
                job.state, job.started_at = "running", time.perf_counter()
                self._running.add(job)
                job._started.set_result(None)
                admitted.append((job, slot))
        if admitted:
            with self._wake:
                self._inbox += admitted
                self._wake.notify()

    def _finished(self, job: Job, slot: int, reason: str) -> None:
        self._running.discard(job)
        job.state = "done"
        if job.finish_reason != "error":  # set only by a failed service (`_fail_all`): that answer stands
            job.finish_reason = reason
        if job.started_at is not None:
            self._recent.append(time.perf_counter() - job.started_at)
        job._tokens.put_nowait(_END)
        rank = self.owner[slot]
        self._free[rank].append(slot)
        self._work[rank] -= _work(job)
        self._dispatch()

    # ---- the engine thread ----

    @property
    def stats(self) -> dict:
        """Steps, mean batch, MTP drafts and acceptance, tokens per sequence-step; of several
        ranks, the engine calls and the seconds rank 0 spent in their all-to-alls."""
        stats = self.batcher.stats.to_json()
        engine = self.batcher.engine
        if (group := getattr(engine, "group", None)) is not None:
            stats.update(engine_calls=engine.calls, exchange_s=round(group.exchange_s, 4))
        return stats

    def _serve(self) -> None:
        """The engine thread. A step that raises fails its own sequences (`_step`) and the thread
        goes on; should the thread itself die, the service fails at once (every waiting request
        answered, `on_fatal` told: the process exits non-zero), never a hang behind "ok"."""
        try:
            self._steps()
        except BaseException as e:
            failed(log, e, "the engine thread died")
            reason = f"the engine thread died ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
            self.fail(reason)
            self.on_fatal(reason)

    def _steps(self) -> None:
        from runtime.serve.batcher import Running

        def running(job: Job, slot: int):
            try:
                return Running(job, slot)
            except Exception as e:  # its sampler could not be made: this job fails, the others go on
                failed(log, e, "a job on slot %d could not start", slot)
                job._call(self._finished, job, slot, "error")
                return None

        active: list = []
        while True:
            with self._wake:
                while not self._inbox and not active and not self._closing:
                    if not self._wake.wait(IDLE_TICK_S):
                        self.batcher.engine.idle()  # rank 0 of several: the others' receives stay alive
                if not active:
                    self._gather()
                if self._closing:
                    break
                take = self.batcher.take(self._inbox)
                admitted, self._inbox = self._inbox[:take], self._inbox[take:]
            active = self._step(active, [r for job, slot in admitted if (r := running(job, slot)) is not None])
        for run in active:
            self._end(run, "cancelled")
        with self._wake:
            for job, slot in self._inbox:
                self._end(Running(job, slot), "cancelled")

    def _step(self, active: list, admitted: list) -> list:
        """One batcher step; an error it did not contain itself ends every sequence of the step
        with an error (each request gets one clear answer) and the engine goes on."""
        try:
            return self.batcher.step(active, admitted)
        except Exception as e:
            failed(log, e, "engine step failed; its %d sequences end with an error", len(active) + len(admitted))
            for run in active + admitted:
                self.batcher.end(run, "error")
            return []

    def _gather(self) -> None:
        """An idle engine's first step waits while jobs keep arriving within the gap of each
        other, up to the most (`self.gather`; GATHER_GAP_S says why). Holds `_wake`."""
        gap, most = self.gather
        deadline, seen = time.perf_counter() + most, len(self._inbox)
        while not self._closing and (left := deadline - time.perf_counter()) > 0:
            self._wake.wait(min(gap, left))
            if len(self._inbox) == seen:
                return
            seen = len(self._inbox)

    def _end(self, run, reason: str) -> None:
        run.job._call(self._finished, run.job, run.slot, reason)

    def close(self) -> None:
        """Stop every job (each within one decode step) and wait for the engine thread: after
        this, nothing touches the engine, so device memory may be released."""
        for job in list(self._queue) + list(self._running):
            job._stop.set()
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
