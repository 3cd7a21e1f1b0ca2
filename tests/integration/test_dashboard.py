"""The batch dashboard in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium) signs in with a tenant's key, submits a JSONL
file, watches the progress refresh live, opens the batch's page, cancels, and signs in
again as an admin (every tenant's batches, the models, the charts).
Screenshots go to the test's folder, and to ``BATCHGEN_SCREENSHOTS_DIR`` when set
(docs/screenshots/ holds a run's).

Without Chromium the test installs Debian's packages (as root, from the registry),
so it runs wherever the suite runs; it is skipped only where that cannot be done
outside CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import http_client
from tests.helpers import chat_line, jsonl, make_tenant, sim_config
from tests.invariants import wait_until

CHROMEDRIVER = "/usr/bin/chromedriver"
# On a fresh machine the first test also pays for apt-get installing Chromium (the
# fixture's set-up counts toward the test's time-out), as the host-project test does
# for its wheelhouse.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def _install_chromium() -> str | None:
    """Debian's chromium and chromium-driver, installed if missing; None when they
    cannot be (not root, no apt)."""
    if shutil.which("chromedriver") or Path(CHROMEDRIVER).exists():
        return shutil.which("chromedriver") or CHROMEDRIVER
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # an old package list: refresh it once
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=900)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    return shutil.which("chromedriver") if done.returncode == 0 else None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = _install_chromium()
    if driver_path is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium and chromium-driver could not be installed")
        pytest.skip("no Chromium here, and no root to install Debian's packages")
    options = webdriver.ChromeOptions()
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(argument)
    chromium = shutil.which("chromium")
    if chromium:
        options.binary_location = chromium
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


class Shots:
    """Screenshots of the run, in the test's folder and in BATCHGEN_SCREENSHOTS_DIR."""

    def __init__(self, driver: Any, folder: Path) -> None:
        self.driver, self.folder = driver, folder
        self.extra = os.environ.get("BATCHGEN_SCREENSHOTS_DIR")
        self.taken: list[Path] = []

    def take(self, name: str) -> None:
        path = self.folder / f"{name}.png"
        assert self.driver.save_screenshot(str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        self.taken.append(path)
        if self.extra:
            Path(self.extra).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(self.extra) / path.name)


def _sign_in(driver: Any, base: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/dashboard")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "sign-in").click()
    wait_until(lambda: driver.find_elements(By.ID, "batches"), 30, "the dashboard")


def _row(driver: Any, batch_id: str) -> dict[str, Any] | None:
    """The batch's row as shown now (the live refresh replaces the rows every two
    seconds: a row that went stale mid-read is read again)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(10):
        try:
            rows = driver.find_elements(By.CSS_SELECTOR, f'tr[data-batch="{batch_id}"]')
            if not rows:
                return None
            row = rows[0]
            return {
                "status": row.find_element(By.CLASS_NAME, "status").text,
                "done": int(row.find_element(By.CLASS_NAME, "done").text),
                "total": int(row.find_element(By.CLASS_NAME, "total").text),
                "text": row.text,
                "results": row.find_element(By.LINK_TEXT, "results").get_attribute("href"),
                "cancel": row.find_elements(By.CLASS_NAME, "cancel"),
            }
        except StaleElementReferenceException:
            continue
    return None


def _message(driver: Any, contains: str) -> str:
    """The page's message once it says ``contains`` (a form's post reloads the page: the
    old page's message may be read while it goes)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def read() -> str | None:
        try:
            found = driver.find_elements(By.ID, "message")
            return found[0].text if found and contains in found[0].text else None
        except StaleElementReferenceException:
            return None

    return str(wait_until(read, 30, f"the message {contains!r}"))


def _cancel(driver: Any, batch_id: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(10):
        row = _row(driver, batch_id)
        assert row is not None and row["cancel"], "no cancel button"
        try:
            row["cancel"][0].click()
            break
        except StaleElementReferenceException:
            continue
    else:
        raise AssertionError("the cancel button kept going stale")
    # The button asks first: the confirmation page's own button cancels.
    wait_until(lambda: driver.find_elements(By.ID, "confirm"), 30, "the confirmation")
    driver.find_element(By.ID, "confirm").click()


def _segment_colours(driver: Any, batch_id: str) -> dict[str, str] | None:
    """The colour (background) of each segment of the batch's progress bar, as drawn."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        segments = driver.find_elements(By.CSS_SELECTOR, f'tr[data-batch="{batch_id}"] .seg')
        return {
            s.get_attribute("data-status"): s.value_of_css_property("background-color")
            + " "
            + s.value_of_css_property("background-image")
            for s in segments
        } or None
    except StaleElementReferenceException:
        return None


def test_submit_watch_and_cancel_in_a_browser(
    clean_db, simulator, workers, api_server, browser, tmp_path
):
    from selenium.webdriver.common.by import By

    shots = Shots(browser, tmp_path)
    key = make_tenant("acme-shop")
    admin_key = make_tenant("ops", is_admin=True)
    # Slow enough to watch and cancel mid-run: 2 threads, each running a pack's calls
    # together (a few at a time), each call about 2.5 s.
    sim_config(simulator.base_url, latency_base_ms=2500)
    requests = tmp_path / "descriptions.jsonl"
    requests.write_bytes(jsonl([chat_line(f"p{i:03d}") for i in range(40)]))
    workers(concurrency=2)
    base = api_server()
    try:
        browser.get(f"{base}/dashboard")
        assert browser.find_elements(By.ID, "key")  # not signed in: the sign-in form
        browser.find_element(By.ID, "key").send_keys("bg_not-a-key")
        browser.find_element(By.ID, "sign-in").click()
        # The post reloads the page: wait for the new page's error, not the old form.
        refused = wait_until(lambda: browser.find_elements(By.ID, "login-error"), 30, "the error")
        assert "unknown API key" in refused[0].text
        shots.take("1-sign-in")

        _sign_in(browser, base, key)
        browser.find_element(By.ID, "file").send_keys(str(requests))
        browser.find_element(By.ID, "submit").click()
        message = _message(browser, "submitted 40 requests as batch_")
        batch_id = message.rsplit(" ", 1)[1]
        browser.execute_script("window.notReloaded = true")
        first = wait_until(lambda: _row(browser, batch_id), 30, "the batch row")
        assert first["total"] == 40
        # The tables refresh themselves: the count moves with no reload of the page.
        wait_until(
            lambda: (r := _row(browser, batch_id)) and 0 < r["done"] < 40 and r,
            30,
            "progress",
        )
        assert browser.execute_script("return window.notReloaded === true")
        shots.take("2-progress")

        # The batch's own page, mid-run: its rate and the time left at that rate.
        browser.find_element(By.CSS_SELECTOR, f'tr[data-batch="{batch_id}"] a.batch-link').click()
        wait_until(lambda: browser.find_elements(By.ID, "rate"), 30, "the batch page")
        rate = float(browser.find_element(By.ID, "rate").text.split()[0])
        assert rate > 0, "no rate while the batch runs"
        assert browser.find_element(By.ID, "time-left").text not in ("", "unknown", "ended")
        assert browser.find_element(By.CSS_SELECTOR, "#batch svg path.line")
        browser.set_window_size(1400, 1300)  # the whole page, its chart too
        shots.take("5-batch")
        browser.set_window_size(1400, 1000)
        browser.get(f"{base}/dashboard")
        wait_until(lambda: _row(browser, batch_id), 30, "the batch row")

        _cancel(browser, batch_id)
        # The post reloads the page: wait for the new page's message, not the old one's.
        assert batch_id in _message(browser, f"cancelled {batch_id}")
        ended = wait_until(
            lambda: (r := _row(browser, batch_id)) and r["status"] == "cancelled" and r,
            30,
            "the cancelled batch",
        )
        # Done counts what ran, not what was cancelled; the cancelled ones are named.
        assert ended["done"] < 40 and "cancelled" in ended["text"]
        # Its bar is not a completed one's: the cancelled part has a colour of its own.
        colours = wait_until(lambda: _segment_colours(browser, batch_id), 30, "the bar")
        assert set(colours) == {"succeeded", "cancelled"}, colours
        assert colours["cancelled"] != colours["succeeded"]
        shots.take("3-cancelled")
        counts = http_client.get(
            f"{base}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}
        ).json()["request_counts"]
        assert counts["cancelled"] > 0 and counts["succeeded"] > 0
        assert counts["succeeded"] + counts["cancelled"] + counts["failed"] == 40

        # The results download is the tenant's own, behind its cookie.
        link = ended["results"]
        cookie = browser.get_cookie("batchgen_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        session = {"Cookie": f"batchgen_session={cookie['value']}"}
        downloaded = http_client.get(link, headers=session)
        assert downloaded.status_code == 200 and downloaded.text.count("\n") == 40
        assert http_client.get(link).status_code == 401
        # A form posted without the page's token changes nothing.
        forged = http_client.post(
            f"{base}/dashboard/batches/{batch_id}/cancel",
            headers=session,
            data={"csrf": "forged"},
        )
        assert forged.status_code == 401

        browser.find_element(By.XPATH, "//button[text()='Sign out']").click()
        _sign_in(browser, base, admin_key)
        models = browser.find_element(By.ID, "models").text
        assert "sim-small" in models and "provider 429s" in models
        tenants_today = browser.find_element(By.ID, "tenants").text
        assert "acme-shop" in tenants_today
        # The admin's table lists every tenant's batches, the charts draw the run.
        assert _row(browser, batch_id) is not None
        assert browser.find_elements(By.CSS_SELECTOR, '#charts path.line[data-series="sim-small"]')
        assert browser.find_elements(By.CSS_SELECTOR, "#charts line.limit")
        browser.set_window_size(1400, 1900)
        shots.take("4-admin")
    finally:
        sim_config(simulator.base_url, latency_base_ms=50)
        browser.set_window_size(1400, 1000)
    assert len(shots.taken) == 5
