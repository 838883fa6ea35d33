"""Plain JSON values from whatever a decision or a record holds (the store's metadata, the browser's listing)."""
from __future__ import annotations

import math


def json_safe(value, depth: int = 0):
    """Plain JSON for the browser: non-finite floats become null, unknown objects their text."""
    if depth > 8:
        return None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    if hasattr(value, "tolist"):  # tensors, numpy scalars
        try:
            return json_safe(value.tolist(), depth + 1)
        except Exception:  # a tensor that cannot leave its device is not worth failing a listing for
            return None
    return str(value)
