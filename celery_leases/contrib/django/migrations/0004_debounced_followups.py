"""celery-leases' schema revision 0006 (``migration.Revision``): when the triggers waiting on a
lease key began, which the unmanaged model ``LeaseKey`` reads."""

from __future__ import annotations

from django.db import migrations

from celery_leases.contrib.django.migration import Revision
from celery_leases.contrib.django.models import Moment


class Migration(migrations.Migration):
    # The revision runs on a connection of the store's own, under its migration lock.
    atomic = False
    dependencies = [("celery_leases", "0003_groups")]

    operations = [
        Revision("0006"),
        migrations.AddField(model_name="leasekey", name="pending_since", field=Moment(null=True)),
    ]
