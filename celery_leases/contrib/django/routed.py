"""The admin across the leases databases (``CELERY_LEASES_DATABASES``).

Each leases database the admin can read is a Django database: the default one is the leases
database (``CELERY_LEASES_DATABASE_ALIAS``, as before routes), each routed one the
``DATABASES`` entry its URL names (whatever the driver). A list
shows one database at a time, chosen with its ``database`` filter (``'default'`` unless the
query says otherwise), since Django pages, sorts and counts one queryset; each row and each
page says which database it is from, a job's page finds the job in whichever database holds
it, and the actions and the cursor's form act through that database's store. A routed
database that ``DATABASES`` does not name is offered too, and its list says how to see it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any
from urllib.parse import urlencode

import sqlalchemy as sa
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import ValidationError
from django.db import DatabaseError, transaction
from django.db.models import Model, QuerySet
from django.http import HttpRequest, QueryDict
from django.utils.encoding import escape_uri_path
from django.utils.html import format_html, format_html_join

from ... import routes
from ...db import Store, store_for
from ...errors import ConfigurationError
from ...settings import DEFAULTS, Settings
from . import database

logger = logging.getLogger("celery_leases")

#: The query parameter of the database a list shows.
DATABASE_VAR = "database"


def aliases() -> dict[str, str | None]:
    """Each leases database's name (``'default'`` first) and the Django database alias it is,
    None for one that ``DATABASES`` does not name. Read once for the settings it comes from
    (a list page asks for each row), without checking the other leases settings (a wrong one
    is the system checks' and the workers' to report, not a reason for the admin to fail)."""
    return dict(_aliases(_snapshot()))


def _snapshot() -> str:
    from django.conf import settings

    names = ("DATABASES", database.ALIAS_SETTING, database.django_key("databases"))
    return repr([getattr(settings, name, None) for name in names])


@functools.lru_cache(maxsize=8)
def _aliases(snapshot: str) -> tuple[tuple[str, str | None], ...]:
    from django.conf import settings

    try:
        found: dict[str, str | None] = {routes.DEFAULT: database.alias()}
    except ConfigurationError:
        found = {routes.DEFAULT: None}
    routed = getattr(settings, database.django_key("databases"), None) or {}
    for name, url in routed.items() if isinstance(routed, dict) else ():
        try:
            found[str(name)] = database.alias_of(str(url))
        except (ConfigurationError, ValueError, sa.exc.ArgumentError):
            found[str(name)] = None
    return tuple(found.items())


@functools.lru_cache(maxsize=8)
def _settings(snapshot: str) -> Settings:
    return database.settings()


def several() -> bool:
    """Whether the leases live in more than one database."""
    return len(aliases()) > 1


def chosen(request: HttpRequest) -> str:
    """The database a page shows: its query's ``database``, or that of the list it came
    from (a job's page keeps the list's filters in ``_changelist_filters``), else
    ``'default'``. :class:`IncorrectLookupParameters` for a name no database has."""
    name = named(request)
    if name is None:
        return routes.DEFAULT
    if name not in aliases():
        raise IncorrectLookupParameters(f"no leases database is named {name!r}")
    return name


def named(request: HttpRequest) -> str | None:
    """The database a page's query names (its own ``database``, or its list's), else None:
    a link from outside the admin's lists (a bookmark, "Recent actions")."""
    name = request.GET.get(DATABASE_VAR)
    if name is None:
        name = QueryDict(request.GET.get("_changelist_filters", "")).get(DATABASE_VAR)
    return name


def name_of(alias: str | None) -> str:
    """The leases database that Django database ``alias`` is (``'default'`` for any other)."""
    return next((n for n, a in aliases().items() if a == alias and a is not None), routes.DEFAULT)


def store_of(name: str) -> Store:
    """The store of leases database ``name`` (its settings read once for the settings they
    come from, as ``routes.on`` keeps what it made of each)."""
    from django.conf import settings

    names = [database.django_key(key) for key in DEFAULTS]
    seen = repr([_snapshot(), *(getattr(settings, key, None) for key in names)])
    return store_for(routes.on(_settings(seen), name))


def store_shown(request: HttpRequest) -> Store:
    """The store of the leases database a page shows (:func:`chosen`)."""
    return store_of(chosen(request))


def store_where(obj: Model) -> Store:
    """The store of the leases database ``obj`` was read from."""
    return store_of(name_of(obj._state.db))


class DatabaseFilter(admin.SimpleListFilter):
    """The database a list shows (shown only when the leases live in several): one at a time,
    ``'default'`` unless chosen; no "All", as one list pages one database's rows."""

    title = "database"
    parameter_name = DATABASE_VAR

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        found = aliases()
        if len(found) < 2:
            return []
        return [
            (name, name if alias is not None else f"{name} (not in DATABASES)")
            for name, alias in found.items()
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset  # the admin's get_queryset reads the database: counts follow it

    def get_facet_counts(self, pk_attname: str, filtered_qs: QuerySet[Any]) -> dict[str, Any]:
        return {}  # each choice is another database: no count of this queryset says it

    def choices(self, changelist: Any) -> Any:
        shown = self.value() or routes.DEFAULT
        for name, title in self.lookup_choices:
            yield {
                "selected": shown == name,
                "query_string": (
                    changelist.get_query_string(remove=[self.parameter_name])
                    if name == routes.DEFAULT
                    else changelist.get_query_string({self.parameter_name: name})
                ),
                "display": title,
            }


class RoutedAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """An admin of a leases table in every leases database: the list reads the chosen one
    (:class:`DatabaseFilter`), an object's page the one that holds it, and a ``database``
    column says which when there are several."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        alias = aliases()[chosen(request)]
        queryset = super().get_queryset(request)
        return queryset.using(alias) if alias is not None else queryset.none()

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        if request.method == "GET":
            try:
                name = chosen(request)
            except IncorrectLookupParameters:
                pass  # the list says so, as Django does for a filter's unknown value
            else:
                if aliases()[name] is None:
                    messages.warning(request, _not_in_databases(name))
        return super().changelist_view(request, extra_context)

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        """The object in the database of the list it came from, else in any other. Another
        database that fails to answer (down) is passed over with a warning: it must not fail
        the page of an object that lives elsewhere."""
        try:
            first = chosen(request)
        except IncorrectLookupParameters:
            first = routes.DEFAULT
        found = aliases()
        order = [(first, found[first])] + [(n, a) for n, a in found.items() if n != first]
        meta = self.model._meta
        field = meta.pk if from_field is None else meta.get_field(from_field)
        try:
            key = field.to_python(object_id)
        except (ValidationError, ValueError):
            return None
        # A page whose link names no database (a bookmark, "Recent actions") shows the first
        # database's object, and says which others hold one of the same name (a key or a
        # group named alike in two databases): an edit must not land in another database
        # than the one its user meant.
        looks_everywhere = request.method == "GET" and named(request) is None and several()
        held: list[tuple[str, Any]] = []
        searched: set[str] = set()
        for name, alias in order:
            if alias is None or alias in searched:
                continue
            searched.add(alias)
            obj = self._found_in(request, name, alias, first, {field.name: key})
            if obj is not None:
                held.append((name, obj))
                if not looks_everywhere:
                    break
        if len(held) > 1:
            # Said by the page itself once it is allowed (render_change_form), not here:
            # Django looks the object up before it checks the user's permission.
            setattr(request, _NAMESAKES, (held[0][1], [name for name, _ in held]))
        return held[0][1] if held else None

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> Any:
        namesakes = getattr(request, _NAMESAKES, None)
        if namesakes is not None and namesakes[0] is obj:
            messages.warning(request, _also_in(request, namesakes[1]))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_preserved_filters(self, request: HttpRequest) -> str:
        """Django's (the list's query, carried by the links of its rows as
        ``_changelist_filters``), naming the list's database even when its query does not
        (the default one's): a page opened from a list is of that list's database, and only
        a link from outside the lists (a bookmark, "Recent actions") names none."""
        preserved = super().get_preserved_filters(request)
        match = request.resolver_match
        opts = self.model._meta
        on_list = (
            match is not None and match.url_name == f"{opts.app_label}_{opts.model_name}_changelist"
        )
        if not (on_list and several()):
            return preserved
        filters = QueryDict(QueryDict(preserved).get("_changelist_filters", ""), mutable=True)
        if DATABASE_VAR in filters:
            return preserved
        try:
            filters[DATABASE_VAR] = chosen(request)
        except IncorrectLookupParameters:
            return preserved
        return urlencode({"_changelist_filters": filters.urlencode()})

    def _found_in(
        self, request: HttpRequest, name: str, alias: str, first: str, lookup: dict[str, Any]
    ) -> Any:
        """The object of ``lookup`` in database ``name`` (Django's ``alias``), or None. Only the
        page's own database (``first``) may fail the page."""
        found_in = super().get_queryset(request).using(alias).filter(**lookup)
        if name == first:
            return found_in.first()
        try:
            # In a savepoint: a failed query must not leave a transaction of that database
            # (ATOMIC_REQUESTS, a POST's atomic()) aborted for what follows.
            with transaction.atomic(using=alias):
                return found_in.first()
        except DatabaseError as exc:
            # The driver's text names hosts, users and files: in the log, not the page. Said
            # by the page once Django lets it through (``_said``), as the namesakes are.
            logger.warning("admin: leases database %r not searched", name, exc_info=True)
            unsearched = getattr(request, _UNSEARCHED, None)
            if unsearched is None:
                unsearched = []
                setattr(request, _UNSEARCHED, unsearched)
            unsearched.append(
                f"leases database {name!r} could not be searched "
                f"({type(exc).__name__}; the server's log says why)"
            )
            return None

    # Django looks an object up (get_object) before it checks the user's permission: what
    # the lookup has to say waits until the view did not refuse the page.

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> Any:
        return _said(request, super().change_view(request, object_id, form_url, extra_context))

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> Any:
        return _said(request, super().delete_view(request, object_id, extra_context))

    def history_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> Any:
        return _said(request, super().history_view(request, object_id, extra_context))

    def get_list_display(self, request: HttpRequest) -> Any:
        shown = tuple(super().get_list_display(request))
        return (*shown, "leases_database") if several() else shown

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        shown = tuple(super().get_fields(request, obj))
        wanted = several() and "leases_database" not in shown
        return (*shown, "leases_database") if wanted else shown

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        shown = tuple(super().get_readonly_fields(request, obj))
        wanted = several() and "leases_database" not in shown
        return (*shown, "leases_database") if wanted else shown

    @admin.display(description="database")
    def leases_database(self, obj: Model) -> str:
        return name_of(obj._state.db)


#: Where ``get_object`` leaves, for the page, the object it found and the databases that hold
#: one of its name.
_NAMESAKES = "_celery_leases_namesakes"
#: Where it leaves the warnings of the databases it could not search.
_UNSEARCHED = "_celery_leases_unsearched"


def _said(request: HttpRequest, response: Any) -> Any:
    """``response``, a page Django let through, after the warnings of the databases its
    lookup could not search (a page refused raised before this)."""
    for warning in getattr(request, _UNSEARCHED, ()):
        messages.warning(request, warning)
    setattr(request, _UNSEARCHED, [])
    return response


def _also_in(request: HttpRequest, names: list[str]) -> str:
    """The warning of a page whose object has a namesake in other leases databases: which
    one it shows, and a link to the page of each other one (its query kept, the database
    named where Django carries a list's filters from page to page)."""
    shown, *others = names

    def link(name: str) -> str:
        query = request.GET.copy()
        query.pop(DATABASE_VAR, None)
        filters = QueryDict(query.get("_changelist_filters", ""), mutable=True)
        filters[DATABASE_VAR] = name
        query["_changelist_filters"] = filters.urlencode()
        return f"{escape_uri_path(request.path)}?{query.urlencode()}"

    links = format_html_join(", ", '<a href="{}">{}</a>', ((link(n), n) for n in others))
    return format_html(
        "celery-leases: this page shows the object of leases database {}; the link that opened "
        "it named no database, and one of the same name is also in: {}",
        shown,
        links,
    )


def _not_in_databases(name: str) -> str:
    return (
        f"celery-leases: leases database {name!r} (CELERY_LEASES_DATABASES) is not in "
        f"DATABASES, so the admin cannot read it: add an entry for the same database to "
        f"DATABASES (`celery -A proj leases list --database {name}` lists its jobs meanwhile)"
    )
