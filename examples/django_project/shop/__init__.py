"""The example Django project: a shop whose invoicing runs as a leased Celery task."""

from .celery import app as celery_app

__all__ = ("celery_app",)
