"""``python -m examples.webhook_sync.demo``: run the demo (see ``driver``)."""

import sys

from .driver import main

sys.exit(main())
