"""The eager model as the oracle of the service's log-probabilities: the float32 log-softmax of
one forward pass over a token sequence (row i predicts token i + 1)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from runtime.engine.engine import Engine
from runtime.model.config import load_config
from runtime.programs.catalog import build_programs
from runtime.weights.pack import PackedLayout, pack_in_memory
from runtime.weights.views import packed_views
from store.checkpoint import Checkpoint


def eager_model(model_dir: Path, max_seq: int = 64) -> tuple[Callable[[list[int]], torch.Tensor], Callable]:
    """(log_softmax(ids) → [len(ids), V], a fresh eager Engine) over the checkpoint's packed weights."""
    config = load_config(model_dir)
    layout = PackedLayout(config, ranks=1)
    weights = packed_views(layout, pack_in_memory(Checkpoint.open(model_dir), layout))

    def engine() -> Engine:
        return Engine(build_programs(config, layout, max_seq=max_seq), weights)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(engine().forward(torch.tensor(ids)).logits.float(), -1)

    return log_softmax, engine


def loglikelihood(lp: torch.Tensor, ids: list[int], start: int) -> float:
    """The summed log-probability of ids[start:] given what precedes each (what lm-eval computes)."""
    return sum(float(lp[i - 1, ids[i]]) for i in range(start, len(ids)))
