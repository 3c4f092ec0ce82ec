"""``python -m lossparity.cli ...`` runs the ``lossparity`` command (the same as the console script)."""

import sys

from . import main

sys.exit(main())
