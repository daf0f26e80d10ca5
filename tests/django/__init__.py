"""The Django integration, run in the example project (examples/django_project)."""
