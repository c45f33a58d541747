"""The queue in the cycle's order, kept by the caller from one cycle to the next (issue 12).

A cycle orders the whole queue (priority level high first; within a level, service class, then
first submission, then id) and reads each job's fast-lane key (``core._LANE_KEY``). At 100,000
queued jobs that is two sorts and several passes over job objects scattered in memory, every
cycle, although between two cycles only a few jobs arrive or leave. ``KeptQueue`` keeps that
order, with each job's lane key computed once when the job enters, in compact parallel lists
(blocks of at most ``_SPLIT`` jobs, so an arrival or a departure moves a few thousand pointers,
not the whole queue). The caller keeps one and passes it to every ``schedule(..., kept=...)``.

What it proves before the cycle uses it (``sync``): queued jobs are frozen objects, so a job
that is the very same object as the one kept under its id has the same fields, hence the same
place in the order and the same key. Every snapshot job that is not that object (it arrived, or
its row changed and the caller built a new object) is added, after the kept object of its id is
removed; every kept job whose id is no longer queued is removed; the counts must then agree
(else the order is built again). A snapshot whose queue is the very tuple of the last sync (a
caller whose queue did not change hands the same one: ``services.scheduling.QueueCache``) holds
the same objects: nothing to prove, the sync costs nothing. A snapshot that says how its queue
differs from the tuple of the last sync (``model.QueueDelta``, the caller's account: the jobs
that arrived, changed or left) is synced from that account in O(changes), without the proof
(the count must still agree). A caller that builds new objects
for unchanged jobs still gets the right order (they count as changed), only no saving. Where
the order depends on ``now`` (least attained service with a starvation factor: a job's class
changes as it waits) ``sync`` declines and the cycle orders from scratch; when more than a
quarter of the queue changed it builds the order again (sorting is then cheaper than the
updates).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from functools import partial
from itertools import chain, compress, repeat
from operator import add, attrgetter, is_, le, lt, not_
from typing import Iterable, Iterator

from hai.domain.scheduler.model import Policy, QueueDelta, QueuedJob, Snapshot
from hai.domain.scheduler.placement import KeptSlots
from hai.domain.scheduler.quota import KeptCharges
from hai.domain.scheduler.victims import rank as _rank
from hai.domain.scheduler.victim_table import KeptPlaces

_LANE_KEY = attrgetter("nodes", "gpus_per_node", "group", "user", "allow_cross_zone")
_ID = attrgetter("id")
_SPLIT = 2048  # a block holding more jobs is split in two
_INF = float("inf")


class Block:
    """A run of consecutive jobs of one level, in queue order, as parallel lists: the job, its
    id, its lane key (``KeptQueue._key``), when it was queued, its service class, and its sort
    key (class, first submission, id). Queued times are an array of machine numbers (a pass
    over them reads contiguous memory, not one object per job, which in queue order lie
    scattered); ids are a list of the jobs' own id objects: every cycle makes them the keys of
    ~100,000 pending reasons, and an array made a new int object of each (a fifth of the
    reasons' inserts).

    ``lane_keys``: each job's key for the cycle's fast lane (its lane key, plus 1 when it waited
    past the threshold), kept from one cycle to the next: the threshold's time only moves on,
    so a job past it stays past it, and until it reaches the earliest queued time of the jobs
    not yet past it (``young``) no job's key changes."""

    __slots__ = ("jobs", "ids", "keys", "qat", "cls", "sk", "ek", "since", "young")
    _LISTS = ("jobs", "ids", "keys", "qat", "cls", "sk")

    def __init__(self) -> None:
        self.jobs: list[QueuedJob] = []
        self.ids: list[int] = []  # (the job objects' own ints: no new object per read)
        self.keys: list[int] = []
        # queued times as machine numbers: read without touching an object per job
        self.qat = array("d")
        self.cls: list[int] = []
        self.sk: list[tuple[int, float, int]] = []
        # the lane keys as of the threshold time ``since`` (None: not made yet); ``young``: the
        # earliest queued time after ``since`` (at most: a job removed may have been it)
        self.ek: list[int] | None = None
        self.since = self.young = 0.0

    def insert(self, pos: int, job: QueuedJob, key: int, c: int, sk: tuple[int, float, int]) -> None:
        self.jobs.insert(pos, job)
        self.ids.insert(pos, job.id)
        self.keys.insert(pos, key)
        qat = job.queued_at
        self.qat.insert(pos, qat)
        self.cls.insert(pos, c)
        self.sk.insert(pos, sk)
        if self.ek is not None:
            if qat <= self.since:
                self.ek.insert(pos, key + 1)
            else:
                self.ek.insert(pos, key)
                if qat < self.young:
                    self.young = qat

    def delete(self, pos: int) -> None:
        del self.jobs[pos], self.ids[pos], self.keys[pos], self.qat[pos], self.cls[pos], self.sk[pos]
        if self.ek is not None:
            del self.ek[pos]

    def split(self) -> Block:
        """Move the second half of this block to a new block (returned)."""
        h = len(self.jobs) // 2
        b = Block()
        for name in Block._LISTS:
            lst = getattr(self, name)
            setattr(b, name, lst[h:])
            del lst[h:]
        self.ek = None  # (both made again when next asked)
        return b

    def lane_keys(self, since: float) -> list[int]:
        """Each job's fast-lane key with ``since`` the threshold time (queued at or before it:
        past the threshold, key + 1). Read only."""
        ek = self.ek
        if ek is not None and self.since <= since < self.young:
            self.since = since  # no job reached the threshold since the keys were made
            return ek
        qat = self.qat
        ek = self.ek = list(map(add, self.keys, map(le, qat, repeat(since))))
        self.since = since
        self.young = min(filter(partial(lt, since), qat), default=_INF)  # the jobs not past it
        return ek


class Level:
    """The jobs of one priority level in queue order, in blocks; ``counts``: jobs per class."""

    __slots__ = ("rank", "blocks", "last", "counts", "size")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.blocks: list[Block] = []
        self.last: list[tuple[int, float, int]] = []  # each block's last sort key (bisect to find a block)
        self.counts: dict[int, int] = {}
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[QueuedJob]:
        return chain.from_iterable(b.jobs for b in self.blocks)

    def runs(self) -> list[tuple[int, int]]:
        """[(class, jobs)] in queue order."""
        return [(c, k) for c, k in sorted(self.counts.items()) if k]

    def add(self, job: QueuedJob, key: tuple, c: int) -> None:
        sk = (c, job.first_submitted_at, job.id)
        if not self.blocks:
            self.blocks.append(Block())
            self.last.append(sk)
        bi = bisect_left(self.last, sk)
        if bi == len(self.blocks):
            bi -= 1
        b = self.blocks[bi]
        b.insert(bisect_left(b.sk, sk), job, key, c, sk)
        self.last[bi] = b.sk[-1]
        if len(b.jobs) > _SPLIT:
            nb = b.split()
            self.blocks.insert(bi + 1, nb)
            self.last[bi] = b.sk[-1]
            self.last.insert(bi + 1, nb.sk[-1])
        self.counts[c] = self.counts.get(c, 0) + 1
        self.size += 1

    def locate(self, job: QueuedJob, c: int) -> tuple[int, int] | None:
        """(block, position in it) of a kept job of this level; None: not kept here."""
        sk = (c, job.first_submitted_at, job.id)
        bi = bisect_left(self.last, sk)
        if bi == len(self.blocks):
            return None
        b = self.blocks[bi]
        pos = bisect_left(b.sk, sk)
        if pos == len(b.jobs) or b.jobs[pos] is not job:
            return None
        return bi, pos

    def remove(self, job: QueuedJob, c: int) -> bool:
        got = self.locate(job, c)
        if got is None:
            return False
        bi, pos = got
        b = self.blocks[bi]
        b.delete(pos)
        if b.jobs:
            self.last[bi] = b.sk[-1]
        else:
            del self.blocks[bi], self.last[bi]
        self.counts[c] -= 1
        self.size -= 1
        return True


class KeptQueue:
    """The queue kept across cycles (see the module's text), the cycle's node slots (``slots``:
    ``placement.KeptSlots``) and the running jobs' quota charges (``charges``:
    ``quota.KeptCharges``). Pure data; one per caller."""

    def __init__(self) -> None:
        self._classes: tuple[float, ...] | None = None  # the class thresholds the order was built with
        self._byid: dict[int, QueuedJob] = {}  # job id -> the kept job object
        self._levels: dict[int, Level] = {}
        self._reserved: dict[int, QueuedJob] = {}  # job id -> a kept job with reserved nodes
        self._keys: dict[tuple, int] = {}  # lane key and class -> an even int
        # the snapshot's queue tuple as of the last sync (held, so its id is not reused while kept)
        self._queued: tuple[QueuedJob, ...] | None = None
        self.rebuilds = 0  # (for tests and benchmarks) full builds
        self.accounts = 0  # (likewise) syncs made from the caller's account (QueueDelta), not a proof
        self.added = 0  # jobs added by the last sync (a full build adds every job)
        self.removed = 0  # jobs removed by the last sync
        # the cycle's node slots, kept for the next cycle (``placement.KeptSlots``)
        self.slots = KeptSlots()
        # the running jobs' GPUs by quota bucket, kept for the next cycle (``quota.KeptCharges``)
        self.charges = KeptCharges()
        # where each running job runs, as the victim table reads it (``victim_table.KeptPlaces``)
        self.places = KeptPlaces()

    def _reset(self, classes: tuple[float, ...] | None) -> None:
        self._classes = classes
        self._queued = None
        self._byid, self._levels, self._reserved, self._keys = {}, {}, {}, {}

    def _key(self, job: QueuedJob, c: int) -> int:
        """The job's lane key as an even int (one per distinct (nodes, GPUs a node, group, user,
        cross-zone, service class)): plus 1 when the job waited past the threshold, it keys
        the cycle's fast lane with a hash that costs nothing."""
        k = (_LANE_KEY(job), c)
        got = self._keys.get(k)
        if got is None:
            got = self._keys[k] = 2 * len(self._keys)
        return got

    def _class(self, job: QueuedJob) -> int:
        th = self._classes
        return bisect_right(th, job.attained_gpu_s) if th else 0

    def _add(self, job: QueuedJob) -> None:
        r, c = _rank(job.priority), self._class(job)
        key = self._key(job, c)
        lv = self._levels.get(r)
        if lv is None:
            lv = self._levels[r] = Level(r)
        lv.add(job, key, c)
        self._byid[job.id] = job
        if job.reserved_nodes:
            self._reserved[job.id] = job

    def _remove(self, job: QueuedJob) -> bool:
        del self._byid[job.id]
        self._reserved.pop(job.id, None)
        r = _rank(job.priority)
        lv = self._levels.get(r)
        if lv is None or not lv.remove(job, self._class(job)):
            return False
        if not lv.size:
            del self._levels[r]
        return True

    def sync(self, snapshot: Snapshot, policy: Policy) -> list[Level] | None:
        """The snapshot's queue in queue order (levels high first), or None where the kept
        order cannot serve this cycle (the cycle then orders from scratch)."""
        classes = tuple(policy.service_classes_gpu_s)
        if classes and policy.starvation_factor > 0:
            self._reset(None)  # a job's class depends on now: nothing kept
            return None
        queued = snapshot.queued
        if classes != self._classes:
            self._reset(classes)
        self.added = self.removed = 0
        if queued is self._queued:  # the very tuple of the last sync: the same jobs, nothing to prove
            return [self._levels[r] for r in sorted(self._levels, reverse=True)]
        delta = snapshot.queue_delta
        if delta is not None and delta.queued is queued and delta.base is self._queued and queued:
            return self._apply(delta)
        self._queued = None
        byid = self._byid
        ids = list(map(_ID, queued))
        idset = set(ids)
        if len(idset) != len(ids):
            return None  # a job twice: not a queue
        same = list(map(is_, map(byid.get, ids), queued))  # the very object kept for that id
        n_same = same.count(True)
        if n_same == len(queued) == len(byid):
            pass  # nothing arrived, left or changed
        elif not byid or len(queued) + len(byid) - 2 * n_same > len(queued) // 4 + 64:
            self._rebuild(queued)
        else:
            changed = list(compress(queued, map(not_, same)))  # arrived, or a new object (its row changed)
            gone = [byid[j.id] for j in changed if j.id in byid]
            if len(gone) < len(byid) - n_same:  # and the kept jobs no longer queued
                gone += map(byid.__getitem__, byid.keys() - idset)
            self._update(gone, changed, queued)
        self._queued = queued if type(queued) is tuple else None  # (a list may change in place)
        return [self._levels[r] for r in sorted(self._levels, reverse=True)]

    def _apply(self, delta: QueueDelta) -> list[Level]:
        """``sync`` from the caller's account of what changed since the last sync (``QueueDelta``:
        its base is the tuple of the last sync), in O(changes): the jobs gone and the kept
        objects of the changed jobs removed, the changed jobs added. The count must then agree
        (else the order is built again, as when the proof fails)."""
        queued, byid = delta.queued, self._byid
        self._queued = None
        self.accounts += 1
        if len(delta.changed) + len(delta.gone) > len(queued) // 4 + 64:
            self._rebuild(queued)
        else:
            gone = [byid[jid] for jid in delta.gone if jid in byid]
            changed = []
            for job in delta.changed:
                old = byid.get(job.id)
                if old is not job:  # (a job the account repeats unchanged is left as it is)
                    if old is not None:
                        gone.append(old)
                    changed.append(job)
            self._update(gone, changed, queued)
        self._queued = queued
        return [self._levels[r] for r in sorted(self._levels, reverse=True)]

    def _update(self, gone: list[QueuedJob], changed: list[QueuedJob], queued: tuple[QueuedJob, ...]) -> None:
        """Remove the kept objects ``gone``, add the new objects ``changed``; the kept count must
        then be the queue's, else (the proof or the account did not match the kept order) the
        order is built again."""
        ok = True
        for job in gone:
            ok = self._remove(job) and ok
        for job in changed:
            self._add(job)
        self.added, self.removed = len(changed), len(gone)
        if not ok or len(self._byid) != len(queued):
            self._rebuild(queued)

    def _rebuild(self, queued: tuple[QueuedJob, ...]) -> None:
        self._reset(self._classes)
        self.rebuilds += 1
        th = self._classes
        # order once as the cycle does (sort by id, then by submission; by class first)
        if th:
            items = sorted(queued, key=lambda j: (-_rank(j.priority), bisect_right(th, j.attained_gpu_s), j.first_submitted_at, j.id))
        else:
            items = sorted(queued, key=lambda j: (-_rank(j.priority), j.first_submitted_at, j.id))
        for job in items:
            r, c = _rank(job.priority), self._class(job)
            lv = self._levels.get(r)
            if lv is None:
                lv = self._levels[r] = Level(r)
            if not lv.blocks or len(lv.blocks[-1].jobs) >= _SPLIT // 2:
                lv.blocks.append(Block())
                lv.last.append((c, job.first_submitted_at, job.id))
            b = lv.blocks[-1]
            key = self._key(job, c)
            sk = (c, job.first_submitted_at, job.id)
            b.jobs.append(job)
            b.ids.append(job.id)
            b.keys.append(key)
            b.qat.append(job.queued_at)
            b.cls.append(c)
            b.sk.append(sk)
            lv.last[-1] = sk
            lv.counts[c] = lv.counts.get(c, 0) + 1
            lv.size += 1
            self._byid[job.id] = job
            if job.reserved_nodes:
                self._reserved[job.id] = job
        self.added, self.removed = len(queued), 0

    def positions(self, lv: Level, job_ids: Iterable[int]) -> dict[int, list[int]]:
        """Block -> the sorted positions in it (each once) of those of ``job_ids`` that are kept
        in ``lv``."""
        out: dict[int, list[int]] = {}
        for jid in job_ids:
            job = self._byid.get(jid)
            if job is None or _rank(job.priority) != lv.rank:
                continue
            got = lv.locate(job, self._class(job))
            if got is not None:
                out.setdefault(got[0], []).append(got[1])
        return {bi: sorted(set(lst)) for bi, lst in out.items()}

    def ids(self) -> dict[int, QueuedJob]:
        """The kept jobs by id (after ``sync``: exactly the snapshot's queue). Read only."""
        return self._byid

    def reserved(self) -> list[QueuedJob]:
        """The kept jobs with reserved nodes (in no particular order)."""
        return list(self._reserved.values())
