"""``python -m drc_book run|build|figure``: see :mod:`drc_book.runner`."""

import sys

from drc_book.runner import main
from drc_core import run_cli

sys.exit(run_cli(main))
