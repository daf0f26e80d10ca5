"""Integrations of celery-leases with other frameworks (optional extras)."""
