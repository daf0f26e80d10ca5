"""DjangoLeasedTask: a LeasedTask that is also Celery's DjangoTask."""

from __future__ import annotations

from celery.contrib.django.task import DjangoTask

from ...task import LeasedTask


class DjangoLeasedTask(LeasedTask, DjangoTask):  # type: ignore[misc]
    """Base class for leased tasks in a Django project: ``@shared_task(base=DjangoLeasedTask,
    bind=True)``.

    It has Celery's ``delay_on_commit()`` / ``apply_async_on_commit()`` (the job is recorded
    and published once the caller's transaction commits). Like every leased task in a project
    with ``celery_leases.contrib.django`` installed, its ``self.checkpoint()`` and
    ``self.save_cursor()`` inside ``transaction.atomic()`` join that transaction: the ORM
    writes and theirs commit together, and a stale attempt gets ``LeaseLost`` inside the
    block, which rolls them back. As with ``connection=``, a cancel or a shutdown seen by such
    a checkpoint is raised by ``self.stop_point()`` after the block (or by the next
    checkpoint).
    """
