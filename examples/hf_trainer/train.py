"""A Hugging Face Trainer with in-memory checkpoints and survivors: saved into the agent's memory every step, restored
from it when the job restarts (``aelastic.integrations.huggingface``), and on a fault only the failed worker's process
replaced: the others train again, with a new Trainer, in their processes (``aelastic.worker.restartable``;
docs/howto/huggingface.md).

    aelastic run --standalone --nproc-per-node 2 --max-restarts 1 examples/hf_trainer/train.py --crash-at-step 20

A tiny GPT-2 built from its configuration (nothing is downloaded) learns random token sequences (fixed seeds, CPU,
DDP over gloo, dropout on). ``--crash-at-step N``: rank ``--crash-rank`` raises during step N of the first
attempt; every rank then prints ``rank R (pid P): restored step S from memory`` (or ``... from replica from HOST``,
``... from disk PATH``; the survivor with the pid it had) and the Trainer goes on from step S + 1. Rank 0 prints a
digest of the final parameters: a run with a fault and one without print the same.

For the benchmark (benchmarks/frameworks.py): ``--ballast-mib`` (a larger checkpoint), ``--step-time`` (a longer
step), ``--save-every N`` (0: no checkpoint); under torchrun, ``--checkpoint-dir DIR`` is the Trainer's own recipe (a
checkpoint on disk every N steps, resumed from the newest one).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time
from typing import Any

import torch
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import aelastic.checkpoint
from aelastic.integrations.huggingface import InMemoryCheckpoint
from aelastic.worker import restartable


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random sequences of tokens, the same for every run."""

    def __init__(self, count: int, length: int, vocabulary: int) -> None:
        self.ids = torch.randint(vocabulary, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Crash(TrainerCallback):  # type: ignore[misc]
    """Raises on one rank before a step's optimizer step (after the gradients' all-reduce: every rank has finished the
    step before, its save included), in the first attempt only; sleeps ``step_time`` in every step (the compute of a
    larger model)."""

    def __init__(self, step: int | None, rank: int, step_time: float, step_log: str | None) -> None:
        self.step, self.rank, self.step_time, self.step_log = step, rank, step_time, step_log

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.step_time)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The benchmark's, run from the repository; after the callbacks before this one (the checkpoint's).
        if args.process_index == 0 and self.step_log:
            from benchmarks.steplog import log_step

            log_step(self.step_log, state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and state.global_step == self.step and args.process_index == self.rank:
            raise RuntimeError(f"a fault at step {state.global_step}")


@restartable
def train(args: argparse.Namespace) -> None:
    """One round: called again, in this process, when another worker fails or the world changes (a new Trainer for
    the round's world; the healthy workers keep their processes)."""
    # The Trainer's Accelerate state (the process group's world) lasts the process's life: a survivor's next round
    # starts from a fresh one, made from this round's environment.
    AcceleratorState._reset_state(reset_partial_state=True)
    memory = InMemoryCheckpoint(every_n_steps=max(args.save_every, 1))
    own_checkpoints = args.checkpoint_dir is not None and args.save_every and not aelastic.checkpoint.available()
    training = TrainingArguments(
        output_dir=args.checkpoint_dir or "/tmp/aelastic-hf-trainer",
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        seed=0,
        data_seed=0,
        use_cpu=True,
        ddp_backend="gloo",
        logging_strategy="no",
        report_to=[],
        save_strategy="steps" if own_checkpoints else "no",
        save_steps=max(args.save_every, 1),
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=args.width, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    # Weights that do not train (as a frozen embedding): a larger checkpoint, the same arithmetic.
    model.register_parameter("ballast", torch.nn.Parameter(torch.zeros(args.ballast_mib * 2**18), requires_grad=False))
    callbacks = [memory] if args.save_every else []
    callbacks.append(Crash(args.crash_at_step, args.crash_rank, args.step_time, args.step_log))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(4096, 32, config.vocab_size),
                      callbacks=callbacks)  # fmt: skip
    who = f"rank {training.process_index} (pid {os.getpid()})"
    resume = memory.resume_path()
    if resume is not None:
        loaded = aelastic.checkpoint.last_loaded()
        assert loaded is not None
        print(f"{who}: restored step {loaded.step} from {loaded.source}", flush=True)
    elif own_checkpoints and os.path.isdir(args.checkpoint_dir):
        resume = get_last_checkpoint(args.checkpoint_dir)
        if resume is not None:
            print(f"{who}: restored {resume} from disk", flush=True)
    if resume is None:
        print(f"{who}: starts", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"final parameters {digest[:16]} after step {trainer.state.global_step}", flush=True)
    # The DDP wrapper's reducer holds the process group: freed at the interpreter's end, gloo's destructor joins its
    # threads while holding the GIL one of them waits for (a hang, under torchrun too). Free it, then the group, now.
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--width", type=int, default=64, help="the model's hidden size (its state grows with it)")
    parser.add_argument("--ballast-mib", type=int, default=0, help="MiB of frozen weights (a larger checkpoint)")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (a larger model)")
    parser.add_argument("--save-every", type=int, default=1, help="steps between checkpoints; 0: none")
    parser.add_argument("--checkpoint-dir", default=None, help="without an agent: the Trainer's own checkpoints")
    parser.add_argument("--step-log", default=None, help="rank 0 appends each step's end here (the benchmark's)")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
