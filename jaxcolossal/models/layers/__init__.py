"""Layers every model family uses: attention (:mod:`~jaxcolossal.models.layers.attention`, with the
Pallas :mod:`~jaxcolossal.models.layers.flash_attention`), RoPE (:mod:`~jaxcolossal.models.layers.rope`),
norms (:mod:`~jaxcolossal.models.layers.norm`), Megatron's column/row-parallel projections
(:mod:`~jaxcolossal.models.layers.linear`), the vocab-parallel embedding and fused LM-head loss
(:mod:`~jaxcolossal.models.layers.vocab`), the mixture-of-experts MLP (:mod:`~jaxcolossal.models.layers.moe`)
and LoRA adapters (:mod:`~jaxcolossal.models.layers.lora`). They name logical axes only and never
import a family."""
