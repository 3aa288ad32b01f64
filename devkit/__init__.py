"""The dev kit: what exists to run Backfill on one machine or in tests, never in production.

``backfill dev`` (:mod:`devkit.dev`), its job and demo documents (:mod:`devkit.demo_job`,
``demo_docs/``), the embedded
PostgreSQL and Redis (:mod:`devkit.embedded`), the CPU engine and its model builds
(:mod:`devkit.devengine`, ``model_build/``), the local Redis Cluster
(:mod:`devkit.redis_cluster`), the engine speed probe (:mod:`devkit.enginespeed`), and the
child-process harness they, the benchmarks and the tests share (:mod:`devkit.harness`,
:mod:`devkit.steprun`).

It may import every production package; none of them imports it, and the command line only
inside ``backfill dev``, so ``backfill worker`` and ``backfill api`` never load it.
"""
