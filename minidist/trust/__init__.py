"""Chapter 13, trust nothing: replica checks (the tensors several ranks must hold bit for bit, compared by hash),
fault drills that break a run on purpose, and the cheap health checks that stop a broken run at the step it breaks.
"""
