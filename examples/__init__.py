"""Runnable examples of celery-leases."""
