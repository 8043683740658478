"""Chapter 14, Hugging Face Llama checkpoints in and out: `python -m minidist.convert to-hf|from-hf`; the config,
names and RoPE layout in memory (`hf_model`), the files read as untrusted input (`hf_files`).
"""
