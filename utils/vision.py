"""Image-classification workloads through torchvision: MNIST, CIFAR-10, and FakeData for offline benchmarks.

Each builder returns a `Workload` like the synthetic one, so every step script trains it unchanged
(`--workload mnist`). The images are decoded once into tensors (a TensorDataset), so a batch costs no
per-image Python work and evaluate() can index it directly. The data lives under $TUTORIAL_DATA_DIR
(default ./data); MNIST and CIFAR-10 are downloaded there on first use when this machine is online.
torchvision is imported inside the builders: it takes seconds, and the synthetic workload never needs it.
"""
import contextlib
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from utils.workload import Workload

try:
    import fcntl  # file locks: Linux and macOS
except ImportError:  # Windows: every process downloads for itself
    fcntl = None

DATA_DIR_VARIABLE = "TUTORIAL_DATA_DIR"
FAKEDATA_SIZES = (2048, 499)  # train, held-out: 499 is prime, so no world size divides it evenly


def data_dir():
    """Where datasets are read from and downloaded to."""
    return os.environ.get(DATA_DIR_VARIABLE) or "data"


def small_cnn(in_channels, num_classes):
    """Two conv blocks and a linear head: about 30k weights, compute-bound on a CPU thread (for the benchmarks)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 4 * 4, num_classes))  # any image size -> 4x4


def _classification(train_set, eval_set, model, lr):
    return Workload(train_set, eval_set, model, lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                    nn.CrossEntropyLoss(), classification=True)


def _as_tensors(images, labels, mean, std):
    """uint8 images (N, H, W) or (N, H, W, C) -> normalized float (N, C, H, W), labels -> int64."""
    images = torch.as_tensor(images)
    images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2).contiguous()
    # in place: CIFAR-10's training set is 600 MB as float32, and one copy of it is enough
    images = images.float().div_(255).sub_(torch.tensor(mean).view(-1, 1, 1)).div_(torch.tensor(std).view(-1, 1, 1))
    return TensorDataset(images, torch.as_tensor(labels, dtype=torch.long))


@contextlib.contextmanager
def _one_at_a_time(root, name):
    """Held by one process of this machine at a time: the first downloads, the others wait and then find the files.

    A file lock, not a collective: building a workload never talks to the other ranks, so a rank that stops here
    stops alone, with its own one-line message, and the others' first collective fails within --timeout.
    """
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{name}.lock"), "w") as lock:
        if fcntl:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def load_splits(dataset_class, files_hint):
    """(train, test) splits of a torchvision dataset, downloaded first when missing and this machine is online."""
    root, name = data_dir(), dataset_class.__name__
    with _one_at_a_time(root, name):
        try:
            return tuple(dataset_class(root, train=train) for train in (True, False))
        except RuntimeError:  # "Dataset not found": fetch it
            pass
        try:
            return tuple(dataset_class(root, train=train, download=True) for train in (True, False))
        except Exception as error:  # no network (URLError), a partial or corrupt file (RuntimeError)...
            problem = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    raise SystemExit(f"error: {name} is not in {os.path.abspath(root)} and the download failed ({problem}; "
                     f"offline?): on a machine that is online run `python -c \"import torchvision; "
                     f"torchvision.datasets.{name}('data', download=True)\"`, copy its data/ ({files_hint}) here, or "
                     f"set {DATA_DIR_VARIABLE} to where it is")


def mnist(seed):
    """Handwritten digits, 60k train / 10k test 28x28 greyscale images, on the small CNN."""
    import torchvision

    train, test = load_splits(torchvision.datasets.MNIST, "MNIST/raw/*-idx?-ubyte")
    mean, std = (0.1307,), (0.3081,)  # the training set's, the usual constants
    torch.manual_seed(seed)  # same initial weights in every process
    return _classification(_as_tensors(train.data, train.targets, mean, std),
                           _as_tensors(test.data, test.targets, mean, std), small_cnn(1, 10), lr=0.05)


def cifar10(seed):
    """Ten classes of 32x32 colour photos, 50k train / 10k test, on resnet18 (random init, no pretrained weights)."""
    import torchvision

    train, test = load_splits(torchvision.datasets.CIFAR10, "cifar-10-batches-py/")
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    return _classification(_as_tensors(train.data, train.targets, mean, std),
                           _as_tensors(test.data, test.targets, mean, std), model, lr=0.05)


def fakedata(seed, sizes=FAKEDATA_SIZES, image_size=(3, 32, 32), num_classes=10):
    """torchvision's FakeData: random CIFAR-sized images and labels, made on the spot (no files, no network).

    Nothing in it can be learned beyond memorizing (held-out accuracy stays near chance); it is there to
    measure speed, on the same small CNN the MNIST workload uses.
    """
    import numpy as np
    import torchvision

    def materialize(size, offset):  # FakeData re-seeds the global generator per image: same images everywhere
        images = torchvision.datasets.FakeData(size, image_size, num_classes, random_offset=offset)
        pairs = [images[index] for index in range(size)]
        pixels = np.stack([np.asarray(image) for image, _ in pairs])  # (N, H, W, C) uint8, as CIFAR-10 stores it
        return _as_tensors(pixels, [int(label) for _, label in pairs], (0.5,) * 3, (0.25,) * 3)

    train_set, eval_set = materialize(sizes[0], seed), materialize(sizes[1], seed + sizes[0])
    torch.manual_seed(seed)
    return _classification(train_set, eval_set, small_cnn(image_size[0], num_classes), lr=0.05)
