"""Apply a plan (recompute, offload) to the captured step (rewriter) and prove the result computes the same thing
(verify)."""

from acstudio.rewrite.rewriter import Recomputation, RewriteError, RewrittenStep, rewrite, rewrite_step

__all__ = ["Recomputation", "RewriteError", "RewrittenStep", "rewrite", "rewrite_step"]
