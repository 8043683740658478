"""Chapter 11, expert parallelism: each MoE layer's experts split over the ep ranks, tokens sent to their experts
and back by uneven all-to-all, and gradients reduced over two replica groups (dense over dp·cp, experts over edp).
"""
