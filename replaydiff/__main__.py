"""``python -m replaydiff``: the same as the ``replaydiff`` command."""
import sys

from replaydiff.cli.main import main

sys.exit(main())
