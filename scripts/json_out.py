"""Where a benchmark writes its JSON: `--out` when given, else $OUT/<name> (the device
machine's folder that comes back), else outputs/<name>."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(out: str, name: str, payload) -> Path:
    """Writes `payload` as indented JSON to `out` (a path, "" for the default) and prints
    where."""
    path = Path(out or Path(os.environ.get("OUT", "outputs")) / name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
