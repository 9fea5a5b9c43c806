"""A pipeline timeline as a PNG, one row per rank: forward, backward and weight-gradient actions as colored
bars (a lighter shade for odd microbatches), idle time left light grey. Drawn for a plan's estimate (the
schedule replayed with its costs) or from a measured trace (.timeline). See docs/planner.md."""

from __future__ import annotations

import json
import struct
import zlib

COLORS = {"F": (66, 133, 244), "B": (52, 168, 83), "W": (251, 188, 5), "wait": (234, 67, 53)}
IDLE, GAP, BACKGROUND = (235, 235, 235), (255, 255, 255), (255, 255, 255)


def write_png(path, width: int, height: int, pixels: bytearray) -> None:
    """An RGB PNG of ``pixels`` (``width`` x ``height`` x 3 bytes, rows top down)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def draw(rows: list, path, width: int = 1600, row_height: int = 28) -> None:
    """``rows``: per rank, (start, end, kind, microbatch) bars in any time unit; drawn to ``path``."""
    t0 = min((b[0] for r in rows for b in r), default=0)
    t1 = max((b[1] for r in rows for b in r), default=1)
    scale = (width - 20) / max(t1 - t0, 1e-12)
    height = len(rows) * row_height + 10
    pixels = bytearray(BACKGROUND * (width * height))

    def fill(x0: int, x1: int, y0: int, y1: int, color) -> None:
        line = bytes(color) * max(0, x1 - x0)
        for y in range(y0, y1):
            at = (y * width + x0) * 3
            pixels[at:at + len(line)] = line

    for i, bars in enumerate(rows):
        y0 = 5 + i * row_height
        fill(10, width - 10, y0 + 2, y0 + row_height - 2, IDLE)
        for start, end, kind, mb in bars:
            x0, x1 = 10 + int((start - t0) * scale), 10 + max(int((end - t0) * scale), int((start - t0) * scale) + 1)
            color = COLORS.get(kind, (120, 120, 120))
            if mb % 2:
                color = tuple(c + (255 - c) // 3 for c in color)
            fill(x0, min(x1, width - 10), y0 + 2, y0 + row_height - 2, color)
            if x1 - x0 > 3:
                fill(x1 - 1, x1, y0 + 2, y0 + row_height - 2, GAP)
    write_png(path, width, height, pixels)


def schedule_rows(result) -> list:
    """Rows of a schedule replay (``simulate``'s result): each rank's compute actions."""
    return [[(s, e, "B" if a.kind == "B" else a.kind, a.microbatch) for s, e, a in line] for line in result.timelines]


def trace_rows(path) -> list:
    """Rows of a measured trace (.timeline.PipelineTimeline's file): each process's actions, waits apart."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    pids = sorted({e["pid"] for e in events})
    return [[(e["ts"], e["ts"] + e["dur"], e["name"], e["args"].get("microbatch", 0)) for e in events
             if e["pid"] == pid and e["tid"] == 0] for pid in pids]
