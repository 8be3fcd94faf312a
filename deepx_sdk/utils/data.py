"""torch.utils.data as a model's training loop uses it: Dataset, TensorDataset, DataLoader, random_split.

A batch is one tensor per field, made on the daemon: from a TensorDataset by one gather (`x[indices]`, one
`indexselect` instruction per field, whatever the batch size), from any other dataset by stacking its items on the
host (numpy arrays and numbers) and sending the batch once. The order is the sampler's: in order, or shuffled by a
generator (`Generator().manual_seed(s)` as torch writes it, a numpy Generator, or, by default, one seeded from
`dx.manual_seed` where it was called), so that a seeded run sees the same batches every time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError

__all__ = ["DataLoader", "Dataset", "Generator", "Subset", "TensorDataset", "default_collate", "random_split"]


class Generator:
    """A random source for shuffling, as torch.Generator is used: `Generator().manual_seed(0)`."""

    def __init__(self) -> None:
        self._rng = np.random.default_rng()
        self._seed: int | None = None

    def manual_seed(self, seed: int) -> Generator:
        self._seed = int(seed)
        self._rng = np.random.default_rng(self._seed)
        return self

    def initial_seed(self) -> int | None:
        return self._seed

    def permutation(self, n: int) -> np.ndarray:
        return self._rng.permutation(n)


def _rng(generator: Any) -> Any:
    """Something with permutation(n): the generator given, else one from the session's seed (dx.manual_seed)."""
    if generator is None:
        from deepx_sdk.session import session

        s = session()
        if s.base_seed is None:
            return np.random.default_rng()
        return np.random.default_rng([s.base_seed, next(s.seed_counter)])
    if isinstance(generator, (Generator, np.random.Generator)):
        return generator
    raise DeepxError(f"DataLoader: generator must be a deepx_sdk.utils.data.Generator or a numpy Generator, got "
                     f"{type(generator).__name__}")


class Dataset:
    """What a DataLoader reads: `__getitem__(i)` gives one sample (a tensor, an array, a number, or a tuple or dict
    of those) and `__len__` how many there are."""

    def __getitem__(self, index: int) -> Any:
        raise DeepxError(f"{type(self).__name__} does not define __getitem__")

    def __len__(self) -> int:
        raise DeepxError(f"{type(self).__name__} does not define __len__")


class TensorDataset(Dataset):
    """Samples are rows of the given tensors (the same first dimension), as tuples."""

    def __init__(self, *tensors: Any) -> None:
        from deepx_sdk.tensor import Tensor, as_tensor

        if not tensors:
            raise DeepxError("TensorDataset: give at least one tensor")
        self.tensors = tuple(t if isinstance(t, Tensor) else as_tensor(np.asarray(t)) for t in tensors)
        n = self.tensors[0].shape[0] if self.tensors[0].shape else None
        if n is None or any(not t.shape or t.shape[0] != n for t in self.tensors):
            raise DeepxError(f"TensorDataset: the tensors must share their first dimension, got shapes "
                             f"{[t.shape for t in self.tensors]}")

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return tuple(t[index] for t in self.tensors)

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def rows(self, indices: np.ndarray) -> tuple[Any, ...]:
        """The rows at `indices` of every tensor: one gather each."""
        from deepx_sdk.tensor import tensor

        idx = tensor(np.asarray(indices, dtype=np.int64))
        return tuple(t[idx] for t in self.tensors)


class Subset(Dataset):
    def __init__(self, dataset: Dataset, indices: Sequence[int]) -> None:
        self.dataset, self.indices = dataset, list(indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.indices[index]]

    def __len__(self) -> int:
        return len(self.indices)

    def rows(self, indices: np.ndarray) -> Any:
        inner = getattr(self.dataset, "rows", None)
        if inner is None:
            raise DeepxError("Subset.rows: the dataset has no rows()")
        return inner(np.asarray(self.indices, dtype=np.int64)[np.asarray(indices, dtype=np.int64)])


def random_split(dataset: Dataset, lengths: Sequence[int | float], generator: Any = None) -> list[Subset]:
    """Split into non-overlapping subsets of the given lengths (or fractions summing to 1, the remainder given out
    one by one from the first, as torch does)."""
    n = len(dataset)
    if all(isinstance(x, float) for x in lengths) and math.isclose(sum(lengths), 1.0):
        sizes = [math.floor(n * f) for f in lengths]
        for i in range(n - sum(sizes)):
            sizes[i % len(sizes)] += 1
    else:
        sizes = [int(x) for x in lengths]
    if sum(sizes) != n:
        raise DeepxError(f"random_split: the lengths sum to {sum(sizes)}, the dataset has {n} samples")
    order = _rng(generator).permutation(n)
    out, at = [], 0
    for size in sizes:
        out.append(Subset(dataset, order[at:at + size].tolist()))
        at += size
    return out


def default_collate(samples: list[Any]) -> Any:
    """A batch from samples: tensors stacked on the daemon, arrays and numbers stacked on the host and sent once,
    tuples and dicts field by field, strings as lists."""
    from deepx_sdk.tensor import Tensor, stack, tensor

    first = samples[0]
    if isinstance(first, Tensor):
        return stack(samples)
    if isinstance(first, (np.ndarray, np.generic, numbers.Number)):  # Python floats as float64, ints as int64: torch's
        return tensor(np.stack([np.asarray(s) for s in samples]))
    if isinstance(first, str):
        return list(samples)
    if isinstance(first, dict):
        return {k: default_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise DeepxError("default_collate: the samples have different numbers of fields")
        return type(first)(default_collate(list(column)) for column in zip(*samples)) if isinstance(first, tuple) \
            else [default_collate(list(column)) for column in zip(*samples)]
    raise DeepxError(f"default_collate: cannot batch samples of type {type(first).__name__}")


class DataLoader:
    """Batches of a dataset: `for x, y in DataLoader(ds, batch_size=64, shuffle=True): ...`, as torch's.

    batch_size: samples per batch (None: samples one by one, uncollated). shuffle: a new order each epoch (each
    `iter`), from `generator`. drop_last: leave out a last, smaller batch. collate_fn: samples -> batch (default:
    `default_collate`; a TensorDataset or a Subset of one is gathered on the daemon instead, one instruction per
    field). num_workers is accepted for torch's scripts and must be 0: batches are made in the calling thread."""

    def __init__(self, dataset: Dataset, batch_size: int | None = 1, shuffle: bool = False, *, drop_last: bool = False,
                 generator: Any = None, collate_fn: Any = None, num_workers: int = 0, pin_memory: bool = False) -> None:
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise DeepxError(f"DataLoader: batch_size must be a positive integer or None, got {batch_size!r}")
        if num_workers != 0:
            raise DeepxError("DataLoader: num_workers must be 0 (batches are made in the calling thread; the daemon "
                             "does the work)")
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, bool(shuffle), drop_last
        self.generator, self.collate_fn = generator, collate_fn
        self._rng = _rng(generator) if shuffle else None

    def __len__(self) -> int:
        n = len(self.dataset)
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self) -> np.ndarray:
        n = len(self.dataset)
        return self._rng.permutation(n) if self._rng is not None else np.arange(n)

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        if self.batch_size is None:
            for i in order:
                yield self.dataset[int(i)]
            return
        rows = getattr(self.dataset, "rows", None) if self.collate_fn is None else None
        if isinstance(self.dataset, Subset) and not hasattr(self.dataset.dataset, "rows"):
            rows = None
        bs = self.batch_size
        for at in range(0, len(order), bs):
            chosen = order[at:at + bs]
            if len(chosen) < bs and self.drop_last:
                return
            if rows is not None:
                yield rows(chosen)
            else:
                collate = self.collate_fn or default_collate
                yield collate([self.dataset[int(i)] for i in chosen])
