"""``python -m batchfit``: the same command as the ``batchfit`` console script."""

import sys

try:
    from batchfit.cli import main
except KeyboardInterrupt:  # Ctrl-C before main() could answer it: exit 130 as main() would, no traceback
    sys.stderr.write("batchfit: error: interrupted\n")
    raise SystemExit(130) from None

raise SystemExit(main())
