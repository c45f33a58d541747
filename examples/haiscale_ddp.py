#!/usr/bin/env python
"""A real torch DDP training that the HAI platform can suspend and resume exactly.

A small MLP learns a fixed random "teacher" on synthetic data. Every batch is a pure function
of (seed, step, rank), so a run that is suspended at step k and resumed from its checkpoint sees
exactly the batches an uninterrupted run sees and ends with the same parameters: the last lines
print the final step and a checksum of the parameters to compare.

    # by hand, one process
    python examples/haiscale_ddp.py --steps 200
    # by hand, 2 processes on CPU
    torchrun --nproc-per-node 2 examples/haiscale_ddp.py --steps 200
    # on the platform (torch job: RANK, WORLD_SIZE, MASTER_ADDR, ... come from the agent)
    hai submit --type torch --nodes 2 --gpus-per-node 1 -- python examples/haiscale_ddp.py --steps 2000

Uses the job SDK: should_suspend() every step, CheckpointManager (asynchronous, atomic, keeps
the last K) every --ckpt-every steps and when asked to suspend, then suspend_ready() and exit 0;
resumes from resume_path() (HAI_RESUME_FROM). gloo on CPU, nccl when CUDA is available.
Options may also come from the environment: HAI_EXAMPLE_STEPS, HAI_EXAMPLE_STEP_SLEEP, ...
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import os
import sys
import time


def _env(name: str, default):
    v = os.environ.get(f"HAI_EXAMPLE_{name.upper()}")
    return type(default)(v) if v is not None else default


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=_env("steps", 200), help="total training steps")
    p.add_argument("--batch-size", type=int, default=_env("batch_size", 64), help="per rank")
    p.add_argument("--dim", type=int, default=_env("dim", 64), help="input width")
    p.add_argument("--hidden", type=int, default=_env("hidden", 256))
    p.add_argument("--layers", type=int, default=_env("layers", 3))
    p.add_argument("--lr", type=float, default=_env("lr", 1e-3))
    p.add_argument("--seed", type=int, default=_env("seed", 1234))
    p.add_argument("--ckpt-every", type=int, default=_env("ckpt_every", 0), help="0: only on suspend")
    p.add_argument("--keep", type=int, default=_env("keep", 3), help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=_env("log_every", 20))
    p.add_argument("--step-sleep", type=float, default=_env("step_sleep", 0.0),
                   help="seconds of extra work per step (to make a short run last)")
    p.add_argument("--warmup", type=int, default=_env("warmup", 10), help="steps excluded from throughput")
    p.add_argument("--backend", default=_env("backend", "auto"), choices=["auto", "gloo", "nccl"])
    p.add_argument("--ckpt-dir", default=os.environ.get("HAI_CHECKPOINT_DIR") or "checkpoints")
    return p.parse_args(argv)


def _rank_ordered_allreduce(world: int):
    import torch
    import torch.distributed as dist

    def hook(_state, bucket):
        flat = bucket.buffer()
        parts = [torch.empty_like(flat) for _ in range(world)]
        fut = dist.all_gather(parts, flat, async_op=True).get_future()

        def reduce(_f):
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            flat.copy_(total.div_(world))
            return flat

        return fut.then(reduce)

    return hook


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from hai import sdk

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # deterministic and polite on shared CPUs
    torch.use_deterministic_algorithms(True, warn_only=True)
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    distributed = world > 1
    if distributed:
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    # the model and the teacher depend only on the seed
    torch.manual_seed(args.seed)
    dims = [args.dim] + [args.hidden] * (args.layers - 1) + [1]
    mods: list[nn.Module] = []
    for i in range(len(dims) - 1):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            mods.append(nn.GELU())
    model = nn.Sequential(*mods).to(device)
    teacher = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(args.seed + 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None) \
        if distributed else model
    if distributed and world > 2:
        # Exact resume at any world size. A ring all-reduce adds each gradient element in an
        # order set by where the element falls in DDP's bucket, and DDP rebuilds its buckets after
        # the first step of every (re)start, so a resumed run would add in another order for one
        # step and drift in the last bits. Summing in rank order makes the result independent of
        # the bucket layout. (With two ranks a + b == b + a exactly, so the default hook is kept.)
        ddp.register_comm_hook(None, _rank_ordered_allreduce(world))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def batch(step: int):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 4099 + rank)
        x = torch.randn(args.batch_size, args.dim, generator=g)
        noise = 0.01 * torch.randn(args.batch_size, 1, generator=g)
        x = x.to(device, non_blocking=True)
        return x, x @ teacher + noise.to(device, non_blocking=True)

    ckpt = sdk.CheckpointManager(args.ckpt_dir, keep=args.keep)
    start = 0
    state = ckpt.load(map_location=device)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        log(f"resumed from {sdk.resume_path()} at step {start}")
    log(f"training: world_size={world} backend={backend if distributed else 'none'} device={device} "
        f"steps={args.steps} start={start} restart_count={os.environ.get('HAI_RESTART_COUNT', '0')}")

    def snapshot(step: int) -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "seed": args.seed, "world_size": world}

    def shut_down() -> None:
        """Destroy the process groups and free them now, while the interpreter is whole. A gloo
        worker thread may still hold the last gradient all-reduce, and freeing it takes the GIL:
        during the interpreter's exit that kills the thread inside a destructor and aborts the
        rank after its work is done ("terminate called without an active exception", exit 134; a
        torch race, seen on loaded CPUs). DDP goes first (its reducer would free the group with
        the GIL held, which such a thread waits for), then the group's Python handle, which frees
        it without the GIL and joins its threads once they have let go of their work."""
        nonlocal ddp
        group = ddp.process_group
        dist.destroy_process_group()
        ddp = None
        gc.collect()
        del group

    loss_fn = nn.MSELoss()
    t_start = None
    timed_steps = 0
    step = start
    while step < args.steps:
        if sdk.should_suspend():
            t0 = time.time()
            path = ckpt.save(snapshot(step), step, blocking=True)
            sdk.suspend_ready()  # every rank; waits for rank 0's write (barrier)
            log(f"suspended at step {step}: checkpoint {path} ({time.time() - t0:.3f}s)")
            if distributed:
                shut_down()
            return 0
        if step - start == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            t_start = time.perf_counter()
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        step += 1
        if step == start + 1:
            log(f"first step done at {time.time():.3f}")  # time-to-first-step on a (re)start
        if t_start is not None:
            timed_steps += 1
        if args.log_every and step % args.log_every == 0:
            lv = loss.item()
            log(f"step {step}/{args.steps} loss {lv:.6f}")
            sdk.report_progress(step, args.steps, loss=lv)
        if args.ckpt_every and step % args.ckpt_every == 0 and step < args.steps:
            ckpt.save(snapshot(step), step)  # asynchronous: training goes on while it is written
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t_start if t_start is not None else None
    ckpt.wait()
    sdk.report_progress(step, args.steps)

    h = hashlib.sha256()
    total = 0.0
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
        total += float(t.double().sum())
    if elapsed and timed_steps:
        sps = timed_steps * args.batch_size * world / elapsed
        log(f"throughput samples/s={sps:.1f} steps/s={timed_steps / elapsed:.2f} "
            f"timed_steps={timed_steps} world_size={world}")
    log(f"final step={step} checksum={h.hexdigest()} param_sum={total:.10f}")
    if distributed:
        dist.barrier()
        shut_down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
