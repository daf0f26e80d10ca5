"""The jobs table (celery-leases' schema revision 0001, ``migration.Revision``: the SQL that
``sqlmigrate`` prints is the revision's for the project's database), and the unmanaged model
that reads it."""

from __future__ import annotations

from django.db import migrations, models

from celery_leases.contrib.django.migration import Revision
from celery_leases.contrib.django.models import table_name
from celery_leases.db.schema import STATES


class Migration(migrations.Migration):
    initial = True
    # The revisions run on a connection of the store's own, under its migration lock.
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
        Revision("0001"),
    ]
