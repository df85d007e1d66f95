"""ORM helpers: lock a row, load it fresh under the lock, and write it fenced.

Two mistakes this module exists to prevent:

1. **Reading before locking.** ``p = Product.objects.get(pk=1); with p.lock(): p.stock -= 1;
   p.save()`` decrements a value read *before* the lock was held: two requests
   both read 5 and both write 4. ``Product.objects.locked(pk=1)`` acquires the
   lock first and then loads the row, so the body always sees the last write.

2. **Writing after the lease ran out.** A holder can pause (GC, a slow query,
   SIGSTOP) past its lease while another process takes the lock and writes::

       t0  A locks product 1 (fence 41), reads stock 5
       t1  A pauses for longer than the TTL; its lease expires
       t2  B locks product 1 (fence 42), reads 5, writes 4 with fence 42
       t3  A resumes and writes 4 (its stale computation)  <- lost update

   No lock can stop t3; the storage must. :meth:`LockableModel.fenced_save` is
   one conditional ``UPDATE ... SET ..., fence = 41 WHERE pk = 1 AND fence < 41``:
   at t3 the row holds fence 42, zero rows match, and A gets
   :class:`~django_redlock.FencedWriteRejected` instead of silently overwriting B.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from asgiref.sync import sync_to_async
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import models, router

from .conf import get_manager
from .core.templates import (
    LockNameTemplate,
    Placeholder,
    TemplateError,
    UnresolvedPlaceholder,
    parse_template,
    resolve_path,
)
from .exceptions import FencedWriteRejected

if TYPE_CHECKING:
    from .lock import Lock

__all__ = ["FenceField", "LockableModel", "LockingManager", "LockingQuerySet"]


class FenceField(models.BigIntegerField):
    """The fencing token of the last fenced write to the row (0: never fenced).

    Written only by :meth:`LockableModel.fenced_save` and
    :meth:`LockingQuerySet.fenced_update`; not editable in forms or the admin.
    """

    description = "Fencing token of the last fenced write"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("editable", False)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> Any:
        name, path, args, kwargs = super().deconstruct()
        if kwargs.get("default") == 0:
            del kwargs["default"]
        if kwargs.get("editable") is False:
            del kwargs["editable"]
        return name, path, args, kwargs


def _fence_field(model: type[models.Model]) -> models.Field:
    for field in model._meta.concrete_fields:
        if isinstance(field, FenceField):
            return field
    raise ImproperlyConfigured(
        f"{model._meta.label} has no FenceField; add `fence = FenceField()` (or inherit "
        f"from LockableModel) to use fenced writes")


def _check_fence(lock: Any, what: str) -> int:
    fence = getattr(lock, "fence", 0)
    if not isinstance(fence, int) or fence <= 0:
        raise ValueError(
            f"{what} needs a lock acquired with fencing on (fencing=True): "
            f"lock {getattr(lock, 'name', lock)!r} has fence {fence!r}, and a fenced write with "
            f"no fence would protect nothing")
    return fence


def _template_for(model: type[models.Model]) -> LockNameTemplate:
    cached = model.__dict__.get("_redlock_template")
    if cached is not None:
        return cached
    source = getattr(model, "lock_name_template", None) or \
        f"{model._meta.app_label}.{model._meta.model_name}:<pk>"
    try:
        template = parse_template(source)
    except TemplateError as e:
        raise ImproperlyConfigured(f"{model._meta.label}.lock_name_template: {e}") from None
    model._redlock_template = template  # type: ignore[attr-defined]
    return template


def _label(model: type[models.Model]) -> str:
    return f"model:{model._meta.label}"


def lock_name_for_lookup(model: type[models.Model], lookup: dict[str, Any]) -> str:
    """The lock name of the row ``lookup`` selects, without reading the row.

    Each placeholder root of the model's template must be in the lookup: ``pk``
    as ``pk=``, ``pk__exact=`` or the primary key's own name (``id=``); any other
    field by its name or attname. Values are normalised with the field's
    ``to_python`` so ``pk="5"`` and ``pk=5`` name the same lock.
    """
    meta = model._meta
    template = _template_for(model)

    def find(root: str) -> tuple[bool, Any, models.Field | None]:
        field: models.Field | None
        if root == "pk":
            field = meta.pk
            names = ["pk", "pk__exact"]
        else:
            try:
                field = meta.get_field(root)  # type: ignore[assignment]
            except FieldDoesNotExist:
                field = None
            names = [root, f"{root}__exact"]
        if field is not None:
            for extra in (field.name, field.attname):
                names += [extra, f"{extra}__exact"]
        for key in names:
            if key in lookup:
                return True, lookup[key], field
        return False, None, field

    def value_of(p: Placeholder) -> Any:
        found, value, field = find(p.root)
        if not found:
            raise UnresolvedPlaceholder(p, f"{p.root!r} is not in the lookup")
        if not p.attrs and field is not None and field.concrete and \
                not isinstance(value, models.Model):
            value = field.to_python(value)
        elif not p.attrs and isinstance(value, models.Model):
            value = value.pk
        return resolve_path(value, p)

    try:
        return template.render(value_of)
    except UnresolvedPlaceholder as e:
        raise ImproperlyConfigured(
            f"{model.__name__}.objects.locked() must know the lock name before it reads the row: "
            f"lock name template {template.source!r} needs {e.placeholder} in the lookup "
            f"(got: {', '.join(sorted(lookup)) or 'nothing'}); e.g. locked(pk=...)") from None


class LockingQuerySet(models.QuerySet):
    """A QuerySet with :meth:`locked` (lock, then read) and :meth:`fenced_update`."""

    @contextlib.contextmanager
    def locked(self, *, ttl: Any = ..., timeout: Any = ..., auto_renew: Any = ...,
               fencing: bool = True, max_hold: Any = ..., label: str | None = None,
               **lookup: Any) -> Iterator[Any]:
        """Acquire the row's lock, *then* load the row, and yield it.

        ``with Product.objects.locked(pk=pk) as product:`` -- the lock has the
        name ``product.lock()`` would use; the row is read after the lock is held
        (``.get(**lookup)`` on this queryset), so the body never acts on a value
        read before; ``product.held_lock`` is the :class:`~django_redlock.Lock`
        (for :meth:`LockableModel.fenced_save`). The lock is released when the
        block ends; ``LockLost`` is raised then if it was lost meanwhile.
        ``DoesNotExist`` propagates (the lock is released first).
        """
        name = lock_name_for_lookup(self.model, lookup)
        lock = get_manager().lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                                  fencing=fencing, max_hold=max_hold,
                                  label=label or _label(self.model))
        with lock:
            instance = self.get(**lookup)
            instance.held_lock = lock
            yield instance

    @contextlib.asynccontextmanager
    async def alocked(self, *, ttl: Any = ..., timeout: Any = ..., auto_renew: Any = ...,
                      fencing: bool = True, max_hold: Any = ..., label: str | None = None,
                      **lookup: Any) -> AsyncIterator[Any]:
        """The ``async with`` twin of :meth:`locked` (an ``AsyncLock``, then ``aget``)."""
        name = lock_name_for_lookup(self.model, lookup)
        lock = get_manager().alock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                                   fencing=fencing, max_hold=max_hold,
                                   label=label or _label(self.model))
        async with lock:
            instance = await self.aget(**lookup)
            instance.held_lock = lock
            yield instance

    def fenced_update(self, lock: Any, **values: Any) -> int:
        """``UPDATE`` the selected rows whose stored fence is below ``lock.fence``.

        One statement: ``.filter(fence__lt=lock.fence).update(fence=lock.fence,
        **values)``. Returns the number of rows written. Raises
        :class:`~django_redlock.FencedWriteRejected` when no row was written although
        the queryset selects some (a newer holder wrote them all); rows already
        carrying a higher fence are skipped, so a smaller count than expected means
        some were newer.
        """
        fence = _check_fence(lock, "fenced_update()")
        field = _fence_field(self.model)
        if field.name in values or field.attname in values:
            raise ValueError(f"fenced_update() writes {field.name!r} itself; do not pass it")
        written = self.filter(**{f"{field.name}__lt": fence}).update(
            **{field.attname: fence}, **values)
        if written == 0 and self.exists():
            raise FencedWriteRejected(
                f"fenced update of {self.model._meta.label} refused: every selected row carries "
                f"a fence >= {fence} (a newer lock holder already wrote)",
                lock_name=getattr(lock, "name", None), fence=fence)
        return written

    async def afenced_update(self, lock: Any, **values: Any) -> int:
        return await sync_to_async(self.fenced_update)(lock, **values)


class LockingManager(models.Manager.from_queryset(LockingQuerySet)):  # type: ignore[misc]
    """The default manager of :class:`LockableModel`: ``.locked(...)``, ``.fenced_update(...)``."""


class LockableModel(models.Model):
    """An abstract model whose rows can be locked and written with fencing.

    The lock name of a row is ``"<app_label>.<model_name>:<pk>"`` (e.g.
    ``"shop.product:42"``); set ``lock_name_template`` on the class to change it
    (placeholders resolved from the instance, e.g. ``"sku:<sku>"``; ``.locked()``
    then needs those fields in its lookup).

    A plain ``save()`` of an existing row leaves the ``fence`` column alone (it
    is not in the UPDATE), so an unfenced save cannot move the fence backwards.
    """

    fence = FenceField()

    objects = LockingManager()

    lock_name_template: ClassVar[str | None] = None

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        """``Model.save()``, except that updating an existing row never writes ``fence``.

        (An update then names its fields, so a row deleted meanwhile raises
        ``DatabaseError`` instead of being inserted again.)
        """
        if (not self._state.adding and self.pk is not None and not args
                and kwargs.get("update_fields") is None and not kwargs.get("force_insert")):
            kwargs["update_fields"] = self._unfenced_fields()
        super().save(*args, **kwargs)

    save.alters_data = True  # type: ignore[attr-defined]

    # -- names and locks -------------------------------------------------------------
    def lock_name(self) -> str:
        """The name of this row's lock (what ``manage.py locks`` shows)."""
        if self.pk is None:
            raise ValueError(f"cannot lock an unsaved {type(self).__name__}: it has no pk yet")

        def lookup(p: Placeholder) -> Any:
            if p.root == "self":
                return resolve_path(self, p)
            try:
                value = getattr(self, p.root)
            except AttributeError:
                raise UnresolvedPlaceholder(p, f"{type(self).__name__} has no attribute "
                                               f"{p.root!r}") from None
            return resolve_path(value, p)

        template = _template_for(type(self))
        try:
            return template.render(lookup)
        except UnresolvedPlaceholder as e:
            raise ImproperlyConfigured(f"{type(self).__name__}.lock_name_template "
                                       f"{template.source!r}: {e}") from None

    def lock(self, *, ttl: Any = ..., timeout: Any = ..., auto_renew: Any = ...,
             fencing: bool = True, max_hold: Any = ..., label: str | None = None) -> Lock:
        """A :class:`~django_redlock.Lock` on this row (not yet acquired).

        Prefer ``Model.objects.locked(pk=...)`` when you will read the row: it
        reads *after* acquiring. This instance's field values were read before.
        """
        return get_manager().lock(self.lock_name(), ttl=ttl, timeout=timeout,
                                  auto_renew=auto_renew, fencing=fencing, max_hold=max_hold,
                                  label=label or _label(type(self)))

    def alock(self, *, ttl: Any = ..., timeout: Any = ..., auto_renew: Any = ...,
              fencing: bool = True, max_hold: Any = ..., label: str | None = None) -> Any:
        """An ``AsyncLock`` on this row (``async with obj.alock():``)."""
        return get_manager().alock(self.lock_name(), ttl=ttl, timeout=timeout,
                                   auto_renew=auto_renew, fencing=fencing, max_hold=max_hold,
                                   label=label or _label(type(self)))

    # -- writes ------------------------------------------------------------------------
    def _unfenced_fields(self, update_fields: Iterable[str] | None = None) -> list[str]:
        meta = self._meta
        fence = _fence_field(type(self))
        if update_fields is None:
            deferred = self.get_deferred_fields()
            return [f.name for f in meta.concrete_fields
                    if not f.primary_key and f is not fence and f.attname not in deferred
                    and not getattr(f, "generated", False)]
        names: list[str] = []
        for name in update_fields:
            try:
                field = meta.get_field(name)
            except FieldDoesNotExist:
                raise ValueError(f"fenced_save(update_fields=...): {type(self).__name__} has no "
                                 f"field {name!r}") from None
            if field is fence:
                continue  # written by fenced_save itself
            if not getattr(field, "concrete", False) or field.primary_key or \
                    getattr(field, "many_to_many", False):
                raise ValueError(f"fenced_save(update_fields=...): {name!r} is not a concrete, "
                                 f"non-primary-key field")
            names.append(field.name)
        return names

    def fenced_save(self, lock: Any, update_fields: Iterable[str] | None = None,
                    using: str | None = None) -> None:
        """Write this row only if nobody wrote it since it was read, with a newer fence.

        One conditional UPDATE (``... SET <fields>, fence = F WHERE pk = %s AND
        fence = <the fence this instance was loaded with>``), after checking that
        ``F = lock.fence`` is higher than that loaded fence. Checking only
        "stored fence < F" is not enough, as the chaos run showed::

            A (fence 41) reads stock 10, is paused past its lease
            B (fence 42) acquires, reads stock 10
            A resumes and writes 9 with fence 41: accepted (stored fence < 41)
            B writes 9 with fence 42: accepted, and A's sale is lost

        With the loaded fence in the WHERE clause, B's write is refused (the row
        changed since B read it) and B re-reads under its lock. So read the row
        under the lock (``Model.objects.locked()`` does) and write it once.

        ``update_fields``: the fields to write (default: every concrete field
        except the primary key and fields not loaded). Raises
        :class:`~django_redlock.FencedWriteRejected` when no row was written
        (a newer holder wrote, the row changed since this instance was read, or
        the row is gone), and ``ValueError`` when the lock has no fence
        (``fencing=False`` or never acquired). On success ``self.fence`` is the
        lock's fence.

        Like ``QuerySet.update()``, it sends no ``pre_save``/``post_save`` signals
        and does not insert: save the row once before writing it fenced. Write a
        row always under the same lock name (``self.lock()``,
        ``Model.objects.locked()``), since fences increase per name.
        """
        fence = _check_fence(lock, "fenced_save()")
        if self.pk is None:
            raise ValueError(f"fenced_save() of an unsaved {type(self).__name__}: save() it "
                             f"once first")
        model = type(self)
        meta = self._meta
        fence_field = _fence_field(model)
        db = using or self._state.db or router.db_for_write(model, instance=self)
        values: dict[str, Any] = {}
        for name in self._unfenced_fields(update_fields):
            field = meta.get_field(name)
            values[field.attname] = field.pre_save(self, False)  # type: ignore[union-attr]
        loaded = getattr(self, fence_field.attname) or 0
        written = 0
        if fence > loaded:
            written = model._base_manager.using(db).filter(
                pk=self.pk, **{fence_field.attname: loaded}
            ).update(**{fence_field.attname: fence}, **values)
        if written == 0:
            stored = model._base_manager.using(db).filter(pk=self.pk).values_list(
                fence_field.attname, flat=True).first()
            if stored is None:
                why = "the row no longer exists"
            elif stored >= fence or fence <= loaded:
                why = (f"the row carries fence {max(stored, loaded)} >= {fence}: a newer lock "
                       f"holder already wrote it")
            else:
                why = (f"the row was written (fence {loaded} -> {stored}) since this instance "
                       f"was read: read it again under the lock and write once")
            raise FencedWriteRejected(
                f"fenced save of {meta.label} pk={self.pk!r} refused: {why}",
                lock_name=getattr(lock, "name", None), fence=fence, stored_fence=stored)
        setattr(self, fence_field.attname, fence)
        self._state.db = db
        self._state.adding = False

    fenced_save.alters_data = True  # type: ignore[attr-defined]

    async def afenced_save(self, lock: Any, update_fields: Iterable[str] | None = None,
                           using: str | None = None) -> None:
        """:meth:`fenced_save` from async code (runs it in Django's sync thread)."""
        await sync_to_async(self.fenced_save)(lock, update_fields, using)

    afenced_save.alters_data = True  # type: ignore[attr-defined]
