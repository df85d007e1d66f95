"""``with_lock``: one decorator for views, model methods and plain functions.

(Why one module of 870 lines: ``with_lock``, ``with_semaphore``,
``with_segments`` and ``with_multi_lock`` are one ``_Target`` that finds the
request, renders the names, answers a busy lock and runs the body the same way
for every kind of callable, sync and async; split by kind, each part would
re-tell those rules.)

::

    @with_lock("stock:<pk>")                   # a function view, pk from the URL
    def restock(request, pk): ...

    @method_decorator(with_lock("cart:<request.user.pk>"), name="dispatch")
    class CartView(View): ...                   # a class-based view

    class Product(LockableModel):
        @with_lock("product:<pk>")              # a model method, pk from self
        def restock(self, qty): ...

    @with_lock("report:<day>", timeout=0)       # a plain function / Celery task body
    def build_report(day): ...

What counts as a view is decided per call: the first argument (or the second,
after ``self``, for a method of a class-based view) is an ``HttpRequest``. Pass
``view=True/False`` to say it yourself.

Where placeholders come from:

* a view: its URL keyword arguments, then ``request`` (``<request.user.pk>``; a
  bare ``<user.pk>`` is also read from the request when no URL kwarg is called
  ``user``); a method decorated directly can also use ``<self.attr>``;
* anything else: the call's bound arguments (``inspect.signature(f).bind``,
  defaults applied), then, for a method, attributes of ``self`` (so a model
  method can say ``<pk>``).

A view that cannot get the lock answers instead of raising: busy past the
timeout -> ``BUSY_STATUS`` (423) with ``Retry-After`` (``on_busy`` overrides);
no Redis quorum -> 503 with ``Retry-After``, logged once. Anything else raises
:class:`~django_redlock.LockNotAcquired` / :class:`~django_redlock.QuorumUnavailable`.

The held lock is available to the body: ``request.redlock`` in a view and
:func:`current_lock` anywhere (a context variable, so it follows threads started
with ``contextvars.copy_context()`` and asyncio tasks), e.g. for a fenced write::

    @with_lock(Product.lock_template())        # the row's own name, "shop.product:<pk>"
    def restock(pk, qty):
        product = Product.objects.claim_and_get(current_lock(), pk=pk)  # claim, then read
        product.stock += qty
        product.fenced_save(current_lock(), update_fields=["stock"])

A view that returned normally while its lock was lost (the release raises
``LockLost``) keeps its response when its work is known to be protected: its
``atomic=True`` block committed after the ownership check, or the database
accepted a fenced write made with this hold's fence. The loss is logged and
signalled (``lock_lost``); answering 500 would tell the client that a recorded
write failed. Any other view, and every non-view call, raises ``LockLost``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from types import EllipsisType
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import BadRequest, ImproperlyConfigured
from django.db import transaction
from django.http import HttpRequest, StreamingHttpResponse

from .conf import get_manager
from .core.arguments import LABEL_MAX, check_label, check_max_hold, check_timeout, check_ttl
from .core.keys import InvalidLockName
from .core.templates import (
    LockNameTemplate,
    Placeholder,
    TemplateError,
    UnresolvedPlaceholder,
    parse_template,
    resolve_path,
)
from .exceptions import LockLost, LockNotAcquired, LockNotOwned, QuorumUnavailable
from .fencedwrites import fenced_write_accepted
from .responses import busy_response, unavailable_response
from .transport.finalizers import get_logger

__all__ = ["current_lock", "with_lock"]

logger = get_logger("django_redlock.decorators")

F = TypeVar("F", bound=Callable[..., Any])

#: Where a view's placeholder reads what the client sent (``request.<this>``).
_CLIENT_DATA = frozenset({"GET", "POST", "COOKIES", "headers", "META", "FILES", "body"})

_current_lock: ContextVar[Any] = ContextVar("django_redlock_current_lock", default=None)


def current_lock() -> Any:
    """The lock held by the innermost ``with_lock``-decorated call running now, or None.

    A :class:`~django_redlock.Lock` (an ``AsyncLock`` in an ``async def``). Use it
    for fenced writes from inside a decorated function, where the lock object is
    otherwise out of reach. Claim the row before reading it, so that a holder
    paused past its lease is the one refused, not the newer holder::

        @with_lock(Product.lock_template())     # the row's own lock name
        def restock(pk, qty):
            product = Product.objects.claim_and_get(current_lock(), pk=pk)
            product.stock += qty
            product.fenced_save(current_lock(), update_fields=["stock"])
    """
    return _current_lock.get()


def _as_request(obj: Any) -> Any:
    """``obj`` when it is a Django request (or wraps one, like DRF's ``Request``)."""
    if isinstance(obj, HttpRequest):
        return obj
    if isinstance(getattr(obj, "_request", None), HttpRequest):
        return obj
    return None


def _describe(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", None) or "?"
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) \
        or type(func).__name__
    return f"{module}.{qualname}"


#: ``with_lock(mode=...)``: a plain lock, or a read-write lock's reader or writer.
MODES = ("exclusive", "read", "write")


class _Target:
    """What one ``with_lock(...)(func)`` knows: the template, options and ``func``."""

    def __init__(self, func: Callable[..., Any], template: LockNameTemplate, *, ttl: Any,
                 timeout: Any, auto_renew: Any, atomic: bool, on_busy: Any, fencing: bool,
                 max_hold: Any, label: str | None, using: str | None, manager: Any,
                 view: bool | None, reentrant: bool = False, mode: str = "exclusive",
                 permits: int | None = None, count: int | None = None,
                 more: tuple[LockNameTemplate, ...] = (), multi: bool = False) -> None:
        self.func = func
        self.reentrant = reentrant
        self.mode = mode
        #: ``with_semaphore``'s permits (None: ``with_lock``, a lock of ``mode``).
        self.permits = permits
        #: ``with_segments``'s count (None: not segments).
        self.count = count
        self.template = template
        #: Every template: one, or those of ``with_multi_lock`` (all or none).
        self.templates = (template, *more)
        #: ``with_multi_lock``: a multi-lock of every template's name.
        self.multi = multi
        #: What the messages and the metrics call the lock(s) (a bounded label).
        self.source = " + ".join(t.source for t in self.templates)
        self.ttl = ttl
        self.timeout = timeout
        self.auto_renew = auto_renew
        self.atomic = atomic
        #: Whether the warning of a body run inside an open transaction was
        #: logged (_check_transaction: once per decorated function).
        self._warned_transaction = False
        #: Whether an async view's streaming response was warned about (call_async).
        self._warned_stream = False
        self.on_busy = on_busy
        self.fencing = fencing
        self.max_hold = max_hold
        self.label = label
        self.using = using
        self.manager = manager
        self.view = view
        self.where = _describe(func)
        try:
            self.signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):  # a builtin or an odd callable: no bound arguments
            self.signature = None

    # -- which kind of call ------------------------------------------------------
    def find_request(self, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """(request, view instance or None) for a view call; (None, None) otherwise."""
        if self.view is False:
            return None, None
        if args:
            request = _as_request(args[0])
            if request is not None:
                return request, None
            if len(args) > 1:
                request = _as_request(args[1])
                if request is not None:
                    return request, args[0]
        if self.view:
            raise TypeError(f"with_lock(view=True) on {self.where}: the call has no HttpRequest "
                            f"as its first argument (or second, after self)")
        return None, None

    # -- lock names ----------------------------------------------------------------
    def _unresolved(self, template: LockNameTemplate, exc: UnresolvedPlaceholder,
                    sources: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            f"with_lock({template.source!r}) on {self.where}: cannot resolve placeholder "
            f"{exc.placeholder}: {exc.reason}. {sources}")

    def view_names(self, request: Any, view_self: Any, kwargs: dict[str, Any]) -> list[str]:
        """The lock name of each template for one request (one but for a multi-lock)."""
        return [self.view_name(request, view_self, kwargs, t) for t in self.templates]

    def call_names(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """The lock name of each template for one call (one but for a multi-lock)."""
        return [self.call_name(args, kwargs, t) for t in self.templates]

    def view_name(self, request: Any, view_self: Any, kwargs: dict[str, Any],
                  template: LockNameTemplate | None = None) -> str:
        """The lock name for one request (of ``template``, by default the first).

        A value the client sent (a URL argument, ``request.GET``/``POST``/
        ``headers``/``COOKIES``/``META``) that is missing, empty, holds a
        control character or makes the name too long is the client's error:
        :class:`~django.core.exceptions.BadRequest`, which Django answers
        with a 400. A placeholder the view can never resolve is the site's
        error (``ImproperlyConfigured``, a 500), whatever the request.
        """
        def lookup(p: Placeholder) -> Any:
            root = p.root
            if root in kwargs:
                value = kwargs[root]
            elif root == "request":
                value = request
            elif root == "self" and view_self is not None:
                value = view_self
            else:
                try:
                    value = getattr(request, root)
                except AttributeError:
                    raise UnresolvedPlaceholder(
                        p, f"{root!r} is not a URL keyword argument of the view "
                           f"(it got: {', '.join(sorted(kwargs)) or 'none'}) nor an attribute "
                           f"of the request") from None
            return resolve_path(value, p)

        def from_client(p: Placeholder) -> bool:
            if p.root in kwargs:
                return True
            data = p.attrs[0] if p.root == "request" and p.attrs else p.root
            return data in _CLIENT_DATA

        template = template or self.template
        try:
            return template.render(lookup)
        except UnresolvedPlaceholder as e:
            if from_client(e.placeholder) and e.placeholder.root not in kwargs:
                raise BadRequest(f"lock name {template.source!r}: the request has no "
                                 f"value for {e.placeholder}") from None
            raise self._unresolved(
                template, e, "A view resolves placeholders from its URL keyword arguments, then from "
                   "request (e.g. <request.user.pk>).") from None
        except InvalidLockName as e:
            # One bad value (e.placeholder), or a name too long once rendered
            # (then any value the client sent may have made it so).
            culprits = (e.placeholder,) if isinstance(e.placeholder, Placeholder) \
                else template.placeholders
            if any(from_client(p) for p in culprits):
                raise BadRequest(str(e)) from None
            raise

    def call_name(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                  template: LockNameTemplate | None = None) -> str:
        """The lock name for one call (of ``template``, by default the first)."""
        template = template or self.template
        arguments: dict[str, Any] = {}
        if self.signature is not None:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            for pname, param in self.signature.parameters.items():
                if pname not in bound.arguments:
                    continue
                if param.kind is inspect.Parameter.VAR_KEYWORD:
                    for key, value in bound.arguments[pname].items():
                        arguments.setdefault(key, value)
                else:
                    arguments[pname] = bound.arguments[pname]
        else:
            arguments.update(kwargs)
        has_self = "self" in arguments

        def lookup(p: Placeholder) -> Any:
            root = p.root
            if root in arguments:
                value = arguments[root]
            elif has_self:
                try:
                    value = getattr(arguments["self"], root)
                except AttributeError:
                    raise UnresolvedPlaceholder(
                        p, f"{root!r} is neither an argument of {self.where}() "
                           f"({', '.join(arguments) or 'none'}) nor an attribute of self "
                           f"({type(arguments['self']).__name__})") from None
            else:
                raise UnresolvedPlaceholder(
                    p, f"{root!r} is not an argument of {self.where}() "
                       f"(its arguments: {', '.join(arguments) or 'none'})")
            return resolve_path(value, p)

        try:
            return template.render(lookup)
        except UnresolvedPlaceholder as e:
            raise self._unresolved(
                template, e, "A function resolves placeholders from its arguments (and a method also "
                   "from attributes of self).") from None

    # -- locks ---------------------------------------------------------------------
    def _where_called(self) -> str:
        """``module.qualname`` for the label; the view *class* for method_decorator.

        ``method_decorator(..., name="dispatch")`` hands us ``View.dispatch`` bound
        to the instance: naming the instance's class says which view holds the lock.
        """
        owner = _partial_self(self.func)
        if owner is None:
            return self.where
        cls = type(owner)
        return f"{cls.__module__}.{cls.__qualname__}.{getattr(self.func, '__name__', '?')}"

    def _options(self, is_view: bool) -> dict[str, Any]:
        auto_renew = self.auto_renew
        if auto_renew is ... and is_view:
            auto_renew = True  # a slow request keeps its lock unless told otherwise
        label = self.label or f"{'view' if is_view else 'func'}:{self._where_called()}"
        if len(label) > LABEL_MAX:  # a derived one (a given one was checked): cut, not refused
            label = label[:LABEL_MAX - 3] + "..."
        options = {"ttl": self.ttl, "timeout": self.timeout, "auto_renew": auto_renew,
                   "fencing": self.fencing, "max_hold": self.max_hold, "label": label}
        if self.reentrant:
            options["reentrant"] = True
        return options

    def _manager(self) -> Any:
        return self.manager if self.manager is not None else get_manager()

    def _make(self, manager: Any, names: list[str], is_view: bool, *,
              aio: bool = False) -> Any:
        """The lock (or its kin) for one call, not yet acquired: a plain lock, a
        read-write lock's reader or writer (``mode``), a semaphore (``permits``),
        segments (``count``) or a multi-lock (several templates), sync or asyncio."""
        options = self._options(is_view)
        if self.multi:
            make = manager.amulti_lock if aio else manager.multi_lock
            return make(names, **options)
        name = names[0]
        if self.count is not None:
            make = manager.asegments if aio else manager.segments
            return make(name, self.count, **options)
        if self.permits is not None:
            make = manager.asemaphore if aio else manager.semaphore
            return make(name, self.permits, **options)
        factory = {("exclusive", False): manager.lock, ("exclusive", True): manager.alock,
                   ("read", False): manager.read_lock, ("read", True): manager.aread_lock,
                   ("write", False): manager.write_lock, ("write", True): manager.awrite_lock,
                   }[(self.mode, aio)]
        return factory(name, **options)

    def _busy(self, request: Any, exc: LockNotAcquired, manager: Any, name: str) -> Any:
        if self.on_busy is not None:
            return self.on_busy(request, exc)
        return busy_response(request, exc, status=manager.busy_status, lock_name=name)

    # -- sync ------------------------------------------------------------------------
    def call_sync(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request, view_self = self.find_request(args)
        if request is not None and _is_async_view(view_self, self.func):
            # ``method_decorator(..., name="dispatch")`` on an async class-based view:
            # dispatch() is sync but returns the handler's coroutine. Holding a sync
            # lock around it would release before the handler ran (and block the event
            # loop while waiting): hand Django a coroutine that holds an AsyncLock.
            if self.atomic:
                raise ImproperlyConfigured(
                    f"with_lock({self.source!r}, atomic=True) on {self._where_called()}"
                    f": the view is async, and Django transactions are bound to a thread")
            return self.call_async(args, kwargs)
        self._check_transaction()
        manager = self._manager()
        if request is not None:
            names = self.view_names(request, view_self, kwargs)
            name = ", ".join(names)
            lock = self._make(manager, names, True)
            lock.metrics_label = self.source  # a bounded label (metrics)
            try:
                lock.__enter__()
            except LockNotAcquired as exc:
                return self._busy(request, exc, manager, name)
            except QuorumUnavailable as exc:
                return unavailable_response(request, exc, lock_name=name)
            missing = object()
            previous = getattr(request, "redlock", missing)
            request.redlock = lock
            try:
                return self._run_held(lock, args, kwargs, view=True)
            finally:
                if previous is missing:
                    with contextlib.suppress(AttributeError):
                        del request.redlock
                else:
                    request.redlock = previous
        lock = self._make(manager, self.call_names(args, kwargs), False)
        lock.metrics_label = self.source
        try:
            lock.__enter__()
        except LockNotAcquired as exc:
            if self.on_busy is None:
                raise
            return self.on_busy(None, exc)
        return self._run_held(lock, args, kwargs)

    def _check_transaction(self) -> None:
        """Before the lock is taken: a body run inside a transaction that is
        already open (``ATOMIC_REQUESTS``, an outer ``atomic()``) commits only
        after the lock is released, and another holder may read the old
        values meanwhile::

            A  (outer atomic)  takes the lock, sells one: stock 9, uncommitted
            A  releases the lock; the outer transaction is still open
            B  takes the lock, reads stock 10 (A has not committed), sells one
            A  commits 9; B commits 9: one sale lost

        ``atomic=True`` promised that the writes commit while the lock is
        held: there it refuses to run (``RuntimeError``, as Django's own
        ``atomic(durable=True)`` does when nested; a test case's transaction
        does not count). Without it the body runs, and a warning says once per
        function that only fenced writes are protected."""
        try:
            connection = transaction.get_connection(self.using)
            blocks = getattr(connection, "atomic_blocks", None) or []
        except ImproperlyConfigured:  # no database settings (a manager of its own): no transaction
            return
        if not blocks or getattr(blocks[-1], "_from_testcase", False):
            return
        if self.atomic:
            raise RuntimeError(
                f"with_lock({self.source!r}, atomic=True) on {self._where_called()} was "
                f"called inside an open transaction (ATOMIC_REQUESTS or an outer atomic()): "
                f"its writes would commit after the lock is released, when another holder "
                f"may have read the old values. Exempt the view from ATOMIC_REQUESTS "
                f"(@transaction.non_atomic_requests) or call it outside the transaction.")
        if not self._warned_transaction:
            self._warned_transaction = True
            logger.warning(
                "with_lock(%r) on %s runs inside an open transaction (ATOMIC_REQUESTS or an "
                "outer atomic()): its writes commit after the lock is released, so only "
                "fenced writes (claim, fenced_save, fenced_update) are protected",
                self.source, self._where_called())

    def _run_held(self, lock: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                  view: bool = False) -> Any:
        """Run the body with ``lock`` acquired; ``lock.__exit__`` releases it last."""
        token = _current_lock.set(lock)
        fence = lock.fence
        done = False
        try:
            with contextlib.ExitStack() as stack:
                stack.push(lock)  # its __exit__ runs after the body: raises LockLost if lost
                if not self.atomic:
                    result = self.func(*args, **kwargs)
                else:
                    with transaction.atomic(using=self.using):
                        result = self.func(*args, **kwargs)
                        _ensure_owned(lock)  # raising here rolls the transaction back
                done = True
                if view and isinstance(result, StreamingHttpResponse):
                    if getattr(result, "is_async", False):
                        self._warn_stream()
                    else:
                        stack.pop_all()  # released when the stream ends, not now
                        self._release_when_closed(lock, result)
                return result
        except LockLost as exc:
            if view and done and self._response_stands(lock, fence, exc):
                return result
            raise
        finally:
            _current_lock.reset(token)

    def _release_when_closed(self, lock: Any, response: StreamingHttpResponse) -> None:
        """Hold ``lock`` while ``response`` streams: its body runs after the
        view returned, and used to run with the lock already released
        (another request took it while the first one's rows were still
        being read out). The lock is released when the stream ends or is
        closed (a server closes the response, and with it its iterator,
        once sent or once the client went away). A loss found by that
        release is logged (and was signalled): the response is sent."""

        def release() -> None:
            try:
                lock.__exit__(None, None, None)
            except LockLost as exc:
                logger.warning("lock %r of %s was lost while its streaming response was "
                               "sent: %s", _name_of(lock), self._where_called(), exc)

        response.streaming_content = _HeldStream(response.streaming_content, release)

    def _warn_stream(self) -> None:
        if not self._warned_stream:
            self._warned_stream = True
            logger.warning(
                "with_lock(%r) on %s returned an asynchronous streaming response: its "
                "body is sent after the lock is released (a synchronous stream holds it "
                "until it ends)", self.source, self._where_called())

    def _response_stands(self, lock: Any, fence: int, exc: LockLost) -> bool:
        """Whether a view that returned normally keeps its response although the
        release found the lock lost (``exc``).

        Yes when its writes are known to have been protected: the ``atomic=True``
        block committed after checking the lock was still held, or the storage
        accepted a fenced write with this hold's fence
        (:mod:`django_redlock.fencedwrites`). Answering 500 then would tell the
        client that a recorded sale failed. The loss was already signalled
        (``lock_lost``); it is logged here once more with what was kept. A view
        with neither keeps raising :class:`~django_redlock.LockLost`: nothing
        vouches that its unfenced writes did not overlap another holder's.
        """
        if self.atomic:
            why = "its atomic block committed while the lock was held"
        elif fenced_write_accepted(lock, fence):
            why = "its fenced write was accepted by the database"
        else:
            return False
        logger.warning("lock %r (fence %d) of %s was lost after the view's work: %s; the "
                       "view's response stands (%s)", _name_of(lock), fence, self._where_called(),
                       why, exc)
        return True

    # -- async -----------------------------------------------------------------------
    async def call_async(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request, view_self = self.find_request(args)
        manager = self._manager()
        is_view = request is not None
        if is_view:
            names = self.view_names(request, view_self, kwargs)
        else:
            names = self.call_names(args, kwargs)
        name = ", ".join(names)
        lock = self._make(manager, names, is_view, aio=True)
        lock.metrics_label = self.source
        try:
            await lock.__aenter__()
        except LockNotAcquired as exc:
            if not is_view and self.on_busy is None:
                raise
            answer = self._busy(request, exc, manager, name)
            return await answer if inspect.isawaitable(answer) else answer
        except QuorumUnavailable as exc:
            if not is_view:
                raise
            return unavailable_response(request, exc, lock_name=name)
        missing = object()
        previous = getattr(request, "redlock", missing) if is_view else missing
        if is_view:
            request.redlock = lock
        token = _current_lock.set(lock)
        fence = lock.fence
        done = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                stack.push_async_exit(lock)
                result = self.func(*args, **kwargs)
                if inspect.isawaitable(result):  # a coroutine (an async CBV's dispatch too)
                    result = await result
                done = True
                if is_view and isinstance(result, StreamingHttpResponse):
                    self._warn_stream()
                return result
        except LockLost as exc:
            if is_view and done and self._response_stands(lock, fence, exc):
                return result
            raise
        finally:
            _current_lock.reset(token)
            if is_view:
                if previous is missing:
                    with contextlib.suppress(AttributeError):
                        del request.redlock
                else:
                    request.redlock = previous


class _HeldStream:
    """A streaming response's content that calls ``release`` once, when it
    ends or is closed (Django registers an iterator's ``close`` with the
    response, and a server closes the response, also when the client left
    before the first chunk: a generator's ``finally`` would not run then)."""

    def __init__(self, content: Any, release: Callable[[], None]) -> None:
        self._content = iter(content)
        self._release: Callable[[], None] | None = release

    def __iter__(self) -> "_HeldStream":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._content)
        except BaseException:  # the end (StopIteration), or the stream failed
            self.close()
            raise

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def with_semaphore(template: str, permits: int, *, ttl: float | EllipsisType = ...,
                   timeout: float | None | EllipsisType = ...,
                   auto_renew: bool | EllipsisType = ..., atomic: bool = False,
                   on_busy: Callable[[Any, LockNotAcquired], Any] | None = None,
                   fencing: bool = True, max_hold: float | None | EllipsisType = ...,
                   label: str | None = None, using: str | None = None, manager: Any = None,
                   view: bool | None = None) -> Callable[[F], F]:
    """Hold one of ``permits`` permits of the semaphore named by ``template``
    while the decorated callable runs (:meth:`LockManager.semaphore`).

    Everything else is as for :func:`with_lock`: the placeholders, the busy
    answers of a view (``BUSY_STATUS`` with ``Retry-After``, 503 without a
    quorum), ``on_busy``, ``atomic``, ``current_lock()`` and ``request.redlock``
    (here the semaphore: ``.index`` is the permit held, ``.fence`` its fence).
    ``permits`` is checked at decoration time (``ValueError``).
    """
    from .engine.semaphore import check_permits

    return with_lock(template, ttl=ttl, timeout=timeout, auto_renew=auto_renew, atomic=atomic,
                     on_busy=on_busy, fencing=fencing, max_hold=max_hold, label=label,
                     using=using, manager=manager, view=view,
                     _permits=check_permits(permits))


def with_segments(template: str, count: int, *, ttl: float | EllipsisType = ...,
                  timeout: float | None | EllipsisType = ...,
                  auto_renew: bool | EllipsisType = ..., atomic: bool = False,
                  on_busy: Callable[[Any, LockNotAcquired], Any] | None = None,
                  fencing: bool = True, max_hold: float | None | EllipsisType = ...,
                  label: str | None = None, using: str | None = None, manager: Any = None,
                  view: bool | None = None) -> Callable[[F], F]:
    """Hold any one free segment of ``count`` of the name ``template`` renders
    while the decorated callable runs (:meth:`LockManager.segments`).

    Everything else is as for :func:`with_lock`; ``current_lock()`` and
    ``request.redlock`` are the segments held: ``.index`` is the segment,
    ``.fence`` its fence. A body that must skip some segments (say, the rows
    whose stock ran out) uses :func:`django_redlock.segments` and its ``skip``
    instead. ``count`` is checked at decoration time (``ValueError``).
    """
    from .engine.segments import check_count

    return with_lock(template, ttl=ttl, timeout=timeout, auto_renew=auto_renew, atomic=atomic,
                     on_busy=on_busy, fencing=fencing, max_hold=max_hold, label=label,
                     using=using, manager=manager, view=view, _count=check_count(count))


def with_multi_lock(templates: Sequence[str], *, ttl: float | EllipsisType = ...,
                    timeout: float | None | EllipsisType = ...,
                    auto_renew: bool | EllipsisType = ..., atomic: bool = False,
                    on_busy: Callable[[Any, LockNotAcquired], Any] | None = None,
                    fencing: bool = True, max_hold: float | None | EllipsisType = ...,
                    label: str | None = None, using: str | None = None, manager: Any = None,
                    view: bool | None = None) -> Callable[[F], F]:
    """Hold every lock the ``templates`` render, or none, while the decorated
    callable runs (:meth:`LockManager.multi_lock`: deadlock-free whatever order
    the templates are in).

    Each template takes its placeholders as :func:`with_lock`'s does, from the
    same call; everything else is as for :func:`with_lock`. ``current_lock()``
    and ``request.redlock`` are the multi-lock: ``.fences`` maps each name to
    its fence. Two templates that render one name in a call raise
    ``ValueError`` then (:func:`django_redlock.multi_lock`'s rule); an empty or
    a plain string ``templates`` raises it at decoration time.
    """
    if isinstance(templates, (str, bytes)) or not hasattr(templates, "__iter__"):
        raise ValueError(f"with_multi_lock(templates) takes a list of lock name templates, "
                         f"not {templates!r}")
    given = list(templates)
    if not given:
        raise ValueError("with_multi_lock(templates) needs at least one template")
    first, *more = given
    return with_lock(first, ttl=ttl, timeout=timeout, auto_renew=auto_renew, atomic=atomic,
                     on_busy=on_busy, fencing=fencing, max_hold=max_hold, label=label,
                     using=using, manager=manager, view=view, _more=more, _multi=True)


def _parsed(template: Any) -> LockNameTemplate:
    """``template`` parsed; ``ImproperlyConfigured`` naming it when it is malformed."""
    try:
        return parse_template(template)
    except TemplateError as e:
        raise ImproperlyConfigured(f"with_lock({template!r}): {e}") from None


def _partial_self(func: Any) -> Any:
    """The instance behind ``method_decorator``'s ``partial(bound method)``, else None."""
    if isinstance(func, functools.partial):
        return getattr(func.func, "__self__", None)
    return None


def _is_async_view(view_self: Any, func: Callable[..., Any]) -> bool:
    """Whether ``func`` is a method of a class-based view whose handlers are async."""
    owner = view_self if view_self is not None else _partial_self(func)
    if owner is None:
        return False
    try:
        return bool(getattr(type(owner), "view_is_async", False))
    except ImproperlyConfigured:  # mixed sync/async handlers; Django reports it itself
        return False


def _refuse_unheld_body(func: Any, template: str) -> None:
    """``TypeError`` for what ``with_lock`` would wrap without holding its lock
    while the body runs: it holds the lock for the call, and these calls return
    before their body ran.

    * a class (a ``View`` decorated directly): the class became a function,
      and ``as_view()`` failed with a bare ``AttributeError``;
    * a generator function, sync or async (an ``async def`` with ``yield`` is
      no coroutine function, so it took the sync path)::

          call    acquire; produce(1) returns the generator object; release
          next()  the body runs: current_lock() is None, another holder gets in
    """
    where = f"with_lock({template!r}) on {_describe(func)}"
    if isinstance(func, type):
        raise TypeError(
            f"{where}: a class cannot be decorated directly (a view class would no longer "
            f"have as_view()); decorate its dispatch: "
            f"@method_decorator(with_lock({template!r}), name=\"dispatch\")")
    unheld = ("returns before its body runs: the lock would be released before the body "
              "ran, and nothing would hold it meanwhile. Take the lock inside the generator")
    if inspect.isasyncgenfunction(func):
        # No view alternative here: an async stream is sent after the view's
        # lock is released (docs/howto/views.rst).
        raise TypeError(f"{where}: an async generator function {unheld} "
                        f"(async with django_redlock.alock(...): ...)")
    if inspect.isgeneratorfunction(func):
        raise TypeError(f"{where}: a generator function {unheld} "
                        f"(with django_redlock.lock(...): ...), or decorate a sync view that "
                        f"returns a StreamingHttpResponse of it: that lock is held until the "
                        f"stream ends")


def _ensure_owned(lock: Any) -> None:
    """Raise :class:`LockLost` unless ``lock`` is still held (checked right before commit).

    Releasing here reports the loss the usual way (``lock_lost`` signal, warning
    log) and raises ``LockLost`` with the engine's reason; the exception leaves
    the ``atomic`` block, which rolls back.
    """
    if lock.owned():
        return
    name = _name_of(lock)
    try:
        lock.release()
    except LockNotOwned:
        raise LockLost(f"lock {name!r} was released inside the atomic body; "
                       f"not committing", lock_name=name, fence=lock.fence) from None
    raise LockLost(f"lock {name!r} was lost before commit", lock_name=name, fence=lock.fence)


def _name_of(lock: Any) -> str:
    """A lock's name; a multi-lock's names, joined."""
    name = getattr(lock, "name", None)
    return name if isinstance(name, str) else ", ".join(lock.names)


def with_lock(template: str, *, ttl: float | EllipsisType = ...,
              timeout: float | None | EllipsisType = ...,
              auto_renew: bool | EllipsisType = ..., atomic: bool = False,
              on_busy: Callable[[Any, LockNotAcquired], Any] | None = None,
              fencing: bool = True, max_hold: float | None | EllipsisType = ...,
              label: str | None = None, using: str | None = None, manager: Any = None,
              view: bool | None = None, reentrant: bool = False,
              mode: str = "exclusive", _permits: int | None = None,
              _count: int | None = None, _more: Sequence[str] = (),
              _multi: bool = False) -> Callable[[F], F]:
    """Hold the lock named by ``template`` while the decorated callable runs.

    ``mode``: ``"exclusive"`` (a plain lock), or ``"read"`` / ``"write"``: a
    reader or the writer of the read-write lock on that name
    (:func:`django_redlock.read_lock`, :func:`django_redlock.write_lock`).

    ``ttl``, ``timeout``, ``max_hold``: as for :func:`django_redlock.lock`; left
    out, the ``REDLOCK`` settings apply. ``auto_renew``: views renew unless told
    ``auto_renew=False``; other callables follow ``REDLOCK["AUTO_RENEW"]``.

    ``atomic=True`` runs a sync body inside ``transaction.atomic(using=using)``;
    just before the block commits, the lock must still be held, else the
    transaction rolls back and :class:`~django_redlock.LockLost` propagates.
    Not available on ``async def`` (Django transactions belong to a thread).

    ``on_busy(request, exc)``: called instead of answering 423 when the lock stays
    busy past ``timeout``; its return value is the view's response. On a non-view,
    it is called as ``on_busy(None, exc)`` and its return value is the call's
    result (without it, :class:`~django_redlock.LockNotAcquired` is raised).

    ``label``: owner metadata stored with the lock (``manage.py locks`` shows it);
    default ``"view:<module>.<qualname>"`` for views, ``"func:..."`` otherwise.
    ``manager``: a :class:`~django_redlock.LockManager` to use instead of the
    settings' one. ``view``: force (True) or rule out (False) view handling.

    A malformed template raises ``ImproperlyConfigured`` at decoration time; a
    placeholder that cannot be resolved raises it at call time, naming the
    placeholder and the function.
    """
    parsed, *rest = [_parsed(t) for t in (template, *_more)]
    more = tuple(rest)
    if on_busy is not None and not callable(on_busy):
        raise TypeError(f"with_lock(on_busy=...) must be callable, not {on_busy!r}")
    # The time arguments are checked when the module is imported, by the same
    # rules as lock()'s (core.arguments), not at the first request.
    if ttl is not ...:
        ttl = check_ttl(ttl)
    if timeout is not ...:
        timeout = check_timeout(timeout)
    if max_hold is not ...:
        max_hold = check_max_hold(max_hold)
    label = check_label(label)
    if auto_renew is not ... and not isinstance(auto_renew, bool):
        raise ValueError(f"with_lock(auto_renew=...) must be True or False, not {auto_renew!r}")
    if not isinstance(reentrant, bool):
        raise ValueError(f"with_lock(reentrant=...) must be True or False, not {reentrant!r}")
    if mode not in MODES:
        raise ValueError(f"with_lock(mode=...) must be one of {', '.join(map(repr, MODES))}, "
                         f"not {mode!r}")
    if reentrant and mode != "exclusive":
        raise ValueError(f"with_lock(reentrant=True) is for mode='exclusive' (a plain lock), "
                         f"not mode={mode!r}")

    def decorator(func: F) -> F:
        if isinstance(func, (staticmethod, classmethod)):
            raise TypeError("put @with_lock below @staticmethod / @classmethod, next to the "
                            "function")
        if not callable(func):
            raise TypeError(f"with_lock(...) decorates a callable, not {func!r}")
        _refuse_unheld_body(func, template)
        is_async = iscoroutinefunction(func)
        if atomic and is_async:
            raise ImproperlyConfigured(
                f"with_lock({template!r}, atomic=True) on async {_describe(func)}: Django "
                f"transactions are bound to a thread; decorate a sync function (called with "
                f"sync_to_async) instead")
        target = _Target(func, parsed, ttl=ttl, timeout=timeout, auto_renew=auto_renew,
                         atomic=atomic, on_busy=on_busy, fencing=fencing, max_hold=max_hold,
                         label=label, using=using, manager=manager, view=view,
                         reentrant=reentrant, mode=mode, permits=_permits, count=_count,
                         more=more, multi=_multi)
        if is_async:
            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await target.call_async(args, kwargs)

            wrapper: Any = async_wrapper
        else:
            @functools.wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return target.call_sync(args, kwargs)

            wrapper = sync_wrapper
        wrapper.redlock_template = parsed.source
        return wrapper  # type: ignore[no-any-return]

    return decorator
