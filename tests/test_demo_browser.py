"""A person's view of the demo shop: headless Chromium clicks "buy one".

The whole stack runs as in ``make serve`` (gunicorn, the demo's SQLite file,
the suite's Redis nodes); Selenium drives Debian's Chromium through its
ChromeDriver. Skipped, saying why, when Selenium or the browser is missing
(``apt-get install chromium chromium-driver``; ``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("CHROMIUM_BINARY", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage", "--window-size=1200,800"]

pytestmark = pytest.mark.slow


def _browser_missing() -> str:
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return (f"no headless browser: {path} not found "
                    f"(apt-get install -y chromium chromium-driver; missing: {package})")
    if shutil.which("gunicorn") is None:
        try:
            import gunicorn  # noqa: F401
        except ImportError:
            return "the demo extra (gunicorn) is not installed"
    return ""


def _require_browser() -> Any:
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is not installed (pip install selenium)")
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    return webdriver


@pytest.fixture(scope="module")
def stack(session_nodes: Any) -> Iterator[Any]:
    _require_browser()  # before starting a server for nothing
    from testproject.demo import Stack

    with Stack(workers=2, nodes=list(session_nodes.urls), stock=20, stripes=4,
               env={"DEMO_WORK": "0", "DEMO_DELAY": "0"}, log=lambda _msg: None) as running:
        yield running


@pytest.fixture
def browser() -> Iterator[Any]:
    webdriver = _require_browser()
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in CHROMIUM_ARGS:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def _stock(driver: Any, pk: int) -> int:
    from selenium.webdriver.common.by import By

    return int(driver.find_element(By.ID, f"stock-{pk}").text)


def test_clicking_buy_one_lowers_the_stock(browser: Any, stack: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from testproject.inventory.loadgen import ShopClient

    pk = stack.products["MUG-001"]
    browser.get(stack.url + "/")
    before = _stock(browser, pk)
    assert before > 1
    browser.find_element(By.ID, f"buy-{pk}").click()
    WebDriverWait(browser, 15).until(lambda d: _stock(d, pk) == before - 1)
    status = browser.find_element(By.ID, "status").text
    assert "Bought one" in status and "fence" in status
    browser.save_screenshot(str(tmp_path / "shop.png"))

    # The server agrees (the page did not just change a number), and a reload shows it.
    assert ShopClient(stack.url).get_json(f"/products/{pk}/")["stock"] == before - 1
    browser.find_element(By.ID, f"buy-{pk}").click()
    WebDriverWait(browser, 15).until(lambda d: _stock(d, pk) == before - 2)
    browser.refresh()
    assert _stock(browser, pk) == before - 2


def test_clicking_buy_one_on_a_striped_product(browser: Any, stack: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    pk = stack.products["BAG-001"]
    browser.get(stack.url + "/")
    before = _stock(browser, pk)
    browser.find_element(By.ID, f"buy-{pk}").click()
    WebDriverWait(browser, 15).until(lambda d: _stock(d, pk) == before - 1)
