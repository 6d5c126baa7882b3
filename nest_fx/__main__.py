"""``python -m nest_fx``: the ``nest-fx`` command line without the console script (e.g. with PYTHONPATH)."""

import sys

from nest_fx.cli import main

sys.exit(main())
