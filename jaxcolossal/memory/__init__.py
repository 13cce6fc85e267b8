"""Where a layout's bytes live and how much they cost: the memory kind of each shard
(:mod:`~jaxcolossal.memory.placement`), the activations traced from the model's own autodiff
(:mod:`~jaxcolossal.memory.activations`), the per-device bytes of state, gradients and offload
and the placement that fits a budget (:mod:`~jaxcolossal.memory.budget`), and the explanation of
an out-of-memory error (:mod:`~jaxcolossal.memory.oom`). Shared by the training loop and the
planner; imports neither."""
