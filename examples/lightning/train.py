"""A PyTorch Lightning Trainer with in-memory checkpoints and survivors: saved into the agent's memory every step,
restored from it when the job restarts (``aelastic.integrations.lightning``), and on a fault only the failed worker's
process replaced: the others fit again, with a new Trainer, in their processes (``aelastic.worker.restartable``;
docs/howto/lightning.md).

    aelastic run --standalone --nproc-per-node 2 --max-restarts 1 examples/lightning/train.py --crash-at-step 30

A small regression model on synthetic data (fixed seeds, CPU, DDP over gloo). ``--crash-at-step N``: rank
``--crash-rank`` raises during step N of the first attempt; every rank then prints ``rank R (pid P): restored step S
from memory`` (or ``... from replica from HOST``, ``... from disk PATH``; the survivor with the pid it had) and goes
on from step S + 1. Rank 0 prints a digest of the final parameters: a run with a fault and one without print the
same.

For the benchmark (benchmarks/frameworks.py): ``--ballast-mib`` (a larger checkpoint), ``--step-time`` (a longer
step), ``--save-every N`` (0: no checkpoint); under torchrun, ``--checkpoint-dir DIR`` is Lightning's own recipe
(``ModelCheckpoint`` every N steps, resumed from ``last.ckpt``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import aelastic.checkpoint
from aelastic.integrations.lightning import MEMORY_PATH, InMemoryCheckpoint
from aelastic.worker import restartable


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader that Lightning can resume in the middle of an epoch: its state is the batches it gave in the
    current epoch, and a restored one skips them (a checkpoint of every step restores mid-epoch). torchdata's
    StatefulDataLoader does the same for any dataset."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given = self.skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"given": self.given}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["given"]

    def __iter__(self) -> Iterator[Any]:
        self.given, skip, self.skip = 0, self.skip, 0
        for index, batch in enumerate(super().__iter__()):
            self.given = index + 1
            if index >= skip:
                yield batch


class Regression(L.LightningModule):
    def __init__(self, crash_at: int | None, crash_rank: int, ballast_mib: int = 0, step_time: float = 0.0,
                 step_log: str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()  # as most modules do: the in-memory checkpoint leaves them out
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        # Weights that do not train (as a frozen embedding): a larger checkpoint, the same arithmetic.
        self.ballast = torch.nn.Parameter(torch.zeros(ballast_mib * 2**18), requires_grad=False)
        self.crash_at, self.crash_rank, self.step_time, self.step_log = crash_at, crash_rank, step_time, step_log

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_time)  # the compute of a larger model
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # After the gradients' all-reduce: every rank has finished the step before, its save included.
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.global_step == self.crash_at and self.global_rank == self.crash_rank:
            raise RuntimeError(f"a fault at step {self.global_step}")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The benchmark's, run from the repository; after the callbacks' hooks (the checkpoint's).
        if self.global_rank == 0 and self.step_log:
            from benchmarks.steplog import log_step

            log_step(self.step_log, self.global_step)

    def on_fit_start(self) -> None:
        if self.trainer.ckpt_path == MEMORY_PATH:  # fit restored the step from the agents' memory
            loaded = aelastic.checkpoint.last_loaded()
            assert loaded is not None
            print(f"rank {self.global_rank} (pid {os.getpid()}): restored step {loaded.step} from {loaded.source}",
                  flush=True)  # fmt: skip

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@restartable
def train(args: argparse.Namespace) -> None:
    """One round: called again, in this process, when another worker fails or the world changes (a new Trainer for
    the round's world; the healthy workers keep their processes)."""
    L.seed_everything(0, workers=True)
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    model = Regression(args.crash_at_step, args.crash_rank, args.ballast_mib, args.step_time, args.step_log)
    callbacks: list[L.Callback] = []
    memory = InMemoryCheckpoint(every_n_steps=max(args.save_every, 1))
    if args.save_every and aelastic.checkpoint.available():
        callbacks.append(memory)
    disk = args.checkpoint_dir is not None and args.save_every and not aelastic.checkpoint.available()
    if disk:  # torchrun's recipe: Lightning's own checkpoint files
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.save_every,
                                         save_last=True, save_top_k=0))  # fmt: skip
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu", devices=local, num_nodes=world // local, strategy="ddp" if world > 1 else "auto",
        max_steps=args.steps, callbacks=callbacks, logger=False, enable_checkpointing=bool(disk),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    ckpt_path = memory.resume_path()  # restored by fit, into the model's own tensors (see Regression.on_fit_start)
    if ckpt_path is None and disk and os.path.exists(os.path.join(args.checkpoint_dir, "last.ckpt")):
        ckpt_path = os.path.join(args.checkpoint_dir, "last.ckpt")
        print(f"rank {rank} (pid {os.getpid()}): restored {ckpt_path} from disk", flush=True)
    elif ckpt_path is None:
        print(f"rank {rank} (pid {os.getpid()}): starts", flush=True)
    trainer.fit(model, ResumableLoader(data, batch_size=32, sampler=sampler), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"final parameters {digest[:16]} after step {trainer.global_step}", flush=True)
    # Lightning leaves the process group to the interpreter's end, where gloo's threads can abort the process
    # ("terminate called without an active exception", under torchrun too): free the DDP wrapper's cycles and
    # destroy the group while Python is alive.
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--ballast-mib", type=int, default=0, help="MiB of frozen weights (a larger checkpoint)")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (a larger model)")
    parser.add_argument("--save-every", type=int, default=1, help="steps between checkpoints; 0: none")
    parser.add_argument("--checkpoint-dir", default=None, help="without an agent: ModelCheckpoint's files there")
    parser.add_argument("--step-log", default=None, help="rank 0 appends each step's end here (the benchmark's)")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
