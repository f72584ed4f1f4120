"""``python -m batchfit``: the same command as the ``batchfit`` console script."""

from batchfit.cli import main

raise SystemExit(main())
