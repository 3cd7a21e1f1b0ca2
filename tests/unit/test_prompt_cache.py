"""Prompt caching (batchgen.domain.formats.prompt_cache, batchgen.simulator.caching): the shared
prefix and its key, Anthropic's breakpoint, and the simulated caches' lifetimes."""

from __future__ import annotations

import pytest

from batchgen.domain.formats import prompt_cache
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES
from batchgen.domain.formats.message_batches import NATIVE_PARAMS
from batchgen.domain.formats.prompt_cache import (
    PrefixKeys,
    has_cache_control,
    key_of,
    shared_prefix,
    with_cache_breakpoint,
)
from batchgen.simulator.caching import PromptCache
from batchgen.simulator.flex import FlexTier

MARK = {"type": "ephemeral"}
GUIDE = "Write in the brand's calm voice; never promise delivery dates. " * 120  # ~1400 tokens
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


def chat(product: str, system: str = GUIDE, **extra: object) -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Describe {product}."},
        ],
        **extra,
    }


def test_the_prefix_is_what_comes_before_the_first_user_message():
    a, b = (
        shared_prefix(chat("a chair"), CHAT_COMPLETIONS),
        shared_prefix(chat("a lamp"), CHAT_COMPLETIONS),
    )
    assert a is not None and a == b  # fmt: skip
    assert a[1] == GUIDE
    with_tools = shared_prefix(chat("a chair", tools=TOOLS), CHAT_COMPLETIONS)
    assert with_tools is not None and with_tools[0] != a[0] and "lookup" in with_tools[1]
    assert (
        shared_prefix({"messages": [{"role": "user", "content": "hi"}]}, CHAT_COMPLETIONS) is None
    )
    assert shared_prefix({"input": ["text"]}, EMBEDDINGS) is None
    response = {"instructions": GUIDE, "input": "Describe a chair."}
    found = shared_prefix(response, RESPONSES)
    assert found is not None and found[1] == GUIDE
    native = {NATIVE_PARAMS: {"system": [{"type": "text", "text": GUIDE}], "messages": []}}
    found = shared_prefix({"messages": [], **native}, CHAT_COMPLETIONS)
    assert found is not None and found[1] == GUIDE


def test_one_key_per_model_and_prefix():
    (prefix, _), (other, _) = (
        shared_prefix(chat("x"), CHAT_COMPLETIONS),  # type: ignore[misc]
        shared_prefix(chat("x", system=GUIDE + "!"), CHAT_COMPLETIONS),  # type: ignore[misc]
    )
    assert key_of("m", prefix) == key_of("m", dict(reversed(prefix.items())))
    assert key_of("m", prefix) != key_of("m", other)
    assert key_of("m", prefix) != key_of("n", prefix)
    assert -(2**63) <= key_of("m", prefix) < 2**63  # a bigint


def test_keys_only_for_prefixes_long_enough_each_counted_once(monkeypatch):
    counted: list[str] = []
    real = prompt_cache.count_text

    def counting(text: str, encoding: str, limit: int | None = None) -> int:
        counted.append(text)
        return real(text, encoding, limit)

    monkeypatch.setattr(prompt_cache, "count_text", counting)
    keys = PrefixKeys(lambda model: 1024, lambda model: "cl100k_base")
    first = keys.key("m", chat("a chair"), CHAT_COMPLETIONS)
    assert first is not None
    assert keys.key("m", chat("a lamp"), CHAT_COMPLETIONS) == first
    assert len(counted) == 1  # the shared prefix is counted once per batch
    assert keys.key("m", chat("a desk", system="Be brief."), CHAT_COMPLETIONS) is None
    # Long in bytes but short in tokens: counted, and too short.
    assert keys.key("m", chat("a rug", system="a" * 2000), CHAT_COMPLETIONS) is None
    alone = keys.key("m", chat("a sofa", system=GUIDE + " Sofas only."), CHAT_COMPLETIONS)
    assert alone is not None and keys.singles() == [alone]
    assert keys.counts[first] == 2
    # A model with prompt_cache = false keeps no keys.
    off = PrefixKeys(lambda model: None, lambda model: "cl100k_base")
    assert off.key("m", chat("a chair"), CHAT_COMPLETIONS) is None


def test_a_breakpoint_goes_on_the_system_prompt_where_the_request_has_none():
    params = {"system": GUIDE, "messages": [{"role": "user", "content": "hi"}]}
    marked = with_cache_breakpoint(params)
    assert marked["system"] == [
        {"type": "text", "text": GUIDE, "cache_control": {"type": "ephemeral"}}
    ]
    assert params["system"] == GUIDE  # not in place
    blocks = {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert with_cache_breakpoint(blocks)["system"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
    ]
    tools = {"tools": [{"name": "a"}, {"name": "b"}], "messages": []}
    assert with_cache_breakpoint(tools)["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in with_cache_breakpoint(tools)["tools"][0]


@pytest.mark.parametrize(
    "params",
    [
        {"system": [{"type": "text", "text": GUIDE, "cache_control": {"type": "ephemeral"}}]},
        {
            "system": GUIDE,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
                    ],
                }
            ],
        },
        {"messages": [{"role": "user", "content": "no system, no tools"}]},
    ],
)
def test_a_request_with_breakpoints_of_its_own_or_no_prefix_is_left_alone(params):
    assert with_cache_breakpoint(params) is params
    assert has_cache_control(params) is ("cache_control" in str(params))


def test_a_simulated_cache_entry_lives_ttl_after_its_last_use():
    now = [0.0]
    cache = PromptCache(ttl_s=300.0, clock=lambda: now[0])
    scope = ("key_a", "m")
    assert cache.use(scope, "p") is False  # written
    now[0] = 299.0
    assert cache.use(scope, "p") is True  # read, and kept warm
    now[0] = 598.0
    assert cache.use(scope, "p") is True
    assert cache.use(("key_b", "m"), "p") is False  # another organisation's cache
    assert cache.use((scope[0], "other-model"), "p") is False
    now[0] = 898.1
    assert cache.use(scope, "p") is False  # idle past its time: cold again
    off = PromptCache(ttl_s=0.0, clock=lambda: now[0])
    assert off.use(scope, "p") is False and off.use(scope, "p") is False and not len(off)


def test_a_simulated_cache_drops_the_least_recently_used():
    cache = PromptCache(ttl_s=300.0, max_entries=2, clock=lambda: 0.0)
    scope = ("k", "m")
    cache.use(scope, "a")
    cache.use(scope, "b")
    cache.use(scope, "a")  # a is now the most recent
    cache.use(scope, "c")  # b goes
    assert cache.use(scope, "a") and cache.use(scope, "c") and not cache.use(scope, "b")


def test_the_simulated_flex_tier_is_busy_at_its_capacity_per_deployment():
    tier = FlexTier(seed=1)
    assert not tier.refuses("east", 2, 0.0)
    tier.enter("east")
    tier.enter("east")
    assert tier.refuses("east", 2, 0.0)
    assert not tier.refuses("west", 2, 0.0)
    tier.leave("east")
    assert not tier.refuses("east", 2, 0.0)
    assert not tier.refuses("east", None, 0.0)
    drawn = [FlexTier(seed=9).refuses(None, None, 0.5) for _ in range(1)]
    assert drawn == [FlexTier(seed=9).refuses(None, None, 0.5)]  # seeded
    assert all(tier.refuses(None, None, 1.0) for _ in range(5))


def test_a_tenants_picks_of_one_group_go_where_the_first_of_them_was():
    from batchgen.domain.scheduling.round_robin import interleave, order_picks

    # (name, group): the store's order, batches a and b sharing prefixes, c none.
    picks = [("a0", "A"), ("b0", "B"), ("c0", None), ("a1", "A"), ("b1", "B"), ("c1", None)]
    group = {name: g for name, g in picks}.get
    names = [name for name, _ in picks]
    assert order_picks(names) == names  # no grouping asked: the store's order
    grouped = order_picks(names, group)
    assert grouped == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert sorted(grouped) == sorted(names)  # who runs first, never how many
    # In a round, each tenant's places take its picks in that order.
    released = interleave([1, 2, 1, 2, 1, 1, 1, 1], {1: names, 2: ["x0", "x1"]}, group)
    assert released == ["a0", "x0", "a1", "x1", "b0", "b1", "c0", "c1"]
