"""``python -m bench.prefix_sim``: runs :mod:`bench.simulator.prefix_sim`."""

import sys

from bench.simulator.prefix_sim import main

if __name__ == "__main__":
    sys.exit(main())
