"""The invoicing of a batch, asked for over HTTP."""

from django.http import JsonResponse
from django.views.decorators.http import require_POST

from .tasks import invoice_orders


@require_POST
def invoice(request, batch: str):
    """Invoice ``count`` (a POST field) orders of ``batch``: queued for a worker, or run here
    under CELERY_TASK_ALWAYS_EAGER, inside the request's transaction with ATOMIC_REQUESTS."""
    count = int(request.POST["count"])
    job = invoice_orders.delay(batch, count)
    return JsonResponse({"job": job.id}, status=202)
