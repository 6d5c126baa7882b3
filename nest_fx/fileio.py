"""Reading user files with one clear error per failure (no traceback for user mistakes)."""
from __future__ import annotations

import json
from typing import Any, Type


def read_text(path: str, error: Type[Exception], what: str) -> str:
    """The file's text, or ``error`` naming the file and the OS reason."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise error(f"cannot read {what} file {path!r}: {exc.strerror}") from None


def read_json(path: str, error: Type[Exception], what: str) -> Any:
    """Parsed JSON, or ``error`` naming the file and the line of the syntax error."""
    text = read_text(path, error, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
