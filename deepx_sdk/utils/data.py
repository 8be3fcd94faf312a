"""torch.utils.data as a model's training loop uses it: Dataset, TensorDataset, DataLoader, random_split.

A batch is one tensor per field, made on the daemon: from a TensorDataset by one gather (`x[indices]`, one
`indexselect` instruction per field, whatever the batch size), from any other dataset by stacking its items on the
host (numpy arrays and numbers) and sending the batch once, or, with `num_workers`, in worker processes that put it
on the daemon as heap tensors ahead of the loop (`_workers.py`). The order is the sampler's: in order, or shuffled by a
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
    field, whatever num_workers says).

    num_workers > 0: batches are made ahead of the loop by that many worker processes (forked: the dataset is
    inherited, never pickled), `prefetch_factor` batches per worker in flight; each worker collates with numpy (or
    `collate_fn`, which must then give numpy arrays) and registers the batch's arrays as heap tensors on the
    daemon, so the training loop gets them by name with no copy through its own process. The dataset must give
    numpy arrays and numbers. `worker_init_fn(worker_id)` runs first in each worker; numpy's and `random`'s global
    generators are seeded per worker. `timeout` (seconds, 0: none) bounds the wait for one batch;
    `persistent_workers` keeps the processes across epochs. A worker's exception is raised here with its
    traceback; a worker that dies is named. pin_memory is accepted and means nothing (the daemon owns memory)."""

    def __init__(self, dataset: Dataset, batch_size: int | None = 1, shuffle: bool = False, *, drop_last: bool = False,
                 generator: Any = None, collate_fn: Any = None, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = None, persistent_workers: bool = False, worker_init_fn: Any = None,
                 timeout: float = 0) -> None:
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise DeepxError(f"DataLoader: batch_size must be a positive integer or None, got {batch_size!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise DeepxError(f"DataLoader: num_workers must be a non-negative integer, got {num_workers!r}")
        if num_workers == 0 and (prefetch_factor is not None or persistent_workers):
            raise DeepxError("DataLoader: prefetch_factor and persistent_workers need num_workers > 0 (as in torch)")
        if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
            raise DeepxError(f"DataLoader: prefetch_factor must be a positive integer, got {prefetch_factor!r}")
        if timeout < 0:
            raise DeepxError(f"DataLoader: timeout must be >= 0, got {timeout!r}")
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, bool(shuffle), drop_last
        self.generator, self.collate_fn = generator, collate_fn
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor or 2
        self.persistent_workers, self.worker_init_fn, self.timeout = persistent_workers, worker_init_fn, timeout
        self._rng = _rng(generator) if shuffle else None
        self._pool: Any = None

    def __len__(self) -> int:
        n = len(self.dataset)
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self) -> np.ndarray:
        n = len(self.dataset)
        return self._rng.permutation(n) if self._rng is not None else np.arange(n)

    def _gathered(self) -> Any:
        """The dataset's rows(indices) where batches are gathered on the daemon, else None."""
        if self.collate_fn is not None or self.batch_size is None:
            return None
        if isinstance(self.dataset, Subset) and not hasattr(self.dataset.dataset, "rows"):
            return None
        return getattr(self.dataset, "rows", None)

    def _chosen(self, order: np.ndarray) -> list[np.ndarray]:
        if self.batch_size is None:
            return [order[i:i + 1] for i in range(len(order))]
        bs = self.batch_size
        out = [order[at:at + bs] for at in range(0, len(order), bs)]
        if out and len(out[-1]) < bs and self.drop_last:
            out.pop()
        return out

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        rows = self._gathered()
        if self.num_workers > 0 and rows is None:
            # the workers' seeds, after the order: an epoch's batches are those of num_workers=0
            yield from self._from_workers(self._chosen(order), self._seed_source())
            return
        if self.batch_size is None:
            for i in order:
                yield self.dataset[int(i)]
            return
        for chosen in self._chosen(order):
            if rows is not None:
                yield rows(chosen)
            else:
                collate = self.collate_fn or default_collate
                yield collate([self.dataset[int(i)] for i in chosen])

    def _from_workers(self, chosen: list[np.ndarray], seed_source: Any) -> Iterator[Any]:
        from deepx_sdk.session import session
        from deepx_sdk.tensor import Tensor
        from deepx_sdk.utils._workers import WorkerPool, numpy_collate

        s = session()

        def wrap(name: str, dtype: str, shape: tuple[int, ...]) -> Tensor:
            t = Tensor(name, shape, dtype, s)
            t._k = None  # a heap tensor the worker made: deleted when collected, its name never pooled
            return t

        pool = self._pool
        if pool is None or pool.closed:
            if self.batch_size is None:  # one sample at a time, uncollated
                collate = self.collate_fn or (lambda samples: samples[0])
            else:
                collate = self.collate_fn or numpy_collate
            seed = int(np.random.default_rng(seed_source).integers(2**31))
            pool = WorkerPool(self.dataset, collate, self.num_workers, self.prefetch_factor, float(self.timeout),
                              self.worker_init_fn, seed)
            if self.persistent_workers:
                self._pool = pool
        try:
            yield from pool.batches(chosen, wrap)
        except Exception:  # a failed or dead worker: the pool's pipes cannot be trusted for another epoch
            pool.close()
            self._pool = None
            raise
        finally:
            if not self.persistent_workers:
                pool.close()

    def _seed_source(self) -> Any:
        """The workers' base seed for this epoch: drawn from the generator (reproducible, new each epoch), as
        torch's DataLoader draws it."""
        if isinstance(self.generator, Generator):
            return self.generator._rng.integers(2**31)
        if isinstance(self.generator, np.random.Generator):
            return self.generator.integers(2**31)
        if self._rng is not None:
            return self._rng.integers(2**31)
        return None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            try:
                pool.close()
            except Exception:  # interpreter shutdown
                pass
