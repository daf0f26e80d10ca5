"""DjangoLeasedTask: a LeasedTask that is also Celery's DjangoTask."""

from __future__ import annotations

from typing import Any

from celery.contrib.django.task import DjangoTask
from sqlalchemy.engine import Connection

from ...db.dbapi import Foreign
from ...task import LeasedTask
from . import transaction


class DjangoLeasedTask(LeasedTask, DjangoTask):  # type: ignore[misc]
    """Base class for leased tasks in a Django project: ``@shared_task(base=DjangoLeasedTask,
    bind=True)``.

    It has Celery's ``delay_on_commit()`` / ``apply_async_on_commit()`` (the job is recorded
    and published once the caller's transaction commits), and ``self.checkpoint()`` inside
    ``transaction.atomic()`` joins that transaction: the ORM writes and the checkpoint commit
    together, and a stale attempt gets ``LeaseLost`` inside the block, which rolls them back.
    As with ``connection=``, a cancel or a shutdown seen by such a checkpoint is raised by
    ``self.stop_point()`` after the block (or by the next checkpoint).
    """

    def checkpoint(
        self,
        state: Any,
        *,
        progress: tuple[int, int | None] | int | None = None,
        connection: Connection | Foreign | None = None,
    ) -> None:
        """``LeasedTask.checkpoint``, joining Django's transaction inside ``atomic()``."""
        if connection is None:
            connection = transaction.joined(self)
        super().checkpoint(state, progress=progress, connection=connection)

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        transaction.release(self)
        super().after_return(*args, **kwargs)
