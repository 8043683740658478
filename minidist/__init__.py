"""minidist: distributed LLM training from first principles.

Each chapter of the course graduates its code into one small module here; `python -m minidist.train`
assembles them into a trainer.
"""

__version__ = "0.1.0"
