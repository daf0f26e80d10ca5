"""Settings merged into Celery's integration suite by scripts/celery_suite.sh (EXTRA_CONFIG)."""

CONFIG = {
    "leases_database_url": "postgresql+psycopg://postgres@127.0.0.1:5432/celery_suite",
}
