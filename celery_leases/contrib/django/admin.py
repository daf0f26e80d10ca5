"""A read-only admin of the leased jobs, with retry / cancel / release actions that call the
store's operations (``celery_leases.control``), as ``celery leases`` does."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import display_for_value
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils import timezone
from django.utils.html import format_html

from ... import control, heartbeat
from ...db.rows import load_message
from ...db.schema import QUEUED, STATES, WAITING
from ...errors import ArgumentsError, LeaseError
from . import routed
from .group_admin import GroupFilter, jobs_of  # and registers the groups' admin
from .models import Job, LeaseKey
from .routed import DatabaseFilter, RoutedAdmin


def _celery_app() -> Any:
    from celery import current_app

    return current_app._get_current_object()


def _each(request: HttpRequest, jobs: QuerySet[Job], act: Callable[[str], str]) -> None:
    for job_id in jobs.values_list("id", flat=True):
        try:
            messages.success(request, act(job_id))
        except LeaseError as exc:
            messages.error(request, str(exc))


@admin.action(description="Retry: queue again from the checkpoint", permissions=["change"])
def retry(modeladmin: Any, request: HttpRequest, jobs: QuerySet[Job]) -> None:
    store = routed.store_shown(request)
    _each(request, jobs, lambda job_id: control.retry(_celery_app(), store, job_id))


@admin.action(description="Cancel: stop at the next checkpoint", permissions=["change"])
def cancel(modeladmin: Any, request: HttpRequest, jobs: QuerySet[Job]) -> None:
    store = routed.store_shown(request)
    _each(request, jobs, lambda job_id: control.cancel(_celery_app(), store, job_id))


def warn_without_reaper(request: HttpRequest) -> None:
    """Say on the page when no reaper pass happened for a while in the database it shows
    (``heartbeat.silence``)."""
    if request.method != "GET":
        return
    try:
        name = routed.chosen(request)
        if routed.aliases()[name] is None:
            return  # the page says it cannot read that database
        missing = heartbeat.silence(_celery_app(), routed.store_of(name))
    except (LeaseError, IncorrectLookupParameters):
        return
    if missing:
        where = "" if not routed.several() else f" (leases database {name!r})"
        messages.warning(request, f"celery-leases{where}: {missing}")


@admin.action(description="Release: expire the lease (its worker is dead)", permissions=["change"])
def release(modeladmin: Any, request: HttpRequest, jobs: QuerySet[Job]) -> None:
    store = routed.store_shown(request)
    _each(request, jobs, lambda job_id: control.release(store, job_id))


class StateFilter(admin.SimpleListFilter):
    """Jobs by state, as ``celery leases list --state`` shows them: ``waiting`` is a job of a
    group not admitted yet (its row says ``queued``), and ``queued`` the others."""

    title = "state"
    parameter_name = "state__exact"  # the links of Django's own filter on the field still work

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        shown = [*STATES[:1], WAITING, *STATES[1:]]
        return [(state, state) for state in shown]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        value = self.value()
        if value is None:
            return queryset
        waiting = {"lease_group__isnull": False, "admitted_at__isnull": True, "state": QUEUED}
        if value == WAITING:
            return queryset.filter(**waiting)
        if value == QUEUED:
            return queryset.filter(state=QUEUED).exclude(**waiting)
        return queryset.filter(state=value)


class CreatedFilter(admin.SimpleListFilter):
    """Jobs created in the last hour, day, week or 30 days: a range of ``created_at``, which
    its indexes serve."""

    title = "created"
    parameter_name = "created"
    SPANS = {"hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(days=7),
             "30days": timedelta(days=30)}  # fmt: skip

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("hour", "Past hour"), ("day", "Past 24 hours"), ("week", "Past 7 days"),
                ("30days", "Past 30 days")]  # fmt: skip

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        span = self.SPANS.get(self.value() or "")
        if span is None:
            return queryset
        return queryset.filter(created_at__gte=timezone.now() - span)


@admin.register(Job)
class JobAdmin(RoutedAdmin):
    """Jobs newest first; filters by database (when there are several), state, task, group and
    creation, search by id (or its start)."""

    list_display = (
        "id",
        "task",
        "shown_state",
        "owner",
        "attempts",
        "progress",
        "created",
        "checkpointed",
    )
    list_filter = (DatabaseFilter, StateFilter, "task", GroupFilter, CreatedFilter)
    date_hierarchy = "created_at"  # a Moment: see check()
    search_fields = ("^id",)
    actions = (retry, cancel, release)
    readonly_fields = (
        "id", "task", "shown_state", "lease_key", "group", "arguments", "waiting_followup", "owner",
        "attempts", "token", "progress", "checkpoint_json",
        "error", "stop_requested", "result_json", "created", "claimed", "renewed",
        "checkpointed", "finished", "lease_expires",
    )  # fmt: skip
    fields = readonly_fields
    list_per_page = 50

    def check(self, **kwargs: Any) -> list[Any]:
        # Django's date_hierarchy check asks for a date field by its internal type, which for
        # a Moment is its column's (a float); the date hierarchy itself takes it as the
        # DateTimeField it is (its links filter by range, Moments.datetimes() lists them).
        return [e for e in super().check(**kwargs) if e.id != "admin.E128"]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """The list, with a warning when no reaper pass happened for a while."""
        warn_without_reaper(request)
        return super().changelist_view(request, extra_context)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        # The list's actions need the change permission; a job itself is never edited.
        return obj is None and super().has_change_permission(request)

    @admin.display(description="state", ordering="state")
    def shown_state(self, job: Job) -> str:
        """The job's state; ``waiting`` for a job of a group not admitted yet, as
        ``celery leases list`` shows it."""
        return WAITING if job.waiting else job.state

    @admin.display(description="group")
    def group(self, job: Job) -> str:
        """The job's group, a link to its jobs, and whether it waits or when it was
        admitted (as ``celery leases show``)."""
        if job.lease_group is None:
            return "-"
        if job.waiting:
            said = "waiting for its admission"
        elif job.admitted_at is None:
            said = "not admitted"
        else:
            said = f"admitted {display_for_value(job.admitted_at, '-')}"
        group = job.lease_group
        link = jobs_of(group, routed.name_of(job._state.db))
        return format_html('<a href="{}">{}</a>, {}', link, group, said)

    @admin.display(description="progress")
    def progress(self, job: Job) -> str:
        if job.progress_done is None:
            return "-"
        if not job.progress_total:
            return f"{job.progress_done:,}"
        percent = min(100, round(100 * job.progress_done / job.progress_total))
        return format_html(
            '<progress value="{}" max="{}"></progress> <span class="leases-progress">{}% '
            "({} / {})</span>",
            job.progress_done,
            job.progress_total,
            percent,
            f"{job.progress_done:,}",
            f"{job.progress_total:,}",
        )

    @admin.display(description="arguments")
    def arguments(self, job: Job) -> str:
        try:
            message = load_message(job.message, job.id)
        except LeaseError as exc:
            return str(exc)
        return _pretty(json.dumps({"args": message.args, "kwargs": message.kwargs}))

    @admin.display(description="waiting follow-up")
    def waiting_followup(self, job: Job) -> str:
        """The id the triggers waiting on the job's key were given: their run starts when
        the key's live job ends."""
        if job.lease_key is None:
            return "-"
        key = LeaseKey.objects.using(job._state.db).filter(lease_key=job.lease_key).first()
        if key is None or key.pending_id is None:
            return "none"
        latest = (
            ""
            if key.pending_at is None
            else f" (the latest at {key.pending_at:%Y-%m-%d %H:%M:%S} UTC)"
        )
        return f"{key.pending_id}{latest}"

    @admin.display(description="checkpoint")
    def checkpoint_json(self, job: Job) -> str:
        return _pretty(job.checkpoint)

    @admin.display(description="result")
    def result_json(self, job: Job) -> str:
        return _pretty(job.result)

    @admin.display(description="created", ordering="created_at")
    def created(self, job: Job) -> Any:
        return job.created_at

    @admin.display(description="claimed")
    def claimed(self, job: Job) -> Any:
        return job.claimed_at

    @admin.display(description="renewed")
    def renewed(self, job: Job) -> Any:
        return job.renewed_at

    @admin.display(description="last checkpoint", ordering="checkpoint_at")
    def checkpointed(self, job: Job) -> Any:
        return job.checkpoint_at

    @admin.display(description="finished")
    def finished(self, job: Job) -> Any:
        return job.finished_at

    @admin.display(description="lease expires")
    def lease_expires(self, job: Job) -> Any:
        return job.expires_at if job.state == "running" else None


def _pretty(text: str | None) -> str:
    if text is None:
        return "-"
    try:
        shown = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        shown = text  # not JSON: shown as stored
    return format_html("<pre>{}</pre>", shown)


class CursorForm(forms.ModelForm):  # type: ignore[type-arg]
    """A key's cursor as JSON text; empty clears it."""

    cursor = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 8, "cols": 80}),
        help_text="JSON, where the key's next run starts; empty clears it. Set only while no "
        "job holds the key (none queued or running, no follow-up waiting to start).",
    )

    class Meta:
        model = LeaseKey
        fields: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stored = self.instance.cursor_state
        if stored is not None:
            self.fields["cursor"].initial = json.dumps(json.loads(stored), indent=2)

    def clean_cursor(self) -> str | None:
        text = str(self.cleaned_data["cursor"]).strip()
        if not text:
            return None
        try:
            return control.cursor_text(text)
        except ArgumentsError as exc:
            raise forms.ValidationError(f"The cursor is {exc}.") from None


@admin.register(LeaseKey)
class LeaseKeyAdmin(RoutedAdmin):
    """Lease keys: each one's cursor and waiting trigger. A key's page sets or clears its
    cursor through the store (``control.set_cursor``), as ``celery leases cursor`` does."""

    form = CursorForm
    list_display = ("lease_key", "cursor_short", "cursor_at", "pending_id", "pending_at")
    list_filter = (DatabaseFilter,)
    search_fields = ("^lease_key",)
    readonly_fields = ("lease_key", "job_id", "cursor_at", "pending_id", "pending_at")
    fields = ("lease_key", "cursor", "job_id", "cursor_at", "pending_id", "pending_at")
    list_per_page = 50

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: LeaseKey | None = None) -> bool:
        return False

    @admin.display(description="cursor")
    def cursor_short(self, key: LeaseKey) -> str:
        if key.cursor_state is None:
            return "-"
        return key.cursor_state if len(key.cursor_state) <= 80 else key.cursor_state[:79] + "…"

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # Django runs a change page in a transaction of the model's database; the store sets
        # the cursor with one statement on its own connection, which must not wait for that
        # transaction (on SQLite the page's own history entry then could not commit).
        return self._changeform_view(request, object_id, form_url, extra_context)

    def save_model(self, request: HttpRequest, obj: LeaseKey, form: Any, change: bool) -> None:
        try:
            messages.success(
                request,
                control.set_cursor(
                    routed.store_where(obj), obj.lease_key, form.cleaned_data["cursor"]
                ),
            )
        except LeaseError as exc:
            messages.error(request, str(exc))

    def response_change(self, request: HttpRequest, obj: LeaseKey) -> HttpResponse:
        # The message save_model left says what happened; Django's own "changed
        # successfully" would be wrong when the store refused.
        # The query names the database the key was read from (its list's filters): the
        # page after the save shows the same key, not one of that name elsewhere.
        return HttpResponseRedirect(request.get_full_path())
