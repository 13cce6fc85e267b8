"""jaxcolossal: Colossal-AI's large-model training system rebuilt in JAX/XLA on SPMD meshes."""

__version__ = "0.1.0"
