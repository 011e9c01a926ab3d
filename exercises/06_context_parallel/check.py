"""Exercise 6's checker: context parallelism. The learner's script runs under torchrun (one cp group of 2, the ring,
dropout 0, a context of 64) on a short text with the positions each rank trained on, the attention scores its ring
computed and its losses recorded: the ranks' chunks must cut every sequence into parts, each epoch's loss must be one
process's on whole sequences, and the causal attention's work must fall evenly on the ranks.
"""
from exercises.judging import COLLECTIVE_TIMEOUT_S, epochs_of, exit_problems, mean_loss_problems
from harness.jobs import run, shown, torchrun

CP_NPROC, CP_CONTEXT, CP_BATCH, CP_EPOCHS = 2, 64, 8, 2  # processes (one cp group), tokens, sequences a step, epochs
CP_TEXT_CHARS = 4600  # a short excerpt of the help pages: 64 training sequences, 8 optimizer steps an epoch
BALANCE_TOLERANCE = 1.01  # the most one rank's attention scores may exceed another's


def context_reference(text):
    """{epoch: mean loss} of one process training the GPT (dropout 0, context CP_CONTEXT) on whole sequences as
    context_parallel.py's loop does, over the samples in their order: what the cp group computes together when it
    splits every sequence right."""
    from harness.one_process import train_gpt

    return train_gpt(text, CP_BATCH, CP_EPOCHS, context=CP_CONTEXT)["losses"]


def context_problems(samples, reference, context=CP_CONTEXT):
    """A cp group's ranks must hold every position of a sequence once between them; each epoch's loss, averaged over
    the ranks (each holds as many tokens), must be what one process computes on whole sequences; and the causal
    attention's work must fall evenly on the ranks (the query-key scores each rank's ring computed)."""
    if not samples:
        return ["it never trained: no process iterated over a DataLoader"]
    if any(row.get("context") is None for row in samples):
        return ["no rank trained on a part of each sequence: train inside split_sequence(...) (utils/context.py), "
                "which gives the model a rank's chunks, and feed it source[:, positions]"]
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        epoch = f"epoch {number}" + (f" after restart {restart}" if restart else "")
        held = {rank: row["context"]["positions"] for rank, row in sorted(rows.items())}
        seen = [position for positions in held.values() for position in positions]
        twice = sorted({position for position in seen if seen.count(position) > 1})
        never = sorted(set(range(context)) - set(seen))
        if twice or never:
            what = (f"positions {twice[0]} to {twice[-1]} are held by more than one rank" if twice else
                    f"positions {never[0]} to {never[-1]} by none")
            return [f"in {epoch} the ranks' chunks do not cut the sequence of {context} tokens into parts: {what}. "
                    "Every chunk of the 2 x cp must be held by exactly one rank of the cp group"]
    wrong = mean_loss_problems(samples, reference, "on whole sequences")
    if wrong:
        return wrong
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        scores = {rank: row["context"]["scores"] for rank, row in sorted(rows.items())}
        most, least = max(scores, key=scores.get), min(scores, key=scores.get)
        if not scores[least]:
            return [f"rank {least}'s attention computed nothing by the ring in epoch {number}: the check runs "
                    "--exchange ring, and each rank's queries must meet the keys of every chunk before theirs there"]
        if scores[most] > BALANCE_TOLERANCE * scores[least]:
            return [f"rank {most} computed {scores[most] / scores[least]:.2f} times the attention scores rank {least} "
                    f"did in epoch {number} ({scores[most]:,} against {scores[least]:,} per head and sequence, "
                    "forward and backward), and "
                    "every rank waits for the slowest at each step: under the causal mask a query sees the keys "
                    "before it, so the rank holding the end of the sequence does the most. Give each rank an early "
                    "chunk and a late one: of 2 x cp chunks, rank r holds chunks r and 2cp-1-r"]
    return []


def check(script, workdir, say):
    """Exercise 6: 2 ranks, --cp 2, the ring, dropout 0, context 64, on a short text; the positions each rank trained
    on, the attention scores its ring computed, and its losses recorded."""
    from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages

    text = workdir / "text.txt"
    text.write_text(help_pages()[:CP_TEXT_CHARS])
    cmd = [*torchrun(script, CP_EPOCHS, CP_EPOCHS, nproc=CP_NPROC), "--cp", CP_NPROC, "--workload", "gpt-cpu",
           "--context", CP_CONTEXT, "--batch_size", CP_BATCH, "--exchange", "ring", "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}   (one cp group of 2, dropout 0, on {CP_TEXT_CHARS:,} characters of Python's help "
        "pages)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, timeout=180, check=False,
              env={TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0})
    problems = context_problems(job.samples, context_reference(text)) if job.samples else []
    return problems or exit_problems(job, script)
