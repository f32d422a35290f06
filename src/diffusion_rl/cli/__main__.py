"""``python -m diffusion_rl.cli``: the same as the ``diffusion-rl`` command."""

import sys

from . import main

sys.exit(main())
