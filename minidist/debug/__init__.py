"""Debugging distributed training: the tools of chapter 14."""
