"""Reserved nodes: who owns which, who may use them, and what a change gives back.

A queued job whose victims are checkpointing owns the nodes they are freeing. The first owner in
queue order wins a node; a reserved node stays out of the free index and is used only by its
owner, or by a job of strictly higher priority than the owner (which would otherwise preempt for
it; the owner re-plans in its own turn). A reservation ends when its owner starts (anywhere), is
quota-blocked, or has nothing left to wait for; its nodes' free GPUs then go back to everyone.

``Memo`` holds the cycle's memos that are true only while no capacity comes back (a shape that
failed to place, a plan that found no victims). Capacity comes back only here, when a reserved
node is released, so ``Reservations`` owns the invalidation: it bumps ``Memo.epoch`` and empties
the memos.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import attrgetter

from hai.domain.scheduler.model import QueuedJob
from hai.domain.scheduler.placement import FreeIndex, NodeSlot

_RESERVED = attrgetter("reserved_nodes")


class Memo:
    __slots__ = ("epoch", "place_fail", "plan_fail")

    def __init__(self) -> None:
        self.epoch = 0  # bumps when capacity is given back to the index
        self.place_fail: dict[tuple, str] = {}  # (nodes, GPUs a node, may span zones) -> failure sentence
        self.plan_fail: dict[tuple, bool] = {}  # (nodes, GPUs, rank, time-sharing, user) -> no plan

    def capacity_back(self) -> None:
        self.place_fail.clear()
        self.plan_fail.clear()
        self.epoch += 1


class Reservations:
    def __init__(self, queue: Iterable[QueuedJob], index: FreeIndex, memo: Memo):
        self.index, self.memo = index, memo
        self.owner: dict[str, int] = {}  # node -> the queued job it is reserved for
        self.owner_rank: dict[int, int] = {}  # owner -> its rank
        self.owned: dict[int, list[str]] = {}  # owner -> its nodes
        for j in filter(_RESERVED, queue):
            mine: list[str] = []
            for name in j.reserved_nodes:
                if name in index.by_name and name not in self.owner:
                    self.owner[name] = j.id
                    mine.append(name)
            if mine:
                self.owned[j.id] = mine
                self.owner_rank[j.id] = j.priority.rank
        index.fill(self.owner)
        # lowest priority among the owners (may be stale-low: only used to skip work)
        self.lowest_rank = min(self.owner_rank.values(), default=None)

    def release(self, name: str) -> None:
        """A reserved node stops being reserved: its free GPUs go back to everyone."""
        self.owner.pop(name, None)
        slot = self.index.by_name[name]
        if not slot.indexed:
            self.index.insert(slot)
            if slot.free:
                self.memo.capacity_back()

    def drop(self, job_id: int) -> None:
        """The job's reservation ends."""
        names = self.owned.pop(job_id, None)
        if names:
            for name in names:
                if self.owner.get(name) == job_id:
                    self.release(name)

    def extras(self, job: QueuedJob, rank: int) -> list[NodeSlot]:
        """Reserved nodes this job may use: its own, and those of lower-priority owners."""
        if not self.owner:
            return []
        low = self.lowest_rank
        if low is None or low >= rank:
            own = self.owned.get(job.id)
            if not own:
                return []
            by_name = self.index.by_name
            return [by_name[n] for n in own if self.owner.get(n) == job.id]
        out = []
        for name, owner in self.owner.items():
            if owner == job.id or self.owner_rank[owner] < rank:
                out.append(self.index.by_name[name])
        return out

    def usable_fn(self, job: QueuedJob, rank: int) -> Callable[[NodeSlot], bool]:
        """May this job use a node (free, its own, or reserved for a lower-priority job)?"""
        if not self.owner:
            return lambda slot: True
        owner, owner_rank, jid = self.owner, self.owner_rank, job.id

        def usable(slot: NodeSlot) -> bool:
            o = owner.get(slot.name)
            return o is None or o == jid or owner_rank[o] < rank

        return usable

    def started(self, job_id: int, used: list[str]) -> None:
        """The job started on ``used``: those nodes stop being reserved (whoever owned them);
        its other reserved nodes free up."""
        for name in used:
            prev = self.owner.get(name)
            if prev is not None and prev != job_id:
                self.owned[prev] = [n for n in self.owned.get(prev, []) if n != name]
            if prev is not None:
                self.release(name)
        self.drop(job_id)

    def claim(self, job_id: int, rank: int, slots: list[NodeSlot]) -> tuple[str, ...]:
        """The job's preemption plan reserves ``slots`` (taken from their previous owners, if
        any, and from the free index); its other reserved nodes free up."""
        names = tuple(s.name for s in slots)
        old = self.owned.get(job_id, [])
        for s in slots:
            prev = self.owner.get(s.name)
            if prev is not None and prev != job_id:
                self.owned[prev] = [n for n in self.owned.get(prev, []) if n != s.name]
            self.owner[s.name] = job_id
            self.index.remove(s)
        self.owner_rank[job_id] = rank
        if self.lowest_rank is None or rank < self.lowest_rank:
            self.lowest_rank = rank
        self.owned[job_id] = list(names)
        for name in old:
            if name not in names and self.owner.get(name) == job_id:
                self.release(name)
        return names
