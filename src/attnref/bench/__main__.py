"""``python -m attnref.bench``: the same as ``attnref bench``."""

import sys

from attnref.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
