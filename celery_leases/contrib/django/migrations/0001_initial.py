"""The jobs table, made by celery-leases' own migrations (the package's Alembic revisions), and
the unmanaged model that reads it. Later revisions are applied by every ``manage.py migrate``
of the leases database (``apps.upgrade_after_migrate``): no Django migration per revision."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

from celery_leases.contrib.django.migration import migrate_database, unmigrate_database
from celery_leases.contrib.django.models import table_name
from celery_leases.db.schema import STATES


def forwards(apps: Any, schema_editor: Any) -> None:
    migrate_database(schema_editor.connection.alias)


def backwards(apps: Any, schema_editor: Any) -> None:
    unmigrate_database(schema_editor.connection.alias)


class Migration(migrations.Migration):
    initial = True
    # The leases migrations run on a connection of their own, with their own lock.
    atomic = False
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Job",
            fields=[
                ("id", models.CharField(max_length=155, primary_key=True, serialize=False)),
                ("task", models.CharField(max_length=255)),
                ("state", models.CharField(choices=[(s, s) for s in STATES], max_length=16)),
                ("owner", models.CharField(max_length=255, null=True)),
                ("token", models.BigIntegerField()),
                ("attempts", models.IntegerField()),
                ("stalled_attempts", models.IntegerField()),
                ("progress_done", models.BigIntegerField(null=True)),
                ("progress_total", models.BigIntegerField(null=True)),
                ("checkpoint", models.TextField(null=True)),
                ("result", models.TextField(null=True)),
                ("error", models.TextField(null=True)),
                ("stop_requested", models.CharField(max_length=16, null=True)),
                ("created_at", models.FloatField()),
                ("claimed_at", models.FloatField(null=True)),
                ("renewed_at", models.FloatField(null=True)),
                ("checkpoint_at", models.FloatField(null=True)),
                ("finished_at", models.FloatField(null=True)),
                ("expires_at", models.FloatField(null=True)),
            ],
            options={
                "verbose_name": "leased job",
                "db_table": table_name(),
                "ordering": ("-created_at",),
                "managed": False,
            },
        ),
        migrations.RunPython(forwards, backwards),
    ]
