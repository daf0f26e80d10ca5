"""The job's times as datetimes in the ORM (``models.Moment``): the columns stay the epoch
seconds the store writes, so this migration changes Django's state only, no SQL."""

from __future__ import annotations

from django.db import migrations

from celery_leases.contrib.django.models import Moment


class Migration(migrations.Migration):
    dependencies = [("celery_leases", "0001_initial")]

    operations = [
        migrations.AlterField(model_name="job", name="created_at", field=Moment()),
        *(
            migrations.AlterField(model_name="job", name=name, field=Moment(null=True))
            for name in ("claimed_at", "renewed_at", "checkpoint_at", "finished_at", "expires_at")
        ),
    ]
