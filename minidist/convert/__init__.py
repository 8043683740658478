"""Chapter 14, Hugging Face Llama checkpoints in and out: `python -m minidist.convert to-hf|from-hf`; the config,
names and RoPE layout in memory (`hf_model`), the files read as untrusted input (`hf_files`).
Chapter 18, torch.distributed.checkpoint directories in and out: `to-dcp|from-dcp` (`dcp`), with torchtitan's names
and RoPE layout (`titan_model`), their metadata read as untrusted input (`dcp_files`).
"""
