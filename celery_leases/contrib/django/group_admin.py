"""The job groups in the admin: a read-only list of the groups (``celery leases groups``), and
the jobs list's filter by group."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from ... import routes
from ...db.store.groups import GroupRow
from ...groups import rate_text
from . import routed
from .models import Job, JobGroup
from .routed import DatabaseFilter, RoutedAdmin

#: The groups the jobs list's group filter offers (by name); any other is filtered by its URL.
FILTER_GROUPS = 100


def jobs_of(name: str, where: str = routes.DEFAULT) -> str:
    """The URL of the admin's list of the jobs of group ``name`` of leases database
    ``where``."""
    query = {"group": name} if where == routes.DEFAULT else {"database": where, "group": name}
    return reverse("admin:celery_leases_job_changelist") + "?" + urlencode(query)


class GroupFilter(admin.SimpleListFilter):
    """Jobs of one group (``lease_group``); the first :data:`FILTER_GROUPS` groups by name are
    offered."""

    title = "group"
    parameter_name = "group"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        alias = routed.aliases()[routed.chosen(request)]
        if alias is None:
            return []
        groups = JobGroup.objects.using(alias).order_by("name")
        return [(name, name) for name in groups.values_list("name", flat=True)[:FILTER_GROUPS]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        group = self.value()
        return queryset if group is None else queryset.filter(lease_group=group)


@admin.register(JobGroup)
class JobGroupAdmin(RoutedAdmin):
    """Job groups, as ``celery leases groups`` lists them: each one's limit, rate, tokens now,
    jobs admitted and waiting, read with the store's listing. A group's name leads to its
    jobs. Read-only: admissions write the groups."""

    list_display = (
        "group", "limit", "rate_shown", "tokens_now", "admitted", "waiting", "created",
        "last_admission",
    )  # fmt: skip
    list_display_links = None
    list_filter = (DatabaseFilter,)
    search_fields = ("^name",)
    readonly_fields = list_display
    fields = readonly_fields
    list_per_page = 50

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        listing = super().get_changelist_instance(request)
        _with_facts(list(listing.result_list))
        return listing

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        group = super().get_object(request, object_id, from_field)
        if group is not None:
            _with_facts([group])
        return group

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: JobGroup | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: JobGroup | None = None) -> bool:
        return False

    @admin.display(description="group", ordering="name")
    def group(self, group: JobGroup) -> str:
        link = jobs_of(group.name, routed.name_of(group._state.db))
        return format_html('<a href="{}">{}</a>', link, group.name)

    @admin.display(description="limit")
    def limit(self, group: JobGroup) -> str:
        return "-" if group.group_limit is None else str(group.group_limit)

    @admin.display(description="rate")
    def rate_shown(self, group: JobGroup) -> str:
        return "-" if group.rate is None else rate_text(group.rate)

    @admin.display(description="tokens now")
    def tokens_now(self, group: JobGroup) -> str:
        facts = _facts(group)
        return "-" if facts is None or facts.rate is None else f"{facts.tokens:.2f}"

    @admin.display(description="admitted (live)")
    def admitted(self, group: JobGroup) -> str:
        facts = _facts(group)
        return "-" if facts is None else f"{facts.admitted:,}"

    @admin.display(description="waiting")
    def waiting(self, group: JobGroup) -> str:
        facts = _facts(group)
        return "-" if facts is None else f"{facts.waiting:,}"

    @admin.display(description="created", ordering="created_at")
    def created(self, group: JobGroup) -> Any:
        return group.created_at

    @admin.display(description="last admission", ordering="admitted_at")
    def last_admission(self, group: JobGroup) -> Any:
        return group.admitted_at


def _with_facts(groups: list[JobGroup]) -> None:
    """Give each group what the store's listing reads of it now (one query for the page)."""
    if not groups:
        return
    store = routed.store_where(groups[0])  # a page's groups are of one database
    found = {row.name: row for row in store.groups(names=[g.name for g in groups])}
    for group in groups:
        group._leases_facts = found.get(group.name)  # type: ignore[attr-defined]


def _facts(group: JobGroup) -> GroupRow | None:
    return getattr(group, "_leases_facts", None)
