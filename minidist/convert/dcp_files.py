"""A torch.distributed.checkpoint (DCP) directory read as untrusted input.

DCP's `FileSystemReader.read_metadata` runs a plain `pickle.load` on the directory's `.metadata` file, and its
default load planner unpickles byte items with `torch.load(weights_only=False)`: a checkpoint from elsewhere could
run any code it likes the moment it is opened. Here `.metadata` goes through `MetadataUnpickler`, which admits only
the classes DCP writes there (its metadata records, `torch.Size`, dtypes, `pathlib` paths) and refuses anything else
in one line, before any of it is constructed; `SafeReader` is a `FileSystemReader` that reads the metadata that way
and refuses data files outside the directory. Only tensors are ever requested from it (tensor data is read with
`torch.load(weights_only=True)`), never byte items.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from minidist.convert.hf_model import ConvertError

METADATA = ".metadata"
MAX_METADATA_BYTES = 64 * 2**20
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name (torch.strided)
    "torch": {"Size"},  # and the dtypes, checked by value below
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global is refused (nothing built, nothing run)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise ConvertError(f"{METADATA} asks for {module}.{name}, which is not DCP metadata: refused (a checkpoint "
                           "must not run code when it is read)")

    def persistent_load(self, pid: Any) -> Any:
        raise ConvertError(f"{METADATA} holds a persistent reference, which DCP metadata never does: refused")


def read_metadata(dcp_dir: Path):
    """The `Metadata` of a DCP directory, read by `MetadataUnpickler` and checked (its data files are plain names
    inside the directory)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(dcp_dir) / METADATA
    if not Path(dcp_dir).is_dir() or not path.is_file():
        raise ConvertError(f"{dcp_dir} is not a DCP checkpoint directory (no {METADATA} file)")
    data = path.read_bytes()
    if len(data) > MAX_METADATA_BYTES:
        raise ConvertError(f"{path} is {len(data):,} bytes, more than any DCP metadata here ({MAX_METADATA_BYTES:,})")
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except ConvertError:
        raise
    except Exception as e:  # a truncated or malformed pickle of allowed classes
        raise ConvertError(f"{path} is not readable DCP metadata: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ConvertError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ConvertError(f"{path} points at data file {name!r}, which is not a file of {dcp_dir}: refused")
    return metadata


def safe_reader(dcp_dir: Path):
    """A `FileSystemReader` of `dcp_dir` whose metadata is read by `read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:
                raise ConvertError("per-rank DCP metadata files are not read here")
            metadata = read_metadata(Path(dcp_dir))
            if metadata.storage_meta is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(dcp_dir)


def tensor_shapes(metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of every tensor the checkpoint holds (byte items are left out: never read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: (tuple(v.size), v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}
