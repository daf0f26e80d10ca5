"""The demo rig of the webhook-sync example: not code to copy, what runs it and judges it.

    python -m examples.webhook_sync.demo [--broker URL] [--database URL] [--events N]

- ``driver``: the demo itself (``__main__`` runs its ``main``): starts the processes, delivers
  the webhooks, kills the worker holding the sync's lease, prints the verdict;
- ``processes``: its child processes; ``console``: its output; ``verdict``: the checks,
  computed from the data;
- ``upstream``: a stand-in for a provider's events API; ``provider``: a stand-in for the
  provider's side of the webhooks (sign, deliver);
- ``fs_transport``: the ``atomicfs://`` broker (message files, no server) the example's app
  uses by default.
"""
