"""The jobs table as a read-only, unmanaged Django model (its schema is the migrations')."""

from __future__ import annotations

import contextlib
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any, NoReturn

from django.conf import settings
from django.db import models
from django.utils import timezone

from ...db.schema import MAX_ID_LENGTH, MAX_KEY_LENGTH, QUEUED, STATES
from ...errors import LeaseError
from ...settings import DEFAULTS


def table_name() -> str:
    """The leases table (``CELERY_LEASES_TABLE``, as ``leases_table``)."""
    return str(getattr(settings, "CELERY_LEASES_TABLE", DEFAULTS["table"]))


def moment(seconds: float | None) -> datetime | None:
    """A stored time (epoch seconds, database clock) as an aware datetime."""
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=dt_timezone.utc)


class AsDatetime(models.Func):
    """A stored time (epoch seconds) as the database's own datetime, for what Django computes
    in SQL on a datetime (``Trunc``, ``Extract``, ``__date``, ``__year``): the conversion of
    each database, to UTC as Django stores datetimes with ``USE_TZ``."""

    arity = 1
    output_field = models.DateTimeField()

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="to_timestamp(%(expressions)s)")

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # FROM_UNIXTIME would read the session's time zone; this is the same UTC everywhere.
        template = (
            "TIMESTAMPADD(MICROSECOND, CAST(ROUND(%(expressions)s * 1000000) AS SIGNED),"
            " '1970-01-01 00:00:00')"
        )
        return self.as_sql(compiler, connection, template=template)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # Django keeps SQLite's datetimes as this text (whole seconds here).
        return self.as_sql(compiler, connection, template="datetime(%(expressions)s, 'unixepoch')")


class Moment(models.DateTimeField):  # type: ignore[type-arg]
    """A stored time (epoch seconds, database clock) that the ORM reads as an aware datetime.

    The column stays the float the store writes and indexes (no schema change). Comparisons
    take a datetime (``filter(created_at__gte=...)``; a naive one is in Django's current time
    zone) or epoch seconds and compare the column itself, so its indexes serve them.
    Transforms (``__date``, ``__year``, ``__hour``) and ``QuerySet.datetimes()`` (the admin's
    ``date_hierarchy``) read it converted to a datetime in SQL (``AsDatetime``)."""

    def get_internal_type(self) -> str:
        return "FloatField"  # the column's type, and the database's converters, are a float's

    def from_db_value(self, value: float | None, expression: Any, connection: Any) -> Any:
        return moment(value)

    def to_python(self, value: Any) -> datetime | None:
        if value is None or isinstance(value, datetime):
            return value
        if isinstance(value, int | float | str):
            with contextlib.suppress(ValueError):
                return moment(float(value))  # epoch seconds, or their text
        parsed: datetime | None = super().to_python(value)  # a date, a datetime's text
        return parsed

    def get_prep_value(self, value: Any) -> Any:
        if value is None or hasattr(value, "resolve_expression"):
            return value
        value = self.to_python(value)
        if value is None:
            return None
        if timezone.is_naive(value):
            value = timezone.make_aware(value)
        return value.timestamp()

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        return value if prepared else self.get_prep_value(value)

    def get_transform(self, lookup_name: str) -> Any:
        transform = super().get_transform(lookup_name)
        if transform is None:
            return None
        return lambda lhs, *args, **kwargs: transform(AsDatetime(lhs), *args, **kwargs)


class Moments(models.QuerySet):  # type: ignore[type-arg]
    """``dates()`` and ``datetimes()`` over a ``Moment`` (the admin's ``date_hierarchy``
    lists years, months and days with them): truncated from its datetime (``AsDatetime``)."""

    def dates(self, field_name: str, kind: str, order: str = "ASC") -> Any:
        name, queryset = self._as_datetime(field_name)
        return super(Moments, queryset).dates(name, kind, order)

    def datetimes(self, field_name: str, kind: str, order: str = "ASC", tzinfo: Any = None) -> Any:
        name, queryset = self._as_datetime(field_name)
        return super(Moments, queryset).datetimes(name, kind, order, tzinfo)

    def _as_datetime(self, field_name: str) -> tuple[str, Moments]:
        fields = {f.name: f for f in self.model._meta.get_fields()}
        if not isinstance(fields.get(field_name), Moment):
            return field_name, self
        name = f"{field_name}_as_datetime"
        return name, self.alias(**{name: AsDatetime(field_name)})


class Job(models.Model):
    """One leased job, as the store keeps it. Never saved or deleted through the ORM: the
    admin's actions call the store's fenced operations."""

    id = models.CharField(primary_key=True, max_length=MAX_ID_LENGTH)
    task = models.CharField(max_length=255)
    state = models.CharField(max_length=16, choices=[(s, s) for s in STATES])
    owner = models.CharField(max_length=255, null=True)
    token = models.BigIntegerField()
    attempts = models.IntegerField()
    stalled_attempts = models.IntegerField()
    progress_done = models.BigIntegerField(null=True)
    progress_total = models.BigIntegerField(null=True)
    checkpoint = models.TextField(null=True)
    result = models.TextField(null=True)
    error = models.TextField(null=True)
    stop_requested = models.CharField(max_length=16, null=True)
    created_at = Moment()
    claimed_at = Moment(null=True)
    renewed_at = Moment(null=True)
    checkpoint_at = Moment(null=True)
    finished_at = Moment(null=True)
    expires_at = Moment(null=True)
    lease_key = models.CharField(max_length=MAX_KEY_LENGTH, null=True)
    message = models.TextField()
    lease_group = models.CharField(max_length=MAX_KEY_LENGTH, null=True)
    admitted_at = Moment(null=True)

    objects = Moments.as_manager()

    class Meta:
        managed = False
        db_table = table_name()
        ordering = ("-created_at",)
        verbose_name = "leased job"

    def __str__(self) -> str:
        return f"{self.task} {self.id}"

    @property
    def waiting(self) -> bool:
        """A job of a group waiting in the database for its admission (never published)."""
        return self.lease_group is not None and self.admitted_at is None and self.state == QUEUED

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise LeaseError("leased jobs are changed by the store's operations only, never saved")

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise LeaseError("leased jobs are deleted by the reaper's retention only")


class LeaseKey(models.Model):
    """One lease key's row (``<leases table>_keys``): its cursor and its waiting trigger.
    Never saved through the ORM: the admin sets and clears a cursor with the store's
    operation, under the same rule as ``celery leases cursor``."""

    lease_key = models.CharField(primary_key=True, max_length=MAX_KEY_LENGTH)
    cursor_state = models.TextField(null=True)
    job_id = models.CharField(max_length=MAX_ID_LENGTH, null=True)
    cursor_at = Moment(null=True)
    pending_id = models.CharField(max_length=MAX_ID_LENGTH, null=True)
    pending_at = Moment(null=True)
    pending_since = Moment(null=True)

    objects = Moments.as_manager()

    class Meta:
        managed = False
        db_table = f"{table_name()}_keys"
        ordering = ("lease_key",)
        verbose_name = "lease key"

    def __str__(self) -> str:
        return self.lease_key

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise LeaseError("a lease key's cursor is set by the store's operation only")

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise LeaseError("lease keys are never deleted")


class JobGroup(models.Model):
    """One job group's row (``<leases table>_groups``): the limit and rate its last client
    gave, and its token bucket. Its admitted and waiting jobs are the jobs of the group
    (``Job.lease_group``). Never saved through the ORM: admissions write it."""

    name = models.CharField(primary_key=True, max_length=MAX_KEY_LENGTH)
    group_limit = models.IntegerField(null=True)
    rate = models.FloatField(null=True)
    tokens = models.FloatField()
    refilled_at = Moment()
    admitted_at = Moment(null=True)
    created_at = Moment()

    objects = Moments.as_manager()

    class Meta:
        managed = False
        db_table = f"{table_name()}_groups"
        ordering = ("name",)
        verbose_name = "job group"

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise LeaseError("a job group is written by its admissions only")

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise LeaseError("job groups are never deleted")
