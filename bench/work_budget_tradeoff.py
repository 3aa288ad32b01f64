"""``python -m bench.work_budget_tradeoff``: runs :mod:`bench.protection.tradeoff`."""

from bench.protection.tradeoff import main

if __name__ == "__main__":
    main()
