"""ONNX files on disk: a graph file and, for large models, one external-data file beside it.

Protobuf caps one message at 2 GB, and holding every weight inside a ``ModelProto`` costs a
copy of the model per copy of the proto. So every ONNX file the factory writes is either

* one self-contained file, when its tensors hold less than :data:`EXTERNAL_DATA_MIN_BYTES`; or
* ``model.<p>.onnx`` (the graph, a few hundred kB) plus ``model.<p>.onnx.data`` (every tensor's
  bytes, 64-byte aligned), named by :func:`data_file`. TensorRT parses it through the path,
  ONNX Runtime reads it from a path or, in the backend, from verified bytes in memory.

The stages work on *graph-only* protos (:func:`load_graph`): tensors still point at the data file
they came from, so copying or rewriting a graph never copies the weights. :func:`save` streams
each tensor into the new data file one at a time, from memory or from the file it points at,
so writing a model costs the largest tensor, not the model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from model_factory.backend.contract import Files
from model_factory.errors import FactoryError, require

# Below this many bytes of tensors a model stays one file (tiny test models, small CNNs).
EXTERNAL_DATA_MIN_BYTES = 16 << 20
DATA_SUFFIX = Files.DATA_SUFFIX
_ALIGN = 64
_CHUNK = 64 << 20
_HOLE_BLOCK = 1 << 20  # all-zero blocks of this size are left as holes in written data files
_EXTERNAL = 1  # TensorProto.EXTERNAL


def data_file(onnx_path: Path) -> Path:
    """The external-data file that belongs to ``onnx_path`` (it may not exist)."""
    onnx_path = Path(onnx_path)
    return onnx_path.with_name(onnx_path.name + DATA_SUFFIX)


def files_of(onnx_path: Path) -> list[Path]:
    """The files one ONNX model consists of: the graph, then its data file when it has one."""
    onnx_path = Path(onnx_path)
    data = data_file(onnx_path)
    return [onnx_path, data] if data.is_file() else [onnx_path]


def _tensors(model: Any) -> Iterator[Any]:
    """The initializers (subgraphs' too); attribute tensors (Constant, ConstantOfShape) stay in the graph."""
    from onnx.external_data_helper import _get_initializer_tensors

    return _get_initializer_tensors(model)


def _external_info(tensor: Any) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def load_graph(path: Path) -> Any:
    """The model at ``path`` without loading external data: tensors in a data file stay references.

    Use :func:`tensor_array` to read one weight, :func:`save` to write the model (with the weights).
    """
    onnx = require("onnx", "onnx")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # DecodeError and friends: all mean "not an ONNX file"
        raise FactoryError(f"{path} is not a valid ONNX model ({type(exc).__name__}: {str(exc)[:300]}). "
                           "Fix: re-export it, or point the recipe at the right file") from exc


def _external_bytes(tensor: Any, base_dir: Path) -> bytes:
    # Read here rather than through onnx's helpers: onnx refuses a data file with more than one hard
    # link ("hardlink attack"), and packaging hard-links the data files into the repository.
    info = _external_info(tensor)
    src = Path(base_dir) / info["location"]
    offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
    with src.open("rb") as f:
        f.seek(offset)
        data = f.read() if length < 0 else f.read(length)
    if length >= 0 and len(data) != length:
        raise FactoryError(f"{src} ends before tensor {tensor.name!r} does. Fix: re-export the model (its data file "
                           "is truncated)")
    return data


def tensor_array(tensor: Any, base_dir: Path) -> Any:
    """One tensor as a numpy array, read from its data file when it lives in one."""
    onnx = require("onnx", "onnx")
    if tensor.data_location != _EXTERNAL:
        return onnx.numpy_helper.to_array(tensor)
    import numpy as np

    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.frombuffer(_external_bytes(tensor, base_dir), dtype=dtype).reshape(tuple(tensor.dims)).copy()


def with_outputs(model: Any, names: Iterable[str], float32: bool = False) -> Any:
    """A copy of ``model`` that also returns the tensors ``names`` as graph outputs.

    The added outputs are declared FP32 when ``float32``, else left untyped (ONNX Runtime infers them).
    """
    onnx = require("onnx", "onnx")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    for name in names:
        if name not in existing:
            m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) if float32
                                  else onnx.ValueInfoProto(name=name))
    return m


def load_weights(model: Any, base_dir: Path, convert: Mapping[str, Callable[[bytes], bytes]] | None = None) -> Any:
    """Read every external tensor of ``model`` into the proto (in place); returns ``model``.

    ``convert`` as in :func:`save`.
    """
    convert = convert or {}
    for tensor in _tensors(model):
        if tensor.data_location == _EXTERNAL:
            raw = _external_bytes(tensor, base_dir)
            tensor.raw_data = convert[tensor.name](raw) if tensor.name in convert else raw
            del tensor.external_data[:]
            tensor.data_location = 0  # DEFAULT
    return model


def tensor_bytes(model: Any) -> int:
    """Bytes of all tensors of ``model``, whether in memory or in a data file."""
    total = 0
    for t in _tensors(model):
        if t.data_location == _EXTERNAL:
            total += int(_external_info(t).get("length", 0))
        else:
            total += t.ByteSize()
    return total


def save(model: Any, path: Path, base_dir: Path | None = None, external: bool | None = None,
         consume: bool = False, convert: Mapping[str, Callable[[bytes], bytes]] | None = None) -> Path:
    """Write ``model`` to ``path`` (plus :func:`data_file` for large models); returns ``path``.

    Tensors in memory and tensors that point at a data file (relative to ``base_dir``, the folder
    of the file ``model`` was loaded from) are streamed one at a time into the new data file.
    ``model`` itself is left as it was, unless ``consume`` (then its tensors are moved out as they are
    written: no second copy of the weights). ``external`` forces one layout; by default the size decides.
    ``convert`` maps names of tensors in a data file to a function applied to their bytes on the way
    (in chunks of whole elements), e.g. FP32 -> FP16 for a tensor whose type the graph already changed.
    """
    convert = dict(convert or {})
    onnx = require("onnx", "onnx")
    path = Path(path)
    if external is None:
        external = tensor_bytes(model) >= EXTERNAL_DATA_MIN_BYTES
    data_path = data_file(path)
    # Written beside under another name, then renamed: the model may read its weights from the file it replaces.
    writing = data_path.with_name(f".{data_path.name}.writing")
    if consume:
        out = model
    else:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    if not external:
        if any(t.data_location == _EXTERNAL for t in _tensors(out)):
            load_weights(out, Path(base_dir or path.parent), convert)
        try:
            onnx.save_model(out, str(path))
            data_path.unlink(missing_ok=True)  # a one-file model has no data file: a stale one would mislead
        except ValueError as exc:  # over protobuf's 2 GB limit
            raise FactoryError(f"cannot write {path} as one file ({exc}). Fix: this is a bug; large models are "
                               "written with external data") from exc
        return path
    sources: dict[str, Any] = {}
    try:
        with writing.open("wb") as sink:
            for tensor in _tensors(out):
                if tensor.data_location == _EXTERNAL:
                    info = _external_info(tensor)
                    src = Path(base_dir or path.parent) / info["location"]
                    handle = sources.get(str(src))
                    if handle is None:
                        if not src.is_file():
                            raise FactoryError(f"{src}, the external data of a tensor of the model, is missing. "
                                               "Fix: keep the .onnx file and its .data file together")
                        handle = sources[str(src)] = src.open("rb")
                    offset, left = int(info.get("offset", 0)), int(info.get("length", 0))
                    start = _pad(sink)
                    handle.seek(offset)
                    change = convert.get(tensor.name)
                    while left:
                        chunk = handle.read(min(left, _CHUNK))
                        if not chunk:
                            raise FactoryError(f"{src} ends before tensor {tensor.name!r} does. Fix: re-export "
                                               "the model (its data file is truncated)")
                        left -= len(chunk)
                        _write_sparse(sink, change(chunk) if change else chunk)
                    length = sink.tell() - start
                elif tensor.ByteSize() >= 1024:  # small ones stay in the graph, as onnx.save_model does
                    if not tensor.HasField("raw_data"):  # typed fields (float_data, ...) -> raw bytes
                        array = onnx.numpy_helper.to_array(tensor)
                        tensor.CopyFrom(onnx.numpy_helper.from_array(array, tensor.name))
                    raw = tensor.raw_data
                    length = len(raw)
                    start = _pad(sink)
                    _write_sparse(sink, raw)
                    del raw
                    tensor.ClearField("raw_data")
                else:
                    continue
                del tensor.external_data[:]
                tensor.data_location = _EXTERNAL
                for key, value in (("location", data_path.name), ("offset", str(start)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
            sink.truncate()  # the file ends where the last tensor does, also when that tensor ended in a hole
    except BaseException:
        writing.unlink(missing_ok=True)
        raise
    finally:
        for handle in sources.values():
            handle.close()
    os.replace(writing, data_path)
    path.write_bytes(out.SerializeToString())
    return path


def normalize(path: Path) -> Path:
    """Rewrite the ONNX file at ``path`` (as an exporter left it) into this module's layout, in place.

    Exporters write a large model's tensors as one file per tensor; afterwards ``path`` is one file or
    ``path`` + :func:`data_file`, and the exporter's other data files are gone.
    """
    path = Path(path)
    model = load_graph(path)
    old = {_external_info(t)["location"] for t in _tensors(model) if t.data_location == _EXTERNAL}
    staging = path.parent / f".normalize-{path.stem}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        save(model, staging / path.name, base_dir=path.parent, consume=True)
        del model
        for location in old:
            (path.parent / location).unlink(missing_ok=True)
        for f in staging.iterdir():
            os.replace(f, path.parent / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _write_sparse(sink: Any, data: bytes) -> None:
    """Write ``data`` at the sink's position, leaving each all-zero block of it a hole (a seek past it).

    A weight file's zero runs (pruned rows, unused embedding rows, padding) then take no disk in the files
    this module writes (the FP16, INT8 and 7-bit copies of a large model too); readers see the same bytes.
    """
    import numpy as np

    view = memoryview(data)
    flat = np.frombuffer(data, np.uint8)
    for begin in range(0, len(view), _HOLE_BLOCK):
        end = min(begin + _HOLE_BLOCK, len(view))
        if end - begin == _HOLE_BLOCK and not flat[begin:end].any():
            sink.seek(end - begin, os.SEEK_CUR)
        else:
            sink.write(view[begin:end])


def _pad(sink: Any) -> int:
    pos = sink.tell()
    gap = (-pos) % _ALIGN
    if gap:
        sink.write(b"\0" * gap)
    return pos + gap


def check(path: Path) -> Any:
    """``onnx.checker`` on the file and its external data, without reading the weights; return its graph.

    The checker runs on a copy of the graph beside sparse stand-ins of its data files (the same names
    and sizes): onnx's checker refuses a data file with several hard links, which every packaged data
    file has. That the real data files exist and hold every tensor's bytes is checked here.
    """
    import tempfile

    onnx = require("onnx", "onnx")
    path = Path(path)
    model = load_graph(path)
    sizes: dict[str, int] = {}
    for t in _tensors(model):
        if t.data_location != _EXTERNAL:
            continue
        info = _external_info(t)
        location = info.get("location", "")
        real = path.parent / location
        if not location or Path(location).is_absolute() or ".." in Path(location).parts or not real.is_file():
            raise FactoryError(f"{path}: the data of tensor {t.name!r} should be in {location!r} beside it, which is "
                               "missing or outside its folder. Fix: keep the .onnx file and its .data file together")
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        size = sizes.setdefault(location, real.stat().st_size)
        if end > size:
            raise FactoryError(f"{real} holds {size} bytes but tensor {t.name!r} ends at byte {end}. Fix: re-export "
                               "the model (its data file is truncated)")
    with tempfile.TemporaryDirectory(prefix=".onnx-check-") as tmp:
        stand_in = Path(tmp) / path.name
        stand_in.write_bytes(path.read_bytes())
        for location, size in sizes.items():
            with (Path(tmp) / location).open("wb") as f:
                f.truncate(size)  # sparse: no bytes written
        try:
            onnx.checker.check_model(str(stand_in))
        except Exception as exc:  # onnx raises DecodeError, ValidationError, ...: all mean "broken file"
            raise FactoryError(f"{path} is not a valid ONNX model ({type(exc).__name__}: {str(exc)[:300]}). "
                               "Fix: re-export it, or point the recipe at the right file") from exc
    return model


def link_into(onnx_path: Path, dest_dir: Path) -> Path:
    """Hard-link (copy across filesystems) an ONNX file and its data file into ``dest_dir``, same names."""
    onnx_path = Path(onnx_path)
    target = Path(dest_dir) / onnx_path.name
    hardlink_or_copy(onnx_path, target)
    data = data_file(onnx_path)
    if data.is_file():
        hardlink_or_copy(data, Path(dest_dir) / data.name)
    return target


def hardlink_or_copy(src: Path | str, dst: Path | str) -> None:
    """Hard-link ``src`` to ``dst``; copy (with its times and mode) when a link cannot be made (another filesystem)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
