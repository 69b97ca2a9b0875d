"""`dsv4 bench ranks`: the arithmetic behind its verdicts and projections (no servers)."""

import json

import pytest

from bench.ranks_bench import (
    V4_FLASH_SIDECAR_BYTES,
    added_per_rank,
    parse_ranks,
    rank_memory_target,
    summarize_launch,
    v4_flash_expert_share,
    v4_flash_projection,
)

MiB = 1 << 20


def test_added_memory_per_rank_is_the_pss_growth_spread_over_the_extra_ranks():
    added = added_per_rank({1: 1000 * MiB, 2: 1300 * MiB, 4: 1900 * MiB})
    assert added == {2: 300 * MiB, 4: 300 * MiB}
    assert added_per_rank({2: 1300 * MiB}) == {}  # nothing to compare against without N=1


def test_memory_target_is_five_percent_of_the_sidecar_plus_one_ranks_kv():
    target = rank_memory_target(sidecar_bytes=2000 * MiB, slots=16, slot_bytes=4 * MiB)
    assert target == 100 * MiB + 64 * MiB
    assert 150 * MiB <= target < 300 * MiB  # a duplicated 300 MiB of shared weights would miss


def test_v4_flash_pages_per_rank_are_the_shared_weights_plus_a_slice_of_the_experts():
    rows = v4_flash_projection(per_page_s=1e-7, expert_share=0.75, sidecar_bytes=400 * 4096)
    assert [(r["ranks"], r["pages"]) for r in rows] == [(1, 400), (2, 250), (4, 175), (8, 138)]
    assert rows[1]["seconds"] == pytest.approx(250e-7)
    full = v4_flash_projection(1e-7, 0.0)[0]
    assert full["pages"] == pytest.approx(84.6e6, rel=1e-3)  # the seed's 322.8 GiB, 84.6 M pages
    assert full["bytes"] == V4_FLASH_SIDECAR_BYTES


def test_v4_flash_routed_experts_are_most_of_its_packed_layout():
    share, layout = v4_flash_expert_share()
    old_share, old_layout = v4_flash_expert_share(packer=2)
    assert 0.9 < share < old_share < 1.0
    assert 140 * (1 << 30) < layout < 150 * (1 << 30) < 270 * (1 << 30) < old_layout


def test_rank_counts_that_do_not_divide_the_experts_are_skipped_with_a_reason():
    chosen, skipped = parse_ranks("1,2,3,4,2,x", experts=8)
    assert chosen == [1, 2, 4]
    assert skipped == ["skipping --ranks 3: it does not divide the 8 routed experts",
                       "skipping --ranks x: it does not divide the 8 routed experts"]


def test_launch_summary_names_the_rank_whose_registration_took_longest():
    def event(ts, phase, kind, rank=None, **detail):
        e = {"v": 1, "ts": ts, "phase": phase, "kind": kind, **({"rank": rank} if rank is not None else {})}
        if kind == "end":
            e["seconds"] = 1.0
        if detail:
            e["detail"] = detail
        return json.dumps(e)

    lines = [event(100.5, "check", "start", 0), event(100.6, "check", "start", 1),
             event(101.0, "weights", "end", 0, path="MAP", shared_bytes=10, expert_bytes=4),
             event(103.0, "weights", "end", 1, path="MAP", shared_bytes=10, expert_bytes=4),
             event(103.5, "kv", "end", 1, slots=16, slot_bytes=8),
             event(104.0, "serve", "end", 0, url="http://127.0.0.1:1")]
    summary = summarize_launch(lines, started=100.0)
    assert summary["ready_s"] == pytest.approx(4.0)
    assert summary["slowest_rank"] == 1
    assert summary["ranks"][1]["kv"] == {"slots": 16, "slot_bytes": 8, "total_bytes": None}
    assert summary["ranks"][0]["weights"]["expert_bytes"] == 4


def test_slots_grow_with_the_ranks_against_the_target():
    from bench.ranks_bench import slot_ratios

    out = slot_ratios({1: 40, 2: 80, 4: 150})
    assert out[1] == {"slots": 40, "ratio": 1.0, "met": True}
    assert out[2]["ratio"] == 2.0 and out[2]["met"]
    assert out[4]["ratio"] == 3.75 and not out[4]["met"]  # 150 < 0.95 × 4 × 40 = 152
