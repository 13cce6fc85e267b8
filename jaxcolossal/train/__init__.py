"""Train state, the one jitted train step and the objectives' registry, and the training loop as its
phases (:mod:`~jaxcolossal.train.loop`: preflight, start, steps, finish), each in the room named
after what it holds."""
