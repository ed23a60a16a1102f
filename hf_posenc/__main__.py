"""``python -m hf_posenc`` is the ``hf-posenc`` command."""

import sys

from .recipes.cli import main

sys.exit(main())
