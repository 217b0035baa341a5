"""Evaluation: perplexity (and, later, lm-eval-harness integration)."""

from .perplexity import perplexity

__all__ = ["perplexity"]
