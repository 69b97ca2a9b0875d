"""The eager driver around the programs: slots of caches, prefill, batched decode, MTP.

Programs are pure; the engine owns state. It holds every cache of `slots` sequences
([slots, rows, width] per layer and cache) and writes back the rows each layer program
returns, so prefill and decode are the same computation. One `step` runs rows of many
sequences through one call per program: a prefill is one sequence's prompt, a decode step one
(or, verifying an MTP draft, two) new tokens of each sequence in the batch.

Several ranks (a `group`): data-parallel attention, expert-parallel MoE. Slot ids are global
and rank-major (rank 0's slots first); each rank holds the caches of its own slots only and
runs the attention of their rows, while every rank takes part in every step: each layer's
routed-expert rows go to the ranks that own their chosen experts and the shares come back
(`runtime.engine.dispatch`). Rank 0 leads (each call is sent to the others first) and gets
every row's logits back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from runtime.engine.dispatch import gather_rows, routed_exchange
from runtime.engine.sampling import Sampler, Sampling
from runtime.model import forward as model
from runtime.model.dims import WINDOW_CACHES, cache_shapes
from runtime.programs.catalog import DECODE, EXPERTS_PROGRAM, PREFILL, TOP_HEAD, ModelPrograms
from runtime.weights.views import ModelWeights

Runner = Callable[..., object]
Batch = Sequence[tuple[int, Sequence[int] | torch.Tensor]]  # (slot, tokens to append)


def _as_tuple(out: object) -> tuple:
    return tuple(out) if isinstance(out, list | tuple) else (out,)


@dataclass
class Step:
    logits: torch.Tensor  # [R, V]: one row per appended token, in batch order
    hidden: torch.Tensor  # [R, hc, D]: the last hc residual stream, before the head (MTP's input)


@dataclass(frozen=True)
class _Rows:
    """A step's rows as program inputs, and its mode."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor
    mode: str
    picked: torch.Tensor | None = None  # which of the step's rows these are (None: all of them)
    # Cache writes index by what the host knows, made with the step's other indices: a boolean
    # mask or int() of a device tensor in a layer would make every layer wait for the device.
    first_slot: int = 0  # the first row's local slot (a prefill's one)
    completing: dict[int, torch.Tensor | None] = field(default_factory=dict)  # ratio → rows whose
    # position completes a window of that ratio (None: none does)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """These rows of a tensor holding every row of the step."""
        return t if self.picked is None else t[self.picked.to(t.device)]

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return self.positions, self.slots, self.starts


class Engine:
    """`slots` sequences of a model over prepared programs (compiled, loaded or eager)."""

    def __init__(self, programs: ModelPrograms, weights: ModelWeights,
                 runners: dict[str, Runner] | None = None, device: str = "cpu",
                 allocate: Callable[[tuple[int, ...]], torch.Tensor] | None = None, slots: int = 1,
                 group=None, rank_slots: Sequence[int] | None = None):
        """`runners` maps program names to prepared programs (flat tensor arguments, packed
        weights). Without runners the engine calls the model's functions directly with weight
        dicts: the eager path, and the only one the float reference weights can take.

        `group` (runtime.launch.ranks.Group): this engine is one rank of a service of several.
        `slots` are this rank's KV slots, `rank_slots` every rank's (default: `slots` each);
        its weights hold only this rank's routed experts. Rank 0 leads (each call that changes
        state is sent to the others first), the others run the same calls (`ranks.follow`)."""
        if slots < 1:
            raise ValueError("an engine needs at least one slot")
        self.p, self.w, self.device, self.group = programs, weights, device, group
        self._weight_args: dict[tuple[str, str], tuple[torch.Tensor, ...]] = {}  # `_weights`
        self.rank = group.rank if group is not None else 0
        world = group.world if group is not None else 1
        if programs.expert_parallel != (world > 1):
            raise ValueError(f"programs for {'several ranks' if programs.expert_parallel else 'one rank'} "
                             f"in a service of {world}")
        self.own_slots = slots  # this rank's: its caches' first dimension
        self.calls = 0  # steps and MTP steps run
        self.place(rank_slots if rank_slots is not None else (slots,) * world)
        self.experts_per_rank = programs.dims.experts // world
        # this rank's first routed expert (global id): an input of the experts program
        self.expert_base = torch.tensor(self.rank * self.experts_per_rank, dtype=torch.int64, device=device)
        self.max_seq = programs.dims.max_seq
        self.runners = runners
        allocate = allocate or (lambda shape: torch.zeros(shape, dtype=torch.float32, device=device))
        self.caches = {
            group: {name: allocate((slots, *shape))
                    for name, shape in cache_shapes(programs.dims, v.kind, v.ratio).items()}
            for group, v in programs.variants.items()
        }

    def place(self, rank_slots: Sequence[int]) -> None:
        """Every rank's slot count (this one's must be its own): global slot ids, rank-major,
        and each one's owner. Forgets every sequence."""
        world = self.group.world if self.group is not None else 1
        if len(rank_slots) != world or rank_slots[self.rank] != self.own_slots or min(rank_slots) < 1:
            raise ValueError(f"rank {self.rank} of {world} holds {self.own_slots} slots, not those of "
                             f"{tuple(rank_slots)}")
        self.rank_slots = tuple(rank_slots)
        # global slot id → (owning rank, its slot there)
        self.owner = [r for r, n in enumerate(self.rank_slots) for _ in range(n)]
        self.local = [i for n in self.rank_slots for i in range(n)]
        self.lengths = [0] * len(self.owner)  # tokens in each (global) slot's caches, on every rank

    @property
    def slots(self) -> int:
        """Every rank's slots (global ids 0..slots-1)."""
        return len(self.lengths)

    def reset(self, slot: int = 0) -> None:
        self._lead("reset", slot)
        self.lengths[slot] = 0  # rows past a slot's length are never visible: no need to clear them

    def truncate(self, slot: int, length: int) -> None:
        """Forget the slot's tokens from `length` on (a rejected draft)."""
        self._lead("truncate", slot, length)
        self.lengths[slot] = min(self.lengths[slot], length)

    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot `dst` slot `src`'s sequence (its caches and length): `n` choices of one
        prompt share its prefill. Both slots are one rank's; only that rank copies."""
        if self.owner[src] != self.owner[dst]:
            raise ValueError(f"slots {src} and {dst} live on different ranks")
        self._lead("copy_slot", src, dst)
        if self.owner[src] == self.rank:
            a, b = self.local[src], self.local[dst]
            for caches in self.caches.values():
                for cache in caches.values():
                    cache[b].copy_(cache[a])
        self.lengths[dst] = self.lengths[src]

    def _lead(self, op: str, *args) -> None:
        if self.group is not None:  # every rank keeps every slot's length; each its own caches
            self.group.lead(op, *args)

    def idle(self) -> None:
        """Called by a waiting scheduler: rank 0 keeps the other ranks' receives alive."""
        if self.group is not None:
            self.group.ping()

    def _run(self, name: str, *args: torch.Tensor) -> tuple:
        return _as_tuple(self.runners[name](*args))

    def _mode(self, spans: Sequence[tuple[int, int, int]], prefill: bool | None) -> bool:
        """`prefill` (one sequence only), or by default a prefill when it is one sequence's
        several tokens: decided on the whole step, so every rank runs the same mode."""
        if prefill is None:
            return len(spans) == 1 and spans[0][2] > 1
        if prefill and len(spans) != 1:
            raise ValueError("a prefill step holds one sequence")
        return prefill

    def _mine(self, spans: Sequence[tuple[int, int, int]], tokens: torch.Tensor,
              prefill: bool) -> _Rows | None:
        """This rank's rows of the step (slot, start, count per sequence) as program inputs:
        per-row positions, local slots and starts; None when it owns none of them."""
        positions, slots, starts, picked = [], [], [], []
        offset = 0
        for slot, start, count in spans:
            if self.owner[slot] == self.rank:
                positions += range(start, start + count)
                slots += [self.local[slot]] * count
                starts += [start] * count
                picked += range(offset, offset + count)
            offset += count
        if not picked:
            return None
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        some = as_tensor(picked) if len(picked) < offset else None
        tokens = tokens.to(self.device, torch.int64)
        completing = {}
        for ratio in {v.ratio for v in self.p.variants.values() if v.ratio > 0}:  # compressed layers
            done = [i for i, p in enumerate(positions) if (p + 1) % ratio == 0]
            completing[ratio] = as_tensor(done) if done else None
        return _Rows(tokens if some is None else tokens[some], as_tensor(positions), as_tensor(slots),
                     as_tensor(starts), PREFILL if prefill else DECODE, some, slots[0], completing)

    def _layer(self, group: str, x: torch.Tensor | None, r: _Rows | None) -> torch.Tensor | None:
        """One block over this rank's rows (`r`; None: it has none, and only serves its experts)."""
        v = self.p.variants[group]
        names = self.p.cache_names[v.name]
        caches = self.caches[group]
        parallel = self.p.expert_parallel
        out = None
        if r is not None:
            prefill = r.mode == PREFILL
            if self.runners is None:
                x, new = model.block(self.p.dims, v.kind, v.ratio, v.hash_routed, self.w[group], x, r.tokens,
                                     model.Rows(*r.args), caches, prefill, parallel)
                out = (*(x if parallel else (x,)), *(new[n] for n in names))
            else:
                out = self._run(f"{v.name}.{r.mode}", x, r.tokens, *r.args, *(caches[n] for n in names),
                                *self._weights(group, v.name))
        if parallel:  # the routed experts' rows go to their owners; every owner's share comes back
            parts = out[:model.FFN_PARTS] if out is not None else None
            routed = routed_exchange(self.group, self._empty_routed() if parts is None else parts[model.ROUTED_INPUT],
                                     self.experts_per_rank, lambda *rows: self._experts(group, *rows))
            if out is not None:
                out = (model.ffn_out(parts, routed), *out[model.FFN_PARTS:])
        if out is None:
            return None
        for n, new in zip(names, out[1:], strict=True):
            cache = caches[n]
            if n not in WINDOW_CACHES:  # per token
                cache.index_put_((r.slots, r.positions), new.to(cache.dtype))
            elif prefill:  # the slot's every window, recomputed from its rows
                cache[r.first_slot].copy_(new)
            elif (done := r.completing[v.ratio]) is not None:  # only they carry a finished entry
                cache.index_put_((r.slots[done], r.positions[done] // v.ratio), new[done].to(cache.dtype))
        return out[0]

    def _empty_routed(self) -> tuple[torch.Tensor, ...]:
        d, dev = self.p.dims, self.device
        return (torch.empty(0, d.hidden, device=dev), torch.empty(0, d.topk, dtype=torch.int64, device=dev),
                torch.empty(0, d.topk, device=dev))

    def _experts(self, group: str, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's routed experts of `group`'s layer over rows from every rank."""
        w = self.w[group]
        if self.runners is None:
            return model.experts(self.p.dims, w, h, idx, weights, self.expert_base)
        return self._run(EXPERTS_PROGRAM, h, idx, weights, self.expert_base, *self._weights(group, EXPERTS_PROGRAM))[0]

    def _weights(self, group: str, program: str) -> tuple[torch.Tensor, ...]:
        """`program`'s weights of `group`, in its signature's order: looked up once (a layer's
        forty-odd names a call, every step, otherwise)."""
        key = (group, program)
        found = self._weight_args.get(key)
        if found is None:
            found = self._weight_args[key] = tuple(self.w[group][n] for n in self.p.weight_names[program])
        return found

    def _embed(self, r: _Rows) -> torch.Tensor:
        top = self.w["top"]
        if self.runners is None:
            return model.embed(self.p.dims, top, r.tokens)
        return self._run(f"embed.{r.mode}", r.tokens, top["embed.weight"])[0]

    def _head(self, mode: str, x, w: dict[str, torch.Tensor]):
        if self.runners is None:
            return model.head(self.p.dims, w, x)
        return self._run(f"head.{mode}", x, *(w[n] for n in TOP_HEAD))

    def _check(self, batch: Sequence[tuple[int, int, int]]) -> None:
        seen = set()
        for slot, start, count in batch:
            if not 0 <= slot < self.slots or slot in seen:
                raise ValueError(f"slot {slot} is not one of this step's {self.slots} distinct slots")
            seen.add(slot)
            if count < 1:
                raise ValueError(f"slot {slot}: a step appends at least one token")
            if start + count > self.p.dims.max_seq:
                raise ValueError(f"sequence of {start + count} tokens exceeds max_seq={self.p.dims.max_seq}")

    # A step runs in inference mode: no autograd or view bookkeeping on each of the hundreds of
    # small ops an eager step makes (small's eager decode step, 2 AMD cores: 160 → 143 ms). What
    # it returns are inference tensors: read anywhere, changed in place only inside a step.
    @torch.inference_mode()
    def step(self, batch: Batch, prefill: bool | None = None, logits_rows: Sequence[int] | None = None) -> Step:
        """Append each (slot, tokens) to that slot's sequence, all in one call per program: a
        prefill (default: when the batch is one sequence's several tokens) or a decode step,
        whose rows may hold several tokens of a sequence (a packed prompt, a draft to verify).
        One row of logits per token, in batch order (of several ranks: on rank 0) — or, with
        `logits_rows`, only each sequence's last logits_rows[i] rows' (a prompt's next token
        needs its last row's alone): the output head, a vocabulary-wide matmul, then runs on those
        rows only (8 prompts of 32 tokens on `small`: 135 ms of a 1.2 s step otherwise). `hidden`
        keeps every row."""
        spans = [(slot, self.lengths[slot], len(tokens)) for slot, tokens in batch]
        self._check(spans)
        kept = self._kept(spans, logits_rows)
        prefill = self._mode(spans, prefill)
        self._lead("step", batch, prefill)
        self.calls += 1
        swap_point = getattr(self.runners, "swap_point", None)
        if swap_point is not None:  # compiled programs published meanwhile swap in between steps
            swap_point()
        tokens = torch.cat([torch.as_tensor(t, dtype=torch.int64).reshape(-1) for _, t in batch])
        r = self._mine(spans, tokens, prefill)
        x = self._embed(r) if r is not None else None
        for group in self.p.variants:
            if group.startswith("layers."):
                x = self._layer(group, x, r)
        logits = self._head(r.mode, self._rows_kept(x, kept), self.w["top"])[0] if r is not None else None
        for slot, start, count in spans:
            self.lengths[slot] = start + count
        d = self.p.dims
        logits, x = self._gather(spans, (logits, (d.vocab,)), (x, (d.hc, d.hidden)))
        return Step(self._logits_kept(logits, kept), x)

    def _kept(self, spans: Sequence[tuple[int, int, int]], logits_rows: Sequence[int] | None) -> torch.Tensor | None:
        """The rows (in batch order) whose logits are wanted: each sequence's last logits_rows[i];
        None for every row."""
        if logits_rows is None:
            return None
        if len(logits_rows) != len(spans):
            raise ValueError(f"logits_rows names {len(logits_rows)} sequences of a step of {len(spans)}")
        rows, offset = [], 0
        for (slot, _, count), want in zip(spans, logits_rows, strict=True):
            if not 1 <= want <= count:
                raise ValueError(f"slot {slot}: logits of {want} of its {count} rows")
            rows += range(offset + count - want, offset + count)
            offset += count
        return None if len(rows) == offset else torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _rows_kept(self, x: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """The head's input: alone, only the kept rows (of several ranks each computes its own
        rows' logits, and rank 0 keeps the wanted ones once gathered: `_logits_kept`)."""
        return x if kept is None or self.group is not None else x.index_select(0, kept)

    def _logits_kept(self, logits: torch.Tensor | None, kept: torch.Tensor | None) -> torch.Tensor | None:
        if kept is None or self.group is None or logits is None:
            return logits
        return logits.index_select(0, kept.to(logits.device))

    def _gather(self, spans, *outs: tuple[torch.Tensor | None, tuple[int, ...]]) -> tuple:
        """Each output ([rows, *shape], None on a rank without rows) with every rank's rows, in
        the step's order: on rank 0 (elsewhere None); alone, as it is."""
        if self.group is None:
            return tuple(t for t, _ in outs)
        return gather_rows(self.group, [self.owner[slot] for slot, _, _ in spans], [n for _, _, n in spans],
                           outs, self.device)

    def forward(self, tokens: torch.Tensor, slot: int = 0) -> Step:
        """Append `tokens` at the end of one slot's sequence; logits for each of them."""
        return self.step([(slot, tokens)])

    @torch.inference_mode()
    def mtp_step(self, batch: Sequence[tuple[int, int, torch.Tensor, Sequence[int] | torch.Tensor]],
                 prefill: bool | None = None, logits_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Draft logits from the MTP layer for rows of several sequences: per (slot, start,
        hidden [n, hc, D], next tokens [n]), the main model's hc streams of positions start..
        with the token that followed each; returns [R, V] in batch order (of several ranks: on
        rank 0), or only each sequence's last logits_rows[i] rows' (as `step`)."""
        spans = [(slot, start, len(next_tokens)) for slot, start, _, next_tokens in batch]
        self._check(spans)
        kept = self._kept(spans, logits_rows)
        prefill = self._mode(spans, prefill)
        self._lead("mtp_step", batch, prefill)
        self.calls += 1
        next_tokens = torch.cat([torch.as_tensor(t, dtype=torch.int64).reshape(-1) for *_, t in batch])
        r = self._mine(spans, next_tokens, prefill)
        top, mw = self.w["top"], self.w["mtp.0"]
        x = None
        if r is not None:
            hidden = r.of(torch.cat([h for _, _, h, _ in batch]).to(self.device))
            if self.runners is None:
                x = model.mtp_input(self.p.dims, mw, top["embed.weight"][r.tokens], hidden)
            else:
                (x,) = self._run(f"mtp.input.{r.mode}", r.tokens, hidden, top["embed.weight"],
                                 *(mw[n] for n in self.p.weight_names["mtp.input"]))
        x = self._layer("mtp.0", x, r)
        logits = None
        if r is not None:  # MTP's own hc head and norm, over the shared output head
            head = {**{n: mw[n] for n in TOP_HEAD[:-1]}, "head.weight": top["head.weight"]}
            logits = self._head(r.mode, self._rows_kept(x, kept), head)[0]
        return self._logits_kept(self._gather(spans, (logits, (self.p.dims.vocab,)))[0], kept)

    def mtp(self, hidden: torch.Tensor, next_tokens: torch.Tensor, start: int, slot: int = 0) -> torch.Tensor:
        """Draft logits from the MTP layer: hc streams of positions start.., with their next tokens."""
        return self.mtp_step([(slot, start, hidden, next_tokens)])

    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int = 0, slot: int = 0, on_prefill: Callable[[Step], None] | None = None) -> Iterator[int]:
        """Prefill the prompt, then decode up to max_tokens (greedy at temperature 0), alone.
        `on_prefill(step)` sees the prompt's step (its hidden streams feed the MTP layer)."""
        self.reset(slot)
        sampler = Sampler(Sampling(max_tokens, temperature, seed))
        step = self.step([(slot, torch.tensor(prompt, dtype=torch.int64))], logits_rows=[1])
        if on_prefill is not None:
            on_prefill(step)
        for i in range(max_tokens):
            token = sampler.sample(step.logits[-1])
            yield token
            if i + 1 < max_tokens and self.lengths[slot] < self.p.dims.max_seq:
                step = self.step([(slot, torch.tensor([token]))], logits_rows=[1])
            elif i + 1 < max_tokens:
                return
