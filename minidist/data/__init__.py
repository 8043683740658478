"""The data a run trains on: text sources read as bytes (`corpus`), tokenizers (`tokenizer`: bytes, a BPE trained
here, or a tokenizer.json), prepared datasets (`prepare` writes them, `dataset` opens them, `shards` reads their
rows), the deterministic, resumable batch sampler (`sampler`), and `training_data`, what the trainer's --data names.
"""
