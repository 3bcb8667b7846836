"""``python -m attnref``: the same as the ``attnref`` command."""

import sys

from attnref.cli import main

sys.exit(main())
