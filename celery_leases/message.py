"""The Celery message a job carries, as recorded in its row, and sending it again.

A job's row keeps the whole task message (protocol 2): every header (custom ones and stamps
included), the arguments, the callbacks, errbacks, chain and chord, the reply-to and
correlation id, the priority and the exchange and routing key it was published to. It is
recorded from what the client publishes (:class:`RecordingProducer`) or, for a message sent by
name from elsewhere, from what the worker received. It is stored as Celery's own JSON
(``kombu.utils.json``): everything Celery's JSON serializer accepts is accepted, and the
table holds JSON only.

The reaper, a hand-off, a redelivery and ``celery leases retry`` all send that same message
again with :meth:`Message.send`: the same task id, arguments and options, so a resumed job is
the same Celery job.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.app.amqp import task_message
from kombu import Exchange
from kombu.utils import json as kombu_json

from .errors import ArgumentsError, ConfigurationError
from .jsontext import celery_json

#: Header naming the recorded version of a job's message: a new one for each message the
#: library records (a publish, a retry), kept when the recorded message is sent again.
VERSION_HEADER = "leases_message_id"
#: Header counting the deliveries sent again while the leases database was down.
DB_RETRY_HEADER = "leases_db_retries"
#: Header counting the deliveries sent again after the task's transaction lost to another.
CONFLICT_HEADER = "leases_conflicts"
#: Header naming the job's lease key (the resource it works on; ``LeasedTask.lease_key``).
KEY_HEADER = "leases_key"
#: Header naming the job's group (``LeasedTask.lease_group``): its admission and its end.
GROUP_HEADER = "leases_group"
#: Header of a debounced trigger (``LeasedTask.lease_debounce``): ``[quiet, max_wait]``, seconds.
DEBOUNCE_HEADER = "leases_debounce"
#: Header naming what a trigger of a busy lease key does (``LeasedTask.lease_key_strategy``):
#: ``coalesce`` (absent: the same) or ``newest``.
KEY_STRATEGY_HEADER = "leases_key_strategy"
#: Header naming the leases database a job lives in (``routes``; absent: routed at its claim,
#: as a message sent by name).
ROUTE_HEADER = "leases_database"
#: What a trigger of a busy key does: wait and run once the key's job ends (the default), or
#: supersede that job, the newest trigger's arguments winning.
COALESCE, NEWEST = "coalesce", "newest"
KEY_STRATEGIES = (COALESCE, NEWEST)


def checked_strategy(strategy: object) -> str:
    """``strategy`` (a ``lease_key_strategy``), or :class:`ConfigurationError`."""
    if strategy not in KEY_STRATEGIES:
        raise ConfigurationError(
            f"lease_key_strategy must be one of {', '.join(map(repr, KEY_STRATEGIES))}, "
            f"not {strategy!r}"
        )
    return str(strategy)


#: Protocol 2 headers, as Celery's ``amqp.as_task_v2`` writes them.
HEADERS = (
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps",
)  # fmt: skip
#: Headers a transport adds to a message it delivers again (kombu's Redis transport marks a
#: restored message ``redelivered``): about that delivery, not the job, so never recorded.
TRANSPORT_HEADERS = ("redelivered",)
#: What the body's third part (embed) holds.
EMBED = ("callbacks", "errbacks", "chain", "chord")
#: Message properties worth keeping; broker internals (delivery tags) and the AMQP
#: ``expiration`` (recomputed from the ``expires`` header at each send) are not.
PROPERTIES = ("correlation_id", "reply_to", "priority", "delivery_mode", "user_id", "app_id")


@dataclass(frozen=True)
class Message:
    """A task message: headers, body (args, kwargs, embed), properties and route."""

    headers: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    embed: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)
    exchange: str | None = None
    routing_key: str | None = None
    #: The exchange's type (``topic``, ``fanout``, ...) when it is not the default exchange:
    #: re-sending declares it, as kombu's Redis transport routes by the type a channel knows.
    exchange_type: str | None = None

    # -- what it says --------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return str(self.headers["id"])

    @property
    def task(self) -> str:
        return str(self.headers["task"])

    @property
    def version(self) -> str | None:
        """The recorded version (``leases_message_id`` header), None for an unrecorded one."""
        found = self.headers.get(VERSION_HEADER)
        return None if found is None else str(found)

    @property
    def key(self) -> str | None:
        """The lease key the message was published with (``leases_key`` header), or None."""
        found = self.headers.get(KEY_HEADER)
        return None if found is None else str(found)

    @property
    def group(self) -> str | None:
        """The group the message was published in (``leases_group`` header), or None."""
        found = self.headers.get(GROUP_HEADER)
        return None if found is None else str(found)

    @property
    def debounce(self) -> tuple[float, float] | None:
        """The debounce the message was published with (``leases_debounce`` header):
        (quiet, max_wait) in seconds, or None."""
        found = self.headers.get(DEBOUNCE_HEADER)
        if not found:
            return None
        quiet, max_wait = found
        return float(quiet), float(max_wait)

    @property
    def workflow(self) -> list[str]:
        """What of a canvas the message carries: callbacks, errbacks, chain, chord, group."""
        found = [k for k in EMBED if self.embed.get(k)]
        return found + (["group"] if self.headers.get("group") else [])

    @property
    def generation(self) -> int:
        """Celery's ``replaced_task_nesting``: how many ``replace()`` calls led to this job."""
        return int(self.headers.get("replaced_task_nesting") or 0)

    @property
    def retries(self) -> int:
        return int(self.headers.get("retries") or 0)

    @property
    def route(self) -> dict[str, Any]:
        """Where it goes: exchange, routing key and priority (for people reading a job)."""
        found = {
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "priority": self.properties.get("priority"),
        }
        return {k: v for k, v in found.items() if v is not None}

    def expires_in(self, now: datetime | None = None) -> float | None:
        """Seconds until the ``expires`` header (negative once past), None without one."""
        expires = _moment(self.headers.get("expires"))
        if expires is None:
            return None
        return (expires - (now or datetime.now(timezone.utc))).total_seconds()

    def eta_in(self, now: datetime | None = None) -> float | None:
        """Seconds until the ``eta`` header (countdown), None without one."""
        eta = _moment(self.headers.get("eta"))
        if eta is None:
            return None
        return (eta - (now or datetime.now(timezone.utc))).total_seconds()

    def with_headers(self, **headers: Any) -> Message:
        return replace(self, headers={**self.headers, **headers})

    def followup(self) -> Message:
        """This message as a run for triggers that waited: sent as soon as it can run, without
        the ``expires`` or the countdown (``eta``) of the trigger it was built from."""
        return replace(
            self, headers={k: v for k, v in self.headers.items() if k not in ("expires", "eta")}
        )

    def under_id(self, job_id: str) -> Message:
        """This message as the job ``job_id``: a newer trigger's message, run under the id the
        triggers waiting on its key share (``lease_key_strategy="newest"``)."""
        if job_id == self.id:
            return self
        old = self.id
        headers = {**self.headers, "id": job_id}
        if headers.get("root_id") == old:
            headers["root_id"] = job_id
        properties = dict(self.properties)
        if properties.get("correlation_id") == old:
            properties["correlation_id"] = job_id
        return replace(self, headers=headers, properties=properties)

    def new_version(self) -> Message:
        """This message under a version id of its own (a message the library records)."""
        return self.with_headers(**{VERSION_HEADER: uuid.uuid4().hex})

    # -- from Celery and back -------------------------------------------------------------

    @classmethod
    def published(
        cls,
        *,
        body: Any,
        headers: dict[str, Any],
        properties: dict[str, Any],
        exchange: str | None,
        routing_key: str | None,
        declare: Any = None,
    ) -> Message:
        """The message as Celery hands it to the producer, just before it is sent."""
        if not isinstance(body, tuple | list) or len(body) != 3:
            raise ConfigurationError(
                "celery-leases needs Celery's task message protocol 2 (task_protocol = 2)"
            )
        args, kwargs, embed = body
        return cls(
            headers=dict(headers),
            args=list(args),
            kwargs=dict(kwargs),
            embed={k: v for k, v in (embed or {}).items() if v is not None},
            properties=_kept(properties),
            exchange=exchange,
            routing_key=routing_key,
            exchange_type=_type_of(exchange, declare or ()),
        )

    @classmethod
    def received(cls, request: Any, args: Any, kwargs: Any) -> Message:
        """The message a worker received, read back from the task's request context."""
        found = vars(request)
        headers = {h: found[h] for h in HEADERS if h in found}
        custom = request.headers or {}  # custom headers (Celery puts them top level)
        headers.update((k, v) for k, v in custom.items() if k not in TRANSPORT_HEADERS)
        headers.setdefault("lang", "py")
        info = request.delivery_info or {}
        properties = {
            "correlation_id": request.correlation_id or request.id,
            "reply_to": request.reply_to,
            "priority": info.get("priority"),
        }
        return cls(
            headers=headers,
            args=list(args),
            kwargs=dict(kwargs),
            embed={k: found[k] for k in EMBED if found.get(k) is not None},
            properties=_kept(properties),
            exchange=info.get("exchange"),
            routing_key=info.get("routing_key"),
        )

    def send(
        self, app: Any, *, countdown: float | None = None, producer: Any = None, **headers: Any
    ) -> None:
        """Publish this message again, to where it was published first.

        ``countdown`` replaces its ETA; ``headers`` are added to its headers. Celery's
        ``expires`` header stays as it is, and the AMQP expiration is recomputed from it, as
        ``send_task`` does.
        """
        sent = self.with_headers(**headers) if headers else self
        if countdown is not None:
            sent = sent.with_headers(eta=(app.now() + timedelta(seconds=countdown)).isoformat())
        properties = dict(sent.properties)
        # send_task_message takes the delivery mode as an argument of its own.
        route: dict[str, Any] = {"delivery_mode": properties.pop("delivery_mode", None)}
        left = sent.expires_in(app.now())
        if left is not None:
            properties["expiration"] = max(left, 0.0)
        if sent.exchange == "" and sent.routing_key:
            route["queue"] = sent.routing_key  # the default exchange: the key is the queue
        else:
            kind = sent.exchange_type or _type_of(sent.exchange, app.amqp.queues.values())
            route |= {"exchange": sent.exchange, "routing_key": sent.routing_key}
            if sent.exchange and kind:
                route |= {"exchange_type": kind, "declare": [Exchange(sent.exchange, kind)]}
        body = (sent.args, sent.kwargs, {k: sent.embed.get(k) for k in EMBED})
        with app.producer_or_acquire(producer) as publisher:
            app.amqp.send_task_message(
                publisher,
                sent.task,
                task_message(dict(sent.headers), properties, body, None),
                retry=True,
                serializer="json",  # as recorded, whatever the app's default serializer
                **route,
            )

    # -- as stored ---------------------------------------------------------------------------

    def dumps(self) -> str:
        """Celery's JSON of this message; :class:`ArgumentsError` if Celery's JSON refuses it."""
        document = {
            "headers": self.headers,
            "body": [self.args, self.kwargs, self.embed],
            "properties": self.properties,
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "exchange_type": self.exchange_type,
        }
        # As Celery's JSON serializer writes it (NaN and Infinity included, as Celery sends
        # them): what a resumed attempt reads back is what the first one got.
        try:
            return celery_json(document)
        except (TypeError, ValueError) as exc:
            raise ArgumentsError(
                f"arguments of {self.task} must be JSON-serializable to be recorded for a "
                f"resume ({exc}; job {self.id}): celery-leases stores them as Celery's JSON "
                f"serializer does (datetime, UUID, Decimal and bytes included), as JSON only"
            ) from exc

    @classmethod
    def loads(cls, text: str) -> Message:
        document = kombu_json.loads(text)
        args, kwargs, embed = document["body"]
        return cls(
            headers=document["headers"],
            args=args,
            kwargs=kwargs,
            embed=embed or {},
            properties=document.get("properties") or {},
            exchange=document.get("exchange"),
            routing_key=document.get("routing_key"),
            exchange_type=document.get("exchange_type"),
        )


def _kept(properties: dict[str, Any]) -> dict[str, Any]:
    """The properties worth keeping. A priority is kept even when None: kombu would otherwise
    send its default, 0, where the message had none."""
    return {
        k: properties[k]
        for k in PROPERTIES
        if properties.get(k) is not None or (k == "priority" and k in properties)
    }


def _type_of(exchange: str | None, entities: Any) -> str | None:
    """The type of ``exchange`` as one of ``entities`` (queues or exchanges) declares it."""
    if not exchange:
        return None
    for entity in entities:
        found = getattr(entity, "exchange", entity)
        if getattr(found, "name", None) == exchange and getattr(found, "type", None):
            return str(found.type)
    return None


def _moment(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
