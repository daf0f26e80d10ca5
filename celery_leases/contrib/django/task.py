"""DjangoLeasedTask: a LeasedTask that is also Celery's DjangoTask."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
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

    async def adelay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay_on_commit()`` from ``async def`` code: registered with ``on_commit()`` in
        the thread Django runs the ORM's synchronous work in (``sync_to_async``), where the
        transaction of your ``sync_to_async`` ORM calls is; outside one, sent at once. Like
        ``delay_on_commit()``, it returns None: ``await task.adelay(...)`` when the view must
        answer with the job's id."""
        await sync_to_async(self.delay_on_commit)(*args, **kwargs)
