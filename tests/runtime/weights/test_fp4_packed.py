"""Packer versions 3 and 4: FP4 experts stay packed (two e2m1 codes a byte; 4 places their bits for
the eager decode), so the sidecar is the checkpoint's size, and its size is known from the layout
before anything is packed."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from console.cli import main as cli
from console.tui.panes.sidecars import prepack_line
from runtime.model.config import from_dict, load_config
from runtime.model.ops import e2m1_values, interpreted_trace
from runtime.model.tensors import FP4, all_params
from runtime.synth.checkpoint import V4_FLASH, preset_config_dict
from runtime.weights import prepack as prepack_module
from runtime.weights.layout import EXPERTS, PackedLayout
from runtime.weights.pack import serving_fp4
from store.quant import fp4_codes_to_float, unpack_fp4

SIZE_TARGET = 1.02  # issue 24: sidecar bytes ≤ 1.02 × checkpoint bytes


def test_e2m1_decode_of_every_byte_is_the_value_table():
    """Both decodes of the programs — the float16 bit patterns run eagerly or op by op, and the
    arithmetic a traced program compiles — agree with the checkpoint reader's nibble-by-nibble
    decode for all 256 checkpoint bytes once the packer has placed their bits (`serving_fp4`), in
    the packed orientation [in/2, out]: byte j holds inputs 2j (the checkpoint's low nibble) and
    2j+1 (high)."""
    checkpoint = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    want = fp4_codes_to_float(unpack_fp4(checkpoint.view(torch.int8).reshape(256, 1))).t()  # [2, 256]
    every = serving_fp4(checkpoint)
    assert sorted(every.flatten().tolist()) == list(range(256))  # a bijection: the same bytes, bits moved

    class Decode(torch.nn.Module):
        def forward(self, packed):
            return e2m1_values(packed)

    fused = torch.export.export(Decode(), (every,))  # for a compiler: integer ops it fuses
    with interpreted_trace():  # for the export backend, which runs its graph op by op: bit patterns
        op_by_op = torch.export.export(Decode(), (every,))
    assert torch.equal(e2m1_values(every), want)
    assert torch.equal(fused.module()(every), want) and torch.equal(op_by_op.module()(every), want)

    def ops(program):
        return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}

    lookups = {"aten.embedding.default", "aten.index.Tensor", "aten.index_select.default",
               "aten.gather.default"}

    def viewed_as(program):  # the dtypes a program reads bits as
        return {n.args[1] for n in program.graph.nodes if str(n.target) == "aten.view.dtype"}

    # op by op float16 patterns, widened by torch; fused, float32's bits made in integers (inductor
    # widens float16 one value at a time)
    assert torch.float16 in viewed_as(op_by_op) and viewed_as(fused) == {torch.float32}
    assert not lookups & (ops(op_by_op) | ops(fused))
    # checkpoint 0x67 (low code 7, high 6) and 0xA0 (low 0, high 0xA: -1): magnitudes in bits 0-2 and
    # 3-5, signs in 6 and 7
    assert serving_fp4(torch.tensor([0x67, 0xA0], dtype=torch.uint8)).tolist() == [0b00110111, 0b10010000]
    assert e2m1_values(torch.tensor([[0x37], [0x90]], dtype=torch.uint8)).flatten().tolist() == [6.0, 4.0, 0.0, -1.0]


def test_a_traced_program_multiplies_the_packed_bytes_as_the_eager_path_does():
    """`fp4_rows` (what a compiled picked-expert kernel runs: each byte read once, both codes used
    where they multiply) equals the eager product with the dequantised weight."""
    from runtime.model.ops import fp4_rows, weight

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (3, 2, 64, 16), dtype=torch.uint8, generator=gen)  # [T, k, in/2, out]
    e = torch.randint(120, 134, (3, 2, 4, 16), dtype=torch.uint8, generator=gen)  # one scale / 32 inputs
    x = torch.randn(3, 2, 128, generator=gen)
    want = torch.einsum("tki,tkio->tko", x, weight({"m.qweight": q, "m.qscale": e}, "m"))

    class Rows(torch.nn.Module):
        def forward(self, x, q, e):
            return fp4_rows(x, q, e)

    got = torch.export.export(Rows(), (x, q, e)).module()(x, q, e)
    assert ((got - want).norm() / want.norm()).item() < 1e-6


def test_code_scales_equal_exp2():
    """The codes' scale factors as float32 bits: eagerly exactly 2^(byte - 127 + code_exp) up to
    254 - code_exp, FP4's codes (2^-14) and FP8's (2^-8); traced, 2^(byte - 127)."""
    from runtime.model import codes

    for code_exp in (codes.FP16_CODE_EXP, codes.FP8_CODE_EXP):
        every = torch.arange(255 - code_exp, dtype=torch.uint8)
        assert torch.equal(codes.code_scales(every, code_exp), torch.exp2(every - (127.0 - code_exp)))
    # a trace's (one shift, no exp2 a weight): exact from byte 1 to 255 (inf); byte 0, never packed, reads 0
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(codes.traced_scales(every[1:]), torch.exp2(every[1:] - 127.0))
    assert codes.traced_scales(every[:1]).item() == 0.0


@pytest.mark.parametrize("case", ["tiny", "small", "medium", "v4-flash"])
def test_the_packed_layout_is_the_checkpoints_size(case):
    """Every family keeps its checkpoint bytes (FP4 experts packed as stored, U8 [.., in/2, out]);
    tid2eid alone differs, its int64 ids narrowed to int32; the whole is ≤ 1.02× (torch-free)."""
    config = from_dict(V4_FLASH if case == "v4-flash" else preset_config_dict(case))
    layout = PackedLayout(config)
    for family, (ckpt, packed) in layout.family_bytes().items():
        assert packed == (ckpt // 2 if family == "ffn.gate.tid2eid" else ckpt), family
    assert layout.total_bytes() <= SIZE_TARGET * layout.checkpoint_bytes()
    fp4 = {p.name: p for p in all_params(config) if p.fmt == FP4}
    assert fp4, "the routed experts are FP4"
    for name, p in list(fp4.items())[:50]:
        q = layout.tensors[layout.slots[name].names[0]]
        out, inp = p.shape
        assert q.rule.group == EXPERTS and q.dtype == "U8" and q.shape[-2:] == (inp // 2, out)
    assert not [t.name for t in layout.tensors.values() if t.dtype == "I8"], "no widened int8 copy"


def _tensor_bytes(shard) -> int:
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(shard) - 8 - n


def test_the_plan_knows_what_a_prepack_writes(tiny_ckpt, capsys):
    """`dsv4 plan --json` says the sidecar's size before it exists; the prepack writes exactly
    that many bytes; the checkpoint's bytes are its shards' tensor bytes."""
    assert cli(["plan", str(tiny_ckpt), "--json"]) == 0
    side = json.loads(capsys.readouterr().out)["sidecar"]
    assert side["verdict"] == "REPACK" and side["fits"] is True and side["free_bytes"] > 0
    shards = sorted(tiny_ckpt.glob("model-*.safetensors"))
    assert side["checkpoint_bytes"] == sum(_tensor_bytes(s) for s in shards)
    assert side["expected_bytes"] <= SIZE_TARGET * side["checkpoint_bytes"]
    assert cli(["prepack", str(tiny_ckpt)]) == 0
    capsys.readouterr()
    assert os.path.getsize(tiny_ckpt / "dsv4-packed.r1.safetensors") == side["expected_bytes"]


def test_a_prepack_that_would_not_fit_is_refused_before_it_starts(tiny_ckpt, monkeypatch, capsys):
    """Less free space than the sidecar needs: one line naming both, and no file (not even a
    staging one) is left beside the checkpoint."""
    monkeypatch.setattr(prepack_module, "free_bytes", lambda directory: 4096)
    before = set(os.listdir(tiny_ckpt))
    assert cli(["prepack", str(tiny_ckpt)]) == 1
    err = capsys.readouterr().err.strip()
    needed = prepack_module.sidecar_size(tiny_ckpt, 1).expected_bytes
    assert "\n" not in err and err.startswith("dsv4 prepack: ")
    assert "4.0 KiB free" in err and "a prepack writes" in err and f"{needed / 2**20:.1f} MiB" in err
    assert set(os.listdir(tiny_ckpt)) == before


def test_the_sidecars_pane_says_what_a_prepack_writes():
    import dataclasses

    from runtime.launch.plan_report import SidecarPlan

    side = SidecarPlan(path="/m/dsv4-packed.r1.safetensors", verdict="REPACK", expected_bytes=6 << 20,
                       checkpoint_bytes=6 << 20, free_bytes=10 << 30, fits=True)
    assert prepack_line(side) == "a prepack writes 6.0 MiB, 1.00× the checkpoint; 10.0 GiB free"
    tight = dataclasses.replace(side, free_bytes=1 << 20, fits=False)
    assert prepack_line(tight).startswith("[red]") and "only 1.0 MiB free, p refuses" in prepack_line(tight)


def test_loaded_experts_are_the_packed_bytes(tiny_ckpt_ro):
    """What the programs get for the routed experts is the sidecar's packed bytes: uint8, half
    the inputs — never a float or int8 copy."""
    from runtime.weights.pack import pack_in_memory
    from runtime.weights.views import packed_views
    from store.checkpoint import Checkpoint

    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config)
    ck = Checkpoint.open(tiny_ckpt_ro)
    try:
        views = packed_views(layout, pack_in_memory(ck, layout))
    finally:
        ck.close()
    q = views["layers.0"]["ffn.experts.w1.qweight"]
    assert q.dtype == torch.uint8 and q.shape == (config.n_routed_experts, config.hidden_size // 2,
                                                  config.moe_intermediate_size)
    assert views.nbytes() == layout.total_bytes()
