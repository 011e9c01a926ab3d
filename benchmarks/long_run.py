"""Step 12's costs around the training itself, on the CPU-size GPT (gpt-cpu): reading the token file from disk
against a training step, a snapshot against a step, and a rank's memory as the token file grows.

    python benchmarks/long_run.py                      # the standard library cut to 8M characters; files 1x 4x 16x
    python benchmarks/long_run.py --parts memory --multiples 1 2 4 8 16 32
    python benchmarks/long_run.py --parts shares --dp 8                # what each of 8 dp ranks reads, alone
    python benchmarks/long_run.py --source help --base_chars 60000 --multiples 1 2 --global_batch 8 --steps 6 \\
        --log_every 2 --read_batches 4 --rounds 2 --memory_steps 3 --dp 4     # tiny: what tests/test_benchmarks.py runs

The data. tools/prepare_data.py's prepare() writes a token folder of the first --base_chars characters of --source's
documents (stdlib: every .py file of Python's standard library, about 31M characters; help: the help pages, 465K), for
gpt-cpu's context of 64: the x1 folder. Its held-out file (val.bin) is cut to one global batch: every job evaluates it
at step 0 and at its end, which nothing below measures, and the whole file would only lengthen the jobs. The folder of
--multiples' k holds the x1 training file k times over (its rows repeated: the same file as prepare() writes from the
documents repeated k times). All of it lies in a temporary folder, removed at the end; the files were just written,
so their pages lie in the page cache: the reads below are the page cache's, and a cold disk would add its own time.

Jobs. Each is `torchrun --standalone --nproc_per_node=1 long_run.py STEPS SAVE_EVERY --pp 1 --tp 1 --workload
gpt-cpu` on the x1 folder (harness/jobs.run: one compute thread), in a folder of its own, a held-out loss only at step 0
and at the end. The figures come from its lines, one every --log_every steps (harness/jobs/output.step_lines): a
window's tokens over its tokens/s are its seconds. The first window is left out (it holds the held-out loss of step 0
and the warm-up), and the last (it holds the final snapshot, which every job writes): --steps must be at least three
windows. Each configuration runs --job_rounds times, the configurations in turn, in reverse order every other round;
its ms/step is its fastest window's of all its jobs (other work on the machine only ever slows a window down), its
tokens/s that window's. Every job is printed: its command, its seconds, its snapshots, its windows.

1. The data path against a step (--parts data). In this process, on one CPU thread as a rank: Shares(...)[k], what a
rank's DataLoader asks for each step (utils/data.py: the global batch's sequences drawn, their rows read and masked,
this rank's share cut), for global batches k = 0 ... --read_batches - 1, over the x1 training file as TokenFile reads
it (mapped anew for each read: every row's page is faulted into the process anew), and over the same TokenFile with
its rows read whole into memory first (np.fromfile: an array instead of a mapping; the same read(), the same Shares:
only where the rows lie differs). --rounds rounds, the two in turn, the order reversed every other round; the
fastest round's ms per global batch of each, against the step of the job with --workers 0 (a snapshot every 1000
steps): the share of a step the data costs. Then the job's tokens/s with --workers 0 and with --workers 2 (two loader
processes read ahead, on a machine whose cores the training shares), and an estimate of the same job from rows in
memory: its step less the memory-mapped read plus the in-memory one.

2. Snapshots (--parts snapshots). The same job with a snapshot every step and every 1000 steps, with sync saves and
with --async_save (four jobs; the sync one every 1000 steps is part 1's --workers 0 job). What a snapshot adds to a
step: the ms/step of every step less that of every 1000 steps, the same save mode; and that over the step's time: how
many steps of training one snapshot costs. The snapshots each job wrote (its `snapshot saved` lines: every step, or
the final one alone) and the size of its last (the model, AdamW's state and the cursor, on disk) are printed too.

Each dp rank's reads (--parts shares). In this process, on one CPU thread: Shares(...)[k] of every rank of --dp dp
ranks (and of one, dp 1), k = 0 ... --read_batches - 1, over the x1 training file, each read of TokenFile.read
counted: the rows a rank asks the file for per global batch, their bytes (a row is 2 x (context + 1) bytes), and its
ms per global batch (the fastest of --rounds rounds, the ranks in turn). A rank reads its share, global_batch / dp rows,
and the job reads each row of a global batch once; the tokens that count in the whole global batch travel as one
number over dp (the step's all-reduce, not measured here). In each round too, the global batch's order drawn alone
(utils/data.py's global_batch: every rank draws all of the batch's positions and keeps its share's), its fastest
round's ms per global batch: the part of a read that does not shrink with dp. Each round measures the draw, dp 1 and
--dp in turn, in reverse order every other round.

3. A rank's memory as the token file grows (--parts memory). For each folder, a fresh process (spawned_result) does
what a rank's loader does: long_run.prepare_dataloader over Shares over the folder's TokenFile (--workers 0: the
rank's own process reads), --memory_steps global batches from batch 0, and reads /proc/self/status before and after
(VmRSS, VmHWM: its peak, RssAnon: its anonymous memory) and /proc/self/smaps (the resident pages of the token file's
mapping alone). A batch of the held-out file goes through the same code first: what the first batch pages in of the
libraries' code lies outside the measurement. Why not a real job, its worker's RSS read from outside: a rank's memory
is mostly torch, the model and AdamW's state, the same for every file, and its peak would bury the data path's MiB
under them; a reader loop in a process of its own measures the data path alone, from the same start for every file.
Printed per file: its size (what holding it in memory costs), the rows read and the 4 KiB pages they lie in, the
file's pages resident in the process after the loop, the process's RSS before and after, how much its peak and its
anonymous memory grew, and, after the loop, what reading the whole file into memory added to the RSS (np.fromfile).
A mapped file's pages count in the RSS once touched, the kernel mapping the cached pages around each fault too
(Linux's fault-around, 64 KiB by default): a mapping kept for a whole epoch would come to hold the whole file.
TokenFile maps the file anew for each read and lets the mapping go once the rows are copied, so the file's pages
leave the process (they stay in the kernel's page cache); and utils/data.py computes the epoch's order for the
positions a batch reads alone, never a permutation of the whole file (which would take 8 bytes a row).
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/long_run.py` from anywhere; long_run.py lies there

from harness.jobs import machine_summary, output, run, shown, spawned_result, torchrun  # noqa: E402
from utils import positive_int  # noqa: E402

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
PARTS = ("data", "shares", "snapshots", "memory")
# A snapshot every step against one every this many steps: more than any job here runs, so only the final one.
RARELY = 1000


def load_average():
    return "load average " + " ".join(f"{load:.2f}" for load in os.getloadavg())


# --- the data ---------------------------------------------------------------------------------------------------------

def documents(source, characters):
    """(name, the first `characters` characters of `source`'s documents, in order: the last one cut)."""
    from tools.prepare_data import help_topics, stdlib_sources

    name, texts = stdlib_sources() if source == "stdlib" else help_topics()
    kept, left = [], characters
    for text in texts:
        if left <= 0:
            break
        kept.append(text[:left])
        left -= len(kept[-1])
    return f"{name}, its first {sum(map(len, kept)):,} characters", kept


def token_folders(scratch, args):
    """{k: the folder whose training file is the x1 file k times over}, for each of --multiples (see the docstring)."""
    import numpy as np

    from tools.prepare_data import prepare
    from utils.data import PAD
    from utils.gpt import size_of

    name, texts = documents(args.source, args.base_chars)
    base = scratch / "x1"
    meta = prepare(str(base), texts, name, size_of("gpt-cpu").context)
    # The held-out file cut to one global batch, and meta.json told so.
    row_bytes = 2 * (meta["context"] + 1)
    held_out = base / "val.bin"
    os.truncate(held_out, min(held_out.stat().st_size, args.global_batch * row_bytes))
    rows = np.fromfile(held_out, dtype=np.uint16).reshape(-1, meta["context"] + 1)
    meta["val"].update(sequences=len(rows), targets=int(np.count_nonzero(rows[:, 1:] != PAD)))
    (base / "meta.json").write_text(json.dumps(meta, indent=1))
    folders = {}
    for multiple in args.multiples:
        folder = scratch / f"x{multiple}"
        if multiple != 1:
            folder.mkdir()
            shutil.copy(base / "val.bin", folder / "val.bin")
            with open(base / "train.bin", "rb") as source, open(folder / "train.bin", "wb") as target:
                for _ in range(multiple):
                    source.seek(0)
                    shutil.copyfileobj(source, target)
            grown = dict(meta, train={key: count * multiple for key, count in meta["train"].items()})
            (folder / "meta.json").write_text(json.dumps(grown, indent=1))
        folders[multiple] = folder
    return folders, name


# --- 1. the data path against a step ----------------------------------------------------------------------------------

def read_rounds(folder, args):
    """{"memory-mapped": [ms per global batch of each round], "in memory": [...]}: Shares(...)[k] for k = 0 ...
    --read_batches - 1, over the token file mapped afresh each round, and over its rows read whole into memory."""
    import numpy as np
    import torch

    from utils import SEED
    from utils.data import Shares, TokenFile

    torch.set_num_threads(1)  # as a rank of a CPU job (torchrun's OMP_NUM_THREADS=1)
    in_memory = TokenFile(folder, "train")
    rows = np.fromfile(in_memory.path, dtype=np.uint16).reshape(-1, in_memory.context + 1)
    in_memory.rows = lambda: rows
    sources = {"memory-mapped": lambda: TokenFile(folder, "train"), "in memory": lambda: in_memory}
    rounds = {name: [] for name in sources}
    for round_number in range(args.rounds):
        order = list(sources) if round_number % 2 == 0 else list(sources)[::-1]
        for name in order:
            shares = Shares(sources[name](), args.global_batch, SEED, 0, 1)
            began = time.perf_counter()
            for batch in range(args.read_batches):
                shares[batch]
            rounds[name].append((time.perf_counter() - began) / args.read_batches * 1e3)
    return rounds


def share_reads(folder, args):
    """{dp: (rows a rank reads per global batch, their bytes, the fastest round's ms per global batch of a rank)} for dp
    1 and --dp: Shares(...)[k] of every rank, k = 0 ... --read_batches - 1, each TokenFile.read counted (see the
    docstring); and {"drawn": the fastest round's ms of drawing a global batch's order alone}."""
    import torch

    from utils import SEED
    from utils.data import Shares, TokenFile, global_batch

    torch.set_num_threads(1)
    tokens = TokenFile(folder, "train")
    asked, read = [], tokens.read
    tokens.read = lambda indices: asked.append(len(indices)) or read(indices)
    layouts = {dp: [Shares(tokens, args.global_batch, SEED, rank, dp) for rank in range(dp)] for dp in {1, args.dp}}
    rows = {dp: 0 for dp in layouts}
    rounds = {what: [] for what in ["drawn", *sorted(layouts)]}
    for round_number in range(args.rounds):
        # The draw alone and each layout in turn, the order reversed every other round: the load weighs on them alike.
        for what in rounds if round_number % 2 == 0 else list(rounds)[::-1]:
            asked.clear()
            began = time.perf_counter()
            for batch in range(args.read_batches):
                if what == "drawn":  # every rank draws all of the batch's positions, then keeps its share's
                    global_batch(len(tokens), batch, args.global_batch, SEED)
                else:
                    for shares in layouts[what]:
                        shares[batch]
            reads_made = 1 if what == "drawn" else what
            rounds[what].append((time.perf_counter() - began) / (reads_made * args.read_batches) * 1e3)
            if what != "drawn":
                rows[what] = sum(asked) / (what * args.read_batches)
    reads = {"drawn": min(rounds["drawn"])}
    for dp in sorted(layouts):
        reads[dp] = rows[dp], rows[dp] * 2 * (tokens.context + 1), min(rounds[dp])
    return reads


# --- the jobs ---------------------------------------------------------------------------------------------------------

def job_name(workers, save_every, asynchronous):
    return f"--workers {workers}, a snapshot every {save_every} steps, {'async' if asynchronous else 'sync'}"


def windows(printed, log_every, total):
    """[(first step, last step, ms/step, tokens/s)] of a job's windows but its first and its last (see the
    docstring), from its lines: a window's seconds are its tokens over its tokens/s."""
    lines = output.step_lines(printed)
    steps = sorted(lines)
    if steps[:1] != [log_every] or steps[-1:] != [total]:
        raise SystemExit(f"error: the job printed lines at steps {steps}, not every {log_every} up to {total}")
    measured = []
    for before, step in zip(steps[:-2], steps[1:-1]):
        seconds = (lines[step]["tokens"] - lines[before]["tokens"]) / lines[step]["rate"]
        measured.append((before, step, seconds / (step - before) * 1e3, lines[step]["rate"]))
    return measured


def snapshot_bytes(folder):
    """The bytes on disk of the last whole snapshot in a job's folder."""
    from utils import whole_snapshots

    last = whole_snapshots(str(folder / "long_snapshots"))[-1]
    return sum(path.stat().st_size for path in Path(last).rglob("*") if path.is_file())


def train(folders, scratch, args, round_number, workers, save_every, asynchronous):
    """One job of long_run.py on the x1 folder (see the docstring), printed with its windows: what it measured."""
    name = job_name(workers, save_every, asynchronous)
    folder = scratch / f"job-{round_number}-w{workers}-{save_every}-{'async' if asynchronous else 'sync'}"
    folder.mkdir()
    command = torchrun("long_run.py", args.steps, save_every, "--data", folders[1], "--workload", "gpt-cpu", "--pp", 1,
                       "--tp", 1, "--global_batch", args.global_batch, "--log_every", args.log_every, "--eval_every",
                       args.steps, "--workers", workers, *(["--async_save"] if asynchronous else []), nproc=1)
    print(f"job: {name} (round {round_number})\n  $ {shown(command)}", flush=True)
    began = time.perf_counter()
    job = run(command, cwd=folder, timeout=args.timeout)
    seconds = time.perf_counter() - began
    measured = windows(job.output, args.log_every, args.steps)
    saved = len(output.STEP_SAVED.findall(job.output))
    size = snapshot_bytes(folder)
    shutil.rmtree(folder)
    print(f"  {seconds:.1f} s; {saved} snapshots written, the last {size / MiB:.2f} MiB; windows (steps: ms/step, "
          "tokens/s): " + "; ".join(f"{first}-{last}: {ms:.2f}, {rate:,.0f}" for first, last, ms, rate in measured),
          flush=True)
    return dict(seconds=seconds, saved=saved, snapshot=size, windows=measured)


def fastest(name, runs):
    """A configuration's figures from its jobs (train()'s): its fastest window of all (least ms/step) and that
    window's tokens/s, the fastest job's seconds; the snapshots written, which must be the same in every job."""
    if len({(job["saved"], job["snapshot"]) for job in runs}) != 1:
        raise SystemExit(f"error: the jobs of {name} wrote different snapshots: {runs}")
    measured = [window for job in runs for window in job["windows"]]
    *_, ms, rate = min(measured, key=lambda window: window[2])
    return dict(name=name, ms=ms, rate=rate, windows=measured, seconds=min(job["seconds"] for job in runs),
                saved=runs[0]["saved"], snapshot=runs[0]["snapshot"])


def train_all(folders, scratch, args, configurations):
    """{configuration: fastest()}: --job_rounds rounds of a job of each configuration (workers, save_every,
    asynchronous), in turn, in reverse order every other round (load drifting on the machine slows none more)."""
    runs = {configuration: [] for configuration in configurations}
    for round_number in range(args.job_rounds):
        order = configurations if round_number % 2 == 0 else configurations[::-1]
        for configuration in order:
            runs[configuration].append(train(folders, scratch, args, round_number, *configuration))
    return {configuration: fastest(job_name(*configuration), jobs) for configuration, jobs in runs.items()}


# --- 3. a rank's memory as the file grows -----------------------------------------------------------------------------

def memory_status():
    """{VmRSS, VmHWM, RssAnon, RssFile: bytes} of this process, from /proc/self/status."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {name: int(fields[name].split()[0]) * 1024 for name in wanted}


def mapped_resident(path):
    """The resident bytes of this process's mappings of the file at `path` (/proc/self/smaps)."""
    path, resident, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            header = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
            if header:
                inside = header[1] == path
            elif inside and line.startswith("Rss:"):
                resident += int(line.split()[1]) * 1024
    return resident


def reader(rank, folder, global_batch_size, steps, result_path):
    """A spawned process that reads `steps` global batches of `folder`'s training file as a rank's loader does
    (--workers 0), and writes what that did to its memory (see the docstring) to result_path."""
    import numpy as np
    import torch

    from long_run import prepare_dataloader
    from utils import SEED
    from utils.data import Shares, TokenFile, batch_range, global_batch

    torch.set_num_threads(1)
    tokens = TokenFile(folder, "train")
    shares = Shares(tokens, global_batch_size, SEED, 0, 1)
    numbers, _ = batch_range(0, steps, None, "", say=False)
    loader = prepare_dataloader(shares, numbers, Namespace(workers=0))
    # A batch of the held-out file first, through the same code: what the first batch pages in of the libraries' code
    # and allocates once lies outside the measurement.
    held_out = Shares(TokenFile(folder, "val"), global_batch_size, SEED, 0, 1)
    for _ in prepare_dataloader(held_out, [0], Namespace(workers=0)):
        pass
    before = memory_status()
    for _ in loader:
        pass
    after, mapped = memory_status(), mapped_resident(tokens.path)
    # The pages the rows read lie in (a row may straddle two), counted after the measurement.
    row_bytes = 2 * (tokens.context + 1)
    rows = torch.cat([global_batch(len(tokens), batch, global_batch_size, SEED) for batch in numbers]).numpy()
    first, last = rows * row_bytes // PAGE, ((rows + 1) * row_bytes - 1) // PAGE
    pages = len(set(first.tolist()) | set(last.tolist()))
    whole = np.fromfile(tokens.path, dtype=np.uint16)
    loaded = memory_status()["RssAnon"] - after["RssAnon"]
    del whole
    Path(result_path).write_text(json.dumps(dict(file=os.path.getsize(tokens.path), rows=len(rows), pages=pages * PAGE,
                                                 mapped=mapped, before=before, after=after,
                                                 loaded=loaded)))


# --- the reports ------------------------------------------------------------------------------------------------------

def data_report(rounds, jobs, args, file_bytes):
    """Part 1's tables: ms per global batch of each read against the --workers 0 job's step; the jobs' tokens/s."""
    step = jobs[0, RARELY, False]
    mapped, in_memory = min(rounds["memory-mapped"]), min(rounds["in memory"])
    print(f"\n1. The data path against a training step: global batches of {args.global_batch} sequences of 64 + 1 "
          f"tokens from the x1 file ({file_bytes / MiB:.2f} MiB, in the page cache), the fastest of {args.rounds} "
          f"rounds of {args.read_batches} batches")
    print(machine_summary())
    print("| what | ms per global batch | of a step |")
    print("|---|---:|---:|")
    print(f"| Shares over the memory-mapped TokenFile | {mapped:.4f} | {mapped / step['ms']:.2%} |")
    print(f"| Shares over the same rows in memory | {in_memory:.4f} | {in_memory / step['ms']:.2%} |")
    print(f"| a training step (job: {step['name']}) | {step['ms']:.2f} | 100.00% |")
    print("read rounds, ms per global batch: " + "; ".join(
        f"{name} " + ", ".join(f"{ms:.4f}" for ms in values) for name, values in rounds.items()))
    print(f"memory-mapped / in memory: {mapped / in_memory:.2f}x; the memory-mapped read costs "
          f"{mapped - in_memory:.4f} ms more a step, {(mapped - in_memory) / step['ms']:.2%} of it")
    # The tokens of a step in the step's window: its tokens/s times its seconds a step.
    estimate = step["rate"] * step["ms"] / (step["ms"] - mapped + in_memory)
    print(f"\n{machine_summary()}")
    print("| job | tokens/s | against --workers 0 |")
    print("|---|---:|---:|")
    for workers in (0, 2):
        rate = jobs[workers, RARELY, False]["rate"]
        print(f"| --workers {workers}, memory-mapped file | {rate:,.0f} | {rate / step['rate']:.2f}x |")
    print(f"| --workers 0, rows in memory (estimated: the step less the memory-mapped read plus the in-memory one) | "
          f"{estimate:,.0f} | {estimate / step['rate']:.2f}x |")


def shares_report(reads, args):
    """The shares' table: what a dp rank reads of each global batch, at dp 1 and at --dp."""
    print(f"\nEach dp rank's reads: global batches of {args.global_batch} sequences from the x1 file, "
          f"{args.read_batches} batches a rank, the fastest of {args.rounds} rounds")
    print(machine_summary())
    print("| dp | rows a rank reads per global batch | bytes a rank reads per global batch | rows the job reads per "
          "global batch | ms per global batch, a rank |")
    print("|---:|---:|---:|---:|---:|")
    drawn = reads.pop("drawn")
    for dp, (rows, size, ms) in reads.items():
        print(f"| {dp} | {rows:,.0f} | {size:,.0f} | {rows * dp:,.0f} | {ms:.4f} |")
    print(f"the global batch's order drawn alone (utils/data.py's global_batch, all its positions): {drawn:.4f} ms per "
          f"global batch; a rank's read at dp {args.dp} / at dp 1: {reads[args.dp][2] / reads[1][2]:.2f}x")


def snapshot_report(jobs):
    """Part 2's table: each job's ms/step, what a snapshot every step adds to it, and that in steps of training."""
    print("\n2. A snapshot every step against one every 1000 steps (the final one only), the same jobs otherwise")
    print(machine_summary())
    print("| save | snapshot every | ms/step | a snapshot adds (ms/step) | a snapshot costs (steps) | "
          "snapshots written | snapshot MiB | job s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    costs = {}
    for asynchronous in (False, True):
        base = jobs[0, RARELY, asynchronous]
        for save_every in (RARELY, 1):
            job = jobs[0, save_every, asynchronous]
            added = job["ms"] - base["ms"]
            extra = f"{added:.2f} | {added / base['ms']:.2f}" if save_every == 1 else "- | -"
            print(f"| {'async' if asynchronous else 'sync'} | {save_every} | {job['ms']:.2f} | {extra} | "
                  f"{job['saved']} | {job['snapshot'] / MiB:.2f} | {job['seconds']:.1f} |")
            if save_every == 1:
                costs["async" if asynchronous else "sync"] = added, added / base["ms"]
    print("one snapshot costs " + "; ".join(f"{mode}: {ms:.2f} ms, {steps:.2f} steps of training"
                                             for mode, (ms, steps) in costs.items()))


def memory_report(results, args):
    """Part 3's table: per file, its size against what reading --memory_steps batches of it did to the memory."""
    print(f"\n3. A rank's memory as the token file grows: {args.memory_steps} global batches of {args.global_batch} "
          "rows read by long_run.prepare_dataloader (--workers 0), a fresh process per file; MiB")
    print(machine_summary())
    print("| file | file MiB | rows read | their pages MiB | file resident MiB | RSS before | RSS after | peak (VmHWM) "
          "grew | anonymous grew | whole file read into memory: RSS grew |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for multiple, result in results.items():
        before, after = result["before"], result["after"]
        print(f"| x{multiple} | {result['file'] / MiB:.2f} | {result['rows']:,} | {result['pages'] / MiB:.2f} | "
              f"{result['mapped'] / MiB:.2f} | {before['VmRSS'] / MiB:.2f} | {after['VmRSS'] / MiB:.2f} | "
              f"{(after['VmHWM'] - before['VmHWM']) / MiB:.2f} | {(after['RssAnon'] - before['RssAnon']) / MiB:.2f} | "
              f"{result['loaded'] / MiB:.2f} |")

    def peak_growth(result):
        return result["after"]["VmHWM"] - result["before"]["VmHWM"]

    smallest, largest = results[min(results)], results[max(results)]
    print(f"x{min(results)} -> x{max(results)}: the file {largest['file'] / smallest['file']:.1f}x, its resident "
          f"pages {(largest['mapped'] - smallest['mapped']) / MiB:+.2f} MiB, the peak RSS's growth "
          f"{(peak_growth(largest) - peak_growth(smallest)) / MiB:+.2f} MiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="What to measure")
    parser.add_argument("--source", choices=["stdlib", "help"], default="stdlib", help="The documents of the x1 file")
    parser.add_argument("--base_chars", type=positive_int, default=8_000_000, help="Characters of the x1 file")
    parser.add_argument("--multiples", nargs="+", type=positive_int, default=[1, 4, 16],
                        help="Sizes of the token files of part 3, in x1 files (1 is always made: the jobs read it)")
    parser.add_argument("--global_batch", type=positive_int, default=64, help="Sequences a step (long_run.py's)")
    parser.add_argument("--steps", type=positive_int, default=60, help="Steps of each job")
    parser.add_argument("--log_every", type=positive_int, default=10, help="Steps of a window (a job's line)")
    parser.add_argument("--job_rounds", type=positive_int, default=2, help="Jobs of each configuration")
    parser.add_argument("--read_batches", type=positive_int, default=200, help="Global batches read a round (part 1)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="Rounds of reads (part 1); the fastest counts")
    parser.add_argument("--memory_steps", type=positive_int, default=20, help="Global batches read per file (part 3)")
    parser.add_argument("--dp", type=positive_int, default=8, help="dp ranks whose reads are counted (shares)")
    parser.add_argument("--timeout", type=positive_int, default=600, help="Seconds a job or a reader may take")
    args = parser.parse_args()
    if args.steps < 3 * args.log_every:
        sys.exit(f"error: --steps {args.steps} holds fewer than 3 windows of --log_every {args.log_every}: the first "
                 "and the last are left out")
    args.multiples = sorted(set(args.multiples) | {1}) if "memory" in args.parts else [1]
    if args.global_batch % args.dp:
        sys.exit(f"error: --dp {args.dp} does not divide --global_batch {args.global_batch} into shares")

    print(f"long_run.py's data path, snapshots and memory: {machine_summary()}; {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="long-run-") as scratch:
        scratch = Path(scratch)
        folders, name = token_folders(scratch, args)
        print(f"token files: {name}; x1 train.bin {(folders[1] / 'train.bin').stat().st_size / MiB:.2f} MiB",
              flush=True)
        needed = ([(0, RARELY, False), (2, RARELY, False)] if "data" in args.parts else []) + (
            [(0, RARELY, False), (0, 1, False), (0, RARELY, True), (0, 1, True)] if "snapshots" in args.parts else [])
        jobs = train_all(folders, scratch, args, list(dict.fromkeys(needed)))
        if "data" in args.parts:
            rounds = read_rounds(folders[1], args)
            data_report(rounds, jobs, args, (folders[1] / "train.bin").stat().st_size)
        if "shares" in args.parts:
            shares_report(share_reads(folders[1], args), args)
        if "snapshots" in args.parts:
            snapshot_report(jobs)
        if "memory" in args.parts:
            results = {multiple: spawned_result(reader, (str(folders[multiple]), args.global_batch, args.memory_steps),
                                                1, args.timeout, f"reading the x{multiple} file")
                       for multiple in args.multiples}
            memory_report(results, args)
    print(f"\n{machine_summary()}; {load_average()}")


if __name__ == "__main__":
    main()
