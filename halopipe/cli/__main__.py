"""``python -m halopipe.cli``: the same as the ``halopipe`` command."""

import sys

from .main import main

sys.exit(main())
