"""Reference answers to the exercises, one module per chapter, with the same names and signatures as `exercises/`.

Read them after trying: `make grade CH=NN` grades your own answers in `exercises/` with the same tests.
"""
