"""``python -m bench.gpu_step_times``: runs :mod:`bench.simulator.gpu_step_times`."""

import sys

from bench.simulator.gpu_step_times import main

if __name__ == "__main__":
    sys.exit(main())
