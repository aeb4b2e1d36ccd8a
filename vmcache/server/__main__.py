"""``python -m vmcache.server``: see :mod:`vmcache.server.cli`."""

import sys

from vmcache.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
