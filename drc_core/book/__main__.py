"""``python -m drc_core.book run|build|figure``: see :mod:`drc_core.book.runner`."""

import sys

from drc_core.book.runner import main
from drc_core.errors import run_cli

sys.exit(run_cli(main))
