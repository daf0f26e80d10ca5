"""Tests that run in this process alone: no database server, no broker server, no subprocess
(SQLite files, the ``memory://`` broker, the library's code called directly)."""
