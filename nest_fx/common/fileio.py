"""Reading (and writing) user files with one clear error per failure (no traceback for user mistakes).

Every reader of user data (cluster, topology, plan, workload and profile files) goes through
:func:`read_text`, :func:`read_json` or :func:`read_document`, so each failure becomes one line
of the reader's own error type: a missing or unreadable file, something that is not a regular
file (a FIFO, a device such as ``/dev/zero``, a directory), a file larger than
:data:`MAX_FILE_BYTES`, bytes that are not UTF-8, a syntax error (with its line and column),
nesting deeper than :data:`MAX_DEPTH`, an integer literal too long to convert, or a key given twice
in one mapping (JSON object or YAML mapping: the parsers would silently keep the last value; YAML
merge keys ``<<`` still override as YAML defines). A file is read once, with a bounded read, and
never waited on. :func:`brief` quotes a user value in a message
without printing (or walking) all of it.
"""

from __future__ import annotations

import json
import os
import reprlib
import stat
from typing import Any, Callable, Type
import yaml

MAX_DEPTH = 200  # nesting of lists/mappings a document may have (ours need fewer than 10)

MAX_FILE_BYTES = 64 * 2**20
"""Largest user file read (64 MiB): the largest graph topology the generators make (65,536
devices) is 14 MiB of JSON, and YAML parsing needs about 17 bytes of memory per byte of text."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)

BRIEF_CHARS = 120  # longest quote of a user value in an error message
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def brief(value: Any) -> str:
    """A short one-line ``repr`` of a user value for an error message (at most
    :data:`BRIEF_CHARS` characters): long strings, big numbers and deep or large containers are
    cut with ``...``; self-referencing YAML anchors and alias bombs are never expanded."""
    try:
        text = one_line(_REPR.repr(value))
    except (ValueError, RecursionError):  # an int with more digits than Python will print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= BRIEF_CHARS else text[: BRIEF_CHARS - 3] + "..."


def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of blanks collapsed to single spaces."""
    return " ".join(str(text).split())


def _size(n: float) -> str:
    return f"{n / 2**20:.4g} MiB" if n >= 2**20 else f"{n:.0f} bytes"


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: str, error: Type[Exception], what: str, max_bytes: int) -> int:
    """A descriptor of the regular file at ``path`` (opened without blocking, so a FIFO never
    waits for a writer), or ``error`` naming the file for an OS failure, for anything that is not
    a regular file (checked on the opened file) and for a size over ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"cannot read {what} file {path!r}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: is {_kind(info.st_mode)}, not a regular file; pass the path of a {what} file")
        if info.st_size > max_bytes:
            raise error(
                f"{path}: {_size(info.st_size)}; {what} files larger than {_size(max_bytes)} are refused (is "
                "this the right file?)"
            )
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise error(f"cannot read {what} file {path!r}: {exc.strerror or exc}") from None
        raise
    return fd


def check_readable(path: str, error: Type[Exception], what: str, max_bytes: int = MAX_FILE_BYTES) -> None:
    """``error`` for every failure :func:`read_bytes` names before reading (missing, unreadable,
    not a regular file, too large), with the same message; nothing is read. The command line
    checks its input files with it before it imports torch."""
    os.close(_open_regular(path, error, what, max_bytes))


def read_bytes(path: str, error: Type[Exception], what: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file at ``path``, read once; ``error`` naming the file for an OS
    failure, for anything that is not a regular file (checked on the opened file, which is
    opened without blocking, so a FIFO never waits for a writer) and for more than
    ``max_bytes`` bytes (checked on the size and on the bytes actually read)."""
    fd = _open_regular(path, error, what, max_bytes)
    try:
        chunks, total = [], 0
        while total <= max_bytes:  # bounded: a file that grows while read, or reports size 0 (/proc)
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise error(f"cannot read {what} file {path!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if total > max_bytes:
        raise error(f"{path}: more than {_size(max_bytes)}; {what} files larger than that are refused")
    return b"".join(chunks)


def read_text(path: str, error: Type[Exception], what: str) -> str:
    """The file's text (:func:`read_bytes`, decoded), or ``error`` naming the file and the
    reason (or the first byte that is not UTF-8)."""
    data = read_bytes(path, error, what)
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is dropped
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not a UTF-8 text file (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            f"save the {what} file as UTF-8"
        ) from None


def _depth(data: Any) -> int:
    """Nesting depth of lists/mappings, iteratively (no recursion limit), stopping past MAX_DEPTH;
    a container met twice (YAML anchors) is walked once."""
    deepest, seen, todo = 0, set(), [(data, 1)]
    while todo:
        node, depth = todo.pop()
        if not isinstance(node, (list, dict)) or id(node) in seen:
            continue
        seen.add(id(node))
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _shallow(data: Any, path: str, error: Type[Exception]) -> Any:
    if _depth(data) > MAX_DEPTH:
        raise error(f"{path}: nested more than {MAX_DEPTH} levels deep; this is not a nest-fx document")
    return data


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object."""


def _unique_pairs(pairs: list) -> dict:
    """``object_pairs_hook``: the object, or :class:`_DuplicateKey` naming a key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _DuplicateKey(key)
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (merge keys ``<<`` aside)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"key {brief(key)} appears twice (the last value would silently win; remove one)",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


def parse_json(text: str, path: str, error: Type[Exception]) -> Any:
    """Parsed JSON text, or ``error`` naming ``path`` and the line/column of the problem (or the
    key given twice in one object)."""
    try:
        return _shallow(json.loads(text, object_pairs_hook=_unique_pairs), path, error)
    except _DuplicateKey as exc:
        raise error(
            f"{path}: not valid here: key {brief(exc.args[0])} appears twice in one JSON object (the last value "
            "would silently win); remove one of them"
        ) from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON here: nested too deeply (more than {MAX_DEPTH} levels)") from None
    except ValueError as exc:  # an integer literal past Python's digit limit
        raise error(f"{path}: not valid JSON here: {one_line(str(exc)).split(';')[0]}") from None


def parse_yaml(text: str, path: str, error: Type[Exception]) -> Any:
    """Parsed YAML text (safe loader), or ``error`` naming ``path``, the problem and its line/column
    (for a key given twice: the key and where it appears the second time)."""
    try:
        return _shallow(yaml.load(text, Loader=_UniqueKeyLoader), path, error)  # noqa: S506 - a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = one_line(exc.problem or exc.context or "syntax error")
        raise error(f"{path}: not valid YAML ({problem}{where})") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML ({one_line(str(exc))})") from None
    except RecursionError:
        raise error(f"{path}: not valid YAML here: nested too deeply (more than {MAX_DEPTH} levels)") from None
    except (ValueError, OverflowError) as exc:  # a scalar the constructor cannot build (e.g. a 5,000-digit int)
        raise error(f"{path}: not valid YAML here: {one_line(str(exc)).split(';')[0]}") from None


def read_json(path: str, error: Type[Exception], what: str) -> Any:
    """Parsed JSON, or ``error`` naming the file and the line of the syntax error."""
    return parse_json(read_text(path, error, what), path, error)


def read_document(path: str, error: Type[Exception], what: str) -> Any:
    """A YAML (``.yaml``/``.yml``) or JSON (``.json``) file, parsed; ``error`` for any other
    extension and for every failure :func:`read_text`, :func:`parse_yaml` and
    :func:`parse_json` name."""
    if not path.endswith((".yaml", ".yml", ".json")):
        raise error(f"{path}: {what} files must end in .yaml, .yml or .json")
    text = read_text(path, error, what)
    if path.endswith(".json"):
        return parse_json(text, path, error)
    return parse_yaml(text, path, error)


def write_with(path: str, save: Callable[[str], None], error: Type[Exception]) -> None:
    """``save(path)``, with an unwritable path (no such directory, a directory, no permission) as
    ``error`` naming it."""
    try:
        save(path)
    except OSError as exc:
        raise error(f"cannot write {path!r}: {exc.strerror or exc}") from exc
