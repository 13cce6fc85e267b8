"""How work and bytes are split over devices beyond the rules table: the wire encodings and the
gradient compression of the data-parallel reduction, sequence parallelism (Megatron-SP, Ulysses,
ring attention), TP collective matmuls, and the pipeline's schedule tables. Pure functions of
arrays and configs; the models and the train step call them."""
