"""celery-leases' schema revision 0005 (``migration.Revision``): a job's group and admission
time, and the job groups' table, which the unmanaged model ``JobGroup`` reads."""

from __future__ import annotations

from django.db import migrations, models

from celery_leases.contrib.django.migration import Revision
from celery_leases.contrib.django.models import Moment, table_name
from celery_leases.db.schema import MAX_KEY_LENGTH


class Migration(migrations.Migration):
    # The revision runs on a connection of the store's own, under its migration lock.
    atomic = False
    dependencies = [("celery_leases", "0002_datetimes_and_keys")]

    operations = [
        Revision("0005"),
        migrations.AddField(
            model_name="job",
            name="lease_group",
            field=models.CharField(max_length=MAX_KEY_LENGTH, null=True),
        ),
        migrations.AddField(model_name="job", name="admitted_at", field=Moment(null=True)),
        migrations.CreateModel(
            name="JobGroup",
            fields=[
                (
                    "name",
                    models.CharField(max_length=MAX_KEY_LENGTH, primary_key=True, serialize=False),
                ),
                ("group_limit", models.IntegerField(null=True)),
                ("rate", models.FloatField(null=True)),
                ("tokens", models.FloatField()),
                ("refilled_at", Moment()),
                ("admitted_at", Moment(null=True)),
                ("created_at", Moment()),
            ],
            options={
                "verbose_name": "job group",
                "db_table": f"{table_name()}_groups",
                "ordering": ("name",),
                "managed": False,
            },
        ),
    ]
