"""``python -m bench.gpu_steps``: runs :mod:`bench.simulator.gpu_steps`."""

import sys

from bench.simulator.gpu_steps import main

if __name__ == "__main__":
    sys.exit(main())
