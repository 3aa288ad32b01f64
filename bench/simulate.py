"""``python -m bench.simulate``: runs :mod:`bench.simulator.speed`."""

import sys

from bench.simulator.speed import main

if __name__ == "__main__":
    sys.exit(main())
