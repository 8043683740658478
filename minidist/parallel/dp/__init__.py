"""Chapter 07, data parallelism: gradient buckets reduced while the backward runs (`data_parallel`), and ZeRO
1-3 (`zero`, with its gradient reductions in `zero_grads`, its parameter homes in `zero_params`, its formulas in
`zero_bytes`), and the timeline of a step's collectives.
"""
