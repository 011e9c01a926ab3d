"""A stranger that joins a running job of step 13 (fault_tolerant.py) at its lighthouse, as a replica group whose step
is far ahead of the job's: torchft makes every group of the quorum heal from it. Whatever a group asks its checkpoint
server for, it answers with a planted pickle whose code, once unpickled, writes the file MARKER. Nothing else of a group
is played: it takes part in the quorums until DEADLINE_S have passed. It joins once the file GO exists (its imports
take long on a busy machine: start it early, and let it join when the test wants it).

    python tests/fake_replica.py http://127.0.0.1:PORT MARKER GO [DEADLINE_S]
"""
import http.server
import os
import sys
import threading
import time
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side: its log of every quorum

import torch.distributed as dist
from torch.distributed._serialization import _streaming_save
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing import CheckpointTransport


class Planted:
    """Unpickled, it calls open(MARKER, "w"): the file is the proof that code sent by a stranger ran."""

    def __reduce__(self):
        return open, (sys.argv[2], "w")


def planted_bytes():
    """The stranger's answer to every request: torchft's streaming format (what its HTTPTransport loads with
    weights_only=False), the state of a group with the planted object in it."""
    class Buffer:
        data = bytearray()

        def write(self, chunk):
            self.data += chunk
    buffer = Buffer()
    _streaming_save({"user": {"default": Planted()}, "torchft": {"step": 10**6, "batches_committed": 0}}, buffer)
    return bytes(buffer.data)


class Serve(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(PAYLOAD)

    def log_message(self, *args):
        pass


class Stranger(CheckpointTransport):
    """Says its checkpoint is at a URL of the shape a group of the step uses (a port, a 32-digit token), and sends
    nothing itself: the server above answers every request with the planted bytes."""

    def __init__(self, url):
        self.url = url

    def metadata(self):
        return self.url

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
        pass

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        raise RuntimeError("a stranger heals from no one")


PAYLOAD = b""

if __name__ == "__main__":
    PAYLOAD = planted_bytes()
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.05)
    deadline = time.monotonic() + float(sys.argv[4] if len(sys.argv) > 4 else 60)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=20)
    manager = Manager(ProcessGroupGloo(timeout), load_state_dict=lambda state: None, state_dict=lambda: {},
                      min_replica_size=1, use_async_quorum=False, init_sync=False, lighthouse_addr=sys.argv[1],
                      replica_id="stranger", rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      checkpoint_transport=Stranger(f"http://127.0.0.1:{server.server_address[1]}/{'0' * 32}/"))
    manager.load_state_dict({"step": 10**6, "batches_committed": 0})  # far ahead of any job here
    print(f"stranger: joining {sys.argv[1]} at step {manager.current_step()}", flush=True)
    while time.monotonic() < deadline:
        try:
            manager.start_quorum()
            print(f"stranger: in a quorum of {manager.num_participants()}", flush=True)
        except Exception as error:  # the groups it joined are gone: it tries again
            print(f"stranger: {type(error).__name__}", flush=True)
        time.sleep(1)
    os._exit(0)
