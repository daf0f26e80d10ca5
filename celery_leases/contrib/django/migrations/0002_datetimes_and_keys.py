"""celery-leases' schema revisions 0002 (lease keys), 0003 (holders, a key's pending triggers)
and 0004 (the operators' indexes), one ``migration.Revision`` each; and in Django's state only:
the job's times as datetimes in the ORM (``models.Moment``), its lease key and message, and the
lease keys' table (``LeaseKey``) for the admin. From revision 0006 on, each revision is a Django
migration of its own."""

from __future__ import annotations

from django.db import migrations, models

from celery_leases.contrib.django.migration import Revision
from celery_leases.contrib.django.models import Moment, table_name
from celery_leases.db.schema import MAX_ID_LENGTH, MAX_KEY_LENGTH

TIMES = ("claimed_at", "renewed_at", "checkpoint_at", "finished_at", "expires_at")


class Migration(migrations.Migration):
    # The revisions run on a connection of the store's own, under its migration lock.
    atomic = False
    dependencies = [("celery_leases", "0001_initial")]

    operations = [
        Revision("0002"),
        Revision("0003"),
        Revision("0004"),
        migrations.AlterField(model_name="job", name="created_at", field=Moment()),
        *(
            migrations.AlterField(model_name="job", name=name, field=Moment(null=True))
            for name in TIMES
        ),
        migrations.AddField(
            model_name="job",
            name="lease_key",
            field=models.CharField(max_length=MAX_KEY_LENGTH, null=True),
        ),
        migrations.AddField(model_name="job", name="message", field=models.TextField(default="")),
        migrations.CreateModel(
            name="LeaseKey",
            fields=[
                (
                    "lease_key",
                    models.CharField(max_length=MAX_KEY_LENGTH, primary_key=True, serialize=False),
                ),
                ("cursor_state", models.TextField(null=True)),
                ("job_id", models.CharField(max_length=MAX_ID_LENGTH, null=True)),
                ("cursor_at", Moment(null=True)),
                ("pending_id", models.CharField(max_length=MAX_ID_LENGTH, null=True)),
                ("pending_at", Moment(null=True)),
            ],
            options={
                "verbose_name": "lease key",
                "db_table": f"{table_name()}_keys",
                "ordering": ("lease_key",),
                "managed": False,
            },
        ),
    ]
