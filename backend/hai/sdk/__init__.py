"""The job-side SDK of the HAI platform: stdlib only, importable inside any training script.

    from hai import sdk

    ckpt = sdk.CheckpointManager(keep=3)
    state = ckpt.load()                       # None unless the platform resumes this job
    for step in range(start, total):
        if sdk.should_suspend():              # every rank, every step: same answer, same step
            ckpt.save(make_state(step), step, blocking=True)
            sdk.suspend_ready()               # every rank: the platform may stop us now
            return
        train_step(step)
        sdk.report_progress(step + 1, total, loss=loss)

Outside the platform (no HAI_CONTROL_DIR) every call is a no-op and should_suspend() is False.
See ``hai.sdk.core`` for the channel to the node agent.
"""

from hai.sdk.checkpoint import CheckpointManager
from hai.sdk.core import (
    barrier,
    checkpoint_dir,
    checkpointing,
    control_dir,
    on_platform,
    report_checkpoint,
    report_progress,
    report_storage_full,
    resume_path,
    StorageFull,
    storage,
    should_suspend,
    suspend_ready,
    suspend_requested,
)

__all__ = [
    "CheckpointManager",
    "barrier",
    "checkpoint_dir",
    "checkpointing",
    "control_dir",
    "on_platform",
    "report_checkpoint",
    "report_progress",
    "report_storage_full",
    "StorageFull",
    "storage",
    "resume_path",
    "should_suspend",
    "suspend_ready",
    "suspend_requested",
]
