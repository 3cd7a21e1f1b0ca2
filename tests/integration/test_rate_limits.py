"""The budget holds across worker processes against a provider enforcing the same limits."""

from __future__ import annotations

import random
import threading

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.limits import counters
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.limits.budget import Budget
from batchgen.registry import LimitShape, get_registry
from batchgen.simulator import SimulatorConfig, SimulatorThread
from batchgen.store import db
from batchgen.store.schema import Item, Tenant
from tests import http_client
from tests.helpers import chat_line, make_tenant, wait_batches
from tests.waiting import poll_until, wait_until

pytestmark = pytest.mark.integration

WINDOW_S = 5.0
TOKENS_PER_WINDOW = 30_000
REQUESTS_PER_WINDOW = 250
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]

MODELS_TOML = """
[models."budgeted"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "budgeted"
budget_key = "budgeted-account"
context_window = 16384
max_output_tokens = 400
tokens_per_min = {tpm}
requests_per_min = {rpm}
max_concurrency = 16
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
encoding = "cl100k_base"
charge_policy = "reserve"
"""


@pytest.fixture
def limited(clean_db, tmp_path, monkeypatch):
    """A simulator enforcing tokens and requests per 5 s window, and a registry saying the same."""
    config = SimulatorConfig(
        tokens_per_min=TOKENS_PER_WINDOW,
        requests_per_min=REQUESTS_PER_WINDOW,
        window_s=WINDOW_S,
        charge_mode="reserve",
        latency_base_ms=30,
        latency_per_token_ms=0.2,
        seed=3,
    )
    with SimulatorThread(config) as sim:
        models = tmp_path / "models.toml"
        models.write_text(
            MODELS_TOML.format(
                base_url=sim.base_url, tpm=TOKENS_PER_WINDOW, rpm=REQUESTS_PER_WINDOW
            )
        )
        env = {
            "BATCHGEN_MODELS_FILE": str(models),
            "BATCHGEN_BUDGET_WINDOW_S": str(WINDOW_S),
            "BATCHGEN_BUDGET_GUARD_S": "1.0",
            "BATCHGEN_MAX_COUNTDOWN_S": "10",
            "BATCHGEN_SWEEP_INTERVAL_S": "1",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()
        yield sim, env
    get_settings.cache_clear()


def mixed_requests(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150)))
        rows.append(
            chat_line(
                f"m{i}",
                model="budgeted",
                text=f"Item {i}: {words}",
                max_tokens=rng.randint(20, 200),
            )
        )
    return rows


@pytest.mark.slow
def test_four_workers_stay_within_the_provider_limits(limited, workers):
    sim, env = limited
    make_tenant("bulk")
    n = 300  # about three windows at the limit
    batch = client.submit_batch(mixed_requests(n), tenant="bulk")
    queues = ["llm.budgeted", "batchgen.control"]
    started = [
        workers(queues, concurrency=8, beat=i == 0, env=env, name=f"w{i}", wait=False)
        for i in range(4)
    ]
    for w in started:
        w.wait_ready()
    wait_batches([batch["id"]], timeout_s=240)

    info = client.get_batch(batch["id"], tenant="bulk")
    assert info["request_counts"]["succeeded"] == n
    stats = http_client.get(f"{sim.base_url}/_sim/stats").json()
    assert stats["max_tokens_in_any_window"] <= TOKENS_PER_WINDOW
    limited_log = [
        e for e in http_client.get(f"{sim.base_url}/_sim/log").json() if e["status"] == 429
    ]
    assert stats["rate_limited"] <= 0.005 * stats["requests"], (stats, limited_log[:5])
    with db.session_scope() as s:
        # Budget waits did not use up failure attempts.
        assert s.scalar(select(func.max(Item.attempts))) <= 2


def test_a_shape_left_unset_learns_the_providers_window(limited, workers, tmp_path, monkeypatch):
    """Against the simulator's (sliding) window limiter, one registry entry declares
    ``limit_shape = "window"`` and one, on its own budget, none: that one starts as a
    bucket, learns the window from the reset headers, and draws no more 429s than the
    declared window, within the limits as tightly."""
    sim, env = limited
    both = (
        MODELS_TOML.replace('"budgeted"', '"declared"')
        .replace('"budgeted-account"', '"declared-account"')
        .replace('group = "declared"', 'group = "budgeted"')
        + 'limit_shape = "window"\n'
    )
    both += MODELS_TOML.replace('"budgeted-account"', '"learned-account"')
    models = tmp_path / "two-models.toml"
    models.write_text(
        both.format(base_url=sim.base_url, tpm=TOKENS_PER_WINDOW, rpm=REQUESTS_PER_WINDOW)
    )
    env = {**env, "BATCHGEN_MODELS_FILE": str(models)}
    monkeypatch.setenv("BATCHGEN_MODELS_FILE", str(models))
    get_settings.cache_clear()
    registry = get_registry()
    assert registry["declared"].limit_shape is LimitShape.WINDOW
    assert registry["budgeted"].limit_shape is None
    make_tenant("bulk")
    workers(["llm.budgeted", "batchgen.control"], concurrency=16, env=env)
    limited_calls: dict[str, int] = {}
    for model in ("declared", "budgeted"):
        http_client.post(f"{sim.base_url}/_sim/reset").raise_for_status()
        rows = mixed_requests(240, seed=11)
        for row in rows:
            row["body"]["model"] = model
        batch = client.submit_batch(rows, tenant="bulk")
        wait_batches([batch["id"]], timeout_s=240)
        assert client.get_batch(batch["id"], tenant="bulk")["request_counts"]["succeeded"] == 240
        stats = http_client.get(f"{sim.base_url}/_sim/stats").json()
        assert stats["max_tokens_in_any_window"] <= TOKENS_PER_WINDOW, (model, stats)
        limited_calls[model] = stats["rate_limited"]
    budget = Budget(get_redis(), get_settings())
    assert budget.shape(registry["budgeted"]) is LimitShape.WINDOW
    assert limited_calls["budgeted"] <= limited_calls["declared"], limited_calls


@pytest.mark.slow
def test_budget_starvation_fails_nothing_and_work_resumes(limited, workers):
    """Budget at zero for a long while: many more budget waits than Celery's default
    max_retries (3), yet no item fails, and all finish once the budget returns."""
    sim, env = limited
    make_tenant("starved")
    spec = get_registry()["budgeted"]
    budget = Budget(get_redis(), get_settings())
    stop = threading.Event()

    def hold_at_zero() -> None:  # the provider keeps answering "come back in 1 s"
        while not stop.is_set():
            budget.cool_down(spec, 1.0)
            stop.wait(0.3)

    holder = threading.Thread(target=hold_at_zero, daemon=True)
    holder.start()
    try:
        batch = client.submit_batch(
            [chat_line(f"s{i}", model="budgeted") for i in range(30)], tenant="starved"
        )
        worker = workers(["llm.budgeted", "batchgen.control"], concurrency=8, env=env)
        # A long while at zero: six budget waits an item on average, twice Celery's
        # default max_retries, before the test looks.
        wait_until(lambda: _budget_denials() > 6 * 30, 90, lambda: f"{_budget_denials()} denials")
        with db.session_scope() as s:
            done = s.scalar(
                select(func.count())
                .select_from(Item)
                .where(Item.status.in_(["succeeded", "failed", "expired"]))
            )
        assert done == 0
        assert stats_requests(sim) == 0  # nothing was sent while the budget was zero
    finally:
        stop.set()
        holder.join()
    wait_batches([batch["id"]], timeout_s=60)
    counts = client.get_batch(batch["id"], tenant="starved")["request_counts"]
    assert counts["succeeded"] == 30 and counts["failed"] == 0
    denials = _budget_denials()
    assert denials > 3 * 30  # far more waits than Celery's max_retries=3 would allow
    assert "Retry in" in worker.log_tail(100_000)  # the waits were Celery retries


def _budget_denials() -> float:
    return counters.read(get_redis(), "budgeted").get(counters.BUDGET_DENIALS, 0.0)


def stats_requests(sim) -> int:
    return http_client.get(f"{sim.base_url}/_sim/stats").json()["requests"]


FAIR_TOML = """
[models."shared"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "shared"
budget_key = "shared-account"
context_window = 16384
max_output_tokens = 400
tokens_per_min = 1000000
requests_per_min = 100000
max_concurrency = 2
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
"""


def succeeded(batch_id: str) -> int:
    with db.session_scope() as s:
        return s.scalar(
            select(func.count())
            .select_from(Item)
            .where(Item.batch_id == batch_id, Item.status == "succeeded")
        )


def _two_tenants(
    tmp_path, monkeypatch, models_toml: str, limited: str, **settings: str
) -> dict[str, str]:
    """The registry ``models_toml`` and ``settings`` in this process's environment (and
    returned for the workers'); tenant ``limited`` allowed one ~75-token item per budget
    window, and tenant ``free`` with no budget of its own."""
    models = tmp_path / "models.toml"
    models.write_text(models_toml)
    env = {
        "BATCHGEN_MODELS_FILE": str(models),
        "BATCHGEN_BUDGET_GUARD_S": "0.5",
        "BATCHGEN_DISPATCH_INTERVAL_S": "0.3",
        **settings,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    make_tenant(limited, tokens_per_min=100)
    make_tenant("free")
    return env


def test_tenant_token_limit_does_not_starve_other_tenants(clean_db, tmp_path, monkeypatch, workers):
    """A tenant allowed one item per budget window fills the model's dispatch window
    (2 slots × 2) with items that only wait for its own budget. Another tenant must
    still run at once: all its items finish before the limited tenant's budget lets
    its second item run (before the fix it could not even start until then)."""
    with SimulatorThread(SimulatorConfig(latency_base_ms=20, seed=5)) as sim:
        env = _two_tenants(
            tmp_path,
            monkeypatch,
            FAIR_TOML.format(base_url=sim.base_url),
            "limited",
            BATCHGEN_BUDGET_WINDOW_S="15",
        )
        slow = client.submit_batch(
            [chat_line(f"l{i}", model="shared") for i in range(12)], tenant="limited"
        )
        workers(["llm.shared", "batchgen.control"], concurrency=4, env=env)
        # The limited tenant's first item ran; the rest now wait on its budget.
        wait_until(lambda: succeeded(slow["id"]) >= 1, 30, "the limited tenant's first item")
        fast = client.submit_batch(
            [chat_line(f"f{i}", model="shared") for i in range(12)], tenant="free"
        )
        poll_until(lambda: succeeded(fast["id"]) >= 12, 60)
        done_fast, done_slow = succeeded(fast["id"]), succeeded(slow["id"])
    get_settings.cache_clear()
    assert done_fast == 12
    assert done_slow == 1


# --- a budget shaped like the provider's limiter ----------------------------------------------

BUCKET_TOML = MODELS_TOML + 'limit_shape = "{shape}"\n'


@pytest.fixture
def bucket_provider(clean_db, tmp_path, monkeypatch):
    """A simulator whose limiter is a token bucket counting its own way (about four bytes a
    token, OpenAI's way: more than tiktoken), per 5 s window; a registry of the same
    limits whose shape each test picks."""
    config = SimulatorConfig(
        tokens_per_min=TOKENS_PER_WINDOW,
        requests_per_min=REQUESTS_PER_WINDOW,
        window_s=WINDOW_S,
        limiter="bucket",
        latency_base_ms=30,
        latency_per_token_ms=0.2,
        seed=4,
    )
    with SimulatorThread(config) as sim:

        def registry(shape: str) -> dict[str, str]:
            models = tmp_path / f"models-{shape}.toml"
            # "learned": the registry sets no shape.
            toml = MODELS_TOML if shape == "learned" else BUCKET_TOML
            models.write_text(
                toml.format(
                    base_url=sim.base_url,
                    tpm=TOKENS_PER_WINDOW,
                    rpm=REQUESTS_PER_WINDOW,
                    shape=shape,
                )
            )
            env = {
                "BATCHGEN_MODELS_FILE": str(models),
                "BATCHGEN_BUDGET_WINDOW_S": str(WINDOW_S),
                "BATCHGEN_BUDGET_GUARD_S": "0.2",
                "BATCHGEN_MAX_COUNTDOWN_S": "10",
                "BATCHGEN_SWEEP_INTERVAL_S": "1",
                "BATCHGEN_DISPATCH_INTERVAL_S": "0.2",
            }
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            get_settings.cache_clear()
            return env

        yield sim, registry
    get_settings.cache_clear()


def provider_efficiency(sim) -> tuple[float, dict]:
    """The fastest finish the provider allowed ÷ ours: from the first admission, a client
    could at best have had everything admitted once its bucket (full at the start)
    refilled what exceeds the capacity; and the simulator's stats."""
    log = [e for e in http_client.get(f"{sim.base_url}/_sim/log").json() if e["status"] == 200]
    starts = sorted(e["start_ts"] for e in log)
    charged = sum(e["charged_tokens"] for e in log)
    rate = TOKENS_PER_WINDOW / WINDOW_S
    fastest = max(0.0, charged - TOKENS_PER_WINDOW) / rate
    stats = http_client.get(f"{sim.base_url}/_sim/stats").json()
    return fastest / (starts[-1] - starts[0]), stats


@pytest.mark.parametrize("shape", ["bucket", "window", "learned"])
def test_a_bucket_budget_keeps_up_with_a_bucket_provider(bucket_provider, workers, shape):
    """Against a token-bucket provider that counts prompts its own way: the bucket shape
    learns the provider's count, with next to no 429s; the window shape stays within the
    limits too; a registry that sets no shape stays a bucket (the reset headers are a
    bucket's) and does as well as the declared one. How near the fastest finish the
    provider allows each shape comes is a speed, measured side by side by bench/peer.py,
    not here: on a loaded machine the workers, not the budget, set the pace."""
    sim, registry = bucket_provider
    env = registry(shape)
    make_tenant("bulk")
    batch = client.submit_batch(mixed_requests(400, seed=5), tenant="bulk")
    workers(["llm.budgeted", "batchgen.control"], concurrency=16, env=env)
    wait_batches([batch["id"]], timeout_s=240)
    assert client.get_batch(batch["id"], tenant="bulk")["request_counts"]["succeeded"] == 400
    efficiency, stats = provider_efficiency(sim)
    ratio = Budget(get_redis(), get_settings()).ratio(get_registry()["budgeted"])
    print(f"{shape}: efficiency {efficiency:.2f}, ratio {ratio:.3f}, 429s {stats['rate_limited']}")
    assert stats["bound"]["tokens"]["respected"], stats["bound"]
    assert stats["rate_limited"] <= 0.02 * stats["requests"], stats
    if shape in ("bucket", "learned"):
        # The simulator counts more than tiktoken (about 1.2x on a quiet machine). Its
        # headers taught the ratio: it left its start and did not collapse. On a loaded
        # machine calls reach the provider later than their grant and the samples run
        # low (0.92 seen at load 10), so how close it comes is measured by bench/peer.py
        # against llmock, not asserted here.
        assert ratio != pytest.approx(get_settings().budget.ratio_start)
        assert ratio > 0.8
    learned = get_redis().hget(keys.budget_shape("budgeted-account"), "shape")
    if shape == "learned":
        assert (
            Budget(get_redis(), get_settings()).shape(get_registry()["budgeted"]).value == "bucket"
        )
        assert learned in (None, b"bucket")
    else:
        assert learned is None  # a declared shape is not learned


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_429_answer_carries_the_providers_rate_limit_headers(kind, stream):
    """The adapters read the rate-limit headers of a 429 too (the budget is calibrated
    from them as from an answer's): the simulator, over its limit, says what is left."""
    from batchgen.errors import RateLimited
    from batchgen.providers import get_provider
    from batchgen.providers.base import ProviderRequest
    from batchgen.registry import ModelSpec

    with SimulatorThread(SimulatorConfig(tokens_per_min=500, requests_per_min=50)) as sim:
        spec = ModelSpec(
            name="limited",
            provider=kind,
            base_url=sim.base_url + ("" if kind == "anthropic" else "/v1"),
            api_key_env="BATCHGEN_TEST_PROVIDER_KEY",
            group="g",
            budget_key="k",
            context_window=16384,
            max_output_tokens=1024,
            tokens_per_min=500,
            requests_per_min=50,
            max_concurrency=2,
            input_usd_per_1m=1.0,
            output_usd_per_1m=1.0,
        )
        request = ProviderRequest(
            spec=spec,
            body={"model": "limited", "messages": [{"role": "user", "content": "hi"}]}
            | {"max_tokens": 400},
            timeout_s=5.0,
            stream=stream,
        )
        provider = get_provider(spec)
        first = provider.complete(request)  # 400 and some of 500: admitted
        assert first.rate_limits.remaining_tokens is not None
        with pytest.raises(RateLimited) as refused:
            provider.complete(request)  # the window holds less than 400 now
    state = refused.value.rate_limits
    assert state is not None and state.remaining_tokens == first.rate_limits.remaining_tokens
    assert state.remaining_requests == 49 and state.reset_tokens_s is not None
    assert refused.value.retry_after_s is not None


HELD_TOML = FAIR_TOML.replace("max_concurrency = 2", "max_concurrency = 4")


def _while_held(tenant: str) -> tuple[bool, int, int]:
    """Whether ``tenant``'s own budget holds it back now (an item it turned away is not
    due yet), how many of its items that budget has turned away so far, and how many
    items of the other tenants run."""
    with db.session_scope() as session:
        tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
        turned_away = Item.tenant_id == tenant_id, Item.error_code == "budget_wait"
        held = session.scalar(
            select(func.count())
            .select_from(Item)
            .where(*turned_away, Item.status == "pending", Item.not_before > func.now())
        )
        count = session.scalar(select(func.count()).select_from(Item).where(*turned_away))
        others_running = session.scalar(
            select(func.count())
            .select_from(Item)
            .where(Item.tenant_id != tenant_id, Item.status == "running")
        )
    return bool(held), count, others_running


def test_a_tenant_held_by_its_own_budget_leaves_the_slots_to_others(
    clean_db, tmp_path, monkeypatch, workers
):
    """Tenant A may run one item per budget window; A and B both have many items on a
    model of 4 slots (a window of 4). Once A's budget turns an item away, the dispatcher
    passes A over while it is held: no more of A's items are released only to be turned
    away again (before the fix each round released one), and B's items fill all 4
    slots."""
    with SimulatorThread(SimulatorConfig(latency_base_ms=400, seed=5)) as sim:
        toml = HELD_TOML.format(base_url=sim.base_url)
        env = _two_tenants(
            tmp_path,
            monkeypatch,
            toml,
            "held",
            BATCHGEN_BUDGET_WINDOW_S="60",
            BATCHGEN_DISPATCH_AHEAD_FACTOR="1",
        )
        client.submit_batch([chat_line(f"a{i}", model="shared") for i in range(30)], tenant="held")
        fast = client.submit_batch(
            [chat_line(f"b{i}", model="shared") for i in range(40)], tenant="free"
        )
        workers(["llm.shared", "batchgen.control"], concurrency=8, env=env)
        poll_until(lambda: _while_held("held")[0], 60, poll_s=0.05)
        held, first_turned_away, _ = _while_held("held")
        assert held, "tenant A's budget never held it back"
        most_running, turned_away = 0, first_turned_away

        def sampled_to_the_end() -> bool:  # while A is held and B runs
            nonlocal held, turned_away, most_running
            held, turned_away, running = _while_held("held")
            most_running = max(most_running, running)
            return not held or succeeded(fast["id"]) >= 40

        wait_until(sampled_to_the_end, 240, "A's hold to end or B to finish", poll_s=0.05)
    get_settings.cache_clear()
    # The items already released when the hold began may still be turned away (the
    # window holds 4); no item of A is released after that while it is held.
    assert turned_away <= 3, f"A's items kept being released while held: {turned_away}"
    assert most_running == 4  # B used every slot
