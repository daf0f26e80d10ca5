"""Alembic's environment for the celery-leases revisions (see ``run_environment``)."""

from celery_leases.db.migrations import run_environment

run_environment()
