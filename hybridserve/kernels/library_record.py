"""The record kept beside each cached kernel library: its size and sha256, written when it is built.

``ctypes`` maps a shared library into the process; a truncated file there kills the process with SIGBUS
at load, and a file with other bytes (another library copied over it) loads and fails later. So a cached
library is loaded only after its bytes match the record written by the build that produced it
(:func:`verify`); a library without a record, or not matching it, is rebuilt (``kernels/build.py``).
The record is ``<library>.sha256``, a small JSON object ``{"size": bytes, "sha256": hex}``, installed
with an atomic rename after the library itself, so a reader sees either no record or a complete one.
After loading, :func:`missing_symbols` checks that the library exports what its source declares.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

#: what every kernel library exports (``csrc/isa_level.h``), and a library with a registry too (``registry.h``)
BASE_SYMBOLS = ("hs_built_isa_level",)
REGISTRY_SYMBOLS = ("hs_registry_size", "hs_registry_entry")


class UnverifiedLibrary(RuntimeError):
    """A cached library whose bytes do not match its build record (or that has none)."""


def record_path(library: Path) -> Path:
    """Where the record of ``library`` is kept."""
    return library.with_name(library.name + ".sha256")


def _digest(library: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    with open(library, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def write_record(library: Path) -> None:
    """Record the size and sha256 of the freshly built ``library`` (atomically: a temp file renamed)."""
    size, sha = _digest(library)
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=library.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"size": size, "sha256": sha}, f)
        os.chmod(tmp, 0o644)  # readable wherever the library is (mkstemp makes it private)
        os.replace(tmp, record_path(library))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def discard_record(library: Path) -> None:
    """Remove the record of ``library`` (so the next start rebuilds it); nothing when there is none."""
    try:
        os.remove(record_path(library))
    except FileNotFoundError:
        pass


def verify(library: Path) -> None:
    """Raise :class:`UnverifiedLibrary`, naming the file and why, unless ``library``'s size and sha256 are
    the ones its record holds."""
    record = record_path(library)
    try:
        with open(record) as f:
            expected = json.load(f)
        want_size, want_sha = int(expected["size"]), str(expected["sha256"])
    except FileNotFoundError:
        raise UnverifiedLibrary(f"{library} has no build record ({record.name})") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UnverifiedLibrary(f"{library}: its build record {record.name} is unreadable ({exc})") from None
    size = library.stat().st_size
    if size != want_size:
        raise UnverifiedLibrary(f"{library} is {size} bytes, its build record says {want_size} (truncated or replaced)")
    _, sha = _digest(library)
    if sha != want_sha:
        raise UnverifiedLibrary(f"{library} has sha256 {sha[:16]}..., its build record says {want_sha[:16]}... "
                                f"(its bytes were changed after the build)")


def declared_symbols(source: Path) -> list[str]:
    """The C symbols a library built from ``source`` exports: the ISA level, and, when the source defines a
    registry (``HS_REGISTRY(HS_KERNEL(name) ...)``), the registry functions and every kernel it lists."""
    text = source.read_text()
    symbols = list(BASE_SYMBOLS)
    start = re.search(r"^HS_REGISTRY\(", text, re.MULTILINE)
    if start is not None:
        depth, end = 1, start.end()
        while depth and end < len(text):  # to the parenthesis closing HS_REGISTRY(
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        symbols += [*REGISTRY_SYMBOLS, *re.findall(r"HS_KERNEL\((\w+)\)", text[start.end():end])]
    return symbols


def missing_symbols(lib: ctypes.CDLL, symbols: list[str]) -> list[str]:
    """Those of ``symbols`` the loaded ``lib`` does not export."""
    return [s for s in symbols if not hasattr(lib, s)]
