"""How a TAR@FAR cell is shown in every benchmark table: a threshold set by too few false accepts is marked, not
read. Shared by ``tasks.evaluate``, its report and its set-fusion section, and below all three."""

from __future__ import annotations


MIN_FALSE_ACCEPTS = 10  # a TAR@FAR threshold set by fewer impostor scores than this is noise, not a finding


def _false_accepts(far: str | float, impostors: float | None) -> float | None:
    """``far`` × ``impostors``, the false accepts a TAR@FAR threshold is set by, when under ``MIN_FALSE_ACCEPTS``
    (None otherwise or without a count); ``far`` as a float or a metric suffix such as ``tar@far=1e-4``."""
    expected = float(str(far).rsplit("=", 1)[-1]) * (impostors or 0)
    return expected if impostors and expected < MIN_FALSE_ACCEPTS else None


def thin(far: str | float, impostors: float | None) -> bool:
    """Whether a TAR at ``far`` on ``impostors`` impostor pairs rests on too few false accepts to read."""
    return _false_accepts(far, impostors) is not None


def few_false_accepts(cell: str, far: str | float, impostors: float | None) -> str:
    """A TAR@FAR table cell as shown: where the threshold rests on fewer than ``MIN_FALSE_ACCEPTS`` false accepts
    (``thin``), the value in italics with their count, ``*13.33 %* (1.6 FA)``."""
    expected = _false_accepts(far, impostors)
    return cell if expected is None or cell == "—" else f"*{cell}* ({expected:.1f} FA)"


FEW_FALSE_ACCEPTS_NOTE = (f"Cells in italics rest on fewer than {MIN_FALSE_ACCEPTS} false accepts (FAR × impostor "
                          "pairs, the count beside them): the threshold is set by that few impostor scores, so read "
                          "them as noise, not as a difference between rows.")
