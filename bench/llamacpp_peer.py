"""`dsv4 bench peer --peer llama.cpp`: our `dsv4 serve` against llama.cpp's server on the same weights.

The peer is the engine an operator would otherwise pick on a CPU: llama.cpp's `llama-server`, built
once from the `llama-cpp-python` package's vendored sources (the sdist from PyPI, `pip download
--no-binary`; cmake's `llama-server` target, release, this cpu's ISA) and kept under the user cache
dir (`<cache>/dsv4-console/llama.cpp/build-<version>/`), never in the project. The checkpoint is
converted by llama.cpp's own converter (`convert_hf_to_gguf.py`, its `deepseek4` architecture) at its
own types (FP4 experts as MXFP4, FP8 as Q8_0, BF16 kept: about the bytes the service reads) for the
figures, and at all-float32 for the tokens (flash attention off: then llama.cpp's greedy tokens are
transformers', as the service's are), each once per checkpoint and kept beside the build.

Both servers are real processes on loopback, on the same threads (torch's count: one rank's), and
take turns: streamed greedy completions of the same token-id prompts (`ignore_eos`), 1 request and
CONCURRENT at once (`-np` slots), REPEATS times, then first tokens alone (`bench.peer_bench`'s runs
and medians). Ratios are service ÷ llama.cpp (above 1: the service is faster). Where llama.cpp cannot
run a checkpoint (it refuses `tiny`: compression ratios other than 0/4/128, an indexer head under 64),
the bench says why in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE = "llama-cpp-python"
PEER = "llama.cpp"
SERVER = "llama-server"
BUILD_TIMEOUT_S = 4 * 3600  # two cores build it in about an hour
CONVERT_TIMEOUT_S = 3600
START_TIMEOUT_S = 600
OWN_TYPES, FLOAT32 = "auto", "f32"  # the converter's --outtype: its own types per tensor, or all float32


class PeerUnavailable(RuntimeError):
    """llama.cpp cannot be built, convert this checkpoint, or serve it: the one line why."""


def cache_root() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("dsv4-console")) / "llama.cpp"


def _run(cmd: list[str], log_file: Path, timeout: float, env: dict | None = None, cwd: Path | None = None) -> None:
    with open(log_file, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=cwd,
                              stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
        raise PeerUnavailable(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} failed ({log_file}): {' / '.join(tail)}")


def sources(log: Callable[[str], None]) -> Path:
    """The vendored llama.cpp of the newest `llama-cpp-python` sdist, downloaded and unpacked once."""
    root = cache_root() / "src"
    found = sorted(root.glob(f"{PACKAGE.replace('-', '_')}-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    root.mkdir(parents=True, exist_ok=True)
    log(f"{PEER}: pip download {PACKAGE} --no-binary (its vendored sources) …")
    _run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-binary", ":all:", "--no-deps", "-d", str(root)],
         root / "download.log", 600)
    archive = sorted(root.glob(f"{PACKAGE.replace('-', '_')}-*.tar.gz"))[-1]
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return sorted(root.glob(f"{PACKAGE.replace('-', '_')}-*/vendor/llama.cpp"))[-1]


def server(log: Callable[[str], None]) -> Path:
    """The `llama-server` binary, built once (cmake, release, native ISA, no network code)."""
    src = sources(log)
    version = src.parents[1].name.rsplit("-", 1)[-1]
    build = cache_root() / f"build-{version}"
    binary = build / "bin" / SERVER
    if binary.is_file():
        return binary
    log(f"{PEER}: building {SERVER} {version} from {src} (once; long on few cores) …")
    configure = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    _run(configure, cache_root() / f"configure-{version}.log", 600)
    _run(["cmake", "--build", str(build), "--target", SERVER, "-j", str(os.cpu_count() or 1)],
         cache_root() / f"build-{version}.log", BUILD_TIMEOUT_S)
    if not binary.is_file():
        raise PeerUnavailable(f"{PEER}: the build made no {binary}")
    return binary


def _checkpoint_id(model: Path) -> str:
    """The checkpoint as the conversion depends on it: its config and each file's name, size, mtime."""
    h = hashlib.sha256((model / "config.json").read_bytes())
    for f in sorted(model.iterdir()):
        if f.is_file() and f.suffix in (".safetensors", ".json"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def gguf(model: Path, outtype: str, log: Callable[[str], None]) -> Path:
    """The checkpoint converted by llama.cpp's converter at `outtype`, once (written aside, renamed)."""
    src = sources(log)
    out = cache_root() / "gguf" / f"{model.name}-{_checkpoint_id(model)}.{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"{PEER}: converting {model} with its convert_hf_to_gguf.py (--outtype {outtype}) …")
    partial = out.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(src), str(src / "gguf-py")))}
    _run([sys.executable, "-c", _CONVERT, "f32" if outtype == FLOAT32 else "own", str(src / "convert_hf_to_gguf.py"),
          str(model), "--outtype", outtype, "--outfile", str(partial)], out.with_suffix(".log"), CONVERT_TIMEOUT_S,
         env=env)
    os.replace(partial, out)
    return out


# The converter as is, but for two things. It names the tokenizer's pre-tokenizer from a hash of its
# output on a test text, and the synthetic checkpoints' byte-level BPE is none it knows ("BPE
# pre-tokenizer was not recognized"): an unknown one converts as llama.cpp's "default" (the bench sends
# token ids, so no text is ever split by it). And its deepseek4 model keeps its own types whatever
# --outtype says (Q8_0 for FP8, MXFP4 experts, BF16): for the float32 conversion every tensor is
# forced to F32 and each routed expert's FP4 codes are dequantised (e2m1 value x 2^(scale - 127), 32
# inputs a scale) into an F32 stack, the numbers the service multiplies.
_CONVERT = """
import runpy, sys
import numpy as np
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = pre
if sys.argv[1] == "f32":
    import gguf, torch
    import conversion.deepseek as ds
    ds.DeepseekV4Model.tensor_force_quant = lambda self, name, new_name, bid, n_dims: gguf.GGMLQuantizationType.F32
    E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    def experts_f32(self, bid, proj, key):
        stack, consumed = [], []
        for eid in range(self.hparams["n_routed_experts"]):
            w, s = (f"layers.{bid}.ffn.experts.{eid}.{proj}.{part}" for part in ("weight", "scale"))
            packed = ds.LazyTorchTensor.to_eager(self.model_tensors[w]()).view(torch.uint8)
            scale = ds.LazyTorchTensor.to_eager(self.model_tensors[s]()).view(torch.uint8)
            codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
            values = E2M1[codes] * torch.exp2(scale.float() - 127).repeat_interleave(32, 1)
            stack.append(values.float().numpy())
            consumed += [w, s]
        self.gguf_writer.add_tensor(self.format_tensor_name(key, bid), np.stack(stack))
        return consumed
    ds.DeepseekV4Model._write_mxfp4_expert_tensor = experts_f32
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _first_error(log_file: Path) -> str:
    """The first error line of a llama-server log, without its timestamp (`E llama_model_load: error
    loading model: DeepSeek-V4 loader only supports compression ratios 0, 4, and 128`), else its last line."""
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    for line in lines:
        head, sep, rest = line.partition(" E ")
        if sep and not head.strip(" .0123456789"):
            return rest.split("error loading model: ", 1)[-1]
    return lines[-1] if lines else "no output"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `llama-server` of one GGUF on loopback: `threads`, `slots` sequences of `ctx` tokens each."""

    def __init__(self, binary: Path, model: Path, threads: int, slots: int, ctx: int, log_file: Path,
                 flash_attention: bool = True, float_cache: bool = False):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-np", str(slots), "-c", str(ctx * slots),
               "-fa", "on" if flash_attention else "off",
               "--no-webui", *(("-ctk", "f32", "-ctv", "f32") if float_cache else ())]
        self._log = open(log_file, "w")  # noqa: SIM115 — the server's whole life
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait(log_file)

    def _wait(self, log_file: Path) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"{SERVER} exited {self.proc.returncode}: {_first_error(log_file)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise PeerUnavailable(f"{SERVER} did not answer /health within {START_TIMEOUT_S} s ({log_file})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def stream(client, url: str, prompt: list[int], new_tokens: int) -> tuple[float, float, float, list[int]]:
    """One streamed greedy completion from llama-server's /completion (token ids in and out): (sent,
    first token, last token) perf_counter times, ids (`bench.peer_bench.service_run`'s `stream`)."""
    # the last token it predicts never reaches the stream (its final chunk carries none): one more is
    # asked, and the first `new_tokens` kept
    body = {"prompt": prompt, "n_predict": new_tokens + 1, "temperature": 0, "top_k": 1, "stream": True,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
    ids: list[int] = []
    sent = time.perf_counter()
    first = last = sent
    # a connection of its own: llama-server drops one kept alive after a stream, and the next request
    # on it failed ("Server disconnected without sending a response")
    with client.stream("POST", f"{url}/completion", json=body, headers={"Connection": "close"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got = (json.loads(line[6:]).get("tokens") or [])[:new_tokens - len(ids)]
                if got:
                    last = time.perf_counter()
                    if not ids:
                        first = last
                    ids += got
                if len(ids) >= new_tokens:
                    break
    return sent, first, last, ids


def reference_tokens(model: Path, batch: list[list[int]], new_tokens: int, threads: int, ctx: int,
                     log: Callable[[str], None], work: Path) -> tuple[tuple[int, ...], ...]:
    """llama.cpp's greedy tokens of every prompt on the all-float32 conversion, its KV cache float32
    too (its default is float16), flash attention off."""
    import httpx

    binary = server(log)
    f32 = gguf(model, FLOAT32, log)
    with Server(binary, f32, threads, 1, ctx, work / "llama-server-f32.log", flash_attention=False,
                float_cache=True) as s, \
            httpx.Client(timeout=3600) as client:
        return tuple(tuple(stream(client, s.url, p, new_tokens)[3]) for p in batch)
