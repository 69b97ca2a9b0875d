"""The eager driver around the programs: caches, prefill, decode, greedy generation, MTP.

Programs are pure; the engine owns state. It writes the rows each layer program returns into
that layer's fixed-size caches, so prefill and decode are the same computation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from runtime import model
from runtime.model_programs import DECODE, PREFILL, TOP_HEAD, ModelPrograms
from runtime.weights import ModelWeights

Runner = Callable[..., object]


def _as_tuple(out: object) -> tuple:
    return tuple(out) if isinstance(out, list | tuple) else (out,)


def cache_bytes(programs: ModelPrograms) -> int:
    """Bytes of KV-cache state one sequence slot needs at the programs' max_seq."""
    total = 0
    for v in programs.variants.values():
        for shape in model.cache_shapes(programs.dims, v.kind).values():
            total += shape[0] * shape[1] * 4
    return total


@dataclass
class Step:
    logits: torch.Tensor  # [T, V]
    hidden: torch.Tensor  # [T, hc, D]: the last hc residual stream, before the head (MTP's input)


class Engine:
    """One sequence slot of a model over prepared programs (compiled, loaded or eager)."""

    def __init__(self, programs: ModelPrograms, weights: ModelWeights,
                 runners: dict[str, Runner] | None = None, device: str = "cpu",
                 allocate: Callable[[tuple[int, ...]], torch.Tensor] | None = None):
        """`runners` maps program names to prepared programs (flat tensor arguments, packed
        weights). Without runners the engine calls the model's functions directly with weight
        dicts: the eager path, and the only one the float reference weights can take."""
        self.p, self.w, self.device = programs, weights, device
        self.runners = runners
        allocate = allocate or (lambda shape: torch.zeros(shape, dtype=torch.float32, device=device))
        self.caches = {
            group: {name: allocate(shape) for name, shape in model.cache_shapes(programs.dims, v.kind).items()}
            for group, v in programs.variants.items()
        }
        self.length = 0  # tokens in the caches

    def reset(self) -> None:
        self.length = 0  # rows past `length` are never visible, so no need to clear them

    def _run(self, name: str, *args: torch.Tensor) -> tuple:
        return _as_tuple(self.runners[name](*args))

    def _layer(self, group: str, mode: str, x, tokens, positions):
        v = self.p.variants[group]
        names = self.p.cache_names[v.name]
        caches = self.caches[group]
        w = self.w[group]
        if self.runners is None:
            x, rows = model.block(self.p.dims, v.kind, v.ratio, v.hash_routed, w, x, tokens, positions, caches)
            out = (x, *(rows[n] for n in names))
        else:
            out = self._run(f"{v.name}.{mode}", x, tokens, positions, *(caches[n] for n in names),
                            *(w[n] for n in self.p.weight_names[v.name]))
        for n, rows in zip(names, out[1:], strict=True):
            caches[n].index_copy_(0, positions, rows)
        return out[0]

    def _embed(self, mode: str, tokens):
        top = self.w["top"]
        if self.runners is None:
            return model.embed(self.p.dims, top, tokens)
        return self._run(f"embed.{mode}", tokens, top["embed.weight"])[0]

    def _head(self, mode: str, x, w: dict[str, torch.Tensor]):
        if self.runners is None:
            return model.head(self.p.dims, w, x)
        return self._run(f"head.{mode}", x, *(w[n] for n in TOP_HEAD))

    def forward(self, tokens: torch.Tensor) -> Step:
        """Append `tokens` at the end of the sequence; logits for each of them."""
        t = tokens.shape[0]
        if self.length + t > self.p.dims.max_seq:
            raise ValueError(f"sequence of {self.length + t} tokens exceeds max_seq={self.p.dims.max_seq}")
        mode = DECODE if t == 1 else PREFILL
        swap_point = getattr(self.runners, "swap_point", None)
        if swap_point is not None:  # compiled programs published meanwhile swap in between steps
            swap_point()
        tokens = tokens.to(self.device, torch.int64)
        positions = torch.arange(self.length, self.length + t, device=self.device)
        x = self._embed(mode, tokens)
        for group in self.p.variants:
            if group.startswith("layers."):
                x = self._layer(group, mode, x, tokens, positions)
        logits, _ = self._head(mode, x, self.w["top"])
        self.length += t
        return Step(logits, x)

    def mtp(self, hidden: torch.Tensor, next_tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Draft logits from the MTP layer: hc streams of positions start.., with their next tokens."""
        t = next_tokens.shape[0]
        mode = DECODE if t == 1 else PREFILL
        positions = torch.arange(start, start + t, device=self.device)
        next_tokens = next_tokens.to(self.device, torch.int64)
        top, mw = self.w["top"], self.w["mtp.0"]
        if self.runners is None:
            x = model.mtp_input(self.p.dims, mw, top["embed.weight"][next_tokens], hidden)
        else:
            (x,) = self._run(f"mtp.input.{mode}", next_tokens, hidden, top["embed.weight"],
                             *(mw[n] for n in self.p.weight_names["mtp.input"]))
        x = self._layer("mtp.0", mode, x, next_tokens, positions)
        # MTP's own hc head and norm, over the shared output head
        logits, _ = self._head(mode, x, {**{n: mw[n] for n in TOP_HEAD[:-1]}, "head.weight": top["head.weight"]})
        return logits

    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> Iterator[int]:
        """Prefill the prompt, then decode up to max_tokens (greedy at temperature 0)."""
        self.reset()
        gen = torch.Generator().manual_seed(seed)
        step = self.forward(torch.tensor(prompt, dtype=torch.int64))
        for i in range(max_tokens):
            logits = step.logits[-1].float()
            if temperature > 0:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            else:
                token = int(torch.argmax(logits))
            yield token
            if i + 1 < max_tokens and self.length < self.p.dims.max_seq:
                step = self.forward(torch.tensor([token]))
            elif i + 1 < max_tokens:
                return
