"""Make build outputs depend only on their inputs: the same recipe and inputs give the same bytes.

``torch.jit.save`` writes, besides the model, two things that change from one build to the next:

* ``.data/serialization_id``: a random number, new at every save;
* ``code/**.py.debug_pkl``: the source ranges of the traced code, with the absolute paths of the
  model's module and of this machine's site-packages (another folder or venv, other bytes).

:func:`normalize_torchscript` rewrites the archive without the debug records (optional: TorchScript
loads and runs without them; only error messages lose their Python line numbers) and with a
serialization id derived from the content, keeping PyTorch's 64-byte record alignment.

One source of difference it cannot remove: in one Python process, tracing the same class a second
time names it ``___torch_mangle_N`` in the archive. ``model-factory build`` exports in a child
process (``isolate``), so each build starts fresh.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zipfile
from pathlib import Path

_ALIGN = 64  # PyTorch aligns every record's data to 64 bytes (caffe2/serialize/inline_container.cc)
_SERIALIZATION_ID = ".data/serialization_id"
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def normalize_torchscript(path: Path) -> None:
    """Rewrite a TorchScript archive in place so that its bytes depend only on the model."""
    path = Path(path)
    with zipfile.ZipFile(path) as src:
        records = [(info.filename, src.read(info)) for info in src.infolist()
                   if not info.filename.endswith(".debug_pkl")]
    content = hashlib.sha256()
    for name, data in records:
        if not name.endswith(_SERIALIZATION_ID):
            content.update(name.encode() + b"\0" + data)
    # PyTorch's id is a decimal string of about 40 digits: keep that shape, derived from the content.
    new_id = str(int(content.hexdigest(), 16))[:40].encode()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as out:
            for name, data in records:
                if name.endswith(_SERIALIZATION_ID):
                    data = new_id
                info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
                info.compress_type = zipfile.ZIP_STORED
                # The local header is 30 bytes + name + extra; pad the extra field ("FB" + length, as
                # PyTorch writes it) so that the data starts on a 64-byte boundary.
                start = f.tell() + 30 + len(name.encode()) + 4
                pad = (-start) % _ALIGN
                info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
                out.writestr(info, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
