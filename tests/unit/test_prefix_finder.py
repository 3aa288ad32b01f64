"""The prefixes a job's items share (``backfill.prefixes``): whole blocks every member of a
group starts with, the longest such, groups of two items at least, one id per prefix."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.prefix_pass import prefix_body
from backfill.prefixes import SharedPrefix, cacheable_blocks, prefix_id, shared_prefixes
from backfill.reservations import reservation_tokens

BLOCK = 4

# Small alphabets so prompts share prefixes often; a few instructions in front of documents.
_tokens = st.lists(st.integers(0, 3), max_size=14)
_instructions = st.lists(st.lists(st.integers(0, 3), max_size=13), min_size=1, max_size=3)


@st.composite
def _job(draw: st.DrawFn) -> list[list[int] | None]:
    heads = draw(_instructions)
    prompts: list[list[int] | None] = []
    for _ in range(draw(st.integers(0, 10))):
        if draw(st.integers(0, 9)) == 0:
            prompts.append(None)
            continue
        head = draw(st.sampled_from(heads))
        prompts.append(head + draw(_tokens))
    return prompts


def _groups(found: list[SharedPrefix | None]) -> dict[SharedPrefix, list[int]]:
    groups: dict[SharedPrefix, list[int]] = defaultdict(list)
    for at, shared in enumerate(found):
        if shared is not None:
            groups[shared].append(at)
    return groups


@given(_job(), st.integers(1, 5))
def test_every_member_starts_with_its_groups_prefix_in_whole_cacheable_blocks(
    prompts: list[list[int] | None], block: int
) -> None:
    found = shared_prefixes(prompts, block, scope="t", model="m")
    assert len(found) == len(prompts)
    for shared, members in _groups(found).items():
        assert len(members) >= 2
        assert shared.blocks >= 1
        length = shared.tokens(block)
        heads = set()
        for at in members:
            prompt = prompts[at]
            assert prompt is not None
            # The engine computes the last token again: the prefix leaves it out.
            assert length <= len(prompt) - 1
            heads.add(tuple(prompt[:length]))
        assert len(heads) == 1
        assert shared.id == prefix_id("t", "m", next(iter(heads)))


@given(_job(), st.integers(1, 5))
def test_a_groups_prefix_is_the_longest_its_members_share(
    prompts: list[list[int] | None], block: int
) -> None:
    found = shared_prefixes(prompts, block, scope="t", model="m")
    for shared, members in _groups(found).items():
        longer = (shared.blocks + 1) * block
        member_prompts = [prompts[at] for at in members]
        fits = all(p is not None and longer <= len(p) - 1 for p in member_prompts)
        same = len({tuple(p[:longer]) for p in member_prompts if p is not None}) == 1
        assert not (fits and same)


@given(_job(), st.integers(1, 5))
def test_an_item_shares_nothing_only_when_no_other_item_shares_its_first_block(
    prompts: list[list[int] | None], block: int
) -> None:
    found = shared_prefixes(prompts, block, scope="t", model="m")
    for at, shared in enumerate(found):
        prompt = prompts[at]
        if prompt is None or cacheable_blocks(len(prompt), block) < 1:
            assert shared is None
            continue
        peers = [
            other
            for j, other in enumerate(prompts)
            if j != at
            and other is not None
            and cacheable_blocks(len(other), block) >= 1
            and other[:block] == prompt[:block]
        ]
        assert (shared is None) == (not peers)
        # Items of one first block are one group.
        for j, other in enumerate(prompts):
            if other is not None and found[j] is not None and other[:block] == prompt[:block]:
                assert found[j] == shared


@given(st.data())
def test_the_order_of_the_lines_changes_nothing(data: st.DataObject) -> None:
    prompts = data.draw(_job())
    order = data.draw(st.permutations(range(len(prompts))))
    found = shared_prefixes(prompts, BLOCK, scope="t", model="m")
    shuffled = shared_prefixes([prompts[i] for i in order], BLOCK, scope="t", model="m")
    assert shuffled == [found[i] for i in order]


def test_a_summarisation_job_shares_its_instruction_and_two_instructions_make_two_groups() -> None:
    summarise = list(range(100, 110))  # 10 tokens: two whole blocks and a straddling one
    translate = list(range(200, 209))
    prompts: list[list[int] | None] = [
        [*summarise, 1, 2, 3],
        [*summarise, 4, 5],
        [*translate, 6, 7, 8, 9],
        [*translate, 1],
        [7, 7, 7, 7, 7, 7],  # alone: shares nothing
    ]
    found = shared_prefixes(prompts, BLOCK, scope="tenant-a", model="m")
    assert found[0] == found[1] == SharedPrefix(prefix_id("tenant-a", "m", summarise[:8]), 2)
    assert found[2] == found[3] == SharedPrefix(prefix_id("tenant-a", "m", translate[:8]), 2)
    assert found[4] is None


def test_a_prefix_is_named_by_its_tokens_model_and_tenant() -> None:
    tokens = [1, 2, 3, 4]
    assert prefix_id("a", "m", tokens) == prefix_id("a", "m", list(tokens))
    assert prefix_id("a", "m", tokens) != prefix_id("b", "m", tokens)
    assert prefix_id("a", "m", tokens) != prefix_id("a", "m2", tokens)
    assert prefix_id("a", "m", tokens) != prefix_id("a", "m", [1, 2, 3, 5])
    # No ambiguity where scope and model meet.
    assert prefix_id("ab", "c", tokens) != prefix_id("a", "bc", tokens)


def test_a_prompt_of_exactly_one_block_has_nothing_the_cache_can_serve() -> None:
    prompts: list[list[int] | None] = [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert shared_prefixes(prompts, BLOCK, scope="t", model="m") == [None, None]


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        shared_prefixes([[1]], 0, scope="t", model="m")


def test_only_single_prompt_single_sequence_generations_look_for_a_prefix() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    request = prefix_body("/v1/chat/completions", chat)
    assert request is not None
    assert request["messages"] == chat["messages"]
    assert "model" not in request
    assert prefix_body("/v1/chat/completions", {**chat, "n": 2}) is None
    assert prefix_body("/v1/embeddings", {"model": "m", "input": "hi"}) is None
    assert prefix_body("/v1/completions", {"model": "m", "prompt": ["a", "b"]}) is None
    assert prefix_body("/v1/completions", {"model": "m", "prompt": [1, 2, 3]}) is None
    assert prefix_body("/v1/completions", {"model": "m", "prompt": "a"}) == {"prompt": "a"}
    assert prefix_body("/v1/chat/completions", {"model": "m", "messages": []}) is None


@given(
    st.integers(1, 40),
    st.integers(1, 500),
    st.integers(0, 500),
    st.sampled_from([1, 4, 16]),
)
def test_an_item_reserves_its_own_blocks_the_straddling_one_whole(
    prefix_blocks: int, suffix: int, out: int, block: int
) -> None:
    prefix = prefix_blocks * block
    prompt = prefix + suffix
    whole = reservation_tokens(prompt, out, block)
    own = reservation_tokens(prompt, out, block, prefix_tokens=prefix)
    assert own == whole - prefix
    assert own % block == 0
    assert own >= suffix + out  # the suffix and the output always fit its own blocks
    assert own - block < suffix + out  # and no whole block more


def test_a_shared_prefix_of_several_sequences_or_part_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="shared prefix"):
        reservation_tokens(100, 10, 16, 2, prefix_tokens=16)
    with pytest.raises(ValueError, match="shared prefix"):
        reservation_tokens(100, 10, 16, prefix_tokens=20)
    with pytest.raises(ValueError, match="shared prefix"):
        reservation_tokens(32, 10, 16, prefix_tokens=32)
