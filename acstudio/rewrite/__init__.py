"""Apply a plan (recompute, offload) to the captured step (rewriter, as passes) and prove the result computes the
same thing (verify)."""

from acstudio.errors import RewriteError
from acstudio.rewrite.rewriter import Recomputation, RewrittenStep, rewrite, rewrite_step

__all__ = ["Recomputation", "RewriteError", "RewrittenStep", "rewrite", "rewrite_step"]
