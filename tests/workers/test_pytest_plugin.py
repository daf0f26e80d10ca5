"""The pytest plugin, used the way a user's own test suite uses it (pytester, a fresh pytest)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USER_TASKS = """
import pytest
from celery import Celery

from celery_leases import LeasedTask

stored = []


@pytest.fixture
def leases_app():
    app = Celery("user_app", set_as_current=False)

    @app.task(base=LeasedTask, bind=True, name="user.sync", shared=False)
    def sync(self, pages):
        page = (self.lease.checkpoint or {}).get("page", 0)
        while page < pages:
            stored.append(page)
            page += 1
            self.checkpoint({"page": page}, progress=(page, pages))
        return len(stored)

    stored.clear()
    return app
"""


def run_user_tests(pytester: pytest.Pytester, tests: str) -> pytest.RunResult:
    pytester.makeconftest(USER_TASKS)
    pytester.makepyfile(test_user=tests)
    # A new interpreter: the plugin comes from the installed package's pytest11 entry point.
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=120)


def test_a_users_task_resumes_in_the_leased_worker_after_a_crash(pytester: pytest.Pytester) -> None:
    result = run_user_tests(
        pytester,
        """
        from conftest import stored


        def test_sync_survives_a_crash(leased_app, leased_worker, leases_crash):
            sync = leased_app.tasks["user.sync"]
            leases_crash.after_checkpoint(sync, 2)

            result = sync.delay(5)

            assert result.get(timeout=60) == 5
            assert stored == [0, 1, 2, 3, 4]  # resumed after page 2: nothing stored twice
            job = leases_crash.job(result.id)
            assert (job.state, job.attempts, job.checkpoint) == ("done", 2, {"page": 5})
        """,
    )

    result.assert_outcomes(passed=1)


def test_a_crash_left_to_the_test_resumes_when_it_expires_the_lease_and_reaps(
    pytester: pytest.Pytester,
) -> None:
    result = run_user_tests(
        pytester,
        """
        import time

        from conftest import stored


        def test_sync_waits_for_the_reaper(leased_app, leased_worker, leases_crash):
            sync = leased_app.tasks["user.sync"]
            leases_crash.after_checkpoint(sync, 1, resume=False)
            result = sync.delay(3)
            deadline = time.monotonic() + 30
            while leases_crash.job(result.id).checkpoint is None:
                assert time.monotonic() < deadline, "the first attempt never checkpointed"
                time.sleep(0.05)
            job = leases_crash.job(result.id)
            assert (job.state, job.attempts) == ("running", 1)  # the dead attempt's lease

            assert leases_crash.expire(result.id)
            assert leases_crash.reap().republished == [result.id]

            assert result.get(timeout=60) == 3
            assert stored == [0, 1, 2]
            assert leases_crash.job(result.id).attempts == 2
        """,
    )

    result.assert_outcomes(passed=1)


def test_the_database_is_the_tests_own_and_the_apps_conf_is_put_back(
    pytester: pytest.Pytester,
) -> None:
    result = run_user_tests(
        pytester,
        """
        import pytest

        seen = {}


        @pytest.fixture
        def leases_app():
            from celery import Celery

            app = Celery("kept", set_as_current=False)
            app.conf.leases_duration = 42
            seen["app"] = app
            return app


        def test_first(leased_app, tmp_path):
            assert leased_app.conf.leases_database_url == f"sqlite:///{tmp_path}/leases.sqlite3"
            assert leased_app.conf.leases_duration == 5.0


        def test_after(leases_app):
            assert seen["app"].conf.leases_duration == 42
            assert "leases_database_url" not in seen["app"].conf.changes
        """,
    )

    result.assert_outcomes(passed=2)


def test_run_and_assert_resumable_need_no_worker(pytester: pytest.Pytester) -> None:
    result = run_user_tests(
        pytester,
        """
        from conftest import stored


        def test_resumable(leased_app, leases_crash):
            run = leases_crash.assert_resumable(
                leased_app.tasks["user.sync"], 4, crash_after=[1, 2], reset=stored.clear
            )
            assert run.attempts == 3
        """,
    )

    result.assert_outcomes(passed=1)


def test_an_app_used_before_the_fixture_gets_the_tests_backend_and_broker_then_its_own(
    pytester: pytest.Pytester,
) -> None:
    result = run_user_tests(
        pytester,
        """
        import pytest
        from celery import Celery
        from celery.backends.base import DisabledBackend

        from celery_leases import LeasedTask

        app = Celery("used_before", set_as_current=False)  # no result backend of its own


        @app.task(base=LeasedTask, bind=True, name="user.double", shared=False)
        def double(self, n):
            self.checkpoint({"n": n})
            return 2 * n


        @pytest.fixture
        def leases_app():
            return app


        def test_the_app_is_used_first():
            assert isinstance(app.backend, DisabledBackend)  # built now, and kept by Celery
            assert app.pool.connection.transport_cls == "amqp"


        def test_then_the_worker_fixture(leased_worker):
            assert double.delay(21).get(timeout=30) == 42


        def test_and_again_in_the_next_test(leased_worker):
            assert double.delay(4).get(timeout=30) == 8


        def test_and_after_it_the_apps_own_again():
            assert isinstance(app.backend, DisabledBackend)
            assert app.pool.connection.transport_cls == "amqp"
            app.pool.acquire().release()  # a pool that can still be used, not a closed one
        """,
    )

    result.assert_outcomes(passed=4)
