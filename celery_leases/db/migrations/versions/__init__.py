"""The revisions of the jobs table, one file each: ``NNNN_<what>.py`` with ``revision = "NNNN"``."""
