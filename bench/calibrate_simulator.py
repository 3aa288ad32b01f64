"""``python -m bench.calibrate_simulator``: runs :mod:`bench.simulator.calibrate`."""

import sys

from bench.simulator.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
