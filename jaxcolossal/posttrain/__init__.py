"""Post-training's rollout phase on the training mesh: reward functions
(:mod:`~jaxcolossal.posttrain.rewards`) and GRPO's rollouts (:mod:`~jaxcolossal.posttrain.rollout`).
The objectives themselves are the train step's (:mod:`jaxcolossal.train.objective`)."""
