"""``python -m diffusion_rl``: the ``diffusion-rl`` command, also under ``torchrun``
(``torchrun --nproc_per_node N -m diffusion_rl grpo --config FILE``)."""

import sys

from .cli import main

sys.exit(main())
