"""Django migrations of the leases app: each runs the package's Alembic revisions."""
