"""Reports for people and machines: ``report.json``, ``report.md``, a self-contained
``report.html`` and the PNG plots."""

from __future__ import annotations

import json
import math
from typing import Any


def strict_json(doc: Any, **options: Any) -> str:
    """``doc`` as JSON that strict readers (jq, browsers, other languages) accept: a number
    that is not finite (a diverged loss, a ratio over zero) is written as null, which the
    documents chaos writes read as "not measured"."""
    return json.dumps(_finite(doc), allow_nan=False, **options)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
