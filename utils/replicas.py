"""What step 13's replica groups need from torchft and do not teach: the address the group's servers listen on, a
lighthouse that answers before anything else starts, and a checkpoint transport that heals a group without unpickling
what another group sends.

torchft 0.2.0 listens on every interface: its Manager server binds `[::]` (manager.py passes `bind=f"[::]:{port}"`),
and its HTTPTransport serves the checkpoint on `("", 0)`; neither has an option for an address. Its transports unpickle
what they receive: HTTPTransport loads with `weights_only=False`, PGTransport unpickles its metadata with
`pickle.loads`. Whoever can pose as a group then runs code in every group that heals from it. What is here closes
what can be closed from the step: the servers on the one interface that reaches the lighthouse, and a transport
(CheckpointOverHTTP) that sends the tensors as raw bytes and everything else as JSON, and loads only what the
receiving rank expects, checked first.
"""
import http.server
import json
import os
import re
import secrets
import socket
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request

import torch
import torchft.manager
from torch.distributed.tensor import DTensor
from torchft.checkpointing import CheckpointTransport

from utils.files import replacing
from utils.launch import SPEAKER_GRACE_S

JSON_VALUES = (type(None), bool, int, float, str)
MOST_HEADER_BYTES = 64 * 2**20


def _speaks():
    """One rank of each machine says what every rank of that machine finds alike."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _stop(line):
    """End this rank, from any thread (a checkpoint is received on torchft's quorum thread, where an exception is
    caught and the step tried again): one rank of each machine prints `line`; every rank exits with code 1, the silent
    ones once the one that speaks has had the time to (torchrun stops the others as soon as one has ended)."""
    if _speaks():
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(SPEAKER_GRACE_S)
    sys.stdout.flush()
    os._exit(1)


def reach_the_lighthouse(address, timeout_s):
    """The address of this machine's interface toward the lighthouse at `address` (http://HOST:PORT): the interface
    the job uses, where the group's own servers are to listen. Called on every rank before anything else starts:
    if nothing answers there within timeout_s, it stops with one line (one per machine), instead of the error of
    whichever rank gives up waiting first."""
    parsed = urllib.parse.urlsplit(address)
    if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
        _stop(f"error: --lighthouse {address} is not http://HOST:PORT")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((parsed.hostname, parsed.port), timeout=max(0.1, min(5.0, timeout_s))) as s:
                return s.getsockname()[0]
        except OSError:
            if time.monotonic() > deadline:
                _stop(f"error: rank {os.environ.get('RANK')}: nothing answers at {address} within --timeout "
                      f"{timeout_s} s: the lighthouse is not running or cannot be reached (start it first: "
                      "torchft_lighthouse; --lighthouse gives its address); the snapshot on disk is kept, and the same "
                      "command resumes from it")
            time.sleep(0.5)


def bind_torchft_to(host):
    """Make torchft's Manager server listen on `host` alone. torchft 0.2.0's Manager starts it on `[::]` (every
    interface) and takes no address for it: the step's Manager is given `hostname=host` to say where it is, and this
    replaces the bind address the Manager passes to its server."""
    server = torchft.manager.ManagerServer
    bound = f"[{host}]" if ":" in host else host

    def bound_server(**options):
        return server(**dict(options, bind=f"{bound}:{options['bind'].rsplit(':', 1)[1]}"))

    torchft.manager.ManagerServer = bound_server


def result_record(full_path):
    """What step 13's export of the job's model at `full_path` left beside it (FULL.json): the job's steps, and the
    batches its groups trained; None where there is none."""
    record_path = f"{os.path.splitext(full_path)[0]}.json"
    try:
        with open(record_path) as file:
            record = json.load(file)
        if not (isinstance(record, dict) and all(type(record.get(key)) is int for key in ("steps", "batches"))):
            raise ValueError("not a record of steps and batches")
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: cannot read {record_path} ({error}): move it away, with {full_path}") from None


def save_result(state_dict, record, full_path):
    """Write the job's model to `full_path` and its record beside it, each replacing the last whole (the model first:
    a record never speaks for a model that is not there)."""
    with replacing(full_path) as tmp:
        torch.save(state_dict, tmp)
    with replacing(f"{os.path.splitext(full_path)[0]}.json") as tmp, open(tmp, "w") as file:
        json.dump(record, file)


def _leaves(tree, path=()):
    """(path, leaf) of every leaf of nested dicts, lists and tuples, in order."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, (*path, index))
    else:
        yield path, tree


def _rebuilt(tree, values):
    """`tree` with its leaves replaced, in order, by the next of `values`."""
    if isinstance(tree, dict):
        return {key: _rebuilt(value, values) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuilt(value, values) for value in tree)
    return next(values)


def _local(tensor):
    """The part of a tensor this rank holds (a DTensor's shard), on the CPU, one flat row of its elements."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().cpu().contiguous().reshape(-1)


class CheckpointOverHTTP(CheckpointTransport):
    """torchft's checkpoint transport, without pickle: a healthy rank serves its state at one URL of its own, a JSON
    header (each leaf's path; each tensor's dtype, shape and size; every other value as JSON) and then each tensor's
    raw bytes; the healing rank reads the header, compares it with the state it holds itself (`expected()`: the same
    paths, every tensor of the same dtype and shape, every other value of the same type) and the step it asked for,
    and only then reads the bytes the header declared, into new tensors. Nothing it receives is unpickled, and nothing
    it did not expect is loaded.

    The server listens on `host` alone. Its URL holds a random token, so a plain client of the port gets nothing
    (torchft's Manager still gives the URL to whoever asks it, over its own unauthenticated port)."""

    def __init__(self, host, timeout, expected):
        self._timeout = timeout.total_seconds()
        self._expected = expected
        self._token = secrets.token_hex(16)
        self._served = None  # (step, header, tensors) while a healing group may read them
        self._ready = threading.Condition()
        transport = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = self._timeout

            def do_GET(self):
                match = re.fullmatch(rf"/{transport._token}/(\d+)", self.path)
                served = match and transport._wait_for(int(match[1]))
                if not served:
                    self.send_error(404)
                    return
                _, header, tensors = served
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                self.wfile.write(struct.pack("<Q", len(header)) + header)
                for tensor in tensors:
                    self.wfile.write(memoryview(tensor.view(torch.uint8).numpy()))

            def log_message(self, *args):
                pass  # one line per request a healing group makes: nothing a learner acts on

        server_class = type("Server", (http.server.ThreadingHTTPServer,),
                            {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET,
                             "daemon_threads": True})
        self._server = server_class((host, 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _wait_for(self, step):
        """What is served for `step`, once the healthy rank offers it (a healing rank may ask first), or None."""
        with self._ready:
            self._ready.wait_for(lambda: self._served and self._served[0] == step, timeout=self._timeout)
            return self._served if self._served and self._served[0] == step else None

    def metadata(self):
        host, port = self._server.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/{self._token}/"

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
        leaves, tensors = [], []
        for path, leaf in _leaves(state_dict):
            if isinstance(leaf, torch.Tensor):
                tensors.append(_local(leaf))
                leaves.append(dict(path=path, dtype=str(leaf.dtype).removeprefix("torch."),
                                   shape=list(tensors[-1].shape), bytes=tensors[-1].numel() * leaf.element_size()))
            elif isinstance(leaf, JSON_VALUES):
                leaves.append(dict(path=path, value=leaf))
            else:
                raise TypeError(f"a {type(leaf).__name__} at {path} cannot be sent as JSON")
        header = json.dumps(dict(step=step, leaves=leaves)).encode()
        with self._ready:
            self._served = (step, header, tensors)
            self._ready.notify_all()

    def disallow_checkpoint(self):
        with self._ready:
            self._served = None

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        if not re.fullmatch(r"http://[\w.\-\[\]:]+:\d+/[0-9a-f]{32}/", metadata):
            _stop(f"error: rank {os.environ.get('RANK')}: the group to heal from gave {metadata[:200]!r} as its "
                  "checkpoint's address, not this step's kind: refused, nothing was loaded. Something that is not "
                  "this job's group reached the lighthouse (see the trust boundary in the step's page)")
        url = f"{metadata}{step}"
        try:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as reply:
                return self._read(reply, url, step)
        except (OSError, ValueError) as error:
            _stop(f"error: rank {os.environ.get('RANK')}: the state to heal from could not be read at {url} "
                  f"({error}): nothing was loaded")

    def _read(self, reply, url, step):
        """The state served at `url`, checked against what this rank expects before any tensor's bytes are read."""
        def refuse(why):
            _stop(f"error: rank {os.environ.get('RANK')}: the state served at {url} for step {step} is not this "
                  f"job's ({why}): refused, nothing was loaded. Something that is not this job's group reached the "
                  "lighthouse, or a group runs another version of the step (see the trust boundary in the step's page)")

        size = struct.unpack("<Q", reply.read(8).rjust(8, b"\0"))[0]
        if not 0 < size <= MOST_HEADER_BYTES:
            refuse(f"a header of {size} bytes")
        try:
            header = json.loads(reply.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            refuse(f"its header is not JSON: {error}")
        if not isinstance(header, dict) or header.get("step") != step or not isinstance(header.get("leaves"), list):
            refuse("no header of this step")
        expected = self._expected()
        mine = list(_leaves(expected))
        sent = header["leaves"]
        if len(sent) != len(mine):
            refuse(f"{len(sent)} values where {len(mine)} are expected")
        for leaf, (path, value) in zip(sent, mine):
            if not isinstance(leaf, dict) or leaf.get("path") != list(path):
                refuse(f"{leaf.get('path') if isinstance(leaf, dict) else leaf!r} where {list(path)} is expected")
            if isinstance(value, torch.Tensor):
                part = value.to_local() if isinstance(value, DTensor) else value
                wanted = dict(path=list(path), dtype=str(part.dtype).removeprefix("torch."), shape=[part.numel()],
                              bytes=part.numel() * part.element_size())
                if leaf != wanted:
                    refuse(f"{list(path)}: {leaf} where {wanted} is expected")
            elif set(leaf) != {"path", "value"} or type(leaf["value"]) is not type(value):
                refuse(f"{list(path)}: {leaf.get('value')!r} where a {type(value).__name__} is expected")
        # Only now the bytes, each tensor's as many as its header said, which is as many as this rank holds.
        received = []
        for leaf, (path, value) in zip(sent, mine):
            if not isinstance(value, torch.Tensor):
                received.append(leaf["value"])
                continue
            part = value.to_local() if isinstance(value, DTensor) else value
            data = bytearray(reply.read(leaf["bytes"]))
            if len(data) != leaf["bytes"]:
                refuse(f"{list(path)}: its bytes end early")
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            tensor = flat.view(part.dtype).reshape(part.shape).to(part.device)
            received.append(DTensor.from_local(tensor, value.device_mesh, value.placements, run_check=False,
                                               shape=value.shape, stride=value.stride())
                            if isinstance(value, DTensor) else tensor)
        return _rebuilt(expected, iter(received))

    def shutdown(self, wait=True):
        self._server.shutdown()
