"""``manage.py invoice BATCH COUNT``: queue the invoicing of a batch once the command's
transaction commits (``delay_on_commit``)."""

from django.core.management.base import BaseCommand
from django.db import transaction

from billing.tasks import invoice_orders


class Command(BaseCommand):
    help = "Queue invoice_orders(BATCH, COUNT) once this transaction commits."

    def add_arguments(self, parser):
        parser.add_argument("batch")
        parser.add_argument("count", type=int)
        parser.add_argument("--pause", type=float, default=0.0, help="seconds between invoices")

    def handle(self, batch, count, pause, **options):
        with transaction.atomic():
            # Recorded in the leases table and sent only once this block commits.
            invoice_orders.delay_on_commit(batch, count, pause)
        self.stdout.write(f"queued invoicing of {count} orders of {batch}")
