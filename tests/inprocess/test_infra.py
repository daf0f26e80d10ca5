"""The test infrastructure itself: the check that a service answers.

Real workers and beat on real brokers are tested in tests/workers/test_infra.py.
"""

from __future__ import annotations

import pytest

from tests.support import service as services


def test_an_unreachable_service_skips_the_test_or_fails_it_in_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(services.URLS, "redis", "redis://127.0.0.1:9/0")
    monkeypatch.setattr(services, "_checked", {})
    for ci, outcome in (("false", pytest.skip.Exception), ("true", pytest.fail.Exception)):
        monkeypatch.setenv("CI", ci)
        with pytest.raises(outcome, match=r"redis unreachable at redis://127\.0\.0\.1:9/0: "):
            services.require("redis")
