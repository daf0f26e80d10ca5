"""The chaos tool: real workers on real services, seeded faults, and the invariants checked after.

    python -m chaos.driver --help      # the long form is `make chaos` (CHAOS_ARGS in the Makefile)

- ``driver``: the run (jobs, workers, beat, the fault plan, the trigger thread) and its report;
- ``fault``: the fault kinds and how each is done to real processes and services;
- ``trigger``: the bursts of keyed jobs' triggers, sent as a webhook receiver would;
- ``check``: the invariants, computed from the tables and logs once every process is stopped;
- ``app``: the Celery app the run's workers load (``celery -A chaos.app worker``);
- ``client``: a client the ``kill_client`` fault starts and SIGKILLs (``python -m chaos.client``);
- ``reaper``: a reaper loop the SQLite runs start in a PID namespace of their own
  (``python -m chaos.reaper`` under ``unshare``).

Its self-tests (no services) are in ``chaos/tests``; the short form that ``make test`` runs is
``tests/chaos/test_chaos.py``. It uses the test suite's support code (``tests.support``: the
services, the worker harness, the unit log, ``apps.leased_app``), so it runs from the
repository root and is not installed with the package.
"""
