"""``python -m statereduce.serve``: :mod:`statereduce.serve.cli`."""

import sys

from statereduce.serve.cli import main

sys.exit(main())
