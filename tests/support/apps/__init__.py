"""The Celery apps that test workers run (``celery -A tests.support.apps.<name> worker``), each
built by ``factory.make_app`` from the environment the test passes (the chaos tool's app,
``chaos/app.py``, too)."""
