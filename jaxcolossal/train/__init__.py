"""Train state, the one jitted train step, and the training loop."""
