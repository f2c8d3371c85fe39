"""Errors that carry one actionable message: what was wrong, where, and what to do."""


class FaceopsError(Exception):
    """Base class: the message alone must tell the user what to fix."""


class ConfigError(FaceopsError, ValueError):
    """A params key is unknown, mistyped or out of range."""


class DataError(FaceopsError, ValueError):
    """A dataset file, manifest row or image is missing, unreadable or malformed."""


class TrainingError(FaceopsError, RuntimeError):
    """Training cannot go on (e.g. the loss became NaN/inf); names the step and the last good checkpoint."""
