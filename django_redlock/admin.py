"""The admin "Locks" page: the held locks, one lock node by node, force release, node health.

Added by ``INSTALLED_APPS`` (with ``django.contrib.admin``); no table, no
migration (:class:`~django_redlock.models.RedisLock` is an unmanaged model that
only carries the entry and its permissions). Everything shown is read by
:mod:`django_redlock.engine.inspection`, the same read model as ``manage.py locks``:
``SCAN``, never ``KEYS``, every node asked in parallel against a deadline, and
node addresses shown with their passwords masked.

URLs (under ``admin:django_redlock_redislock_...``):

``changelist``  ``.../redislock/?q=GLOB&p=N`` the held locks matching GLOB, paginated,
                and the node health; a semaphore is one entry with its permits,
                grouped as ``manage.py locks`` groups them (``Inventory.semaphores``)
``detail``      ``.../redislock/lock/?name=NAME`` one lock node by node; a semaphore's
                name: its entry as the list shows it (``inspect_semaphore``)
``release``     ``.../redislock/release/?name=NAME`` GET: the confirmation page;
                POST: force release. Both need ``django_redlock.release_lock``.

A force release is logged twice: a WARNING on the ``django_redlock.admin``
logger (who, which lock, who held it), and an entry in the admin's history
(``LogEntry``, action "deletion").
"""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from .core.keys import InvalidLockName, validate_name
from .engine.inspection import (
    Inventory,
    LockInfo,
    PatternError,
    SemaphoreInfo,
    check_health,
    force_release,
    inspect_lock,
    inspect_semaphore,
    scan_locks,
    validate_pattern,
)
from .models import RedisLock
from .transport.finalizers import get_logger

logger = get_logger("django_redlock.admin")

#: Locks shown per page.
PER_PAGE = 100
#: The permission a force release needs (``app_label.codename``).
RELEASE_PERMISSION = "django_redlock.release_lock"


def _formats() -> Any:
    from .management.commands import locks

    return locks


def _row(lock: Any) -> dict[str, Any]:
    fmt = _formats()
    return {
        "name": lock.name,
        "holders": f"{lock.nodes}/{lock.total}",
        "state": lock.state,
        "quorum": lock.quorum,
        "ttl": fmt.format_ms(lock.ttl_ms),
        "owner": fmt.format_owner({k: v for k, v in lock.owner.items() if k != "label"}),
        "label": lock.owner.get("label") or "",
        "fence": lock.fence,
        "token": lock.token,  # its start: what a confirmed release asks for (release_view)
        "age": fmt.format_seconds(lock.age_s),
        "waiters": fmt.format_count(lock.waiters),
    }


def _semaphore_row(sem: SemaphoreInfo) -> dict[str, Any]:
    """A semaphore as one entry: its permits held of its count, who waits, and
    a row per permit held (the inspection layer grouped them; nothing is read
    again here)."""
    fmt = _formats()
    permits = "?" if sem.permits is None else str(sem.permits)
    line = sem.line
    first = fmt.format_owner(line.owner) if line is not None and line.quorum else ""
    disagree = ""
    if sem.permits is None or len(sem.recorded) > 1:
        disagree = ", ".join(f"{count} on {nodes} node(s)"
                             for count, nodes in sorted(sem.recorded.items()))
    return {
        "semaphore": True,
        "name": sem.name,
        "permits": permits,
        "held": sem.held,
        "holders": f"{sem.held}/{permits}",
        "waiters": sem.waiters,
        "first": first,
        "queued": fmt.format_count(sem.queued),
        "disagree": disagree,
        # The permits held, then the line when it is held below a quorum (a
        # leftover of a failed try: shown, not hidden, as ``locks list`` does).
        "permits_held": [{"part": f"#{index}", **_row(lock)} for index, lock in sem.holders]
        + ([{"part": "line", **_row(line)}] if line is not None and not line.quorum else []),
    }


def _entries(inventory: Inventory) -> list[LockInfo | SemaphoreInfo]:
    """What the page lists, in ``locks list``'s order: the plain locks, then the
    semaphores (each one entry, its permits and line inside)."""
    return [*inventory.ungrouped(), *inventory.semaphores]


def _summary(inventory: Inventory) -> str:
    """``N locks and M semaphores``: the entries the page lists."""
    count, sems = len(inventory.ungrouped()), len(inventory.semaphores)
    parts = ([f"{count} lock{'' if count == 1 else 's'}"] if count or not sems else []) + (
        [f"{sems} semapho{'re' if sems == 1 else 'res'}"] if sems else [])
    return " and ".join(parts)


@admin.register(RedisLock)
class RedisLockAdmin(admin.ModelAdmin):  # type: ignore[type-arg]  # not subscriptable at run time
    """Views over the Redis nodes instead of a queryset."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_release_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return bool(user.is_active and cast(Any, user).has_perm(RELEASE_PERMISSION))

    def get_urls(self) -> list[Any]:
        base = f"{self.opts.app_label}_{self.opts.model_name}"
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name=f"{base}_changelist"),
            path("lock/", wrap(self.detail_view), name=f"{base}_detail"),
            path("release/", wrap(self.release_view), name=f"{base}_release"),
        ]

    # -------------------------------------------------------------- helpers
    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {**self.admin_site.each_context(request), "opts": self.opts, "title": title,
                "has_release_permission": self.has_release_permission(request),
                "changelist_url": reverse("admin:django_redlock_redislock_changelist",
                                          current_app=self.admin_site.name), **extra}

    def _manager(self) -> Any:
        from .conf import get_manager

        return get_manager()

    def _name(self, request: HttpRequest) -> str:
        try:
            return validate_name(request.GET.get("name", ""))
        except InvalidLockName as e:
            from django.core.exceptions import BadRequest

            raise BadRequest(f"bad lock name: {e}") from e

    def _check_view(self, request: HttpRequest) -> None:
        if not self.has_view_permission(request):
            raise PermissionDenied

    # ---------------------------------------------------------------- views
    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self._check_view(request)
        pattern = request.GET.get("q", "").strip() or "*"
        error = None
        rows: list[dict[str, Any]] = []
        summary = ""
        inventory = None
        page = None
        try:
            manager = self._manager()
        except ImproperlyConfigured as e:
            manager = None
            error = " ".join(str(e).split())
        if manager is not None:
            try:
                validate_pattern(pattern)
            except PatternError as e:
                error = f"bad pattern: {e}"
            else:
                inventory = scan_locks(manager, pattern)
                page = Paginator(_entries(inventory), PER_PAGE).get_page(request.GET.get("p"))
                rows = [_semaphore_row(entry) if isinstance(entry, SemaphoreInfo)
                        else {**_row(entry), "semaphore": False} for entry in page.object_list]
                summary = _summary(inventory)
        health = check_health(manager) if manager is not None else None
        refresh = request.GET.get("refresh", "")
        context = self._context(
            request, "Locks", rows=rows, inventory=inventory, page=page, summary=summary,
            pattern="" if pattern == "*" else pattern, error=error, health=health,
            refresh=int(refresh) if refresh.isdigit() and 1 <= int(refresh) <= 3600 else None,
            prefix=getattr(manager, "key_prefix", ""),
            **(extra_context or {}))
        return TemplateResponse(request, "django_redlock/admin_locks.html", context)

    def detail_view(self, request: HttpRequest) -> HttpResponse:
        self._check_view(request)
        name = self._name(request)
        manager = self._manager()
        detail = inspect_lock(manager, name)
        fmt = _formats()
        semaphore = None
        if detail.lock is None and detail.foreign is None and detail.answered:
            # No lock of that name: a semaphore's, as ``locks show NAME`` finds it.
            found, _ = inspect_semaphore(manager, name)
            semaphore = _semaphore_row(found) if found is not None else None
        nodes = []
        if detail.lock is not None:
            for v in detail.lock.per_node:
                nodes.append({
                    "node": v.node, "state": v.state, "agrees": v.agrees,
                    "token": v.token or "-",
                    "ttl": fmt.format_ms(v.pttl_ms) if v.state == "held" else "-",
                    "fence": v.fence if v.fence is not None else "-",
                    "counter": v.fence_counter if v.fence_counter is not None else "-",
                    "waiters": fmt.format_count(v.waiters),
                    "note": v.error or (v.foreign.describe() if v.foreign else
                                        fmt.format_owner(v.owner) if v.state == "held" else "-"),
                })
        context = self._context(
            request, f"Semaphore {name}" if semaphore else f"Lock {name}", name=name,
            detail=detail, nodes=nodes, semaphore=semaphore,
            row=_row(detail.lock) if detail.lock is not None else None,
            since=fmt.format_since(detail.lock.since, detail.lock.age_s)
            if detail.lock is not None else "-")
        return TemplateResponse(request, "django_redlock/admin_lock_detail.html", context)

    def release_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_release_permission(request):
            raise PermissionDenied
        name = self._name(request)
        manager = self._manager()
        if request.method != "POST":
            detail = inspect_lock(manager, name)
            context = self._context(
                request, f"Release lock {name}?", name=name, detail=detail,
                row=_row(detail.lock) if detail.lock is not None else None)
            return TemplateResponse(request, "django_redlock/admin_release_confirm.html", context)
        # The holder the confirmation page showed: the lock is released only
        # while that one holds it. Between the look and the click it may have
        # changed hands, and deleting the new holder's lock would let a third
        # one in beside it.
        # "*": the page showed no holder, and no token starts with it: a lock
        # taken since is kept. A form without the field is not this page's.
        holder = request.POST.get("holder", "")
        if (not holder or len(holder) > 64
                or not (holder == "*" or all(c.isalnum() or c in "-_." for c in holder))):
            messages.error(request, f"Lock {name!r}: the confirmation form was not the one "
                                    f"this page writes; nothing was released.")
            return HttpResponseRedirect(reverse("admin:django_redlock_redislock_changelist",
                                                current_app=self.admin_site.name))
        report = force_release(manager, name, holder)
        fmt = _formats()
        holders = sorted({fmt.format_owner(stored.owner) for _, stored in report.deleted
                          if stored is not None})
        fences = [stored.fence for _, stored in report.deleted if stored is not None]
        held_by = ", ".join(holders) or "-"
        logger.warning("lock %r force-released from the admin by %s: deleted on %d of %d "
                       "nodes (held by %s, fence %s)", name, request.user.get_username(),
                       len(report.deleted), report.total, held_by,
                       max(fences) if fences else "-")
        LogEntry.objects.create(
            user_id=request.user.pk,
            content_type=ContentType.objects.get_for_model(RedisLock, for_concrete_model=False),
            object_id=name, object_repr=name[:200], action_flag=DELETION,
            change_message=f"Force-released (held by {held_by}; deleted on "
                           f"{len(report.deleted)} of {report.total} nodes)")
        if report.answered < report.quorum_size:
            messages.error(request, f"Lock {name!r}: only {report.answered} of {report.total} "
                                    f"nodes answered ({report.quorum_size} needed); it may stay "
                                    f"held until its lease ends.")
        elif report.kept and not report.deleted:
            now_held = sorted({fmt.format_owner(stored.owner) for _, stored in report.kept
                               if stored is not None}) or ["another holder"]
            messages.warning(request, f"Lock {name!r} changed hands since you looked: it is "
                                      f"held by {', '.join(now_held)} now; nothing was "
                                      f"released. Look again before releasing it.")
        elif not report.deleted:
            messages.info(request, f"Lock {name!r} was not held on any node that answered; "
                                   f"nothing to release.")
        else:
            messages.success(request, f"Released lock {name!r} (held by {held_by}): deleted on "
                                      f"{len(report.deleted)} of {report.total} nodes; "
                                      + ("the lock's other holders still hold it."
                                         if report.shared
                                         and len(report.shared) == len(report.deleted)
                                         else "its waiters were woken."))
        return HttpResponseRedirect(reverse("admin:django_redlock_redislock_changelist",
                                            current_app=self.admin_site.name))
