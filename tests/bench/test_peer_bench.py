"""`dsv4 bench peer`: the service and transformers' generate, side by side on the tiny checkpoint.

Eager programs and a few tokens keep it quick; it pins what the bench reports (greedy tokens of
both sides equal, positive speeds, the keys scripts read), never a speed."""

from __future__ import annotations

import json

import pytest

from bench.peer_bench import PEER, SERVICE, Run, _median, _turns, as_json, measure, tables

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tiny_ckpt_ro):
    return measure("tiny", "eager", prompt_tokens=8, new_tokens=5, repeats=1, ttft_rounds=2, model=tiny_ckpt_ro,
                   log=lambda _line: None)


def test_the_service_and_transformers_generate_the_same_greedy_tokens(result):
    assert result["tokens_equal"] is True
    for side in (SERVICE, PEER):
        assert [len(result[side][8].tokens), len(result[side][8].tokens[0])] == [8, 5]


def test_both_sides_decode_and_answer_a_first_token(result):
    for side in (SERVICE, PEER):
        for n in (1, 8):
            run = result[side][n]
            assert run.decode_tokens_per_s > 0 and run.ttft_s > 0, (side, n)


def test_json_carries_the_ratios_and_the_step_split_the_table_shows(result):
    data = json.loads(json.dumps(as_json(result)))
    assert data["decode_ratio_1"] > 0 and data["decode_ratio_8"] > 0 and data["tokens_equal"] is True
    assert set(data[SERVICE]) == set(data[PEER]) == {"1", "8"}
    split = data["split_s"]["8"]
    assert split["engine step"] > 0 and any(k.startswith("programs ") for k in split)
    # eager programs: every step's routed experts run by `experts.native`'s eager form (the grouped way)
    assert split["programs experts.*"] > 0
    main, step = tables(result)
    assert main[2][-1][-1] == "yes" and step[2][-1][0].startswith("left")


def test_a_side_counts_its_run_of_median_decode_speed_and_its_median_first_token():
    """One run's first token is one step, which a moment's load can double: the figure is the
    median over the runs, beside the run of median decode speed."""
    def run(decode_s: float, ttft_s: float) -> Run:
        return Run(ttft_s=ttft_s, decode_s=decode_s, decode_tokens=10, interval_s=decode_s / 10, tokens=((1,),))

    picked = _median([run(1.0, 1.4), run(2.0, 0.7), run(3.0, 0.9)])
    assert picked.decode_s == 2.0 and picked.ttft_s == 0.9
    # the first tokens measured alone count beside the runs'
    assert _median([run(1.0, 1.4), run(2.0, 0.7), run(3.0, 0.9)], [0.5, 0.6, 0.65]).ttft_s == 0.65


def test_the_side_that_goes_first_alternates():
    sides = {SERVICE: 1, PEER: 2}
    assert [[s for s, _ in _turns(sides, i)] for i in range(3)] == [[SERVICE, PEER], [PEER, SERVICE], [SERVICE, PEER]]
