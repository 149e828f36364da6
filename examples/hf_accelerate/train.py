"""A Hugging Face Accelerate loop with in-memory checkpoints and survivors: every step saved into the agent's memory,
and on a fault only the failed worker's process replaced; the others run the loop again in their processes
(``aelastic.integrations.huggingface``, ``aelastic.worker.restartable``; docs/howto/huggingface.md).

    aelastic run --standalone --nproc-per-node 2 --max-restarts 1 examples/hf_accelerate/train.py --crash-at-step 20

A tiny GPT-2 built from its configuration (nothing is downloaded) learns random token sequences (fixed seeds, CPU,
DDP over gloo, dropout on). ``--crash-at-step N``: rank ``--crash-rank`` raises at step N of the first attempt;
every rank then prints ``rank R (pid P): restored step S from memory``, skips the batches of the epoch already
trained, and rank 0 prints a digest of the final parameters: a run with a fault and one without print the same.

For the benchmark (benchmarks/frameworks.py): ``--ballast-mib`` (a larger checkpoint), ``--step-time`` (a longer
step), ``--save-every N`` (0: no checkpoint); under torchrun, ``--checkpoint-dir DIR`` is Accelerate's own recipe
(``accelerator.save_state`` every N steps, ``load_state`` on a restart).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

import aelastic.checkpoint
from aelastic.integrations.huggingface import load_state, save_state
from aelastic.worker import restartable


class Progress:
    """The step, for Accelerate's own checkpoints (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = -1

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


@restartable
def train(args: argparse.Namespace) -> None:
    """One round: called again, in this process, when another worker fails or the world changes."""
    # Accelerate keeps its state (the process group's world) for the process's life: a survivor's next round starts
    # from a fresh one, made from this round's environment.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)  # the process group of this round
    set_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    # Weights that do not train (as a frozen embedding): a larger checkpoint, the same arithmetic.
    model.register_parameter("ballast", torch.nn.Parameter(torch.zeros(args.ballast_mib * 2**18), requires_grad=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    tokens = torch.randint(config.vocab_size, (4096, 32), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(tokens, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": -1}
    who = f"rank {accelerator.process_index} (pid {os.getpid()})"
    disk = args.checkpoint_dir is not None and not aelastic.checkpoint.available()
    accelerator.register_for_checkpointing(progress := Progress())
    if load_state(state):
        loaded = aelastic.checkpoint.last_loaded()
        print(f"{who}: restored step {state['step']} from {loaded and loaded.source}", flush=True)
    elif disk and os.path.isdir(args.checkpoint_dir):
        accelerator.load_state(args.checkpoint_dir)  # torchrun's recipe: Accelerate's own files
        state["step"] = progress.step
        print(f"{who}: restored step {state['step']} from disk", flush=True)
    else:
        print(f"{who}: starts", flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    step = state["step"] + 1
    batches = accelerator.skip_first_batches(loader, step % len(loader))  # this epoch's batches already trained
    model.train()
    while step < args.steps:
        for batch in batches:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            # After the gradients' all-reduce: every rank has finished the step before, its save included.
            if first_attempt and step == args.crash_at_step and accelerator.process_index == args.crash_rank:
                raise RuntimeError(f"a fault at step {step}")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            time.sleep(args.step_time)
            state["step"] = progress.step = step
            if args.save_every and (step + 1) % args.save_every == 0:
                if disk:
                    accelerator.save_state(args.checkpoint_dir)
                else:
                    save_state(state, step=step)
            if accelerator.is_main_process and args.step_log:  # the benchmark's, run from the repository
                from benchmarks.steplog import log_step

                log_step(args.step_log, step)
            step += 1
            if step == args.steps:
                break
        batches = loader
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).parameters()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in weights)).hexdigest()
        print(f"final parameters {digest[:16]} after step {args.steps - 1}", flush=True)
    del model, optimizer, loader, scheduler, state  # the DDP wrapper holds the group: freed before it is destroyed
    accelerator.end_training()  # destroys the process group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--ballast-mib", type=int, default=0, help="MiB of frozen weights (a larger checkpoint)")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (a larger model)")
    parser.add_argument("--save-every", type=int, default=1, help="steps between checkpoints; 0: none")
    parser.add_argument("--checkpoint-dir", default=None, help="without an agent: Accelerate's own files there")
    parser.add_argument("--step-log", default=None, help="rank 0 appends each step's end here (the benchmark's)")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
