"""Invoicing: one leased task writes one invoice per order, each with its checkpoint."""
