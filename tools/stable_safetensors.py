"""safetensors bytes with a stable header, shared by the fixture generators in tools/.

The safetensors writer keeps ``__metadata__`` in a hash map, so its key order changes from run
to run; ``serialize`` rewrites the header with the metadata keys in a fixed order so that a
fixture file is byte-identical on every run.
"""

import json
import struct

from safetensors.torch import save


def serialize(tensors, metadata):
    """safetensors bytes with a stable header.

    The safetensors writer keeps ``__metadata__`` in a hash map, so its key
    order changes from run to run; rewrite the header with the metadata keys
    in a fixed order so that the file is byte-identical on every run.
    """
    data = save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = {k: metadata[k] for k in metadata}
    ordered = {"__metadata__": header.pop("__metadata__")}
    ordered.update(header)
    text = json.dumps(ordered, separators=(",", ":")).encode()
    assert len(text) <= n
    text += b" " * (n - len(text))
    return data[:8] + text + data[8 + n :]
