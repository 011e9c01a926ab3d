"""Step 13 - replica groups that train on when one dies (torchft): each group one torchrun, FSDP inside (HSDP).

    RUST_LOG=warn torchft_lighthouse --min_replicas 1 --bind LIGHTHOUSE:29510   # once; LIGHTHOUSE: its address
    torchrun --nproc_per_node=gpu fault_tolerant.py 50 10 --group 0 --groups 2 --lighthouse http://LIGHTHOUSE:29510
    torchrun --nproc_per_node=gpu fault_tolerant.py 50 10 --group 1 --groups 2 --lighthouse http://LIGHTHOUSE:29510
"""
import argparse
import math
import os
import time
from datetime import timedelta

# torchft's Rust side logs every quorum (hundreds of lines a minute): it reads RUST_LOG once, as it loads.
os.environ.setdefault("RUST_LOG", "warn")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset
from torchft import DistributedSampler, Manager, Optimizer, ProcessGroupGloo, ProcessGroupNCCL

from utils import (WORKLOADS, attempt_store, configure_cpu_threads, evaluate, exists_on_any_rank, exit_without_teardown,
                   log_memory, make_workload, non_negative_int, positive_int, quiet_torchft, replacing,
                   require_epochs_left, require_same_arguments, require_same_start, require_torch_for_fsdp,
                   require_torchrun, require_written_by, stop_if_unloadable, watch_this_worker, weights_digest,
                   writable_path)
from utils.launch import errors_said_once, stop_once
from utils.replicas import CheckpointOverHTTP, bind_torchft_to, reach_the_lighthouse, result_record, save_result
from utils.snapshot_reader import SnapshotReader


def ddp_setup(timeout_s):
    # torchrun has set LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each process it started.
    if torch.cuda.is_available():
        # Before the process group forms: each process its own GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # The processes meet in torchrun's store, under keys of this attempt's own: after a restart the keys of the
    # workers that died are still there (docs/steps.md explains). A collective stuck past the timeout fails.
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", store=attempt_store(timeout_s),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=timeout_s))


class Trainer:
    def __init__(self, model, train_data, make_optimizer, loss_fn, device, save_every, snapshot_path, fsdp, args, host):
        # LOCAL_RANK numbers the processes of this node (it picks the GPU); RANK numbers those of this group.
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        # Each block, then the root: sharded over this group's ranks; the gradient shards FSDP reduce-scatters in the
        # group are then averaged over the groups of this step's quorum (HSDP, each replica a group).
        for module in [*model.children(), model]:
            fully_shard(module, **fsdp)
            module.set_all_reduce_hook(lambda shard: self.manager.allreduce(shard).wait())
        # After fully_shard: it steps the shards.
        self.optimizer = make_optimizer(model)
        self.train_data = train_data
        # This rank's share of an epoch's samples, in the epoch's shuffled order, and the epoch it is of.
        self.share = []
        self.share_epoch = None
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[group {args.group} | rank {self.global_rank}/{dist.get_world_size()} | {device}]"
        # Each group its own snapshot: any one of them can resume alone.
        self.snapshot_path = f"{snapshot_path}-group{args.group}"
        self.verbose = args.verbose
        self.arguments = [args.total_epochs, args.batch_size, args.groups, args.workload]
        self.group = args.group
        self.groups = args.groups
        self.timeout = args.timeout
        self.result_path = os.path.join(os.path.dirname(snapshot_path), "ft_model_full.pt")  # beside the snapshots
        # A group that torchrun started again has lost what it trained since its snapshot: it must not lead a quorum
        # until it has trained a step with a group that holds the job's steps (_quorum_holds_the_job).
        self.holds_the_job = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        # Rank 0 serves the group's Manager, which meets the other groups at the lighthouse; the other ranks read its
        # address after the barrier, not one that rank 0 of the attempt before a restart left in torchrun's store.
        if self.global_rank == 0:
            self.manager = self._make_manager(args, host)
        dist.barrier()
        if self.global_rank != 0:
            self.manager = self._make_manager(args, host)
        # Its step() steps only if every group of the step's quorum did all its all-reduces.
        self.ft_optimizer = Optimizer(self.manager, self.optimizer)
        # DCP's load is a collective: if any rank finds a snapshot, all of them load it.
        self.epochs_run = self._load_snapshot() if exists_on_any_rank(self.snapshot_path, device) else 0
        # Each node read the snapshot from its own disk.
        require_same_start(self.epochs_run, device)

    def _make_manager(self, args, host):
        timeout = timedelta(seconds=args.timeout)
        process_group = (ProcessGroupNCCL if torch.cuda.is_available() else ProcessGroupGloo)(timeout)
        # A healing rank reads a healthy rank's state as raw tensors and JSON, checked against its own state (what
        # torchft sends: ours under "user", its step count under "torchft") before it loads any of it; torchft's own
        # transports unpickle what they receive. The server listens on `host`, the interface toward the lighthouse.
        transport = CheckpointOverHTTP(host, timeout, expected=lambda: dict(user=dict(default=self._state()),
                                                                            torchft=self.manager.state_dict()))
        # The quorum before the forward, not beside it: a group that is behind heals before it reads its batch, and the
        # state a healthy group sends is read while its model is at rest. Every group starts from the same seeded
        # weights: none has to copy them at step 0 (init_sync).
        return Manager(process_group, load_state_dict=self._heal, state_dict=self._state, min_replica_size=1,
                       replica_id=f"group{args.group}", lighthouse_addr=args.lighthouse, use_async_quorum=False,
                       init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                       hostname=host, checkpoint_transport=transport)

    def _state(self):
        # What a healthy group sends one that is behind: each rank its shards, to the same rank of the other group.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return dict(MODEL=model_state, OPTIMIZER=optimizer_state, ARGS=self.arguments)

    def _heal(self, sent):
        # A group that is behind (restarted, or new) loads it, then trains the step with the others. Other arguments
        # make another job: no restart changes them, so only torchrun's first attempt says it (rank 0).
        if sent["ARGS"] != self.arguments:
            stop_once(f"error: this group has TOTAL_EPOCHS, --batch_size, --groups, --workload {self.arguments}, the "
                      f"running groups {sent['ARGS']}: start it with the arguments they had",
                      here=self.global_rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0")
        set_state_dict(self.model, self.optimizer, model_state_dict=sent["MODEL"], optim_state_dict=sent["OPTIMIZER"])
        if self.global_rank == 0:
            print(f"{self.tag} healed at step {self.manager.current_step()} from a healthy group, not from disk")

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            # Read once, as data only: a planted folder runs no code.
            reader = SnapshotReader(self.snapshot_path)
            require_written_by("fault_tolerant.py", self.snapshot_path, reader)
            # Each rank reads only its own shards, into the (sharded) state it already has.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state, EPOCHS_RUN=0,
                            TORCHFT=self.manager.state_dict())
            dcp.load(snapshot, storage_reader=reader)  # fills the tensors above in place
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
            self.manager.load_state_dict(snapshot["TORCHFT"])  # the step to go on from
            epochs_run = snapshot["EPOCHS_RUN"]
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _quorum_holds_the_job(self):
        # torchft heals every group of a quorum toward its highest step. A quorum of groups that all came back without
        # the job's steps (their torchrun restarted them while the others hang, say) would train from an older state
        # and, once ahead, make the job's groups heal from it: their steps lost without a word. So such a quorum waits,
        # unless every group of the job is in it. The all-reduce tells each group of the quorum the same answer.
        holders = torch.tensor([float(self.holds_the_job)], device=self.device)
        self.manager.allreduce(holders).wait()
        return holders.item() > 0 or self.manager.num_participants() >= self.groups or self.manager.errored()

    def _wait_for_the_job(self, step, since):
        # Loud, and bounded: one line when the wait begins; after --timeout, the group stops.
        if since is None and self.global_rank == 0:
            print(f"{self.tag} step {step}: no group of this quorum holds the job's steps (each was restarted by "
                  f"torchrun), so none leads: waiting up to --timeout {self.timeout} s for a group that does")
        if since is not None and time.monotonic() - since > self.timeout:
            stop_once(f"error: group {self.group}: no group that holds the job's steps came within --timeout "
                      f"{self.timeout} s: they have finished, hang, or are gone, and this group trained nothing; to go "
                      "on from the snapshots without them, start every group again", here=self.global_rank == 0)
        time.sleep(1)
        if since is None:
            since = time.monotonic()
        return since

    def _run_batch(self, source, targets):
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        # The step's loss over every sample: averaged over the group's ranks, then over the groups of the quorum.
        loss = loss.detach() / dist.get_world_size()
        dist.all_reduce(loss)
        self.manager.allreduce(loss).wait()
        self.ft_optimizer.step()
        return loss

    def _save_snapshot(self, epoch):
        # All it takes to go on exactly: the data order comes from the sampler's seed and the epoch.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state, EPOCHS_RUN=epoch + 1,
                        STEP="fault_tolerant.py", TORCHFT=self.manager.state_dict())
        # Every rank writes its shards into one folder of the job's; rank 0 then swaps it in for the last snapshot.
        tmp = f"{self.snapshot_path}.{os.environ['TORCHELASTIC_RUN_ID']}.tmp"
        with replacing(self.snapshot_path, tmp, rename=self.global_rank == 0):
            dcp.save(snapshot, checkpoint_id=tmp)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        require_epochs_left(self.epochs_run, max_epochs, self.snapshot_path)
        # The loop counts the job's steps, which a group that heals takes over: each step reads the step's batch (the
        # last of an epoch is short when a share is not a multiple of --batch_size, as in step 5).
        steps_per_epoch = math.ceil(len(self.train_data.sampler) / self.train_data.batch_size)
        # A group that comes back after the others finished finds the job's result beside the snapshots (where the
        # groups share a disk), and must not train the job again alone.
        finished = result_record(self.result_path)
        if finished and finished["steps"] >= max_epochs * steps_per_epoch:
            stop_once(f"{self.tag} the job has finished: {self.result_path} holds its result (step {finished['steps']} "
                      f"of {max_epochs * steps_per_epoch}), so this group has nothing to train (move it away, with its "
                      ".json, to train the job anew)", here=self.global_rank == 0, code=0)
        log_memory("start", self.model, self.optimizer, self.device, self.verbose)  # every rank's, in one table
        waiting_since = None
        while True:
            # Its zero_grad() forms the step's quorum: the groups that train it; one that is behind heals here.
            self.ft_optimizer.zero_grad(set_to_none=True)
            step = self.manager.current_step()
            if step >= max_epochs * steps_per_epoch:
                break
            if not self._quorum_holds_the_job():
                waiting_since = self._wait_for_the_job(step, waiting_since)
                continue
            waiting_since = None
            epoch, batch = divmod(step, steps_per_epoch)
            source, targets = self._batch_of_step(epoch, batch)  # this rank's share of the step
            loss = self._run_batch(source.to(self.device), targets.to(self.device))
            weights = weights_digest(self.model, self.device)
            done = self.manager.current_step()  # one more if this step committed
            self.holds_the_job = self.holds_the_job or done > step
            if self.global_rank == 0:
                if done > step:
                    print(f"{self.tag} step {step} | participants {self.manager.num_participants()} | loss "
                          f"{loss.item():.4f} | weights {weights}")
                else:
                    print(f"{self.tag} step {step} not committed: a group of its quorum failed, and the groups left "
                          "do it again")
            epochs_done, into_epoch = divmod(done, steps_per_epoch)
            if done > step and into_epoch == 0 and (epochs_done % self.save_every == 0 or epochs_done == max_epochs):
                self._save_snapshot(epochs_done - 1)  # sharded: every rank writes its part
                # No rank runs ahead of a snapshot not on disk yet.
                dist.barrier()
        log_memory("end", self.model, self.optimizer, self.device, self.verbose)

    def _batch_of_step(self, epoch, batch):
        # Batch `batch` of this rank's share of the epoch: a step is read by its number, not by iterating. A new
        # shuffle each epoch, the same in every group: the share is listed once an epoch.
        if epoch != self.share_epoch:
            self.train_data.sampler.set_epoch(epoch)
            self.share = list(self.train_data.sampler)
            self.share_epoch = epoch
        first = batch * self.train_data.batch_size
        indices = self.share[first:first + self.train_data.batch_size]
        # A loader of exactly these samples, in one batch: read whole, it gives that batch.
        loader = DataLoader(self.train_data.dataset, batch_size=len(indices), sampler=indices)
        batches = list(loader)
        return batches[0]


def load_train_objs(args):
    # Data, model, optimizer and loss, as in every step.
    return make_workload(args.workload)


def prepare_dataloader(dataset: Dataset, batch_size: int, group: int, groups: int):
    # Each rank reads 1/(groups x its group's ranks) of every epoch: share rank + ranks x group.
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset, group, groups))


def main(args):
    # FSDP on CPU processes needs torch 2.9: else one line.
    require_torch_for_fsdp()
    # torch's warnings about torchft's calls, its checkpoint server's log of each request: silenced at their cause.
    quiet_torchft()
    # Every rank, before anything that waits for another: the lighthouse answers (else one line), and the interface
    # this machine reaches it by is where the group's servers listen (torchft's Manager listens on every interface).
    host = reach_the_lighthouse(args.lighthouse, args.timeout)
    bind_torchft_to(host)
    # From here on this worker stops with one line, never a hang or a traceback: the group must form within --timeout,
    # torchrun must stay alive, and Ctrl-C or a collective that gave up ends it (utils/launch.py).
    watch_this_worker(args.timeout)
    ddp_setup(args.timeout)
    # Every node started with the same command?
    require_same_arguments(args)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    # Only this node's processes share its cores.
    configure_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    workload = load_train_objs(args)
    # bf16 compute; the gradients reduce-scattered in fp32 (a bf16 sum of many ranks' gradients loses their low bits);
    # fp32 outputs for the loss; offloaded shards in CPU memory (pinned for GPUs).
    bf16 = torch.bfloat16 if args.bf16 else None
    fsdp = dict(mp_policy=MixedPrecisionPolicy(bf16, reduce_dtype=torch.float32, output_dtype=torch.float32),
                offload_policy=CPUOffloadPolicy(device.type == "cuda") if args.cpu_offload else OffloadPolicy())
    train_data = prepare_dataloader(workload.train_set, args.batch_size, args.group, args.groups)
    trainer = Trainer(workload.model, train_data, workload.make_optimizer, workload.loss_fn, device,
                      args.save_every, args.snapshot_path, fsdp, args, host)
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    full_model = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # The groups hold the same weights: the first participant of the last step reports and writes them, never over a
    # result that more batches trained (a group that trained part of the job alone holds fewer).
    if trainer.global_rank == 0 and trainer.manager.participating_rank() == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
        # With it, the job's steps and the batches its groups trained (a step of N groups is N batches).
        record = dict(steps=trainer.manager.current_step(), batches=trainer.manager.batches_committed())
        kept = result_record(trainer.result_path)
        if kept and kept["batches"] >= record["batches"]:
            print(f"{trainer.tag} {trainer.result_path} is kept: it holds a result of {kept['batches']} batches of the "
                  f"groups, this group's of {record['batches']}")
        else:
            # A plain state_dict: loads without torch.distributed.
            save_result(full_model, record, trainer.result_path)
            print(f"{trainer.tag} full model saved to {trainer.result_path} (step {record['steps']}, "
                  f"{record['batches']} batches of the groups)")
    dist.destroy_process_group()
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per process")
    parser.add_argument("--workload", default="synthetic", choices=WORKLOADS, help="What to train")
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="ft_snapshot", type=writable_path,
                        help="Sharded snapshot folders: PATH-group0, PATH-group1...")
    parser.add_argument("--group", default=0, type=non_negative_int, help="Which replica group this torchrun is")
    parser.add_argument("--groups", default=2, type=positive_int, help="How many groups share the data")
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", "http://localhost:29510"),
                        help="The lighthouse's address, where the groups meet at every step")
    parser.add_argument("--bf16", action="store_true", help="FSDP: compute in bfloat16")
    parser.add_argument("--cpu_offload", action="store_true", help="FSDP: keep the shards in CPU memory")
    parser.add_argument("--verbose", action="store_true", help="Print every rank's memory at each epoch")
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    if args.group >= args.groups:
        parser.error(f"--group {args.group} is not one of the --groups {args.groups} (0 to {args.groups - 1})")
    require_torchrun()
    main(args)
