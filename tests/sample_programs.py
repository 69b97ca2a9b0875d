"""Tiny programs for the program-cache tests (kept in a file: their source is part of the key)."""

from __future__ import annotations

import torch

from runtime.programs.spec import DynamicDim, ProgramSpec, TensorSpec


def _gate(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, dim=-1)


def scaled_mlp(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A pure function of activations and weights (both inputs)."""
    return _gate(torch.relu(x @ w)) * scale


def spec(name: str = "mlp", hidden: int = 8, out: int = 4, **layout: int) -> ProgramSpec:
    return ProgramSpec(
        name=name,
        fn=scaled_mlp,
        inputs=(
            TensorSpec("x", "float32", ("tokens", hidden)),
            TensorSpec("w", "float32", (hidden, out)),
            TensorSpec("scale", "float32", (out,)),
        ),
        dims=(DynamicDim("tokens", 1, 64),),
        layout=layout,
        model_dims={"hidden": hidden, "out": out},
    )


def inputs(tokens: int = 5, hidden: int = 8, out: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, hidden, generator=g),
        torch.randn(hidden, out, generator=g),
        torch.randn(out, generator=g),
    )


def dies(hidden: int):
    """A factory that kills its process, as the OOM killer would kill a compile worker."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def sleeps(seconds: float):
    """A factory that takes a while, like a long compile: cancellation is tested against it."""
    import time

    time.sleep(seconds)
    return scaled_mlp


def noisy(hidden: int):
    """A factory that says more than a pipe holds (as Inductor and Triton can, compiling for a
    GPU) before it returns: a worker writing into a full pipe would never exit."""
    import sys

    for _ in range(4096):
        sys.stderr.write("warning: " + "x" * 246 + "\n")  # 1 MiB in all
    sys.stderr.flush()
    return scaled_mlp


def waits_for(gate: str, seconds: float):
    """A factory whose compile cannot end before the file `gate` exists (it fails after `seconds`):
    overlap of loading and compiling is pinned by outcome, not by the clock."""
    import os
    import time

    deadline = time.monotonic() + seconds
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} never appeared: nothing was loaded while this compiled")
        time.sleep(0.05)
    return scaled_mlp
