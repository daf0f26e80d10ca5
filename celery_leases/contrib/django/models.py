"""The jobs table as a read-only, unmanaged Django model (its schema is the migrations')."""

from __future__ import annotations

from datetime import UTC, datetime
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
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=UTC)


class Moment(models.FloatField):  # type: ignore[type-arg]
    """A stored time (epoch seconds, database clock) that the ORM reads as an aware datetime
    and that lookups take as a datetime (``filter(created_at__gte=...)``; a naive one is in
    Django's current time zone) or as epoch seconds. The column stays the float the store
    writes and indexes: no schema change."""

    def from_db_value(self, value: float | None, expression: Any, connection: Any) -> Any:
        return moment(value)

    def to_python(self, value: Any) -> datetime | None:
        if value is None or isinstance(value, datetime):
            return value
        return moment(float(super().to_python(value)))

    def get_prep_value(self, value: Any) -> float | None:
        if isinstance(value, datetime):
            if timezone.is_naive(value):
                value = timezone.make_aware(value)
            return value.timestamp()
        prepared: float | None = super().get_prep_value(value)
        return prepared


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
