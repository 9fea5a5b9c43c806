"""The newest complete checkpoint a restarted job resumes from: lightning_tp directories whose index
names only files that are there whole (a write cut short is skipped), the highest step first."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def newest_complete(dirs) -> Optional[Path]:
    """The complete lightning_tp checkpoint under ``dirs`` with the highest global step (then the newest)."""
    from .files import kind, read_meta
    from .dcp_io import check_complete, read_index

    found = []
    for d in dirs:
        if d is None or not Path(d).is_dir():
            continue
        for path in Path(d).iterdir():
            if ".tmp-" in path.name or ".old-" in path.name:  # being written, or being replaced
                continue
            try:
                if kind(path) != "lightning_tp":
                    continue
                check_complete(path, read_index(path))
                step = int(read_meta(path).get("global_step", -1))
            except (ValueError, OSError):
                continue
            found.append((step, path.stat().st_mtime, str(path)))
    return Path(max(found)[2]) if found else None
