"""The admin "Locks" page through Django's test client, against the suite's real
Redis nodes (the browser test is tests/test_admin_browser.py)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.db.migrations.loader import MigrationLoader
from django.test import Client

from django_redlock import LockManager
from django_redlock.models import RedisLock
from tests.admin_support import held_elsewhere
from tests.polling import wait_until

pytestmark = pytest.mark.django_db

URL = "/admin/django_redlock/redislock/"


@pytest.fixture
def manager(session_nodes: Any, make_manager: Any) -> LockManager:
    return make_manager(session_nodes, auto_renew=False)


@pytest.fixture
def hold(session_nodes: Any) -> Iterator[Any]:
    with held_elsewhere(list(session_nodes.urls)) as hold:
        yield hold


@pytest.fixture
def viewer(client: Client) -> Client:
    """A staff user who may see the page but not release."""
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_redislock"))
    other = Client()
    other.force_login(user)
    return other


def _keys(session_nodes: Any, name: str) -> list[bool]:
    return [bool(server.execute("EXISTS", f"redlock:{name}")) for server in session_nodes]


def test_no_table_no_migration_and_the_permissions_exist() -> None:
    assert RedisLock._meta.managed is False
    assert "django_redlock" not in MigrationLoader(None, ignore_no_migrations=True).migrated_apps
    perm = Permission.objects.get(codename="release_lock")
    assert perm.content_type.app_label == "django_redlock"
    assert Permission.objects.filter(codename="view_redislock").exists()


def test_the_index_links_to_the_page(admin_client: Client) -> None:
    page = admin_client.get("/admin/").content.decode()
    assert URL in page and "Locks" in page


def test_list_shows_a_lock_another_process_holds(admin_client: Client, hold: Any) -> None:
    fence = hold("stock:7")
    response = admin_client.get(URL)
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-name="stock:7"' in page
    row = page.split('data-name="stock:7"')[1].split("</tr>")[0]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[1:3] == ["3/3", "quorum"], cells
    # The fence shown is the largest any node issued; the holder's is the largest
    # of the majority that answered first: equal, or a few ms apart.
    assert 0 <= int(cells[5]) - fence < 60_000, (cells, fence)
    assert cells[6] == "nightly-import" and cells[4].endswith("MainThread"), cells
    assert "3 of 3 nodes healthy, quorum 2: OK" in page
    assert page.count('class="redlock-node"') == 3
    assert "Release…" in page


def test_filter_by_pattern(admin_client: Client, manager: LockManager) -> None:
    with manager.lock("stock:1"), manager.lock("orders:1"):
        page = admin_client.get(URL, {"q": "stock:*"}).content.decode()
        assert 'data-name="stock:1"' in page and 'data-name="orders:1"' not in page
        page = admin_client.get(URL, {"q": "nothing:*"}).content.decode()
        assert "No locks held matching" in page
        page = admin_client.get(URL, {"q": "bad[pattern"}).content.decode()
        assert "bad pattern" in page


def test_pagination(admin_client: Client, manager: LockManager) -> None:
    locks = [manager.lock(f"page:{i:03d}") for i in range(130)]
    for lock in locks:
        assert lock.acquire()
    try:
        first = admin_client.get(URL).content.decode()
        second = admin_client.get(URL, {"p": "2"}).content.decode()
    finally:
        for lock in locks:
            lock.release()
    assert first.count('class="redlock-lock"') == 100 and "page 1 of 2" in first
    assert second.count('class="redlock-lock"') == 30 and 'data-name="page:129"' in second


def _cells(page: str, marker: str) -> list[str]:
    """The text of the cells of the row that ``marker`` opens (links stripped)."""
    row = page.split(marker, 1)[1].split("</tr>")[0]
    return [re.sub(r"<[^>]+>", "", cell).replace("&emsp;", "").strip()
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.DOTALL)]


def test_a_semaphore_is_one_entry_with_its_permits(admin_client: Client,
                                                   manager: LockManager) -> None:
    """Grouped as ``manage.py locks`` groups it: one entry with its permits held
    of its count, who holds which permit and who waits; not its permit and line
    locks one lock each. A lock only named like a permit stays a lock."""
    held = [manager.semaphore("adminsem", 3, ttl=30, auto_renew=False, label=f"job-{i}")
            for i in range(3)]
    lookalike = manager.lock("adminsem-x#0", ttl=30, auto_renew=False)
    waiter = manager.semaphore("adminsem", 3, ttl=5, auto_renew=False, label="waiter")
    served: list[bool] = []
    thread = threading.Thread(target=lambda: served.append(waiter.acquire(timeout=15)),
                              daemon=True)

    def page() -> str:
        response = admin_client.get(URL, {"q": "adminsem*"})
        assert response.status_code == 200
        return response.content.decode()

    try:
        assert lookalike.acquire(timeout=0)
        assert held[0].acquire(timeout=5) and held[1].acquire(timeout=5)
        text = page()
        assert text.count('class="redlock-semaphore"') == 1
        assert _cells(text, 'class="redlock-semaphore" data-name="adminsem"')[:3] \
            == ["adminsem (semaphore)", "2/3 permits", "semaphore"]
        assert "2 of 3 permits held, 0 waiting" in text
        # A row per permit held, under the semaphore; none as a lock of its own.
        assert text.count('class="redlock-permit"') == 2
        assert 'class="redlock-lock" data-name="adminsem#' not in text
        for sem in held[:2]:
            cells = _cells(text, f'data-semaphore="adminsem" data-name="adminsem#{sem.index}"')
            assert cells[:3] == [f"#{sem.index}", "3/3", "quorum"], cells
            assert cells[6] == sem.lock.label and int(cells[5]) >= sem.fence, cells
        assert 'class="redlock-lock" data-name="adminsem-x#0"' in text
        assert "1 lock and 1 semaphore under prefix" in text
        # Its name opens the same entry alone (as ``locks show NAME``).
        assert "?name=adminsem\"" in text
        detail = admin_client.get(URL + "lock/", {"name": "adminsem"}).content.decode()
        assert "<title>Semaphore adminsem" in detail and "No lock" not in detail
        assert "2 of 3 permits held, 0 waiting" in detail
        assert detail.count('class="redlock-permit"') == 2

        assert held[2].acquire(timeout=5)  # all held: the next one waits in line
        thread.start()
        assert wait_until(lambda: "3 of 3 permits held, 1 waiting" in page(), timeout=10)
        text = page()
        assert 'first in line' in text and '&quot;waiter&quot;' in text
        assert text.count('class="redlock-permit"') == 3
        assert 'data-name="adminsem#line"' not in text  # the line is the waiting count

        for sem in held:
            sem.release()
        thread.join(15)
        assert served == [True]
        waiter.release()
        text = page()
        assert 'class="redlock-semaphore"' not in text and "1 lock under prefix" in text
    finally:
        if thread.ident is not None:
            thread.join(15)
        for sem in [*held, waiter]:
            if sem.index is not None:
                sem.release()
        if lookalike.owned():
            lookalike.release()


def test_detail_node_by_node(admin_client: Client, hold: Any) -> None:
    fence = hold("stock:8")
    page = admin_client.get(URL + "lock/", {"name": "stock:8"}).content.decode()
    assert page.count('class="redlock-node"') == 3
    assert page.count(">held<") == 3 and str(fence)[:8] in page
    page = admin_client.get(URL + "lock/", {"name": "absent:1"}).content.decode()
    assert "No lock 'absent:1' is held" in page


def test_release_asks_then_releases_logs_and_records(admin_client: Client, hold: Any,
                                                     session_nodes: Any, caplog: Any) -> None:
    hold("stock:9")
    confirm = admin_client.get(URL + "release/", {"name": "stock:9"})
    assert confirm.status_code == 200 and "Yes, release it" in confirm.content.decode()
    assert _keys(session_nodes, "stock:9") == [True, True, True]  # asking releases nothing
    shown = re.search(r'name="holder" value="([^"]+)"', confirm.content.decode())
    assert shown
    with caplog.at_level(logging.WARNING, logger="django_redlock.admin"):
        response = admin_client.post(URL + "release/?name=stock:9", {"holder": shown.group(1)},
                                     follow=True)
    assert response.status_code == 200
    assert "Released lock &#x27;stock:9&#x27;" in response.content.decode()
    assert _keys(session_nodes, "stock:9") == [False, False, False]
    assert "force-released from the admin by admin" in caplog.text
    entry = LogEntry.objects.get(object_id="stock:9")
    assert entry.action_flag == DELETION and "nightly-import" in entry.change_message


def test_a_confirmed_release_spares_a_holder_that_took_the_lock_since(
        admin_client: Client, manager: LockManager, session_nodes: Any) -> None:
    """The operator looks at stuck holder A's lock; meanwhile A finishes and
    B takes the lock; the operator confirms. The release used to delete B's
    lock (the form sent only the name), and a third client got in while B
    worked. The form carries the holder it showed: B's lock stays."""
    a = manager.lock("stock:19", ttl=30, label="stuck-holder-A")
    assert a.acquire()
    page = admin_client.get(URL + "release/", {"name": "stock:19"}).content.decode()
    shown = re.search(r'name="holder" value="([^"]+)"', page)
    assert shown and shown.group(1)
    a.release()
    b = manager.lock("stock:19", ttl=30, label="healthy-holder-B")
    assert b.acquire()
    response = admin_client.post(URL + "release/?name=stock:19", {"holder": shown.group(1)},
                                 follow=True)
    assert "changed hands" in response.content.decode()
    assert _keys(session_nodes, "stock:19") == [True, True, True]
    assert manager.lock("stock:19").acquire(blocking=False) is False  # B is alone in it
    b.release()
    # Confirmed while the same holder holds it: released as before.
    c = manager.lock("stock:19", ttl=30, label="stuck-holder-C")
    assert c.acquire()
    page = admin_client.get(URL + "release/", {"name": "stock:19"}).content.decode()
    shown = re.search(r'name="holder" value="([^"]+)"', page)
    assert shown
    response = admin_client.post(URL + "release/?name=stock:19", {"holder": shown.group(1)},
                                 follow=True)
    assert "Released lock" in response.content.decode()
    assert _keys(session_nodes, "stock:19") == [False, False, False]


def test_a_release_confirmed_on_a_page_that_showed_no_holder_deletes_none(
        admin_client: Client, manager: LockManager, session_nodes: Any) -> None:
    """The page said nobody held the lock ("releasing deletes nothing"); B
    took it before the click, and the release deleted B's lock (the form
    then had no holder, which matched anyone). It says "*" now, which no
    token starts with; and a form without the field releases nothing."""
    page = admin_client.get(URL + "release/", {"name": "stock:29"}).content.decode()
    shown = re.search(r'name="holder" value="([^"]+)"', page)
    assert shown and shown.group(1) == "*"
    b = manager.lock("stock:29", ttl=30, label="healthy-B")
    assert b.acquire()
    response = admin_client.post(URL + "release/?name=stock:29", {"holder": "*"}, follow=True)
    assert "changed hands" in response.content.decode()
    response = admin_client.post(URL + "release/?name=stock:29", follow=True)  # no field
    assert "nothing was released" in response.content.decode()
    assert _keys(session_nodes, "stock:29") == [True, True, True]
    b.release()


def test_without_the_permission_no_button_and_403(viewer: Client, hold: Any,
                                                  session_nodes: Any) -> None:
    hold("stock:10")
    page = viewer.get(URL).content.decode()
    assert 'data-name="stock:10"' in page
    assert "Release…" not in page
    assert viewer.get(URL + "release/", {"name": "stock:10"}).status_code == 403
    assert viewer.post(URL + "release/?name=stock:10").status_code == 403
    assert _keys(session_nodes, "stock:10") == [True, True, True]


def test_no_view_permission_no_page(client: Client) -> None:
    user = User.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(user)
    assert client.get(URL).status_code == 403


def test_passwords_are_masked(admin_client: Client, settings: Any, session_nodes: Any) -> None:
    settings.REDLOCK_NODES = [*session_nodes.urls, "redis://:hunter2@127.0.0.1:1/0"]
    page = admin_client.get(URL).content.decode()
    assert "hunter2" not in page
    assert "redis://:***@127.0.0.1:1/0" in page
    assert "not read" in page
