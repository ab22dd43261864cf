"""Text on screen by OCR (RapidOCR: PaddleOCR models on ONNX Runtime) and fuzzy label matching.

The models ship inside the `rapidocr-onnxruntime` wheel, so nothing is downloaded, ever. Loading
them takes most of a second, so an `OcrEngine` is created by the tool set that owns it and loads
its model lazily, in a worker thread, on first use. Recognition is serialised per engine (a lock):
ONNX Runtime already uses every core for one image, and RapidOCR keeps per-call settings on itself.
Polling tools (ui.waitFor, ui.findAndClick) mostly look at an unchanged screen, so a frame that is
byte for byte one of the last two gets their answer again instead of another OCR pass.

Matching a label against OCR text (`match_score`), both casefolded and with whitespace collapsed:

    score = max( SequenceMatcher(label, text).ratio(),
                 0.9 * max SequenceMatcher(label, slice).ratio() over slices of `text` as long as
                       the label (and one character shorter or longer) )

1.0 is an exact match. The second term finds a label inside a longer line ("Submit" in "Submit
form" scores 0.9): OCR often reads a row of buttons as one line, and the 0.9 keeps an exact
element ahead of a line that merely contains it. The click point of such a match is estimated
from where the slice lies in the line (characters are taken as equally wide).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import asdict, dataclass
from difflib import SequenceMatcher
from typing import TYPE_CHECKING, Any

from tether.tools.errors import ToolError

if TYPE_CHECKING:
    from tether.tools.desktop.screen import Capture

CONTAINED_WEIGHT = 0.9
DET_MAX_SIDE = 2000
RECENT_FRAMES = 2
MIN_TEXT_SCORE = 0.5  # RapidOCR's own default: below it recognitions are mostly noise


@dataclass(frozen=True, slots=True)
class TextElement:
    """One line of text found on screen; `box` is in screen pixels."""

    id: str
    text: str
    box: dict[str, int]
    confidence: float

    @property
    def center(self) -> tuple[int, int]:
        return self.box["x"] + self.box["width"] // 2, self.box["y"] + self.box["height"] // 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class OcrEngine:
    """A RapidOCR instance created on first use; one per tool set (never module state)."""

    def __init__(self, min_score: float = MIN_TEXT_SCORE, reuse_unchanged: bool = True) -> None:
        self.min_score = min_score
        self.reuse_unchanged = reuse_unchanged
        self._engine: Any = None
        self._lock = threading.Lock()
        self._recent: list[tuple[tuple[int, int, int, int], bytes, list[tuple[dict[str, int], str, float]]]] = []
        self.load_seconds: float | None = None
        self.reused = 0

    def _load(self) -> Any:
        if self._engine is None:
            started = time.perf_counter()
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as exc:  # e.g. OpenCV without its system libraries
                raise ToolError(f"the OCR engine cannot load: {exc} (pip install 'tether[desktop]'; OpenCV needs "
                                "apt-get install libgl1 libglib2.0-0)") from None

            # The angle classifier is for photographed, rotated text: screen text is upright, and
            # skipping it saves a model pass per line. Detection runs at the image's own size (up to
            # 2000 px a side): the default upscales anything under 736 px, so a window or region took
            # longer than the whole screen and lost the spaces between words.
            self._engine = RapidOCR(use_cls=False, print_verbose=False, det_limit_type="max",
                                    det_limit_side_len=DET_MAX_SIDE)
            self.load_seconds = time.perf_counter() - started
        return self._engine

    def close(self) -> None:
        """Drop the loaded models (~100 MB) and remembered frames; the next use loads them again."""
        with self._lock:
            self._engine = None
            self._recent = []

    def warm_up(self) -> None:
        """Load the models now (blocking; call it in a thread)."""
        with self._lock:
            self._load()

    def recognize(self, capture: Capture, id_prefix: str = "e") -> list[TextElement]:
        """The text lines in `capture`, top to bottom then left to right, boxes in screen pixels.

        Blocking (hundreds of milliseconds for a full screen): call it in a worker thread. When the
        pixels are byte for byte those of one of the last two calls (polling an unchanged screen),
        that answer is reused: OCR is deterministic, and comparing costs about a millisecond.
        """
        where = (capture.x, capture.y, capture.width, capture.height)
        with self._lock:
            seen = next((r for r in self._recent if r[0] == where and r[1] == capture.bgra), None)
            if seen is not None:
                self.reused += 1
                lines = seen[2]
            else:
                found, _timings = self._load()(capture.bgr(), use_cls=False, text_score=self.min_score)
                lines = reading_order([_line(capture, points, text, score) for points, text, score in found or []])
                if self.reuse_unchanged:  # two frames: a blinking caret alternates between two screens
                    self._recent = [(where, capture.bgra, lines), *self._recent[:RECENT_FRAMES - 1]]
        return [TextElement(id=f"{id_prefix}{i}", text=text, box=dict(box), confidence=round(score, 4))
                for i, (box, text, score) in enumerate(lines, 1)]


def _line(capture: Capture, points: list[list[float]], text: Any, score: Any) -> tuple[dict[str, int], str, float]:
    """One RapidOCR result (a quadrilateral in capture pixels) as an upright box in screen pixels."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, y0 = max(0, int(min(xs))), max(0, int(min(ys)))
    box = {"x": capture.x + x0, "y": capture.y + y0,
           "width": max(1, round(max(xs)) - x0), "height": max(1, round(max(ys)) - y0)}
    return box, str(text), float(score)


def reading_order(items: list[tuple[dict[str, int], str, float]]) -> list[tuple[dict[str, int], str, float]]:
    """Rows top to bottom (a row: centres within half a line height of its first item), each left to right."""
    rows: list[list[tuple[dict[str, int], str, float]]] = []
    for item in sorted(items, key=lambda it: it[0]["y"] + it[0]["height"] / 2):
        box = item[0]
        if rows:
            first = rows[-1][0][0]
            if abs((box["y"] + box["height"] / 2) - (first["y"] + first["height"] / 2)) <= first["height"] / 2:
                rows[-1].append(item)
                continue
        rows.append([item])
    return [item for row in rows for item in sorted(row, key=lambda it: it[0]["x"])]


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


@dataclass(frozen=True, slots=True)
class Match:
    """How well one element matches a label, and which part of its box to click."""

    element: TextElement
    score: float
    box: dict[str, int]

    @property
    def center(self) -> tuple[int, int]:
        return self.box["x"] + self.box["width"] // 2, self.box["y"] + self.box["height"] // 2

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.element.id, "text": self.element.text, "score": round(self.score, 3),
                "box": self.box, "confidence": self.element.confidence}


def match_score(label: str, text: str) -> tuple[float, tuple[int, int] | None]:
    """The score documented above and, for a match inside a longer text, the (start, length) of the
    matching slice in the normalised text (None when the whole text is the match)."""
    a, b = normalize(label), normalize(text)
    if not a or not b:
        return 0.0, None
    if a == b:
        return 1.0, None
    best = SequenceMatcher(None, a, b, autojunk=False).ratio()
    span = None
    if len(b) > len(a):
        contained = 0.0
        for length in {max(1, len(a) - 1), len(a), len(a) + 1}:
            for start in range(0, len(b) - length + 1):
                r = SequenceMatcher(None, a, b[start:start + length], autojunk=False).ratio()
                if r > contained:
                    contained, span = r, (start, length)
        if CONTAINED_WEIGHT * contained > best:
            return CONTAINED_WEIGHT * contained, span
    return best, None


def _sub_box(element: TextElement, span: tuple[int, int] | None) -> dict[str, int]:
    if span is None:
        return element.box
    n = max(1, len(normalize(element.text)))
    start, length = span
    box = element.box
    x = box["x"] + round(box["width"] * start / n)
    return {"x": x, "y": box["y"], "width": max(1, round(box["width"] * length / n)), "height": box["height"]}


def phrases(elements: list[TextElement], max_parts: int) -> list[TextElement]:
    """The elements plus runs of up to `max_parts` neighbours on one row, joined with spaces.

    OCR splits a line where the gap between words is wide ("Show" "Later"), so a multi-word label
    is also matched against such runs; a run's box is the union of its parts' boxes.
    """
    out = list(elements)
    for i in range(len(elements)):
        run = [elements[i]]
        for cur in elements[i + 1:i + max_parts]:
            prev = run[-1]
            p_mid, c_mid = prev.box["y"] + prev.box["height"] / 2, cur.box["y"] + cur.box["height"] / 2
            gap = cur.box["x"] - (prev.box["x"] + prev.box["width"])
            line = max(prev.box["height"], cur.box["height"])
            if abs(p_mid - c_mid) > prev.box["height"] / 2 or not -line <= gap <= 2 * line:
                break
            run.append(cur)
            x0, y0 = min(e.box["x"] for e in run), min(e.box["y"] for e in run)
            x1 = max(e.box["x"] + e.box["width"] for e in run)
            y1 = max(e.box["y"] + e.box["height"] for e in run)
            out.append(TextElement(id="+".join(e.id for e in run), text=" ".join(e.text for e in run),
                                   box={"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0},
                                   confidence=min(e.confidence for e in run)))
    return out


def rank(label: str, elements: list[TextElement]) -> list[Match]:
    """Every element (and run of neighbours, see `phrases`) scored against `label`, best first
    (ties: higher OCR confidence, then top-left)."""
    matches = []
    for element in phrases(elements, len(label.split())):
        score, span = match_score(label, element.text)
        matches.append(Match(element, score, _sub_box(element, span)))
    matches.sort(key=lambda m: (-m.score, -m.element.confidence, m.box["y"], m.box["x"]))
    return matches


def joined_text(elements: list[TextElement]) -> str:
    """All text on screen in reading order, one element per line (what textIncludes/textRegex search)."""
    return "\n".join(e.text for e in elements)
