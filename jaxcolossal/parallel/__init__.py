"""How work and bytes are split over devices: the mesh and its axes
(:mod:`~jaxcolossal.parallel.mesh`), the rules table with the ZeRO stage's specs
(:mod:`~jaxcolossal.parallel.sharding`), the layer scan with its remat policies and ZeRO-3
prefetch (:mod:`~jaxcolossal.parallel.layer_scan`), the pipeline's schedule tables
(:mod:`~jaxcolossal.parallel.pipeline_schedule`) beside their executor
(:mod:`~jaxcolossal.parallel.pipeline_executor`), sequence parallelism
(:mod:`~jaxcolossal.parallel.sequence`), TP collective matmuls
(:mod:`~jaxcolossal.parallel.collective_matmul`), the experts' all-to-all
(:mod:`~jaxcolossal.parallel.expert`), and the data-parallel reduction's wire encodings and
compression (:mod:`~jaxcolossal.parallel.wire`, :mod:`~jaxcolossal.parallel.compression`).
Pure functions of arrays, meshes and configs; the models and the train step call them."""
