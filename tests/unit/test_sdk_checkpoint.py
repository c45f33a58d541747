"""CheckpointManager: host snapshot then background write, atomic rename, keep the last K,
report each checkpoint, resume."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from hai import sdk  # noqa: E402
from hai.sdk import core  # noqa: E402


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    for k in ("HAI_CONTROL_DIR", "HAI_RESUME_FROM", "HAI_CHECKPOINT_DIR", "RANK"):
        monkeypatch.delenv(k, raising=False)
    core._reset()
    yield


def _state(v: float = 1.0):
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(v)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def test_save_is_atomic_keeps_the_last_k_and_loads_back(tmp_path):
    m = sdk.CheckpointManager(tmp_path / "ck", keep=2, chunk_mib=0.001)  # tiny chunks: many writes
    model, opt = _state()
    paths = []
    for step in (10, 20, 30):
        with torch.no_grad():
            model.weight.fill_(float(step))
        paths.append(m.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, step))
    assert m.wait() == paths[-1]
    assert m.checkpoints() == paths[1:]  # the oldest was pruned
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-000000000020.pt", "ckpt-000000000030.pt"]  # no tmp files
    state = m.load(paths[-1])
    assert state["step"] == 30 and torch.equal(state["model"]["weight"], torch.full((3, 4), 30.0))
    assert m.latest() == paths[-1]


def test_the_snapshot_is_taken_at_save_time_even_if_training_goes_on(tmp_path):
    m = sdk.CheckpointManager(tmp_path, keep=1, max_write_mib_s=0.5)  # a slow disk
    big = torch.zeros(256, 1024)  # 1 MiB: takes ~2 s to write at 0.5 MiB/s
    path = m.save({"w": big}, 1)
    big.add_(1.0)  # the next optimizer steps modify the live tensor at once
    assert not os.path.exists(path)  # still being written in the background
    m.wait()
    assert torch.equal(m.load(path)["w"], torch.zeros(256, 1024))


def test_each_checkpoint_is_reported_to_the_platform(tmp_path, monkeypatch):
    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setenv("HAI_CONTROL_DIR", str(control))
    monkeypatch.setenv("HAI_CHECKPOINT_DIR", str(tmp_path / "job-ck"))
    m = sdk.CheckpointManager()  # defaults to HAI_CHECKPOINT_DIR
    assert m.directory == str(tmp_path / "job-ck")
    p = m.save({"x": torch.ones(3)}, 7, blocking=True)
    (ev,) = [json.loads(line) for line in (control / "events.0.jsonl").read_text().splitlines()]
    assert ev["type"] == "checkpoint" and ev["path"] == p and ev["step"] == 7 and ev["duration_s"] > 0


def test_resume_uses_hai_resume_from(tmp_path, monkeypatch):
    m = sdk.CheckpointManager(tmp_path)
    assert m.load() is None  # a fresh start
    p = m.save({"step": 5, "t": torch.arange(3)}, 5, blocking=True)
    monkeypatch.setenv("HAI_RESUME_FROM", p)
    assert sdk.resume_path() == p
    state = sdk.CheckpointManager(tmp_path).load()
    assert state["step"] == 5 and torch.equal(state["t"], torch.arange(3))


def test_only_the_writer_rank_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    m = sdk.CheckpointManager(tmp_path / "ck")
    assert not m.is_writer and m.save({"x": torch.ones(1)}, 1) is None
    assert not (tmp_path / "ck").exists()
    m_all = sdk.CheckpointManager(tmp_path / "ck", writer="all")
    p = m_all.save({"x": torch.ones(1)}, 1, blocking=True)
    assert os.path.basename(p) == "ckpt-rank1-000000000001.pt"


def test_a_failed_write_surfaces_and_leaves_no_partial_file(tmp_path):
    m = sdk.CheckpointManager(tmp_path / "ck", keep=1)
    good = m.save({"x": torch.ones(1)}, 1, blocking=True)
    m.save({"x": object.__new__(_Unpicklable)}, 2)  # serialisation fails in the background
    with pytest.raises(RuntimeError, match="checkpoint write failed"):
        m.wait()
    assert os.listdir(tmp_path / "ck") == [os.path.basename(good)]  # the last good one stays
    assert m.latest() == good


class _Unpicklable:
    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("cannot pickle this")


def test_stale_temporary_files_of_a_crashed_write_are_removed(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / ".ckpt-000000000001.pt.tmp-123").write_bytes(b"partial")
    m = sdk.CheckpointManager(d)
    assert os.listdir(d) == [] and m.latest() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_is_copied_to_pinned_host_memory_before_training_modifies_it(tmp_path):
    m = sdk.CheckpointManager(tmp_path, keep=2)
    w = torch.randn(4096, 4096, device="cuda")
    expected = w.cpu()
    for step in (1, 2):  # the second save reuses the pinned buffers
        path = m.save({"w": w, "step": step}, step)
        w.mul_(2.0).add_(1.0)  # queued right after the save: must not leak into the snapshot
        m.wait()
        state = m.load(path)
        assert state["w"].device.type == "cpu" and torch.equal(state["w"], expected)
        expected = w.cpu()
    assert m.last_snapshot_s is not None and m.last_snapshot_s < m.last_duration_s
