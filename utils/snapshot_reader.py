"""How the steps read a sharded snapshot (a torch.distributed.checkpoint folder): once, as data only.

torch's own reader (DCP's FileSystemReader) unpickles a folder's `.metadata` with `pickle.load`, which calls whatever
functions its bytes name, and each value that is no tensor (the step, the epochs, the schedule's state) with
`torch.load(weights_only=False)`, which does the same; where `.metadata` fails to read or reads as something empty,
DCP (2.14.1; 2.6 does not) reads a `__<rank>.metadata` beside it instead, with `pickle.load` again. SnapshotReader
is the reader DCP loads through instead (`dcp.load(state, storage_reader=reader)`): it reads `.metadata` once, when it
is made, through an unpickler that builds DCP's records and nothing else, checks that what it built is DCP's Metadata
record of the types DCP writes, and gives DCP that record and no other (it never reads a `__<rank>.metadata`); it
reads every tensor and value with `torch.load(weights_only=True)`. Before anything is unpickled, its opcodes are read
without running any (pickletools) to bound how deeply the objects it builds nest: a tuple nested two million deep used
as a dictionary's key crashes the process (SIGSEGV) while the key is hashed, in any unpickler.

    reader = SnapshotReader(path)          # UnusableSnapshot, in words, for a folder that is not data alone
    dcp.load(snapshot, storage_reader=reader)

Only the steps that save sharded snapshots import it (torch.distributed.checkpoint takes a while to import).
"""
import collections
import contextlib
import io
import os
import pathlib
import pickle
import pickletools
import re
import warnings
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from utils.errors import UnusableSnapshot, reason
from utils.snapshots import latest_snapshot, step_snapshot, stop_if_unloadable, whole_snapshots

# How deeply the objects of a snapshot's pickle may nest, as require_shallow counts (a call's result one deeper than
# its arguments): DCP's records, 11 levels; a tensor or value the steps save, 4. Hashing a key nested some 100,000 deep
# (a dict's key is hashed as it is unpickled) overflows the C stack: the process dies of SIGSEGV, with no line.
MOST_NESTED = 64


class SnapshotReader(FileSystemReader):
    """DCP's reader of a folder, reading it as data only: its `.metadata` once (here, as it is made) and no other file
    of metadata, each value with `weights_only=True`, every pickle's nesting bounded before it is unpickled. Made on a
    folder that is not a whole snapshot holding data alone, it raises UnusableSnapshot, which says what is wrong."""

    def __init__(self, path):
        path = str(path)
        if not os.path.isdir(path):
            raise UnusableSnapshot(f"it is a file, not the folder of a sharded snapshot{_single_file_step(path)}")
        super().__init__(path)
        self.folder = path
        self.metadata = read_metadata_once(path)

    def reset(self, checkpoint_id=None):
        # dcp.load(..., checkpoint_id=ANOTHER, storage_reader=reader) would point this reader at another folder than
        # the one whose metadata it checked.
        if checkpoint_id is not None and os.path.abspath(checkpoint_id) != os.path.abspath(self.folder):
            raise ValueError(f"this reader reads {self.folder}, not {checkpoint_id}")
        super().reset()

    def read_metadata(self):
        # No **kwargs, on purpose: DCP asks a reader whose read_metadata takes them for a rank's own metadata
        # (`__<rank>.metadata`: torch 2.14.1, not 2.6) when the first answer is empty. This one has one answer.
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan, planner):
        """Each item of `plan` read from its file once, its pickle's nesting bounded, then loaded with
        weights_only=True: a tensor copied into the one the planner resolves it to, a value handed to the planner as
        a pickle of its own making (the planner unpickles with weights_only=False what it is given)."""
        per_file = collections.defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        for relative_path, items in per_file.items():
            with open(os.path.join(self.folder, relative_path), "rb") as file:
                size = os.fstat(file.fileno()).st_size
                for item in items:
                    stored = self.storage_data[item.storage_index]
                    if stored.offset + stored.length > size:
                        raise UnusableSnapshot(f"its {item.dest_index.fqn} lies past the end of {relative_path}: the "
                                               "file was cut short, or is another's")
                    file.seek(stored.offset)
                    value = load_data_only(file.read(stored.length), item.dest_index.fqn)
                    if item.type == LoadItemType.BYTE_IO:
                        plain = io.BytesIO()
                        torch.save(value, plain)  # tensors, numbers, text and containers: what weights_only loads
                        plain.seek(0)
                        planner.load_bytes(item, plain)
                        continue
                    if not isinstance(value, torch.Tensor):
                        raise UnusableSnapshot(f"its {item.dest_index.fqn} is a {type(value).__name__} where a tensor "
                                               "is stored")
                    part = value[tuple(slice(start, start + length)
                                       for start, length in zip(item.storage_offsets, item.lengths))]
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != part.size():
                        raise UnusableSnapshot(f"its {item.dest_index.fqn} has another shape ({tuple(part.size())}, "
                                               f"not {tuple(target.size())})")
                    target.copy_(part)
                    planner.commit_tensor(item, target)
        done = Future()
        done.set_result(None)
        return done


def _single_file_step(path):
    """` (STEP's snapshot)` for a single-file snapshot that names its step, else ""."""
    with contextlib.suppress(Exception):
        return f" ({torch.load(path, map_location='cpu', weights_only=True)['STEP']}'s snapshot)"
    return ""


def read_metadata_once(folder):
    """The Metadata record of the snapshot in `folder`, read from its `.metadata` as data only and checked to be DCP's
    record of the types DCP writes; UnusableSnapshot, in words, for anything else."""
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise UnusableSnapshot("the folder holds no .metadata, the file a sharded save writes last: it is not a "
                               "snapshot, or its save was cut short")
    with open(os.path.join(folder, ".metadata"), "rb") as file:
        pickled = file.read()
    require_shallow(pickled, ".metadata")
    try:
        metadata = _RecordsOnly(io.BytesIO(pickled)).load()
    except CodeInSnapshot as code:
        raise UnusableSnapshot(f"its .metadata would call {code} as it is read: a snapshot holds tensors, numbers "
                               "and text, and this one holds code") from None
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UnusableSnapshot(f"its .metadata is not a sharded snapshot's ({type(error).__name__}"
                               f"{': ' + message if message else ''})") from None
    require_dcp_records(metadata)
    # Never read here, but a sign: the steps save with every rank together, which writes .metadata alone.
    others = sorted(name for name in os.listdir(folder) if name.startswith("__") and name.endswith(".metadata"))
    if others:
        raise UnusableSnapshot(f"it holds {others[0]}, a file of metadata that no step writes (DCP reads one in place "
                               "of .metadata that fails): it is not a snapshot of the steps, or something was planted")
    return metadata


def load_data_only(stored, name):
    """What torch.save wrote in `stored` (the bytes of one tensor or value of a snapshot), loaded with
    weights_only=True once its pickle's nesting is bounded; UnusableSnapshot, in words, naming `name`, if it cannot
    be."""
    try:
        with zipfile.ZipFile(io.BytesIO(stored)) as archive:
            pickles = [archive.read(member) for member in archive.namelist() if member.endswith("/data.pkl")]
    except zipfile.BadZipFile:
        raise UnusableSnapshot(f"its {name} is not what torch.save writes") from None
    if len(pickles) != 1:
        raise UnusableSnapshot(f"its {name} is not what torch.save writes (it holds {len(pickles)} pickles)")
    require_shallow(pickles[0], name)
    try:
        return torch.load(io.BytesIO(stored), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        named = re.search(r"GLOBAL (\S+)", str(error))
        raise UnusableSnapshot(f"its {name} would call {named[1] if named else 'code'} as it is read: a snapshot "
                               "holds tensors, numbers and text, and this one holds code") from None
    except Exception as error:
        raise UnusableSnapshot(f"its {name} cannot be read as tensors and plain values ({type(error).__name__})") \
            from None


class CodeInSnapshot(Exception):
    """A global that a snapshot's pickle names and that no snapshot of the steps holds: `module.name`."""


class _RecordsOnly(pickle.Unpickler):
    """An unpickler of DCP's .metadata that builds DCP's own records (its dataclasses, torch.Size, dtypes, a path) and
    refuses any other global with CodeInSnapshot: a pickle calls what it names, whatever that is."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise CodeInSnapshot(f"{module}.{name}")


class _Built:
    """An object a pickle builds, as require_shallow follows it: how deeply it nests, and what holds it."""

    __slots__ = ("depth", "holders")

    def __init__(self):
        self.depth, self.holders = 0, []


class TooDeep(Exception):
    pass


# The opcodes that put what they take off the stack into the object beneath it (list, dict, set, an object's state).
_FILLING = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}


def require_shallow(pickled, name):
    """UnusableSnapshot unless no object the pickle `pickled` builds nests more than MOST_NESTED deep, found from its
    opcodes alone, none of them run. Each object it builds is followed with the objects that hold it, so an object
    filled after it was put in another (the memo makes that possible) deepens its holders too."""
    stack, memo, mark = [], {}, object()

    def hold(container, items):
        for item in items:
            item.holders.append(container)
        deepen = [(container, 1 + max((item.depth for item in items), default=-1))]
        while deepen:
            built, depth = deepen.pop()
            if depth > built.depth:
                built.depth = depth
                if depth > MOST_NESTED:
                    raise TooDeep
                deepen.extend((holder, depth + 1) for holder in built.holders)

    try:
        for opcode, arg, _ in pickletools.genops(pickled):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[len(memo) if opcode.name == "MEMOIZE" else arg] = stack[-1]
            elif opcode.name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif opcode.name == "DUP":
                stack.append(stack[-1])
            elif opcode.name == "MARK":
                stack.append(mark)
            else:
                before, taken = opcode.stack_before, []
                if pickletools.markobject in before:  # everything above the last mark, then what lies beneath it
                    at = len(stack) - 1 - stack[::-1].index(mark)
                    taken, stack[at:] = stack[at + 1:], []
                    before = before[:before.index(pickletools.markobject)]
                if before:
                    taken, stack[-len(before):] = stack[-len(before):] + taken, []
                if mark in taken:
                    raise ValueError("a mark where an object belongs")
                if opcode.name in _FILLING:
                    hold(taken[0], taken[1:])
                    stack.append(taken[0])
                elif opcode.stack_after:
                    stack.append(_Built())
                    hold(stack[-1], taken)
    except TooDeep:
        raise UnusableSnapshot(f"its {name} nests objects more than {MOST_NESTED} deep, which no save writes: "
                               "unpickling it could crash every rank") from None
    except Exception as error:  # what pickletools cannot read, or a stack no unpickler could follow
        raise UnusableSnapshot(f"its {name} is not a pickle ({error or type(error).__name__})") from None


def require_dcp_records(metadata):
    """UnusableSnapshot unless `metadata` is DCP's Metadata record, its fields of the types DCP writes down to the last
    number: unpickling can give any object any attributes, and DCP trusts each of them (one of another type made
    torch's own reader fail, and DCP then read a `__<rank>.metadata` unchecked)."""
    _require(metadata, Metadata, "it")
    for name, entry in _field(metadata, "state_dict_metadata", dict).items():
        _require(name, str, "an entry's name")
        if type(entry) is TensorStorageMetadata:
            properties = _field(entry, "properties", TensorProperties)
            for field, kind in (("dtype", torch.dtype), ("layout", torch.layout), ("requires_grad", bool),
                                ("memory_format", torch.memory_format), ("pin_memory", bool)):
                _field(properties, field, kind)
            _size(_field(entry, "size", torch.Size), f"{name}'s size")
            for chunk in _field(entry, "chunks", list):
                _require(chunk, ChunkStorageMetadata, f"a chunk of {name}")
                _size(_field(chunk, "offsets", torch.Size), f"a chunk of {name}")
                _size(_field(chunk, "sizes", torch.Size), f"a chunk of {name}")
        else:
            _require(entry, BytesStorageMetadata, f"the entry of {name}")
    for index, stored in _field(metadata, "storage_data", dict).items():
        _require(index, MetadataIndex, "a place's index")
        _require(_field(index, "fqn", str), str, "a place's name")
        if _field(index, "offset", (torch.Size, type(None))) is not None:
            _size(index.offset, f"{index.fqn}'s offset")
        _field(index, "index", (int, type(None)))
        _require(stored, _StorageInfo, f"the place of {index.fqn}")
        path = _field(stored, "relative_path", str)
        if path in ("", ".", "..") or os.path.basename(path) != path:
            raise UnusableSnapshot(f"its .metadata places {index.fqn} in {path!r}, outside the folder")
        if _field(stored, "offset", int) < 0 or _field(stored, "length", int) < 0:
            raise UnusableSnapshot(f"its .metadata places {index.fqn} at a negative offset or length")
        if getattr(stored, "transform_descriptors", None):
            raise UnusableSnapshot(f"its {index.fqn} is stored transformed ({stored.transform_descriptors}), which "
                                   "the steps never write")
    planned = _field(metadata, "planner_data", (dict, type(None))) or {}
    for key, where in planned.items():
        _require(key, str, "a key of the planner's data")
        _require(where, tuple, f"the planner's data of {key}")
        for part in where:
            _require(part, (str, int), f"the planner's data of {key}")
    storage = _field(metadata, "storage_meta", (StorageMeta, type(None)))
    if storage is not None:
        _field(storage, "checkpoint_id", (str, pathlib.PurePath, type(None)))
        _field(storage, "save_id", (str, type(None)))
        _field(storage, "load_id", (str, type(None)))
        for module in getattr(storage, "modules", None) or []:  # a field of torch 2.7 and later
            _require(module, str, "a module's name in storage_meta")
    if getattr(metadata, "version", None) is not None:  # a field of torch 2.7 and later
        _field(metadata, "version", str)


def _type_name(kind):
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def _require(value, kind, what):
    """UnusableSnapshot unless `value`'s type is `kind` (or one of them) itself: a subclass can do what it likes."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(value) not in kinds and not (pathlib.PurePath in kinds and isinstance(value, pathlib.PurePath)):
        where = "its .metadata holds" if what == "it" else f"in its .metadata, {what} is"
        raise UnusableSnapshot(f"{where} a {type(value).__module__}.{type(value).__qualname__} where DCP's "
                               f"{_type_name(kind)} belongs: it is not a sharded snapshot's")
    return value


def _field(record, name, kind):
    """The field `name` of the record, which must be of type `kind`."""
    if name not in vars(record) and not hasattr(type(record), name):
        raise UnusableSnapshot(f"in its .metadata, a {type(record).__name__} has no {name}: it is not a sharded "
                               "snapshot's")
    return _require(getattr(record, name), kind, f"a {type(record).__name__}'s {name}")


def _size(size, what):
    for number in size:
        _require(number, int, what)


def load_seed_checkpoint(model, path):
    """Fill `model`'s weights (DTensors sharded over a mesh, or whole) with those of the seed checkpoint at `path` (a
    DCP folder of one process's initial weights under MODEL_STATE: tools/seed_checkpoint.py writes it), each rank
    reading only its own shards, as data only (SnapshotReader). One line and exit if it cannot: the weights of another
    model or text, or a folder that is not data alone (a folder that holds no checkpoint at all is refused before, by
    the argument's type: utils.dcp_folder). A collective: call it on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    weights = get_model_state_dict(model)  # the model's own tensors, under the whole model's names
    try:
        dcp.load({"MODEL_STATE": weights}, storage_reader=SnapshotReader(path))
        set_model_state_dict(model, weights)
    except BaseException as error:
        if not isinstance(error, Exception) and type(error).__name__ != "CheckpointException":
            raise
        raise SystemExit(f"error: cannot start from --seed_checkpoint {path} ({reason(error)}): write it again with "
                         "tools/seed_checkpoint.py, with the step's --workload and --text") from None


# --- a long run's rewind (step 12's --resume_from): which snapshot it goes on from ------------------------------

def snapshot_to_resume(folder, resume_from=None):
    """The snapshot a long run goes on from: the last whole one of its --snapshot_path `folder` (a path that does not
    exist when there is none), or with --resume_from STEP that step's (a rewind, after a loss spike). Stops with one
    line when `folder` is a snapshot itself (it holds a .metadata: step 11's snapshot folder, or one step-<steps>/ of
    a long run's), when STEP's snapshot is not kept (the line names the steps that are), and when snapshots later than
    STEP are there that no run rewound to STEP wrote: the rewound run would write over them, or resume from them after a
    restart, so they must be moved out first (the line says how). The later ones that a run rewound to STEP wrote are
    its own (their REWOUND_TO is STEP): the same command again (torchrun's restart, a job run again) goes on from the
    last of them. Reads the folder's names and, with --resume_from, one number of the last snapshot: call it on every
    rank before the process group forms."""
    if os.path.isfile(os.path.join(folder, ".metadata")):
        raise SystemExit(f"error: --snapshot_path {folder} is a snapshot itself (it holds a .metadata: step 11's "
                         "snapshot folder, or one of a long run's step-<steps>/), not a folder of them: give the long "
                         f"run a folder of its own, e.g. the default long_snapshots; {folder} is left as it is")
    if resume_from is None:
        return latest_snapshot(folder)
    snapshots, wanted = whole_snapshots(folder), step_snapshot(folder, resume_from)
    later = [path for path in snapshots if path > wanted]
    if later and rewound_to(later[-1]) == resume_from:
        return later[-1]
    if wanted not in snapshots:
        kept = f"it keeps those of steps {_steps_of(snapshots)}" if snapshots else "it holds none"
        raise SystemExit(f"error: --resume_from {resume_from}: {folder} keeps no snapshot of step {resume_from}; "
                         f"{kept} (--keep says how many of the last stay)")
    if later:
        raise SystemExit(f"error: --resume_from {resume_from}: {folder} holds snapshots after step {resume_from} (of "
                         f"steps {_steps_of(later)}), which the rewound run would write over, or resume from after a "
                         f"restart: move them out first (e.g. `mkdir -p spiked && mv {' '.join(later)} spiked/`), or "
                         f"leave --resume_from out to go on from step {_steps_of(later[-1:])}; nothing was changed")
    return wanted


def _steps_of(snapshots):
    """`12, 18 and 24`: the steps of a long run's snapshots (step_snapshot's paths)."""
    steps = [str(int(os.path.basename(path).removeprefix("step-"))) for path in snapshots]
    return " and ".join([", ".join(steps[:-1]), steps[-1]] if len(steps) > 1 else steps)


def rewound_to(path):
    """The step that the run which wrote the long run's snapshot at `path` was rewound to with --resume_from (its
    REWOUND_TO; 0: none, or a snapshot from before they said it). Read by this process alone, before the process
    group forms, through the steps' own reader (SnapshotReader above: as data only), that one number alone."""
    with stop_if_unloadable(path):
        reader = SnapshotReader(path)
        values = dict(REWOUND_TO=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP says it loads in one process: that is what is meant
            dcp.load(values, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    return values["REWOUND_TO"]
