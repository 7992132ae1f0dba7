"""``python -m longstraw``: the command line (``longstraw.cli``), e.g. ``torchrun --nproc_per_node 8 -m longstraw train
--config run.toml``."""

import sys

from longstraw.cli import main

if __name__ == "__main__":
    sys.exit(main())
