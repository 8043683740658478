"""An identity whose backward counts its runs: a stand-in for tensor parallelism's f/g (and their collectives) on
the input's path, which a zero-bubble split must run once, in B, never again in W (tests/test_zero_bubble.py and
chapter 15's grader)."""

from __future__ import annotations

import torch


class CountedIdentity(torch.autograd.Function):
    runs = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        CountedIdentity.runs += 1
        return g
