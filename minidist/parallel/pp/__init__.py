"""Chapter 09, pipeline parallelism: schedules as data and their simulator, the executor of one rank's actions,
when each rank posts its point-to-point messages (and NCCL's rules replayed on the CPU), and tied embeddings
across the first and last stage.
"""
