"""Training losses."""

from ml.losses.margin import ARCFACE, COSFACE, MARGINS, CombinedMarginLoss

__all__ = ["ARCFACE", "COSFACE", "MARGINS", "CombinedMarginLoss"]
