"""torch.distributed.checkpoint (DCP) over :class:`~.chunks.Chunked` tensors: planners that write each
rank's chunks under the full tensor's name and read the overlap of any saved chunks, and a reader whose
index is unpickled with DCP's own metadata classes only (DCP's ``pickle.load`` would run any code)."""

from __future__ import annotations

import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .chunks import Chunk, Chunked

INDEX = ".metadata"  # DCP's index file
_ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
    "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_index(path) -> md.Metadata:
    """The DCP index of checkpoint directory ``path``, read without running code from it."""
    file = Path(path) / INDEX
    try:
        with open(file, "rb") as f:
            index = _IndexUnpickler(f).load()
    except FileNotFoundError:
        raise ValueError(f"{path} is incomplete: it has no {INDEX} (a save that did not finish?).") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as e:
        raise ValueError(f"{file} is not a checkpoint index lightning_tp can read without running code from it "
                         f"({e}).") from None
    if not isinstance(index, md.Metadata):
        raise ValueError(f"{file} is not a checkpoint index (it holds a {type(index).__name__}).")
    return index


def check_complete(path, index: md.Metadata) -> None:
    """Every data file the index names is there and long enough: a truncated copy is refused whole."""
    need: dict = {}
    for info in (index.storage_data or {}).values():
        if isinstance(info, _StorageInfo):
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in need.items():
        file = Path(path) / name
        have = file.stat().st_size if file.is_file() else -1
        if have < size:
            raise ValueError(f"{path} is incomplete: {name} " + ("is missing" if have < 0 else
                             f"holds {have} bytes of the {size} its index names") + "; nothing was loaded.")


class _SafeReader(FileSystemReader):
    def __init__(self, path, index: md.Metadata):
        super().__init__(path)
        self._index = index

    def read_metadata(self, *args, **kwargs) -> md.Metadata:
        if self._index.storage_meta is None:
            self._index.storage_meta = md.StorageMeta()
        self._index.storage_meta.load_id = self.load_id
        return self._index


class _SavePlanner(DefaultSavePlanner):
    """Writes each Chunked's owned chunks; identical chunks on several ranks are written once (DCP's dedup)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, enable_plan_caching=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, t in self.state_dict.items():
            for c in t.chunks:
                if c.owner:
                    chunk = md.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.view.shape)
                    items.append(WriteItem(index=md.MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk=chunk, properties=md.TensorProperties
                                                                       .create_from_tensor(c.view),
                                                                       size=torch.Size(t.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index):
        view = self.state_dict[index.fqn].at(index.offset).detach()
        # a view of a larger tensor would be saved with its whole storage
        return view.clone() if view.untyped_storage().nbytes() != view.nbytes or not view.is_contiguous() else view


class _LoadPlanner(DefaultLoadPlanner):
    """Reads, for each local chunk, the overlap of every saved chunk of that name into its view."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, t in self.state_dict.items():
            local = [md.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.view.shape) for c in t.chunks]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], local)
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn].at(index.offset)

    def load_bytes(self, read_item, value):
        raise ValueError(f"{read_item.dest_index.fqn}: lightning_tp checkpoints hold tensors only")


@contextmanager
def _reported(what: str, path):
    """DCP's CheckpointException derives from BaseException (an ``except Exception`` misses it): turned
    into a RuntimeError naming the failing ranks and the first one's error."""
    try:
        yield
    except CheckpointException as e:
        rank, (error, _) = next(iter(sorted(e.failures.items())))
        raise RuntimeError(f"{what} {path} failed on rank(s) {sorted(e.failures)}; rank {rank}: "
                           f"{type(error).__name__}: {error}") from error


def save(tensors: dict, path, no_dist: bool = False, group=None) -> None:
    """Write ``{name: Chunked}`` (every rank its own) into directory ``path`` (collective over ``group``)."""
    with _reported("saving checkpoint", path):
        dcp.save(tensors, storage_writer=FileSystemWriter(str(path), single_file_per_rank=True),
                 planner=_SavePlanner(), no_dist=no_dist, process_group=group)


def staged(tensors: dict) -> dict:
    """``{name: Chunked}`` with each owned chunk copied to host memory (what an asynchronous write reads while
    training goes on), the copies complete."""
    out, ready = stage(tensors)
    ready()
    return out


def stage(tensors: dict) -> tuple:
    """:func:`staged` without waiting: (the copies, a function that waits until they are complete). A device's
    chunks go to pinned memory without blocking the host, one event after the last."""
    event = []

    def copy(view):
        view = view.detach()
        if view.device.type != "cuda":
            return view.to("cpu", copy=True)
        host = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
        event[:] = [view.device]
        return host.copy_(view, non_blocking=True)

    out = {n: Chunked(t.shape, [Chunk(c.offsets, copy(c.view), c.owner) for c in t.chunks if c.owner])
           for n, t in tensors.items()}
    if not event:
        return out, lambda: None
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(event[0]))
    return out, done.synchronize


def load(tensors: dict, path, index: md.Metadata, no_dist: bool = False) -> None:
    """Fill the views of ``{name: Chunked}`` from directory ``path`` (names checked by the caller)."""
    with _reported("loading checkpoint", path):
        dcp.load(tensors, storage_reader=_SafeReader(str(path), index), planner=_LoadPlanner(), no_dist=no_dist)


def read_whole(path, index: md.Metadata, names) -> dict:
    """Whole tensors by name, in this process alone (consolidating, exporting)."""
    out = {}
    for name in names:
        meta = index.state_dict_metadata[name]
        out[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that one process loads alone: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load({n: Chunked(tuple(t.shape), [Chunk((0,) * t.dim(), t)]) for n, t in out.items()}, path, index,
             no_dist=True)
    return out


def lightning_model_names(index: md.Metadata) -> dict:
    """{saved name: state-dict key} of the model's tensors in a Lightning FSDP / ModelParallelStrategy
    checkpoint (saved under ``state_dict`` or ``model``)."""
    paths = index.planner_data or {}
    out = {}
    for name, meta in index.state_dict_metadata.items():
        path = paths.get(name) or tuple(name.split(".", 1))
        if isinstance(meta, md.TensorStorageMetadata) and len(path) == 2 and path[0] in ("state_dict", "model"):
            out[name] = path[1]
    return out
