"""The data a run trains on: a byte tokenizer, a corpus that needs no download, and a deterministic, resumable
batch sampler.
"""
