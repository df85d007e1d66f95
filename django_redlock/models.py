"""ORM helpers: lock a row, claim it, read it, and write it fenced.

(Why one module of 730 lines: Django finds models in ``models.py``, and the
queryset, the model and the fence field share one order of claim, read and
fenced write, which is easier to check in one place.)

Two mistakes this module exists to prevent:

1. **Reading before locking.** ``p = Product.objects.get(pk=1); with p.lock(): p.stock -= 1;
   p.save()`` decrements a value read *before* the lock was held: two requests
   both read 5 and both write 4. ``Product.objects.locked(pk=1)`` acquires the
   lock first and then loads the row, so the body always sees the last write.

2. **Writing after the lease ran out.** A holder can pause (GC, a slow query,
   SIGSTOP) past its lease while another process takes the lock. Refusing only
   a write "older than the last write" (``WHERE fence < F``) is not enough::

       t0  A locks product 1 (fence 5), reads stock 10, pauses past its lease
       t1  B locks product 1 (fence 6), reads stock 10
       t2  A resumes, writes 9 WHERE fence < 5: accepted (the row had fence 4)
       t3  B writes 9 WHERE fence < 6: accepted. Two sales, stock 9.

   The holder must *claim* the row before it reads it: ``locked()`` (and
   :meth:`LockingQuerySet.claim_and_get`) first runs ``UPDATE ... SET fence = F
   WHERE pk = %s AND fence < F`` and only then reads it. At t1 B's claim
   moves the row to fence 6, so A's write at t2 (``WHERE fence = 5``: the row
   must still carry *its* claim) matches nothing and raises
   :class:`~django_redlock.FencedWriteRejected`; B's write at t3 stands. Every
   write helper here (:meth:`LockingQuerySet.fenced_update`,
   :meth:`LockableModel.fenced_save`) writes only rows the writer's own hold
   claimed, and only while they still carry its claim, so no older holder
   writes after a newer one claimed, and no write rests on a value read
   before the writer's claim.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from asgiref.sync import sync_to_async
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import models, router
from django.db.models import Max

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
from .fencedwrites import claimed_rows, note_claimed_rows, note_fenced_write
from .signals import fenced_write_rejected
from .signals import send as _send_signal

if TYPE_CHECKING:
    from .engine.lock import Lock

__all__ = ["FenceField", "LockableModel", "LockingManager", "LockingQuerySet", "RedisLock"]


def _rejected(model: Any, message: str, **context: Any) -> FencedWriteRejected:
    """The :class:`FencedWriteRejected` to raise, after the ``fenced_write_rejected`` signal."""
    exc = FencedWriteRejected(message, **context)
    _send_signal(fenced_write_rejected, model, model=model, lock_name=exc.lock_name,
                 fence=exc.fence, stored_fence=context.get("stored_fence"))
    return exc


if TYPE_CHECKING:  # django-stubs' fields are generic (set type, get type); Django's are not
    _BigIntegerField = models.BigIntegerField[int, int]
else:
    _BigIntegerField = models.BigIntegerField


class FenceField(_BigIntegerField):
    """The fencing token of the last fenced write to the row (0: never fenced).

    Written only by the claim (:meth:`LockingQuerySet.claim`,
    :meth:`LockingQuerySet.claim_and_get`, which ``locked()`` runs before it
    reads); never by ``save()``; not editable in forms or the admin.
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


def _fence_field(model: type[models.Model]) -> models.Field[Any, Any]:
    for field in model._meta.concrete_fields:
        if isinstance(field, FenceField):
            return field
    raise ImproperlyConfigured(
        f"{model._meta.label} has no FenceField; add `fence = FenceField()` (or inherit "
        f"from LockableModel) to use fenced writes")


def _claim_field(model: type[models.Model]) -> models.Field[Any, Any]:
    """The fence field of a model whose claims and fenced writes are one
    conditional ``UPDATE`` each: its fence must be in the model's own table.

    A child model of multi-table inheritance has its parent's fence. Django
    writes a child's parent fields with two statements, a ``SELECT`` of the
    pks the filter matches and then ``UPDATE parent ... WHERE pk IN (...)``,
    so the fence condition is checked by the ``SELECT`` only::

        A's fenced_save selects the row (fence = A's), is paused
        B claims and writes (fence = B's)
        A resumes: its UPDATE lands over B's write, and the fence goes back

    Such a model is refused; its parent's rows (same pks) can be locked,
    claimed and written: ``Parent.objects.locked(pk=child.pk)``.
    """
    field = _fence_field(model)
    owner = field.model._meta.concrete_model
    if owner is not model._meta.concrete_model:
        parent = (owner or field.model)._meta.label
        raise ImproperlyConfigured(
            f"{model._meta.label}'s fence is in the table of {parent} (multi-table "
            f"inheritance): Django updates it with a SELECT and then an UPDATE, so a claim or "
            f"a fenced write would not be one conditional statement. Lock, claim and write the "
            f"{parent} row instead ({parent.rsplit('.', 1)[-1]}.objects.locked(pk=...))")
    return field


def _check_own_table(model: type[models.Model], names: Iterable[str], what: str) -> None:
    """Refuse a fenced write of a field of a concrete parent's table: Django
    writes another table's fields with a ``SELECT`` of the pks and then an
    ``UPDATE ... WHERE pk IN (...)``, so the fence condition is not in that
    ``UPDATE`` (the same race as :func:`_claim_field`'s, through a parent
    that has no fence: ``class Item(LockableModel, Base)``)."""
    meta = model._meta
    for name in names:
        try:
            field = meta.get_field(name)
        except FieldDoesNotExist:
            continue  # Django's own error follows
        owner = getattr(field, "model", None)
        if owner is not None and owner._meta.concrete_model is not meta.concrete_model:
            raise ImproperlyConfigured(
                f"{what} of {meta.label} would write {name!r}, a field of {owner._meta.label}'s "
                f"table (multi-table inheritance): Django updates another table with a SELECT "
                f"and then an UPDATE, so the write would not be one conditional statement. "
                f"Write only {meta.label}'s own fields fenced (update_fields=...)")


def _writable(queryset: Any) -> Any:
    """``queryset`` on the database writes go to (``router.db_for_write``),
    unless a database was named: a claim's reads must see its own ``UPDATE``
    (a replica that lags would show the row before the claim), and a fenced
    write goes where ``save()`` would write."""
    if queryset._db is not None:
        return queryset
    return queryset.using(router.db_for_write(queryset.model, **queryset._hints))


def _same_fence(model: type[models.Model], lock: Any, fence: int, pk: Any) -> Exception:
    """The refusal of a claim that meets a row another holder claimed with the
    same fence (possible only after a node lost its data; fencedwrites.py)."""
    which = f" pk={pk!r}" if pk is not None else ""
    return _rejected(model,
        f"claim of {model._meta.label}{which} refused: another lock holder claimed it with "
        f"the same fence {fence} (two holders of one fence: a node lost its data, see the "
        f"safety model)", lock_name=getattr(lock, "name", None), fence=fence,
        stored_fence=fence)


def _check_fence(lock: Any, what: str) -> int:
    fence = getattr(lock, "fence", 0)
    if not isinstance(fence, int) or fence <= 0:
        raise ValueError(
            f"{what} needs a lock acquired with fencing on (fencing=True): "
            f"lock {getattr(lock, 'name', lock)!r} has fence {fence!r}, and a fenced write with "
            f"no fence would protect nothing")
    return fence


def _template_for(model: type[models.Model]) -> LockNameTemplate:
    cached: LockNameTemplate | None = model.__dict__.get("_redlock_template")
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

    def find(root: str) -> tuple[bool, Any, models.Field[Any, Any] | None]:
        field: models.Field[Any, Any] | None
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


class LockingQuerySet(models.QuerySet[Any]):
    """A QuerySet with :meth:`locked` (lock, claim, then read), :meth:`claim`,
    :meth:`claim_and_get` and :meth:`fenced_update`."""

    @contextlib.contextmanager
    def locked(self, *, ttl: Any = ..., timeout: Any = ..., auto_renew: Any = ...,
               fencing: bool = True, max_hold: Any = ..., label: str | None = None,
               **lookup: Any) -> Iterator[Any]:
        """Acquire the row's lock, claim the row with the lock's fence, *then* read it.

        ``with Product.objects.locked(pk=pk) as product:`` -- the lock has the
        name ``product.lock()`` would use. Right after acquiring, the row is
        *claimed* (:meth:`claim_and_get`: ``UPDATE ... SET fence = F WHERE ...
        AND fence < F``) and only then read, so the body never acts on a value
        read before, and every later write of an older holder (conditional on
        its own fence) is refused. ``product.held_lock`` is the
        :class:`~django_redlock.Lock` (for :meth:`LockableModel.fenced_save`).
        The lock is released when the block ends; ``LockLost`` is raised then if
        it was lost meanwhile. ``DoesNotExist`` propagates (the lock is released
        first); :class:`~django_redlock.FencedWriteRejected` is raised at once if
        the row already carries a higher fence (a newer holder claimed it). With
        ``fencing=False`` there is no fence to claim with: the row is only read.
        """
        name = lock_name_for_lookup(self.model, lookup)
        lock = get_manager().lock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                                  fencing=fencing, max_hold=max_hold,
                                  label=label or _label(self.model))
        with lock:
            if fencing:
                instance = self.claim_and_get(lock, **lookup)
            else:
                instance = self.get(**lookup)
                instance.held_lock = lock
            yield instance

    @contextlib.asynccontextmanager
    async def alocked(self, *, ttl: Any = ..., timeout: Any = ..., auto_renew: Any = ...,
                      fencing: bool = True, max_hold: Any = ..., label: str | None = None,
                      **lookup: Any) -> AsyncIterator[Any]:
        """The ``async with`` twin of :meth:`locked` (an ``AsyncLock``, claim, then read)."""
        name = lock_name_for_lookup(self.model, lookup)
        lock = get_manager().alock(name, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                                   fencing=fencing, max_hold=max_hold,
                                   label=label or _label(self.model))
        async with lock:
            if fencing:
                instance = await self.aclaim_and_get(lock, **lookup)
            else:
                instance = await self.aget(**lookup)
                instance.held_lock = lock
            yield instance

    def claim(self, lock: Any) -> int:
        """Mark the selected rows as written by ``lock``'s holder; call it *before* reading.

        One statement, ``UPDATE ... SET fence = F WHERE <filter> AND fence < F``
        (``F = lock.fence``). From then on a write conditional on an older fence
        -- every write of :meth:`fenced_update` and of
        :meth:`~LockableModel.fenced_save` -- matches none of these rows, so a
        holder paused past its lease cannot write after this one claimed. Returns
        the number of rows newly claimed (rows this hold claimed before stay
        claimed). Raises :class:`~django_redlock.FencedWriteRejected` when a
        selected row carries a *higher* fence: a newer holder claimed it, and
        this holder must not act on it (the rows with a lower fence are claimed
        all the same; the newer holder's own claim overrides that); and when a
        row carries this very fence but this hold did not claim it: another
        holder with the same fence did, which only a node that lost its data
        makes possible (docs/safety.rst, "Two holders with one fence"). A claim
        refused because such a holder claimed a row between its read and its
        UPDATE counts none of its rows as this hold's: they stay refused to it.
        """
        fence = _check_fence(lock, "claim()")
        field = _claim_field(self.model)
        self = _writable(self)
        label = self.model._meta.label
        mine = claimed_rows(lock, fence)
        # A row already at this fence that this hold did not claim: another
        # holder with the same fence claimed it (fencedwrites.py, the timeline).
        at_fence = self.filter(**{field.attname: fence}).values_list("pk", flat=True)
        foreign = [pk for pk in at_fence if (label, pk) not in mine]
        if foreign:
            raise _same_fence(self.model, lock, fence, foreign[0])
        lower = list(self.filter(**{f"{field.name}__lt": fence}).values_list("pk", flat=True))
        claimed = self.filter(pk__in=lower, **{f"{field.name}__lt": fence}).update(
            **{field.attname: fence}) if lower else 0
        if claimed == len(lower):
            # Only then are these rows known to be the ones this UPDATE moved.
            # Fewer: another holder moved some of them between the read and
            # the UPDATE, and a row recorded here that it claimed would pass
            # this hold's next claim as its own (both holders would write):
            # none is recorded, so every row at this fence stays foreign.
            note_claimed_rows(lock, fence, [(label, pk) for pk in lower])
        newer = self.filter(**{f"{field.name}__gt": fence}).aggregate(
            newest=Max(field.name))["newest"]
        if newer is not None:
            raise _rejected(self.model,
                f"claim of {self.model._meta.label} refused: a selected row carries fence "
                f"{newer} > {fence} (a newer lock holder claimed it)",
                lock_name=getattr(lock, "name", None), fence=fence, stored_fence=newer)
        if claimed != len(lower):
            # Some row moved to this fence (or above) between the read and the
            # UPDATE: another holder claimed it meanwhile, and which rows are
            # whose cannot be told apart now.
            raise _same_fence(self.model, lock, fence, None)
        return claimed

    def claim_and_get(self, lock: Any, **lookup: Any) -> Any:
        """Claim the one row ``lookup`` selects with ``lock``'s fence, then read it.

        For a lock that is already held, e.g. ``request.redlock`` in a view
        decorated with ``@with_lock(Product.lock_template())``::

            product = Product.objects.claim_and_get(request.redlock, pk=pk)
            product.stock -= 1
            product.fenced_save(request.redlock, update_fields=["stock"])

        The row is read after the claim, so ``product.fence == lock.fence`` and
        its values are the last ones written. Raises ``DoesNotExist`` /
        ``MultipleObjectsReturned`` like ``get()`` (before claiming anything), and
        :class:`~django_redlock.FencedWriteRejected` when a newer holder claimed
        the row, before or right after our claim. Warns (``RuntimeWarning``) when
        ``lock`` is not the row's own lock name: code that locks the row by its
        own name (``locked()``, ``row.lock()``) would not be excluded by it.
        """
        fence = _check_fence(lock, "claim_and_get()")
        field = _claim_field(self.model)
        self = _writable(self)
        selected = self.filter(**lookup) if lookup else self
        meta = self.model._meta
        by_pk = {"pk", meta.pk.name, meta.pk.attname}
        if lookup and all(key.removesuffix("__exact") in by_pk for key in lookup):
            target = selected  # at most one row: claim it directly (2 queries in all)
        else:  # another lookup could select several rows: find the one first
            pks = list(selected.order_by().values_list("pk", flat=True)[:2])
            if not pks:
                raise self.model.DoesNotExist(
                    f"{meta.object_name} matching query does not exist.")
            if len(pks) > 1:
                raise self.model.MultipleObjectsReturned(
                    f"claim_and_get() of {meta.object_name} selects more than one row; claim "
                    f"several rows with claim()")
            target = selected.filter(pk=pks[0])
        # The claim; a row that already carries a higher fence is left alone, and
        # the read below tells (its fence is not ours).
        changed = target.filter(**{f"{field.name}__lt": fence}).update(**{field.attname: fence})
        instance = target.get()
        stored = getattr(instance, field.attname)
        if stored != fence:  # a newer holder claimed it, before or right after our claim
            raise _rejected(self.model,
                f"claim of {meta.label} pk={instance.pk!r} refused: a newer lock holder "
                f"claimed it (fence {stored} > {fence})",
                lock_name=getattr(lock, "name", None), fence=fence, stored_fence=stored)
        row = (meta.label, instance.pk)
        if not changed and row not in claimed_rows(lock, fence):
            # At our fence, but not by our claim: another holder with the same
            # fence claimed it (fencedwrites.py, the timeline).
            raise _same_fence(self.model, lock, fence, instance.pk)
        note_claimed_rows(lock, fence, (row,))
        instance.held_lock = lock
        name = getattr(lock, "name", None)
        if isinstance(name, str) and hasattr(instance, "lock_name"):
            own = instance.lock_name()
            if own != name:
                warnings.warn(
                    f"{self.model.__name__} pk={instance.pk!r} was claimed under lock {name!r}, but "
                    f"its own lock name is {own!r} (what {self.model.__name__}.objects.locked() "
                    f"and .lock() take): two names for one row exclude nothing. Lock it by "
                    f"{own!r} (e.g. @with_lock({self.model.__name__}.lock_template())) or set "
                    f"{self.model.__name__}.lock_name_template", RuntimeWarning, stacklevel=2)
        return instance

    async def aclaim_and_get(self, lock: Any, **lookup: Any) -> Any:
        """:meth:`claim_and_get` from async code (in Django's sync thread)."""
        return await sync_to_async(self.claim_and_get)(lock, **lookup)

    async def aclaim(self, lock: Any) -> int:
        """:meth:`claim` from async code (in Django's sync thread)."""
        return await sync_to_async(self.claim)(lock)

    def fenced_update(self, lock: Any, **values: Any) -> int:
        """``UPDATE`` the selected rows that ``lock`` has claimed (they carry its fence).

        One statement: ``.filter(pk__in=<the rows this hold claimed>,
        fence=lock.fence).update(**values)`` (the claimed rows are kept on the
        lock object, per hold: a row another holder claimed with the same
        fence, possible after a node lost its data, is not written). The rows
        must have been claimed *before* whatever the values were computed from
        was read: by ``locked()`` / :meth:`claim_and_get` for one row, by
        :meth:`claim` for several. Then no interleaving loses an update: an older
        holder's write matches no row once a newer holder claimed, and a newer
        holder's claim moves the fence past this one, so this write is refused.
        (The earlier form, ``WHERE fence < F`` without a claim, let a paused
        holder's write land between a newer holder's read and its write.)

        Returns the number of rows written. Raises
        :class:`~django_redlock.FencedWriteRejected` when no row was written
        although the queryset selects some: none was claimed by ``lock`` (claim
        first) or a newer holder claimed them. Rows not carrying ``lock``'s fence
        are skipped, so a smaller count than expected means some were not ours.
        """
        fence = _check_fence(lock, "fenced_update()")
        field = _claim_field(self.model)
        self = _writable(self)
        _check_own_table(self.model, values, "fenced_update()")
        if field.name in values or field.attname in values:
            raise ValueError(f"fenced_update() writes only rows carrying the lock's fence; do "
                             f"not pass {field.name!r} (claim() sets it)")
        # Only rows this hold claimed: after a node lost its data another holder
        # may carry the same fence (fencedwrites.py), and rows it claimed carry it.
        label = self.model._meta.label
        mine = [pk for row_label, pk in claimed_rows(lock, fence) if row_label == label]
        written = self.filter(pk__in=mine, **{field.attname: fence}).update(**values) \
            if mine else 0
        if written:
            note_fenced_write(lock, fence)
            return written
        newest = self.aggregate(newest=Max(field.name))["newest"]
        if newest is None:
            return 0  # nothing selected
        if newest > fence:
            why = f"a selected row carries fence {newest} > {fence} (a newer lock holder claimed it)"
        else:
            why = (f"no selected row carries this lock's fence {fence}: claim the rows "
                   f"(locked(), claim_and_get() or claim()) before reading what you write")
        raise _rejected(self.model,
            f"fenced update of {self.model._meta.label} refused: {why}",
            lock_name=getattr(lock, "name", None), fence=fence, stored_fence=newest)

    async def afenced_update(self, lock: Any, **values: Any) -> int:
        """:meth:`fenced_update` from async code (in Django's sync thread)."""
        return await sync_to_async(self.fenced_update)(lock, **values)


class LockingManager(models.Manager.from_queryset(LockingQuerySet)):  # type: ignore[misc]  # a base class built at run time; mypy needs the django-stubs plugin (and settings) to follow it
    """The default manager of :class:`LockableModel`: ``.locked(...)``, ``.claim_and_get(...)``,
    ``.claim(...)``, ``.fenced_update(...)``."""


class LockableModel(models.Model):
    """An abstract model whose rows can be locked and written with fencing.

    The lock name of a row is ``"<app_label>.<model_name>:<pk>"`` (e.g.
    ``"shop.product:42"``); set ``lock_name_template`` on the class to change it
    (placeholders resolved from the instance, e.g. ``"sku:<sku>"``; ``.locked()``
    then needs those fields in its lookup).

    One name per row: :meth:`lock_template` is the template to give
    ``@with_lock`` so that a view and ``Model.objects.locked()`` exclude each
    other (``@with_lock(Product.lock_template())`` in a view whose URL has
    ``<pk>``); two different names on one row would both be granted at once.

    A plain ``save()`` of an existing row leaves the ``fence`` column alone (it
    is not in the UPDATE, also for an instance built with the row's pk), so an
    unfenced save cannot move the fence backwards.
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

    def _do_update(self, base_qs: Any, using: Any, pk_val: Any, values: Any,
                   *args: Any, **kwargs: Any) -> Any:
        """Django's UPDATE of a ``save()``, without the fence column.

        :meth:`save` names the fields of an instance loaded from the database,
        but an instance *built* with an existing row's pk
        (``Product(pk=1, ...).save()``: an upsert, a form or a serializer that
        makes a fresh instance) is saved by an UPDATE of every field, which
        wrote its ``fence`` of 0 over the row's. A stale holder's claim
        (``fence < F``) then passed again, after a newer holder had claimed::

            B claims the row (fence 42) and reads it
            somebody saves Product(pk=1, ...): fence 0
            stale A (fence 41) claims: 0 < 41, accepted; A writes
            B's write (WHERE fence = 42) is refused; A's stale sale stands

        Every write of the fence goes through the claim, ``fenced_save`` and
        ``fenced_update`` (queryset updates, which do not come here).
        """
        # (Any FenceField: a child's save() comes here for its parent's table too.)
        kept = [value for value in values if not isinstance(value[0], FenceField)]
        return super()._do_update(base_qs, using, pk_val, kept, *args, **kwargs)

    # -- names and locks -------------------------------------------------------------
    @classmethod
    def lock_template(cls) -> str:
        """The lock name template of this model's rows, e.g. ``"shop.product:<pk>"``.

        The same name ``locked()``, ``lock()`` and ``lock_name()`` use; hand it to
        ``with_lock`` so a decorated view locks the row by that one name.
        """
        return _template_for(cls).source

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
        made: Lock = get_manager().lock(self.lock_name(), ttl=ttl, timeout=timeout,
                                        auto_renew=auto_renew, fencing=fencing,
                                        max_hold=max_hold, label=label or _label(type(self)))
        return made

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
            if not getattr(field, "concrete", False) or getattr(field, "primary_key", False) or \
                    getattr(field, "many_to_many", False):
                raise ValueError(f"fenced_save(update_fields=...): {name!r} is not a concrete, "
                                 f"non-primary-key field")
            names.append(field.name)
        return names

    def fenced_save(self, lock: Any, update_fields: Iterable[str] | None = None,
                    using: str | None = None) -> None:
        """Write this row only while it is still claimed by ``lock``'s hold.

        One conditional UPDATE (``... SET <fields> WHERE pk = %s AND fence = F``,
        ``F = lock.fence``) of an instance read *after* this hold claimed the
        row: by ``Model.objects.locked()`` or
        :meth:`LockingQuerySet.claim_and_get` (or :meth:`LockingQuerySet.claim`
        and then a read). The write lands only while the row still carries this
        hold's claim, so it is refused as soon as a newer holder claimed.

        An instance this hold did not claim is refused before anything is
        written (claim first). Such an instance was once accepted as a
        compare-and-set on the fence it was read with, but a write that keeps
        the row's fence (every write of a claimed holder) does not show in that
        fence, so the compare-and-set missed it::

            A (fence 41) claims and reads stock 10, is paused past its lease
            B (fence 42) acquires, reads stock 10 without a claim (fence 41)
            A resumes and writes 9 WHERE fence = 41: accepted (nobody claimed)
            B writes 9 WHERE fence = 41: accepted, and A's sale is lost

        With B's claim first, A's write matches nothing and B reads A's
        last write.

        ``update_fields``: the fields to write (default: every concrete field
        except the primary key and fields not loaded). Raises
        :class:`~django_redlock.FencedWriteRejected` when nothing was written:
        the instance was not claimed by this hold, a newer holder claimed the
        row, or the row is gone; and ``ValueError`` when the lock has no fence
        (``fencing=False`` or never acquired).

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
        fence_field = _claim_field(model)
        db = using or router.db_for_write(model, instance=self)  # as save() does
        values: dict[str, Any] = {}
        names = self._unfenced_fields(update_fields)
        _check_own_table(model, names, "fenced_save()")
        for name in names:
            field = meta.get_field(name)
            values[field.attname] = field.pre_save(self, False)  # type: ignore[union-attr]
        loaded = getattr(self, fence_field.attname) or 0
        # Read after this hold's claim: it carries the lock's fence, and the row
        # is one this hold claimed (not one another holder of the same fence
        # claimed, possible after a node lost its data: fencedwrites.py).
        claimed = loaded == fence and (meta.label, self.pk) in claimed_rows(lock, fence)
        written = 0
        if claimed:
            written = model._base_manager.using(db).filter(
                pk=self.pk, **{fence_field.attname: fence}).update(**values) if values else \
                model._base_manager.using(db).filter(
                    pk=self.pk, **{fence_field.attname: fence}).count()
        if written == 0:
            stored = model._base_manager.using(db).filter(pk=self.pk).values_list(
                fence_field.attname, flat=True).first()
            if stored is None:
                why = "the row no longer exists"
            elif stored > fence or loaded > fence:
                why = (f"the row carries fence {max(stored, loaded)} > {fence}: a newer lock "
                       f"holder claimed or wrote it")
            elif not claimed:
                why = (f"this instance was not read after a claim by this lock (it carries "
                       f"fence {loaded}, the lock {fence}): claim the row first "
                       f"(Model.objects.locked(), claim_and_get()) and write what that read")
            else:
                why = f"the row carries fence {stored}, no longer this lock's claim {fence}"
            raise _rejected(model,
                f"fenced save of {meta.label} pk={self.pk!r} refused: {why}",
                lock_name=getattr(lock, "name", None), fence=fence, stored_fence=stored)
        note_fenced_write(lock, fence)
        self._state.db = db
        self._state.adding = False

    fenced_save.alters_data = True  # type: ignore[attr-defined]

    async def afenced_save(self, lock: Any, update_fields: Iterable[str] | None = None,
                           using: str | None = None) -> None:
        """:meth:`fenced_save` from async code (runs it in Django's sync thread)."""
        await sync_to_async(self.fenced_save)(lock, update_fields, using)

    afenced_save.alters_data = True  # type: ignore[attr-defined]


# ------------------------------------------------------------ the admin's model
class RedisLock(models.Model):
    """What the admin "Locks" page hangs on: no table, no migration.

    ``managed = False`` and this app ships no migrations, so ``migrate`` creates
    nothing for it; it exists so that the admin lists a "Locks" entry and so
    that Django creates its permissions (``post_migrate``):

    * ``django_redlock.view_redislock``: see the page (staff users);
    * ``django_redlock.release_lock``: force-release a lock from it.

    The page itself reads the Redis nodes (:mod:`django_redlock.admin`); no
    query ever touches a table for this model.
    """

    name: models.CharField[str, str] = models.CharField(max_length=1024, primary_key=True)

    class Meta:
        managed = False
        default_permissions = ("view",)
        permissions = [("release_lock", "Can force-release a Redis lock")]
        verbose_name = "lock"
        verbose_name_plural = "locks"

    def __str__(self) -> str:
        return str(self.name)
