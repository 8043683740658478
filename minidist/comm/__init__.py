"""Chapter 00: communication. `Comm` (every collective and point-to-point call, with a byte ledger and the flight
recorder), collectives built by hand from send/recv, the α-β cost model, the rank grid and its process groups,
running a function on N local ranks, and joining a job's process groups. The lowest layer: it imports nothing else
of the package.
"""
