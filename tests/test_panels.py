"""``django_redlock.panels.LocksPanel`` with django-debug-toolbar installed: real
requests through the toolbar's middleware, then the panel as the toolbar renders
it (``/__debug__/render_panel/``), against the suite's real Redis nodes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

pytest.importorskip("debug_toolbar", reason="django-debug-toolbar is not installed")

pytestmark = pytest.mark.urls("tests.toolbar_urls")


@pytest.fixture(autouse=True, scope="module")
def _receivers() -> Iterator[None]:
    from django_redlock import panels

    panels._connect()
    yield
    panels._disconnect()  # leave other tests' locks alone


@pytest.fixture(autouse=True)
def _toolbar(settings: Any) -> None:
    settings.MIDDLEWARE = ["debug_toolbar.middleware.DebugToolbarMiddleware", *settings.MIDDLEWARE]
    settings.DEBUG_TOOLBAR_PANELS = ["django_redlock.panels.LocksPanel"]
    settings.DEBUG_TOOLBAR_CONFIG = {"SHOW_TOOLBAR_CALLBACK": "tests.toolbar_urls.always",
                                     "IS_RUNNING_TESTS": False, "RENDER_PANELS": False}


def panel(client: Client, path: str) -> tuple[str, str]:
    """(the page's text, the panel's HTML as the toolbar renders it)."""
    response = client.get(path)
    assert response.status_code == 200
    page = response.content.decode()
    match = re.search(r'data-request-id="([0-9a-f]+)"', page)
    assert match, "no toolbar in the page"
    rendered = client.get("/__debug__/render_panel/",
                          {"request_id": match.group(1), "panel_id": "LocksPanel"})
    assert rendered.status_code == 200
    return page, json.loads(rendered.content)["content"]


def cells(html: str) -> list[list[str]]:
    rows = re.findall(r'<tr class="redlock-panel-lock[^"]*">(.*?)</tr>', html, re.S)
    return [[re.sub(r"\s+", " ", c).strip() for c in re.findall(r"<td>(.*?)</td>", r, re.S)]
            for r in rows]


@pytest.mark.django_db
def test_a_lock_the_request_took() -> None:
    page, html = panel(Client(), "/page/7/")
    fence = re.search(r"<p>(\d+)</p>", page).group(1)
    (row,) = cells(html)
    name, outcome, wait, held, shown_fence, granted, released, renewals, label = row
    assert name == "page:7" and outcome == "acquired"
    assert wait.endswith(" ms") and float(wait[:-3]) >= 0
    assert float(held[:-3]) >= 300  # the view slept 0.35 s under the lock
    assert shown_fence == fence
    assert re.fullmatch(r"[23] of 3 nodes \(quorum 2\)", granted), granted
    assert re.fullmatch(r"[23] of 3 nodes", released), released  # a quorum confirmed it
    assert int(renewals) >= 1  # by the renewal thread, every ttl / 3
    assert label == "view:tests.toolbar_urls.locked_page"


@pytest.mark.django_db
def test_a_semaphore_line_handed_on_is_not_still_held(make_manager: Any,
                                                      session_nodes: Any) -> None:
    """The request waited in a semaphore's line, then took the permit and handed
    the line on without waiting for that release's reply: the line is shown
    released (not confirmed), not "still held"."""
    import threading

    other = make_manager(session_nodes, auto_renew=False)
    holder = other.semaphore("panel-sem", 1, timeout=5)
    assert holder.acquire()
    timer = threading.Timer(0.3, holder.release)
    timer.start()
    try:
        page, html = panel(Client(), "/semaphore/")
    finally:
        timer.join(5)
    assert "True" in page
    rows = {row[0]: row for row in cells(html) if row[1] == "acquired"}
    line = rows["panel-sem#line"]
    assert "still held" not in line[3] and line[6] == "released, not confirmed", line
    permit = rows["panel-sem#0"]
    assert re.fullmatch(r"[23] of 3 nodes", permit[6]), permit  # a waited release


@pytest.mark.django_db
def test_busy_and_nothing(make_manager: Any, session_nodes: Any) -> None:
    other = make_manager(session_nodes, auto_renew=False)
    with other.lock("report:daily"):
        page, html = panel(Client(), "/busy/")
    assert "False" in page
    (row,) = cells(html)
    assert row[:2] == ["report:daily", "busy"]
    assert row[3] == "-" and row[4] == "-"
    # A request that takes no lock, and locks taken outside any request, show nothing.
    _, html = panel(Client(), "/plain/")
    assert "This request took no lock." in html


@pytest.mark.parametrize("fencing", [True, False])
def test_a_collections_late_signals_land_in_their_own_holds_record(
        fencing: bool, make_manager: Any, session_nodes: Any) -> None:
    """In a request, a generator inside ``with L`` whose lease ran out (no
    renewal) is freed by a garbage collection, and the request takes the
    same lock object again. The old hold's ``lock_lost`` comes from the
    library's thread, late (behind a slow receiver of another collected
    release): it is written into the old hold's record, found by the
    signal's ``hold``, never into the new hold's (shown lost while it was
    held). By the object alone, or by fence (0 for every hold without
    fencing), it was."""
    import gc
    import time

    from django_redlock import panels, signals
    from django_redlock.transport import finalizers

    mgr = make_manager(session_nodes, node_timeout=0.5)
    name = f"panel-late-{fencing}"
    lock = mgr.lock(name, ttl=0.3, auto_renew=False, fencing=fencing)
    other = mgr.lock("panel-late-other", ttl=30)

    def slow(sender: Any, *, name: str, **kwargs: Any) -> None:
        if name == "panel-late-other":
            time.sleep(0.5)  # the library's thread, busy a while

    def rows(held: Any) -> Any:
        with held:
            yield 1

    signals.lock_released.connect(slow, weak=False)
    request = panels.LocksPanel(None, None)  # type: ignore[no-untyped-call]
    request.enable_instrumentation()
    gc.disable()
    try:
        first, gen = rows(other), rows(lock)
        next(first)
        next(gen)
        time.sleep(0.4)  # the lock's lease runs out
        for abandoned in (first, gen):
            cycle: list[Any] = [abandoned]
            cycle.append(cycle)
            del cycle
        del first, gen, abandoned
        gc.collect()  # both exits: other's release (a slow signal), the lock's loss
        assert lock.acquire()  # the same object, a new hold (released before the
        lock.release()         # old hold's signals are sent: they wait behind slow())
        assert finalizers.drain(10.0)
        old, new = [r for r in request.records if r["name"] == name]
        assert new["lost"] is None and new["released_nodes"] >= 2, new  # (a quorum: settled)
        assert old["lost"] == "the lease ran out before release", old
    finally:
        gc.enable()
        request.disable_instrumentation()
        signals.lock_released.disconnect(slow)


def test_a_task_the_request_started_records_nothing_once_the_request_is_over(
        make_manager: Any, session_nodes: Any) -> None:
    """A task a request starts keeps the request's context, and with it its
    panel: each hold it took after the request was over was recorded, and
    kept for good (a job that loops: without end)."""
    import asyncio

    from django_redlock import panels

    mgr = make_manager(session_nodes)
    alock = mgr.alock("panel-after-request", ttl=5)

    async def scenario() -> tuple[list[Any], int]:
        request = panels.LocksPanel(None, None)  # type: ignore[no-untyped-call]
        request.enable_instrumentation()
        go = asyncio.Event()

        async def job() -> None:
            await go.wait()
            for _ in range(20):
                async with alock:
                    pass

        task = asyncio.ensure_future(job())  # started in the request: its context
        async with alock:
            pass
        request.disable_instrumentation()  # the request is over
        go.set()
        await asyncio.wait_for(task, 30)
        return request.records, len(panels._live.get(alock, {}))

    records, live = asyncio.run(scenario())
    assert [r["name"] for r in records] == ["panel-after-request"]
    assert live <= 1  # the request's own, until the toolbar's stats
