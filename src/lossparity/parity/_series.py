"""One metric's values by step, held as two flat arrays instead of a dict of Python objects.

A log of 590,000 steps held as ``dict[int, float]`` costs about 100 bytes per value (the dict slot, an
``int`` and a ``float`` object); :class:`Series` costs 16 (an ``int64`` step and a ``float64`` value in
two ``array.array``), and hands both arrays to NumPy without a copy for the comparison.

Torch-free and NumPy-free, as the readers are.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, MutableMapping

__all__ = ["Series"]


class Series(MutableMapping[int, float]):
    """``{step: value}`` kept sorted by step in two arrays (``steps``: int64, ``values``: float64).

    Semantics are a dict's (``series[s] = v`` sets or overwrites, ``del``, ``in``, iteration), with the
    keys always iterated in increasing step order. Writing a step above the last one appends (the common
    case of a log read top to bottom); an overwrite of an existing step is a binary search; a step written
    below the last one that is not yet held waits in a small side dict merged on the next read, so a log
    whose steps come out of order costs one sort, not one array shift per value. Equality with any mapping
    is by items, as for a dict.
    """

    __slots__ = ("_steps", "_values", "_pending")

    def __init__(self, items: Mapping[int, float] | Iterable[tuple[int, float]] = ()) -> None:
        self._steps = array("q")
        self._values = array("d")
        self._pending: dict[int, float] | None = None
        pairs = items.items() if isinstance(items, Mapping) else items
        for s, v in pairs:
            self[s] = v

    # -- writes ------------------------------------------------------------------------------------

    def __setitem__(self, step: int, value: float) -> None:
        steps = self._steps
        if not steps or step > steps[-1]:
            steps.append(step)
            self._values.append(value)
            return
        i = bisect_left(steps, step)
        if steps[i] == step:  # bisect_left < len(steps) since step <= steps[-1]
            self._values[i] = value
            if self._pending is not None:
                self._pending.pop(step, None)
            return
        if self._pending is None:
            self._pending = {}
        self._pending[step] = value

    def _settle(self) -> None:
        """Merge the out-of-order writes into the sorted arrays (one sort)."""
        pending = self._pending
        if not pending:
            self._pending = None
            return
        merged = dict(zip(self._steps, self._values))
        merged.update(pending)
        order = sorted(merged)
        self._steps = array("q", order)
        self._values = array("d", (merged[s] for s in order))
        self._pending = None

    def _index(self, step: int) -> int:
        """The position of ``step`` in the (settled) arrays; ``KeyError`` when it is not held."""
        self._settle()
        i = bisect_left(self._steps, step)
        if i == len(self._steps) or self._steps[i] != step:
            raise KeyError(step)
        return i

    def __delitem__(self, step: int) -> None:
        i = self._index(step)
        del self._steps[i]
        del self._values[i]

    def drop_from(self, step: int) -> int:
        """Delete the values at steps ``>= step`` (a restart: the log repeats steps from ``step`` on); return
        how many were deleted."""
        self._settle()
        i = bisect_left(self._steps, step)
        n = len(self._steps) - i
        if n:
            del self._steps[i:]
            del self._values[i:]
        return n

    # -- reads -------------------------------------------------------------------------------------

    def __getitem__(self, step: int) -> float:
        return self._values[self._index(step)]

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        try:
            self[step]
        except KeyError:
            return False
        return True

    def __len__(self) -> int:
        self._settle()
        return len(self._steps)

    def __iter__(self) -> Iterator[int]:
        self._settle()
        return iter(self._steps)

    def items(self) -> Iterator[tuple[int, float]]:  # type: ignore[override]
        """``(step, value)`` in increasing step order."""
        self._settle()
        return zip(self._steps, self._values)

    def values(self) -> Iterator[float]:  # type: ignore[override]
        """The values in increasing step order."""
        self._settle()
        return iter(self._values)

    def arrays(self) -> tuple[array[int], array[float]]:
        """The sorted step array (int64) and value array (float64) themselves (``numpy.frombuffer`` reads
        them without a copy); do not modify them."""
        self._settle()
        return self._steps, self._values

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        # a NaN equals a NaN here: a dict compares the same NaN object as equal, and these floats are new
        return len(self) == len(other) and all(
            s in other and (other[s] == v or (v != v and other[s] != other[s])) for s, v in self.items()
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dict

    def __repr__(self) -> str:
        shown = ", ".join(f"{s}: {v!r}" for s, v in list(self.items())[:6])
        more = ", ..." if len(self) > 6 else ""
        return f"Series({{{shown}{more}}})"
