"""Your answers to the course's exercises, one module per chapter (e.g. `exercises/ch00_collectives.py`).

Every function here is a stub that raises NotImplementedError; its docstring says what to build and gives hints.
Replace each body with your own code, then grade it with `make grade CH=NN` (for chapter 00: CH=00). The same
tests check the reference answers in `solutions/`, so a passing grade means your function behaves like them.
"""
