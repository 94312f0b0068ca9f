"""What a loader's node hands ComfyUI as the fingerprint of its file (V3 `fingerprint_inputs`, V1's IS_CHANGED):
the file's size, modification time (ns) and a digest of its first and last bytes, so a file replaced on disk under
the same name (another download, a retrained LoRA) makes ComfyUI run the loader again instead of serving the model
it cached from the old file. The digest catches a replacement that kept the size and the time (`cp -p`, an archive
restored): a safetensors file's header (tensor names, shapes and offsets) is at its start, and the last bytes are
the last tensor's values. Reading 2 x 64 KiB costs microseconds, even for a 16 GB file.

A folder (a diffusers repository) is fingerprinted file by file (its relative names with each one's fingerprint).
"""

import hashlib
import os
from pathlib import Path

DIGEST_BYTES = 64 * 1024  # read from each end of a file
MAX_FOLDER_FILES = 4096  # a diffusers repository has a few dozen; a folder of more is fingerprinted by its first ones


def _file_print(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        digest.update(handle.read(DIGEST_BYTES))
        if stat.st_size > DIGEST_BYTES:
            handle.seek(max(DIGEST_BYTES, stat.st_size - DIGEST_BYTES))
            digest.update(handle.read(DIGEST_BYTES))
    return f"{stat.st_size}:{stat.st_mtime_ns}:{digest.hexdigest()[:32]}"


def file_fingerprint(path: str | os.PathLike) -> str:
    """`size:mtime_ns:digest` of a file, or of every file under a folder (sorted by relative name). An OSError
    (the file removed, unreadable) propagates: the caller says what it means for the node."""
    path = Path(path)
    if not path.is_dir():
        return _file_print(path)
    files = sorted(p for p in path.rglob("*") if p.is_file())[:MAX_FOLDER_FILES]
    return "|".join(f"{p.relative_to(path)}={_file_print(p)}" for p in files)
