"""LeasedTask: a Celery task base class whose every run holds a database lease."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.canvas import _chain, chord
from celery.exceptions import Ignore

from . import attempt, checkpoint, groups, keys, lifecycle, routes
from .config import check_task_options, conf_version, settings_for
from .db import Store, store_for
from .errors import (
    ArgumentsError,
    ConfigurationError,
    LeaseError,
    LeaseLost,
    StoreUnavailable,
)
from .lease import Lease, current, held, holding
from .message import (
    COALESCE,
    DEBOUNCE_HEADER,
    GROUP_HEADER,
    KEY_HEADER,
    KEY_STRATEGY_HEADER,
    VERSION_HEADER,
    checked_strategy,
)
from .publish import Coalesced, Recorder
from .reaper import register_reaper
from .settings import Settings


class LeasedTask(Task):  # type: ignore[misc]
    """Base class for tasks that hold a lease, checkpoint, and resume after a crash.

    Use as ``@app.task(base=LeasedTask, bind=True)``. Task options ``lease_duration``,
    ``lease_renew_interval``, ``lease_stall_timeout`` (seconds), ``lease_max_checkpoint_bytes``
    and ``lease_kill_stalled`` override the app's ``leases_*`` settings for one task.

    ``lease_key`` names the resource a job works on, so that at most one job per key is
    queued or running at a time: a format string over the task's arguments
    (``"account:{account_id}"``, ``"{0}"``) or a callable taking them; ``apply_async(...,
    lease_key=...)`` sets it for one call. A call while the key has a live job is coalesced
    into it (see :meth:`apply_async`), or supersedes it (``lease_key_strategy="newest"``).

    ``lease_debounce = (quiet, max_wait)`` (seconds) debounces the triggers of a key: a burst
    runs once, ``quiet`` seconds after its last trigger and at most ``max_wait`` seconds after
    its first, with the last trigger's arguments; ``apply_async(..., lease_debounce=...)``
    sets it for one call (docs/keys.md, "Debounce").

    ``lease_group`` names a job's group (a tenant: a format string or a callable over the
    arguments, as ``lease_key``): at most ``lease_group_limit`` jobs of a group (an int, or a
    callable taking the group's name) are in the broker or running at once across all
    workers, and at most ``lease_group_rate`` (``"10/s"``, ``"10/m"``, ``"100/h"``) start a
    second, counted in the database; a job over them waits there, recorded but not published,
    first in first out (docs/keys.md, "Groups"). Each can be set for one call in
    ``apply_async``.
    """

    #: The resource of a job, from its arguments (None: jobs have no key).
    lease_key: str | Callable[..., str] | None = None
    #: (quiet, max_wait) in seconds: debounce the triggers of a key (None: no debounce).
    lease_debounce: tuple[float, float] | None = None
    #: The group of a job, from its arguments (None: no group).
    lease_group: str | Callable[..., str] | None = None
    #: At most this many jobs of a group admitted at once: an int, or a callable taking the
    #: group's name (None: no limit).
    lease_group_limit: int | Callable[[str], int] | None = None
    #: At most this many admissions of a group a unit of time, ``"10/s"`` (None: no limit).
    lease_group_rate: str | float | None = None

    #: What a call does while its lease key has a live job: ``"coalesce"`` (wait, and run
    #: once that job ends, with the first waiting call's arguments) or ``"newest"`` (that job
    #: is superseded: it ends ``superseded`` at its next checkpoint, or at once if it has not
    #: started, and the next run has the newest call's arguments). See docs/keys.md.
    lease_key_strategy: str = COALESCE

    #: The worker's main process resumes the job at once when its pool process dies.
    Request = "celery_leases.worker.request:LeasedRequest"

    #: Marks a leased task for the worker's signals (``worker.signals``).
    __celery_leases__ = True

    @property
    def retry_on_worker_lost(self) -> bool:
        """Celery >= 5.7: when a pool process dies, record RETRY instead of FAILURE.

        Celery's own handling, for a death ``LeasedRequest`` does not resume at once (an
        attempt that saved no checkpoint yet, or past ``leases_max_attempts``): the reaper then
        resumes or gives up on the job, and a client blocked in ``AsyncResult(id).get()``
        waits for that rather than getting ``WorkerLostError``. Not with ``acks_late`` +
        ``reject_on_worker_lost``, where the broker delivers the message again itself.
        """
        return not (self.acks_late and self.reject_on_worker_lost)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Bound to ``app``: refuse unknown ``lease_*`` options, an impossible
        ``lease_debounce`` and a ``lease_key_strategy`` that is none, register the reaper task
        (``celery_leases.reap``) in this app only, and connect the worker's signals (once).
        Calls ``super().on_bound(app)``."""
        super().on_bound(app)
        check_task_options(cls, base=LeasedTask)
        checked_strategy(cls.lease_key_strategy)
        try:
            keys.debounce_of(cls.lease_debounce, where=f"lease_debounce of {cls.name}")
        except ArgumentsError as exc:
            raise ConfigurationError(str(exc)) from exc
        register_reaper(app)

    @property
    def lease_settings(self) -> Settings:
        """The validated ``leases_*`` settings with this task's options applied.

        Read again when the app's configuration changes (``app.conf.leases_x = ...``,
        ``app.conf.update()``, ``config_from_object()``; ``config.conf_version``), checked at
        each use with a few dictionary look-ups, validated only when it changed.

        With ``leases_routes``, their ``database_url`` is that of the job being acted on
        (``routes.using``), else that of the task's own route (its default queue's).
        """
        return self._lease_cache().settings_of(self)

    @property
    def lease_store(self) -> Store:
        """The store of this task's leases database (one per process and database): with
        ``leases_routes``, the database of the job being acted on (``lease_settings``)."""
        return self.lease_settings_and_store()[1]

    def lease_settings_and_store(self) -> tuple[Settings, Store]:
        """``lease_settings`` and ``lease_store`` read at once (the settings looked up once:
        a checkpoint needs both)."""
        cached = self._lease_cache()
        if not cached.routed:
            if cached.store is None:
                cached.store = store_for(cached.settings)
            return cached.settings, cached.store
        settings = cached.settings_of(self)
        return settings, store_for(settings)

    def lease_home(self) -> str:
        """The leases database of this task's jobs sent to its default queue ('default'
        without ``leases_routes``)."""
        cached = self._lease_cache()
        return cached.home(self) if cached.routed else routes.DEFAULT

    def lease_route(self, request: Any = None) -> str | None:
        """The leases database of ``request``'s job (this task's request by default): the one
        its message names, else its route; None without ``leases_routes``.
        :class:`StoreUnavailable` for a database this process does not know (a worker of a
        rolling deploy that has not got it yet: the message goes back, for one that has)."""
        cached = self._lease_cache()
        request = request if request is not None else self.request
        custom = getattr(request, "headers", None) or {}
        # Celery puts a message's custom headers in the request's ``headers``, and at its top
        # level too.
        if not cached.routed:
            named = custom.get(routes.ROUTE_HEADER) or getattr(request, routes.ROUTE_HEADER, None)
            if named and named != routes.DEFAULT:
                routes.on(cached.settings, str(named))  # raises: no other database here
            return None
        headers = {
            name: custom.get(name) or getattr(request, name, None)
            for name in (routes.ROUTE_HEADER, VERSION_HEADER, KEY_HEADER, GROUP_HEADER)
        }
        named = routes.named(cached.settings, headers)
        if named is not None:
            return named
        info = getattr(request, "delivery_info", None) or {}
        keyed = self.lease_key or self.lease_group or headers[KEY_HEADER] or headers[GROUP_HEADER]
        if keyed:
            # A key's or a group's jobs all live in its task's database (a call sent to a
            # queue routed elsewhere is refused when it is recorded): one sent by name to
            # such a queue, never recorded, is claimed there too.
            routed_to = cached.home(self)
        elif info.get("routing_key"):
            queue = routes.queue_of(self.app, info.get("exchange"), info["routing_key"])
            routed_to = routes.route(cached.settings, self.name, queue)
        else:
            routed_to = cached.home(self)  # Task.apply(): never sent, so its default queue's
        return routes.of_message(
            cached.settings,
            str(request.id),
            routed_to=routed_to,
            recorded=headers[VERSION_HEADER] is not None,
        )

    def _lease_cache(self) -> _Cached:
        version = conf_version(self.app)
        cached: _Cached | None = self.__dict__.get("_lease_cached")
        if cached is None or cached.version != version:
            settings = settings_for(self.app).with_task_options(self)
            cached = self.__dict__["_lease_cached"] = _Cached(version, settings)
        return cached

    @property
    def lease(self) -> Lease:
        """The lease of the attempt running in this thread."""
        if not current.stack:
            raise LeaseError("self.lease is only available while a LeasedTask runs")
        return current.stack[-1]

    def checkpoint(
        self,
        state: Any,
        *,
        progress: tuple[int, int | None] | int | None = None,
        connection: Any = None,
    ) -> None:
        """Save ``state`` (JSON-serializable) as the point to resume from, and renew the lease.

        ``progress`` is ``(done, total)`` or ``done``. The checkpoint joins the caller's
        transaction on the leases' database: ``connection``'s (an SQLAlchemy ``Connection``, or
        a DBAPI connection: psycopg, PyMySQL, sqlite3), or, in a Django project, the
        ``transaction.atomic()`` block it runs in: your writes and the checkpoint commit
        together, and a stale attempt gets :class:`LeaseLost` before committing anything.
        Raises :class:`CheckpointError` for a state that is not JSON or too large (nothing is
        written), :class:`WriteConflict` when the transaction lost to a concurrent one (it is
        rolled back: run it again), :class:`Cancelled` or :class:`Preempted` after saving when
        the job was asked to stop.
        """
        checkpoint.save(self, self.lease, state, progress=progress, connection=connection)

    def save_cursor(self, state: Any, *, connection: Any = None) -> None:
        """Save ``state`` (JSON-serializable) as the cursor of the job's lease key: where the
        key's next run starts (``self.lease.cursor``). Fenced like a checkpoint: a stale
        attempt gets :class:`LeaseLost` and writes nothing. It joins the caller's transaction
        as ``checkpoint`` does."""
        checkpoint.save_cursor(self, self.lease, state, connection=connection)

    def key_for(self, args: Any, kwargs: Any) -> str | None:
        """The lease key of a call with ``args`` and ``kwargs`` (the task's ``lease_key``)."""
        return keys.key_of(self, self.lease_key, args, kwargs)

    def group_for(self, args: Any, kwargs: Any) -> str | None:
        """The group of a call with ``args`` and ``kwargs`` (the task's ``lease_group``)."""
        return groups.group_of(self, self.lease_group, args, kwargs)

    def stop_point(self) -> None:
        """Raise :class:`Cancelled` or :class:`Preempted` if the job was asked to stop, and
        :class:`LeaseLost` if this attempt lost its lease (its renewals failed until it ended).

        ``checkpoint()`` calls it after saving; with ``checkpoint(..., connection=conn)`` call it
        yourself once your transaction has committed, so the job stops right there.
        """
        checkpoint.stop_point(self.lease)

    async def aapply_async(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`apply_async` for ``async def`` code (an ASGI view, an async worker of your
        own): the record and the publish run in a thread (``asyncio.to_thread``), so the event
        loop goes on while the database and the broker answer. Same arguments, same result
        (an ``AsyncResult``, or the serving job's for a coalesced trigger)."""
        return await asyncio.to_thread(self.apply_async, *args, **kwargs)

    async def adelay(self, *args: Any, **kwargs: Any) -> Any:
        """``delay()`` for ``async def`` code: ``await task.adelay(account_id)``."""
        return await self.aapply_async(args, kwargs)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Record the job (its whole message, state ``queued``) in the leases table, then
        publish that message. A retry of the running attempt hands its lease back instead,
        with the retry's message as the job's message.

        A job with a lease key (``lease_key=`` here, or the task's option) whose key already
        has a live job is a trigger of that key, coalesced and never lost: a job that has not
        started yet absorbs it; one that has started runs once more, as one follow-up job,
        when it ends (with the arguments of the first trigger that waited). Nothing is
        published then, and the result returned is that of the job that serves the trigger.

        A debounced call (``lease_debounce=(quiet, max_wait)`` here, or the task's option)
        whose key's job has not started yet becomes that job's message (the last trigger's
        arguments win) and moves its due time; the result returned is that job's.

        With ``lease_key_strategy="newest"`` (the task's option, or here for one call) the
        trigger supersedes the key's job instead: a queued one ends at once, a running one at
        its next checkpoint, both ``superseded`` (REVOKED in Celery), and the next run has the
        newest trigger's arguments.
        """
        key = options.pop("lease_key", None)
        debounce = options.pop("lease_debounce", None)
        strategy = options.pop("lease_key_strategy", None)
        group = options.pop("lease_group", None)
        limit = options.pop("lease_group_limit", self.lease_group_limit)
        if inspect.ismethod(limit) and limit.__self__ is self:
            limit = limit.__func__  # a function given as the option became a method of the task
        rate = options.pop("lease_group_rate", self.lease_group_rate)
        if self.app.conf.task_always_eager:
            _eager_route(self, args, kwargs, options, key=key, group=group)
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        if key is not None:
            options["headers"] = {**(options.get("headers") or {}), KEY_HEADER: key}
        if debounce is not None:
            options["headers"] = {**(options.get("headers") or {}), DEBOUNCE_HEADER: debounce}
        if strategy is not None:
            options["headers"] = {
                **(options.get("headers") or {}),
                KEY_STRATEGY_HEADER: checked_strategy(strategy),
            }
        if group is not None:
            options["headers"] = {**(options.get("headers") or {}), GROUP_HEADER: group}
        recorder = Recorder(self, group_limit=limit, group_rate=rate)
        with self.app.producer_or_acquire(producer) as publisher:
            try:
                sent = super().apply_async(
                    args,
                    kwargs,
                    task_id,
                    recorder.producer(publisher),
                    link,
                    link_error,
                    shadow,
                    **options,
                )
            except Coalesced as coalesced:
                return self.AsyncResult(coalesced.job_id)
            except BaseException:
                recorder.undo()
                raise
        # A debounced trigger was published as the message of its burst's job.
        return sent if recorder.debounced is None else self.AsyncResult(recorder.debounced)

    def on_replace(self, sig: Any) -> Any:
        """``self.replace(sig)``: the job ends ``replaced`` and hands its id over to the
        replacement, which runs as a job of its own (a new generation of the id). Asked inside
        a transaction of the task's that may hold the job's row (a checkpoint joined it), the
        replacement waits for the body to return, that transaction ended
        (``Attempt.held_back``)."""
        _refuse_replacement_elsewhere(self, sig)
        lease = held(self.request.id)
        if lease is not None and lease.joined_write and lease.joined is None:
            lease.held_back = ("replace", sig)
            raise Ignore("Replaced by new task")
        return self.replace_now(lease, sig)

    def replace_now(self, lease: Lease | None, sig: Any) -> Any:
        """End the job ``replaced`` (fenced; its end handed on: its key settled, its group's
        next admitted), and send the replacement."""
        if lease is not None and not lifecycle.replace(self, lease):
            raise LeaseLost(f"job {lease.job_id}: lost its lease; not replaced")
        return super().on_replace(sig)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.id is None:
            with holding(Lease("(direct call)", 0, 1, None, "", 1.0, 0.5, detached=True)):
                return self.run(*args, **kwargs)
        try:
            route = self.lease_route(request)
        except StoreUnavailable as exc:  # its database is unknown here, or cannot be asked
            attempt.deliver_later(self, args, kwargs, exc)
        with routes.using(route):
            return attempt.Attempt(self).run(args, kwargs)


class _Cached:
    """A task's settings and store, for one version of its app's configuration."""

    __slots__ = ("_home", "routed", "settings", "store", "version")

    def __init__(self, version: tuple[Any, ...], settings: Settings) -> None:
        self.version = version
        self.settings = settings
        self.store: Store | None = None
        self.routed = routes.routed(settings)
        self._home: str | None = None

    def settings_of(self, task: Any) -> Settings:
        """The task's settings; with routes, for the database of the job being acted on
        (``routes.using``), else of the task's own route."""
        if not self.routed:
            return self.settings
        return routes.on(self.settings, routes.active() or self.home(task))

    def home(self, task: Any) -> str:
        """The database of the task's jobs sent to its default queue."""
        if self._home is None:
            self._home = routes.route(self.settings, task.name, _default_queue(task))
        return self._home


def _eager_route(
    task: Any, args: Any, kwargs: Any, options: dict[str, Any], *, key: Any, group: Any
) -> None:
    """With ``task_always_eager`` and routes: name in the call's headers the database of the
    queue it is sent to, as its record would (an eager run knows no queue), refusing a keyed
    or grouped call to a queue routed elsewhere than its task."""
    cached = task._lease_cache()
    if not cached.routed or (options.get("headers") or {}).get(routes.ROUTE_HEADER):
        return
    queue = _routed_queue(task, options, args, kwargs)
    if queue is None:  # a router that fails here fails the call's send too: the home
        return
    name = routes.route(cached.settings, task.name, queue)
    keyed = key or group or task.lease_key or task.lease_group
    if keyed and name != cached.home(task):
        raise routes.split_call(task.name, queue, name, cached.home(task))
    options["headers"] = {**(options.get("headers") or {}), routes.ROUTE_HEADER: name}


def _refuse_replacement_elsewhere(task: Any, sig: Any) -> None:
    """Refuse, before the job ends, ``task.replace(sig)`` by a keyed or grouped task whose jobs
    live in another leases database than the running job's: the replacement takes over the
    job's id where the job lives, and a key's or a group's jobs must all live in its own."""
    running = routes.active()
    if running is None:
        return
    # The replacement's task that takes over the job's id: a chain's last, a chord's body.
    while True:
        if isinstance(sig, _chain) and sig.tasks:
            sig = sig.tasks[-1]
        elif isinstance(sig, chord):
            sig = sig.body
        else:
            break
    name = getattr(sig, "task", None)
    other = task.app.tasks.get(name) if isinstance(name, str) else None
    if other is None or not getattr(other, "__celery_leases__", False):
        return
    options = getattr(sig, "options", None) or {}
    shared = other.lease_key or other.lease_group
    if not (shared or options.get("lease_key") or options.get("lease_group")):
        return
    home = other.lease_home()
    if home != running:
        raise ConfigurationError(
            f"task {task.name}: replace() by {other.name}, whose jobs have a lease key or a "
            f"group and live in leases database {home!r}, cannot take over this job's id in "
            f"database {running!r} (a key's or a group's jobs must all live in one): send "
            f"it with apply_async() and return its result instead"
        )


def _default_queue(task: Any) -> str | None:
    """The queue Celery's router sends a call of ``task`` without options to: its own
    ``queue`` (``@app.task(queue=...)``) before ``task_routes``, as ``apply_async`` has it;
    for a router that needs the call's arguments, its own queue or the default one."""
    found = _routed_queue(task, {}, (), {})
    if found is None:
        found = getattr(task, "queue", None) or task.app.conf.task_default_queue
    return None if found is None else str(getattr(found, "name", found))


def _routed_queue(task: Any, options: dict[str, Any], args: Any, kwargs: Any) -> str | None:
    """The name of the queue Celery's router sends a call of ``task`` with ``options`` to (the
    task's own options first, as ``apply_async`` merges them): the route's queue, else the one
    its exchange and routing key reach. None when the router fails or names neither."""
    try:
        route = task.app.amqp.router.route(
            {**task._get_exec_options(), **options}, task.name, args or (), kwargs or {}
        )
    except Exception:  # a router of the app's that needs other arguments
        return None
    queue = route.get("queue")
    if queue is not None:
        return str(getattr(queue, "name", queue))
    exchange = route.get("exchange")
    return routes.queue_of(task.app, getattr(exchange, "name", exchange), route.get("routing_key"))
