"""The admin in a real browser (headless Chromium from Debian's packages, scripts/browser.sh):
log in, see a running job's progress, cancel it, see it end ``cancelled``.

``LEASES_ADMIN_SCREENSHOT=docs/admin.png`` keeps the screenshot of the running job's page (the
README shows it); otherwise it goes under the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from celery_leases.message import GROUP_HEADER
from tests.django.conftest import PROJECT, Shop
from tests.django.test_worker import TASK, job_of, wait_for
from tests.support.message import job_message
from tests.support.service import in_ci, private_redis_url
from tests.support.worker import REPO_ROOT, Spawner

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1500,640",
)  # fmt: skip


def require_browser() -> None:
    if shutil.which("chromium") and os.path.exists(CHROMEDRIVER):
        return
    message = "chromium unreachable: run scripts/browser.sh (Debian's chromium, chromium-driver)"
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def site(shop: Shop, tmp_path: Path) -> Iterator[str]:
    """The project served by ``manage.py runserver``: its base URL."""
    port = free_port()
    log = (tmp_path / "runserver.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        cwd=PROJECT,
        # DEBUG: runserver serves the admin's static files.
        env=shop.environment(CELERY_BROKER_URL="memory://", SHOP_DEBUG="1"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def answers() -> bool | None:
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0 or None

        wait_for("runserver answering", answers, timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.e2e
@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
def test_a_staff_user_sees_a_running_job_progress_in_the_admin_and_cancels_it(
    shop: Shop, site: str, browser: object, spawn: Spawner, queue_name: str, tmp_path: Path
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.expected_conditions import staleness_of
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver: WebDriver = browser  # type: ignore[assignment]
    user = f"staff-{uuid.uuid4().hex[:6]}"
    shop.manage(
        "createsuperuser", "--noinput", "--username", user, "--email", f"{user}@example.com",
        DJANGO_SUPERUSER_PASSWORD="a-long-password-1",
    )  # fmt: skip
    batch = f"browser-{uuid.uuid4().hex[:8]}"
    with private_redis_url() as broker:
        celery = {"CELERY_BROKER_URL": broker, "CELERY_TASK_DEFAULT_QUEUE": queue_name}
        spawn.worker("shop", env=shop.environment(**celery), cwd=PROJECT)
        # Given a long batch running on a real worker
        shop.manage("invoice", batch, "600", "--pause", "0.1", **celery)
        job = wait_for(
            "the batch running",
            lambda: j if (j := job_of(shop, batch)) and (j.progress_done or 0) >= 3 else None,
        )

        # When a staff user logs in and opens the job in the admin's list
        driver.get(f"{site}/admin/login/?next=/admin/celery_leases/job/")
        driver.find_element(By.ID, "id_username").send_keys(user)
        driver.find_element(By.ID, "id_password").send_keys("a-long-password-1")
        driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        driver.get(f"{site}/admin/celery_leases/job/?state__exact=running")
        driver.find_element(By.ID, "toggle-nav-sidebar").click()  # room for the columns
        row = driver.find_element(By.XPATH, f"//tr[.//input[@value='{job.id}']]")

        # Then it shows the job running, with its progress
        assert "running" in row.text
        progress = re.search(r"(\d+)% \((\d+) / 600\)", row.text)
        assert progress is not None and int(progress[2]) >= 3, row.text
        shot = Path(os.environ.get("LEASES_ADMIN_SCREENSHOT") or tmp_path / "admin.png")
        driver.save_screenshot(str(REPO_ROOT / shot if not shot.is_absolute() else shot))

        # When they cancel it with the admin action
        row.find_element(By.NAME, "_selected_action").click()
        Select(driver.find_element(By.NAME, "action")).select_by_value("cancel")
        driver.find_element(By.NAME, "index").click()
        # The action's answer is the next page, once it has loaded: a click does not wait, and
        # the page it leaves has messages of its own (the list warns that no reaper runs), so
        # wait for that page to go, then read the new one's.
        WebDriverWait(driver, 30).until(staleness_of(row))
        said = WebDriverWait(driver, 30, ignored_exceptions=[StaleElementReferenceException]).until(
            lambda d: [m.text for m in d.find_elements(By.CSS_SELECTOR, "ul.messagelist li")]
        )
        assert any("it stops at its next checkpoint and ends cancelled" in m for m in said), (
            said,
            job_of(shop, batch),
        )

        # Then the list soon shows it cancelled, the worker having stopped at a checkpoint
        def cancelled() -> bool | None:
            driver.get(f"{site}/admin/celery_leases/job/?q={job.id}")
            text = driver.find_element(By.XPATH, f"//tr[.//input[@value='{job.id}']]").text
            return "cancelled" in text or None

        wait_for("the job cancelled in the admin", cancelled)
        driver.save_screenshot(str(tmp_path / "admin-cancelled.png"))

    # When they drill into the date hierarchy down to the day the job was created
    day = datetime.fromtimestamp(job.created_at, tz=timezone.utc)  # the project's TIME_ZONE is UTC
    driver.get(f"{site}/admin/celery_leases/job/")
    for _ in range(3):
        links = [
            (parse_qs(urlsplit(a.get_attribute("href") or "").query), a)
            for a in driver.find_elements(By.CSS_SELECTOR, "nav.toplinks a:not(.date-back)")
        ]
        part, chosen = next(
            (
                (part, a)
                for part in ("day", "month", "year")
                for query, a in links
                if query.get(f"created_at__{part}") == [str(getattr(day, part))]
            ),
            ("", None),
        )
        assert chosen is not None, [query for query, _ in links]
        chosen.click()
        if part == "day":
            break

    # Then the day's list holds the job
    WebDriverWait(driver, 30).until(lambda d: "created_at__day=" in d.current_url)
    assert driver.find_elements(By.XPATH, f"//tr[.//input[@value='{job.id}']]"), driver.current_url

    # When they set a free lease key's cursor on its page
    key = f"acct-{uuid.uuid4().hex[:8]}"
    shop.manage("leases", "cursor", key, "--set", '{"page": 1}')
    driver.get(f"{site}/admin/celery_leases/leasekey/{key}/change/")
    field = driver.find_element(By.ID, "id_cursor")
    field.clear()
    field.send_keys('{"page": 12}')
    driver.find_element(By.NAME, "_save").click()
    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "ul.messagelist li"))
    said = [m.text for m in driver.find_elements(By.CSS_SELECTOR, "ul.messagelist li")]

    # Then the page says so, and the store has it
    assert any(f"of '{key}' set to" in m for m in said), said  # the admin capitalizes it
    assert json.loads(shop.manage("leases", "cursor", key).stdout) == {"page": 12}
    ended = job_of(shop, batch)
    assert ended is not None and ended.state == "cancelled"
    assert (ended.progress_done or 0) < 600

    # Given a group of one with a job admitted and one waiting for its admission
    group, tag = f"tenant:browser-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]
    members = [f"g{n}-{tag}" for n in range(2)]
    for job_id in members:
        sent = job_message(job_id, TASK, args=[job_id, 1], **{GROUP_HEADER: group})
        shop.store.register(sent)
    shop.store.admit(group, limits=(1, None), define=True)

    # When they open the job groups' page and follow the group to its jobs
    driver.get(f"{site}/admin/celery_leases/jobgroup/?q={group}")
    row = driver.find_element(By.XPATH, f"//tr[contains(., '{group}')]")
    cells = {
        name: row.find_element(By.CSS_SELECTOR, f".field-{name}").text
        for name in ("limit", "admitted", "waiting")
    }
    row.find_element(By.CSS_SELECTOR, "a[href*='?group=']").click()
    WebDriverWait(driver, 30).until(lambda d: "group=" in d.current_url)
    states = [
        driver.find_element(By.XPATH, f"//tr[.//input[@value='{job_id}']]").text
        for job_id in members
    ]

    # Then the group shows its limit, one admitted and one waiting, and so do its jobs
    assert cells == {"limit": "1", "admitted": "1", "waiting": "1"}
    assert ["queued" in states[0], "waiting" in states[1]] == [True, True], states
