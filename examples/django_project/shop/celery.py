"""The project's Celery app, configured from Django's settings (``CELERY_*``)."""

import os

from celery import Celery

from celery_leases import schedule_reaper

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
# CELERY_LEASES_TABLE becomes leases_table, CELERY_BROKER_URL broker_url, and so on.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
every = float(os.environ.get("SHOP_REAPER_EVERY", "10"))
if every:  # SHOP_REAPER_EVERY=0: no reaper in beat's schedule (manage.py check warns)
    schedule_reaper(app, every=every)
