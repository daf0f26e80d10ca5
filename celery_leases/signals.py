"""Signals of celery-leases, in the style of ``celery.signals``."""

from __future__ import annotations

from celery.utils.dispatch import Signal

#: Sent in the worker after each checkpoint is saved: ``sender`` is the task, ``lease`` the
#: :class:`~celery_leases.Lease` (its ``checkpoint`` is the saved state) and ``progress`` the
#: ``(done, total)`` pair or None. A receiver that raises stops the attempt there.
checkpoint_saved = Signal(name="checkpoint_saved", providing_args={"lease", "progress"})

__all__ = ["checkpoint_saved"]
