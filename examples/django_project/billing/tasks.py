"""The leased task: each invoice and the checkpoint after it commit in one transaction."""

import time

from celery import shared_task
from django.db import transaction

from celery_leases.contrib.django import DjangoLeasedTask

from .models import Invoice


@shared_task(base=DjangoLeasedTask, bind=True, name="billing.invoice_orders")
def invoice_orders(self, batch: str, count: int, pause: float = 0.0) -> int:
    """Write invoices ``0 .. count-1`` of ``batch``, resuming after the last one committed."""
    start = (self.lease.checkpoint or {}).get("next", 0)
    for number in range(start, count):
        with transaction.atomic():
            Invoice.objects.create(
                batch=batch, number=number, attempt=self.lease.attempt, token=self.lease.token
            )
            # Joins the transaction: the invoice and the checkpoint commit together, and a
            # stale attempt gets LeaseLost here, which rolls its invoice back.
            self.checkpoint({"next": number + 1}, progress=(number + 1, count))
        self.stop_point()  # a cancel or a shutdown seen by the checkpoint stops here
        time.sleep(pause)
    return count
