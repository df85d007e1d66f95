"""The admin "Locks" page in headless Chromium (Selenium) on pytest-django's live
server, against the suite's real Redis nodes, with the lock held by another
process. Skipped, saying why, only when Selenium or the browser is missing
(``apt-get install chromium chromium-driver``; ``.ci/run`` installs them)."""

from __future__ import annotations

import struct
import urllib.error
import urllib.request
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User

from tests.admin_support import held_elsewhere
from tests.test_demo_browser import CHROMEDRIVER, CHROMIUM, CHROMIUM_ARGS, _require_browser

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/admin/django_redlock/redislock/"


@pytest.fixture
def browser() -> Iterator[Any]:
    webdriver = _require_browser()
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in CHROMIUM_ARGS:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def hold(session_nodes: Any) -> Iterator[Any]:
    with held_elsewhere(list(session_nodes.urls)) as hold:
        yield hold


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, pixels) of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    height = channels = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytearray] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(line)
        prev = line
    pixels = [bytes(r[x * channels:x * channels + 3]) for r in rows[::4]
              for x in range(0, width, 4)]  # every 4th pixel both ways is plenty
    return width, height, pixels


def assert_not_blank(png: bytes, where: Path) -> None:
    where.write_bytes(png)
    width, height, pixels = png_pixels(png)
    assert width > 100 and height > 100
    counts = Counter(pixels)
    colour, most = counts.most_common(1)[0]
    assert len(counts) > 5 and most / len(pixels) < 0.98, \
        f"screenshot {where} looks blank: {len(counts)} colours, {most / len(pixels):.1%} {colour!r}"


def wait_for(driver: Any, what: Any, timeout: float = 20.0) -> None:
    """Wait (bounded) until ``what(driver)`` is true: a click returns before the
    next page has loaded."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout, poll_frequency=0.05).until(what)


def log_in(driver: Any, base: str, username: str, password: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(f"{base}/admin/login/?next={URL}")
    driver.find_element(By.ID, "id_username").send_keys(username)
    driver.find_element(By.ID, "id_password").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait_for(driver, lambda d: "/login/" not in d.current_url and d.current_url.endswith(URL))


def rows(driver: Any) -> dict[str, list[str]]:
    from selenium.webdriver.common.by import By

    return {tr.get_attribute("data-name"): [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in driver.find_elements(By.CSS_SELECTOR, "tr.redlock-lock")}


def test_release_a_lock_from_the_admin(browser: Any, live_server: Any, hold: Any,
                                       session_nodes: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    User.objects.create_superuser("boss", "boss@example.com", "boss-pw")
    fence = hold("stock:42")
    log_in(browser, live_server.url, "boss", "boss-pw")
    seen = rows(browser)
    assert seen["stock:42"][1] in ("2/3", "3/3") and seen["stock:42"][2] == "quorum", seen
    assert int(seen["stock:42"][5]) >= fence and seen["stock:42"][6] == "nightly-import"
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.redlock-node")) == 3
    assert "3 of 3 nodes healthy" in browser.find_element(By.ID, "redlock-health").text
    assert_not_blank(browser.get_screenshot_as_png(), tmp_path / "admin-locks.png")
    browser.get("data:text/html,<body></body>")  # the check itself sees a blank page
    with pytest.raises(AssertionError, match="looks blank"):
        assert_not_blank(browser.get_screenshot_as_png(), tmp_path / "blank.png")
    browser.get(f"{live_server.url}{URL}")  # get() waits for the page to load

    # Node by node.
    browser.find_element(By.LINK_TEXT, "stock:42").click()
    wait_for(browser, lambda d: "Lock stock:42" in d.title)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#redlock-per-node tr.redlock-node")) == 3

    # Release: asks first, then deletes it on every node.
    browser.find_element(By.CSS_SELECTOR, "a.redlock-release").click()
    wait_for(browser, lambda d: "Release lock stock:42?" in d.title)
    assert all(server.execute("EXISTS", "redlock:stock:42") for server in session_nodes)
    browser.find_element(By.ID, "redlock-confirm").click()
    wait_for(browser, lambda d: d.current_url.endswith(URL))
    assert "Released lock 'stock:42'" in browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text
    assert "stock:42" not in rows(browser)
    assert not any(server.execute("EXISTS", "redlock:stock:42") for server in session_nodes)


def test_without_the_permission(browser: Any, live_server: Any, hold: Any,
                                session_nodes: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    user = User.objects.create_user("viewer", password="viewer-pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_redislock"))
    hold("stock:43")
    log_in(browser, live_server.url, "viewer", "viewer-pw")
    assert "stock:43" in rows(browser)
    assert browser.find_elements(By.CSS_SELECTOR, "a.redlock-release") == []
    assert_not_blank(browser.get_screenshot_as_png(), tmp_path / "admin-locks-viewer.png")

    release = f"{live_server.url}{URL}release/?name=stock:43"
    browser.get(release)
    assert "403" in browser.page_source
    # The same URL with the browser's session, status code included; POST too.
    session = browser.get_cookie("sessionid")["value"]
    for data in (None, b""):
        request = urllib.request.Request(release, data=data,
                                         headers={"Cookie": f"sessionid={session}"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=20)
        caught.value.close()
        assert caught.value.code == 403
    assert all(server.execute("EXISTS", "redlock:stock:43") for server in session_nodes)


def test_a_semaphore_is_one_entry(browser: Any, live_server: Any, session_nodes: Any,
                                  tmp_path: Path) -> None:
    """The semaphore as the browser shows it: one entry with its permits held
    of its count, a row per permit held under it, its permits not listed as locks."""
    from selenium.webdriver.common.by import By

    from django_redlock import LockManager

    User.objects.create_superuser("boss", "boss@example.com", "boss-pw")
    manager = LockManager(list(session_nodes.urls), node_timeout=0.5)
    held = [manager.semaphore("browsersem", 4, ttl=30, auto_renew=False, label=f"export-{i}")
            for i in range(2)]
    try:
        for sem in held:
            assert sem.acquire(timeout=5)
        log_in(browser, live_server.url, "boss", "boss-pw")
        browser.get(f"{live_server.url}{URL}?q=browsersem*")
        (entry,) = browser.find_elements(By.CSS_SELECTOR, 'tr.redlock-semaphore')
        assert entry.get_attribute("data-name") == "browsersem"
        cells = [td.text for td in entry.find_elements(By.TAG_NAME, "td")]
        assert cells[1:3] == ["2/4 permits", "semaphore"], cells
        assert "2 of 4 permits held, 0 waiting" in cells[3]
        permits = {tr.get_attribute("data-name"): [td.text for td in
                                                   tr.find_elements(By.TAG_NAME, "td")]
                   for tr in browser.find_elements(
                       By.CSS_SELECTOR, 'tr.redlock-permit[data-semaphore="browsersem"]')}
        assert sorted(permits) == sorted(f"browsersem#{sem.index}" for sem in held)
        for sem in held:
            row = permits[f"browsersem#{sem.index}"]
            # A quorum of the nodes holds each permit: on a loaded machine a
            # grant may settle on two of three (CI once showed "2/3").
            assert row[1] in ("2/3", "3/3") and row[2] == "quorum", row
            assert row[6] == sem.lock.label, row
        assert not any(name.startswith("browsersem#") for name in rows(browser))
        assert "1 semaphore under prefix" in browser.find_element(By.ID, "redlock-summary").text
        assert_not_blank(browser.get_screenshot_as_png(), tmp_path / "admin-semaphore.png")

        # The semaphore's name opens its entry alone.
        browser.find_element(By.LINK_TEXT, "browsersem").click()
        wait_for(browser, lambda d: "Semaphore browsersem" in d.title)
        assert "2 of 4 permits held" in browser.find_element(By.ID, "redlock-semaphore").text
        assert len(browser.find_elements(By.CSS_SELECTOR, "#redlock-semaphore tr.redlock-permit")) == 2

        # A permit's link opens that permit's lock node by node.
        browser.find_element(By.LINK_TEXT, f"#{held[0].index}").click()
        wait_for(browser, lambda d: f"Lock browsersem#{held[0].index}" in d.title)
        assert len(browser.find_elements(By.CSS_SELECTOR,
                                         "#redlock-per-node tr.redlock-node")) == 3
    finally:
        for sem in held:
            if sem.index is not None:
                sem.release()
        manager.close()
