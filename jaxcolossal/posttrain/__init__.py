"""Post-training: the DPO and GRPO objectives (:mod:`~jaxcolossal.posttrain.dpo`,
:mod:`~jaxcolossal.posttrain.grpo`; registered in :data:`jaxcolossal.train.objective.OBJECTIVES`),
the terms every objective shares (:mod:`~jaxcolossal.posttrain.loss_terms`), reward functions
(:mod:`~jaxcolossal.posttrain.rewards`) and GRPO's rollouts on the training mesh
(:mod:`~jaxcolossal.posttrain.rollout`). A floor below ``train``: the step and the loop look these
up, never the other way round."""
