"""Exercise 12, wrong: the diagnosis is right, and each case ends with the right numbers, because every fix removes the
collective and lets each rank compute what it would have received: rank 0 logs the loss of every sample itself, every
rank warms the weights up itself, every rank evaluates every held-out sample itself. The numbers agree only because
each rank can compute them alone."""
DIAGNOSIS = {
    "branch": {"rank": 0, "collective": "reduce", "line": 93},
    "heldout": {"rank": 2, "collective": "barrier", "line": 188},
    "order": {"rank": 0, "collective": "broadcast", "line": 125},
}


def train_branch(rank, world_size):
    model = make_model()
    inputs, targets = samples(TRAIN_SAMPLES, seed=1)
    mine = slice(rank, None, world_size)
    history = []
    for step in range(STEPS):
        if step % LOG_EVERY == 0 and rank == 0:
            # the mean of every rank's loss is the loss over every sample: rank 0 can compute it alone
            with torch.no_grad():
                history.append(F.mse_loss(model(inputs), targets).item())
        elif step % LOG_EVERY == 0:
            history.append(None)
        model.zero_grad()
        F.mse_loss(model(inputs[mine]), targets[mine]).backward()
        average_gradients(model, world_size)
        descend(model)
    return model, {"history": history}


def warm_start(model, rank):
    """Every rank warms the same weights up itself: they start alike without waiting for rank 0."""
    warm_up(model)


def held_out_loss(model, rank, world_size):
    """The mean squared error over every held-out sample: each rank evaluates them all."""
    inputs, targets = samples(HELD_OUT_SAMPLES, seed=2)
    with torch.no_grad():
        return F.mse_loss(model(inputs), targets).item()
