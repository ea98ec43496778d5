"""``python -m sglang_graft``: the same as the ``sglang-graft`` command."""

import sys

from sglang_graft.cli import main

sys.exit(main())
