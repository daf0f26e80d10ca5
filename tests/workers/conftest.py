"""Fixtures of the tests that run real workers: a ``scenario`` factory over the shared fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.scenario import Scenario, kill_all
from tests.support.service import private_redis_url
from tests.support.worker import Spawner


@pytest.fixture
def scenario(
    spawn: Spawner, database_url: str, table_name: str
) -> Iterator[Callable[..., Scenario]]:
    """``scenario(broker_settings, **app_env options)``: a Scenario on this test's database
    and table; closed (client app, engines) at teardown, before the table is dropped."""
    made: list[Scenario] = []

    def make(broker: dict[str, Any], **options: Any) -> Scenario:
        made.append(
            Scenario.create(
                spawn, broker=broker, database_url=database_url, table=table_name, **options
            )
        )
        return made[-1]

    yield make
    spawn.stop_all()
    for made_scenario in made:
        made_scenario.close()


@pytest.fixture
def result_backend(celery_settings: dict[str, Any]) -> Iterator[str]:
    """A Redis result backend of this test's own: the broker's database on Redis, a private
    database otherwise (the rpc:// backend hands each result out only once)."""
    broker = celery_settings["broker_url"]
    if broker.startswith("redis"):
        yield broker
        return
    with private_redis_url() as url:
        yield url


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """SIGKILL the test's workers and beat before any fixture is torn down: nothing is left to
    shut down gracefully, and a warm shutdown of each costs ~2 s."""
    spawner = getattr(item, "funcargs", {}).get("spawn")
    if isinstance(spawner, Spawner):
        kill_all(spawner)
    return (yield)
