"""Support code of the test suite (and of ``bench/`` and ``chaos/``); no tests here.

- ``service``: the real services (PostgreSQL, MariaDB, Redis, RabbitMQ), ``require()``, private
  Redis databases, Celery settings carried to subprocesses, the test process's client app
  (``celery_client``, ``close_app``).
- ``worker``: real ``celery worker`` / ``celery beat`` subprocesses (``Worker``, ``Beat``,
  ``Spawner``).
- ``scenario``: the end-to-end scenario of workers running ``apps.leased_app``, and the checks
  its unit log must pass.
- ``proxy``: a TCP proxy that takes the leases database down for the workers behind it.
- ``replica``: a private PostgreSQL primary and its asynchronous streaming replica, for a
  failover while attempts run (crash the primary, promote the replica).
- ``cli``: the ``celery leases`` command run as a subprocess, and jobs made for it.
- ``unit_log``: the table the test tasks write one row per unit of work to.
- ``apps``: the Celery apps the workers run (``celery -A tests.support.apps.<name>``).
"""
