"""The process floor: launching ``jax.distributed`` from torchrun/SLURM/Open MPI environments
(:mod:`~jaxcolossal.runtime.launch`), the local multi-process launcher
(:mod:`~jaxcolossal.runtime.run`, its processes :mod:`~jaxcolossal.runtime.processes`), the platform probes (:mod:`~jaxcolossal.runtime.platforms`),
XLA's flags (:mod:`~jaxcolossal.runtime.xla_flags`) and the distributed logger
(:mod:`~jaxcolossal.runtime.dist_logger`). It imports nothing else of jaxcolossal's, so every
layer above can use it; fault tolerance grows here."""
