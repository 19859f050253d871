"""A small safetensors reader and writer that needs only NumPy.

File layout (https://github.com/huggingface/safetensors):

    8 bytes   N, the header length, unsigned little-endian
    N bytes   JSON header: {"name": {"dtype": "F32", "shape": [...],
                                     "data_offsets": [begin, end]}, ...,
                            "__metadata__": {"key": "value", ...}}   (optional)
    rest      the tensors' bytes, little-endian, row-major; offsets are relative
              to the start of this buffer

load() checks what the reference implementation checks (offsets in bounds, sizes
matching shapes, no gaps or overlaps), so a file it accepts loads anywhere.
"""

import json
import os
import struct
import tempfile

import numpy as np

# safetensors dtype name -> NumPy dtype (always little-endian on disk).
DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}

# The reference implementation refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000


class SafetensorsError(ValueError):
    """The file is not a valid safetensors file (or cannot be written as one)."""


def load(path):
    """Reads `path`; returns (tensors, metadata).

    tensors: dict name -> NumPy array (a writable copy, native byte order), ordered by
    data offset, i.e. in the order the tensors lie in the file. metadata: dict str ->
    str ({} when the file has none).
    """
    with open(path, "rb") as f:
        data = f.read()
    return loads(data, what=str(path))


def loads(data, what="safetensors data"):
    """Like load(), from the file's bytes."""
    if len(data) < 8:
        raise SafetensorsError(f"{what}: {len(data)} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise SafetensorsError(f"{what}: header length {n} does not fit the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{what}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{what}: header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError(f"{what}: __metadata__ must map strings to strings")

    buffer = memoryview(data)[8 + n :]
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{what}: tensor {name!r}: needs exactly dtype, shape, data_offsets")
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise SafetensorsError(f"{what}: tensor {name!r}: unsupported dtype {info['dtype']!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise SafetensorsError(f"{what}: tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise SafetensorsError(f"{what}: tensor {name!r}: bad data_offsets {offsets!r}")
        begin, end = offsets
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end < begin or end - begin != numel * dtype.itemsize:
            raise SafetensorsError(
                f"{what}: tensor {name!r}: data_offsets {offsets} do not hold shape {shape} of {info['dtype']}"
            )
        entries.append((begin, end, name, dtype, shape))

    # The tensors must tile the buffer exactly: no gaps, no overlaps, nothing left over.
    entries.sort(key=lambda e: (e[0], e[1]))
    position = 0
    for begin, end, name, _, _ in entries:
        if begin != position:
            raise SafetensorsError(f"{what}: tensor {name!r} starts at {begin}, expected {position}")
        position = end
    if position != len(buffer):
        raise SafetensorsError(f"{what}: tensors cover {position} bytes, the buffer has {len(buffer)}")

    tensors = {}
    for begin, end, name, dtype, shape in entries:
        array = np.frombuffer(buffer[begin:end], dtype=dtype).reshape(shape)
        tensors[name] = array.astype(dtype.newbyteorder("="), copy=True)
    return tensors, dict(metadata)


def dumps(tensors, metadata=None):
    """Encodes dict name -> array as safetensors bytes, tensors laid out in dict order."""
    header = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError("metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    chunks = []
    offset = 0
    for name, array in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise SafetensorsError(f"bad tensor name {name!r}")
        array = np.asarray(array)
        dtype = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
        kind = NAMES.get(dtype)
        if kind is None:
            raise SafetensorsError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
        raw = np.ascontiguousarray(array, dtype=dtype).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # pad so that the buffer starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def save(tensors, path, metadata=None):
    """Writes `tensors` to `path` atomically (see write_atomic)."""
    write_atomic(path, dumps(tensors, metadata))


def write_atomic(path, data):
    """Writes bytes to a temporary file next to `path`, then renames it over `path`, so
    that a reader never sees a half-written file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_count(value):
    # bool is a subclass of int in Python; JSON true/false are not sizes.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
