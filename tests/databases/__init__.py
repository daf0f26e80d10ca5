"""Tests on real databases (SQLite, PostgreSQL, MariaDB: the ``database_url`` fixture), from this
process: the broker is ``memory://`` or kombu's ``filesystem://``; no ``celery worker``, no command
run as a subprocess (``test_race.py`` races processes of its own on one table, through
multiprocessing)."""
