"""The trainer: `python -m minidist.train` (or `torchrun ... -m minidist.train`). `loop` reads top to bottom;
`config` owns the settings, `ConfigError` and every choice list; `preflight` checks them before any process group;
the rest is what a run writes and reads back (metrics, plots, the output directory, checkpoints, resharded resume).
"""
