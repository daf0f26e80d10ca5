from django.db import models


class Invoice(models.Model):
    """One invoice of a batch; ``token`` and ``attempt`` say which attempt wrote it."""

    batch = models.CharField(max_length=64)
    number = models.IntegerField()
    attempt = models.IntegerField()
    token = models.BigIntegerField()
