"""The example project's settings, with the Django settings of ``SHOP_EXTRA_SETTINGS`` (a JSON
object) added or replaced: ``DJANGO_SETTINGS_MODULE=tests.django.extra_settings``."""

import json
import os

from shop.settings import *  # noqa: F403

globals().update(json.loads(os.environ.get("SHOP_EXTRA_SETTINGS", "{}")))
