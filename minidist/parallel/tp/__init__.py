"""Chapter 08, tensor and sequence parallelism (Megatron-LM): the f/g operators, column- and row-parallel linears,
the vocabulary split over the tp ranks, and the transformation that applies them to a built model.
"""
