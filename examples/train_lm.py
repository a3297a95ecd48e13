"""A small causal transformer language model, trained elastically on Python's own source.

The flagship example: what a real training loop looks like under ringmaster.

* data: the bytes of a module that ships with Python (``argparse.py``, about
  100 KB), or with ``--corpus stdlib`` the source of the whole standard library
  (about 30 MB, which a small model cannot memorize; whole files, one in
  twenty, held out: about 1.5 MB), cut into fixed windows;
  :class:`agents.runtime.data.ElasticLoader` reads each step's global batch
  with two worker processes, so a step that runs again reads the same batch
  and a replacement continues at the exact sample;
* model: a byte-level causal transformer (pre-norm encoder layers with a causal
  mask), trained under ``torch.autocast("cpu", dtype=torch.bfloat16)``;
* optimizer: AdamW with a linear warm-up and a cosine decay (``LambdaLR``);
* gradient accumulation: the rank's share of the global batch is split into
  ``--accum`` micro-batches, all but the last under ``model.no_sync()``;
* tracked state: model, optimizer, scheduler, EMA weights and a token counter,
  all of which reach a replacement (from a live peer) and durable checkpoints
  (saved asynchronously every ``checkpoint.every_steps``).

Run it with ``ringmaster run examples/lm.yaml``, with a node killed mid-run with
``ringmaster run examples/lm.yaml --kill-node-at-step 50``: both end with the
same loss.  ``--short`` (or ``RINGMASTER_LM_SHORT=1``) trains a smaller model on
shorter windows, for the tests; ``--width`` and ``--layers`` make it larger (the
cross-site benchmark widens it so that its gradients weigh on a slow link).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset

from agents import runtime
from agents.runtime.data import ElasticLoader

VOCAB = 256  # bytes


@dataclass(frozen=True)
class Size:
    """Model and data sizes."""

    context: int = 64
    width: int = 64
    layers: int = 2
    heads: int = 4
    global_batch: int = 16


FULL = Size()
SHORT = Size(context=32, width=32, layers=1, heads=2, global_batch=8)


#: ``--eval-every``: the held-out bytes of each logged loss (the first ones: the same
#: text at every step and in every run, cheap enough to log often).
EVAL_EVERY_BYTES = 256 * 1024
#: The corpora ``--corpus`` names.
CORPORA = ("argparse", "stdlib")
#: ``stdlib``: a file whose path hashes to 0 modulo this is held out (one in twenty).
HELD_OUT_ONE_IN = 20


def corpus() -> bytes:
    """The text: the source of ``argparse``, as installed with this Python."""
    return Path(argparse.__file__).read_bytes()


def stdlib_files() -> list[tuple[str, Path]]:
    """Every ``.py`` file of this Python's standard library (installed packages not),
    by its path under the library's root, in that order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not {"site-packages", "dist-packages"} & set(rel.parts):
            found.append((rel.as_posix(), path))
    return sorted(found)


def split_corpus(name: str = "argparse") -> tuple[torch.Tensor, torch.Tensor]:
    """The text as bytes, to train on and held out.

    ``argparse``: its first 95 % and the rest.  ``stdlib``: whole files, a file
    held out when the CRC-32 of its path is 0 modulo :data:`HELD_OUT_ONE_IN`, so that
    no held-out text was seen in training and every machine with this Python
    splits alike.
    """
    if name == "argparse":
        text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
        split = int(len(text) * 0.95)
        return text[:split], text[split:]
    if name != "stdlib":
        raise ValueError(f"--corpus {name!r}: not one of {', '.join(CORPORA)}")
    train, held = bytearray(), bytearray()
    for rel, path in stdlib_files():
        into = held if zlib.crc32(rel.encode()) % HELD_OUT_ONE_IN == 0 else train
        into += path.read_bytes() + b"\n"
    return (
        torch.frombuffer(train, dtype=torch.uint8),
        torch.frombuffer(held, dtype=torch.uint8),
    )


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i``: the bytes at ``[i*c, i*c + c)`` and the same shifted by one."""

    def __init__(self, data: torch.Tensor, context: int) -> None:
        self.data = data
        self.context = context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.context : (i + 1) * self.context + 1].long()
        return chunk[:-1], chunk[1:]


class ByteLM(nn.Module):
    """Embeddings, pre-norm transformer layers under a causal mask, a tied output."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, size.width)
        self.position = nn.Parameter(torch.zeros(size.context, size.width))
        layer = nn.TransformerEncoderLayer(
            size.width,
            size.heads,
            dim_feedforward=4 * size.width,
            dropout=0.0,  # no RNG in the step: every rank's step is a function of its data
            batch_first=True,
            norm_first=True,
        )
        self.layers = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(size.width)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied output: small logits at the start
        mask = nn.Transformer.generate_square_subsequent_mask(size.context)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]
        h = self.layers(h, mask=self.mask[:t, :t], is_causal=True)
        return self.norm(h) @ self.embed.weight.t()


class TokenCount:
    """Tokens trained on by all ranks together: tracked, so it survives recoveries."""

    def __init__(self) -> None:
        self.tokens = 0

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens = int(state["tokens"])


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Any:
    """LR factor: linear warm-up over ``warmup`` steps, then a cosine down to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, context: int, batch: int = 256) -> float:
    """Mean next-byte loss (fp32) on the held-out windows, ``batch`` windows at a time."""
    windows = Windows(data, context)
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        pairs = [windows[i] for i in range(start, min(start + batch, len(windows)))]
        x = torch.stack([p[0] for p in pairs])
        y = torch.stack([p[1] for p in pairs])
        logits = model(x).float().reshape(-1, VOCAB)
        total += float(F.cross_entropy(logits, y.reshape(-1), reduction="sum"))
        count += y.numel()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=0, help="0: the job's max_steps")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--short", action="store_true", help="the small form, for tests")
    parser.add_argument("--width", type=int, default=0, help="0: the form's own (64)")
    parser.add_argument("--layers", type=int, default=0, help="0: the form's own (2)")
    parser.add_argument("--out", help="directory: each rank writes its final numbers there")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--corpus", choices=CORPORA, default="argparse", help="the text")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights' and data order's")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="steps: rank 0 logs the loss on the first 256 KB held out (0: never)",
    )
    parser.add_argument(
        "--final-eval",
        choices=("every-rank", "first-of-node"),
        default="every-rank",
        help="who evaluates the final model on the whole held-out text (first-of-node: "
        "each node's first worker; the node's ranks hold one replica)",
    )
    args = parser.parse_args()
    size = SHORT if args.short or os.environ.get("RINGMASTER_LM_SHORT") == "1" else FULL
    size = dataclasses.replace(
        size, width=args.width or size.width, layers=args.layers or size.layers
    )

    torch.manual_seed(args.seed)
    train_data, held_out = split_corpus(args.corpus)

    session = runtime.init()
    total = args.steps or session.spec.max_steps
    net = ByteLM(size)
    model = session.wrap(net)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, total))
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.95))
    seen = TokenCount()
    session.track(model=model, optimizer=opt, scheduler=sched, ema=ema, tokens=seen)
    loader = ElasticLoader(
        Windows(train_data, size.context),
        session,
        size.global_batch,
        seed=args.seed + 1,
        num_workers=2,
    )

    loss_sum = torch.zeros(())
    for step in session.steps(total or None):
        if session.rank == 0 and args.eval_every and step and step % args.eval_every == 0:
            # past the step boundary: an outer sync due there is applied (the global model)
            started = time.monotonic()
            loss = evaluate(net, held_out[:EVAL_EVERY_BYTES], size.context)
            took = time.monotonic() - started
            print(f"eval after step {step - 1} loss {loss:.4f} ({took:.2f}s)", flush=True)
        with session.guard():
            x, y = loader.batch(step)
            opt.zero_grad()
            loss_sum = torch.zeros(())
            # mean over the step's global batch: per-rank sums, scaled, averaged by DDP
            scale = loader.loss_scale / size.context
            micro = list(zip(x.tensor_split(args.accum), y.tensor_split(args.accum), strict=True))
            for i, (xb, yb) in enumerate(micro):
                last = i == len(micro) - 1
                with model.no_sync() if not last else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = model(xb)
                    loss = F.cross_entropy(
                        logits.float().reshape(-1, VOCAB), yb.reshape(-1), reduction="sum"
                    )
                    (loss * scale).backward()
                loss_sum += loss.detach()
            opt.step()
            sched.step()
            ema.update_parameters(net)
        if session.step_failed:
            continue  # the step runs again in the next generation
        seen.tokens += size.global_batch * size.context
        mean = float(loss_sum) / (len(y) * size.context)
        session.report(loss=mean, samples=len(y))
        if session.rank == 0 and step % args.log_every == 0:
            lr = sched.get_last_lr()[0]
            print(f"step {step} loss {mean:.4f} lr {lr:.2e} world {session.world_size}", flush=True)
    loader.close()
    evaluates = args.final_eval == "every-rank" or session.local_rank == 0
    if session.finished and evaluates:
        final = {
            "step": session.step,
            "eval_loss": evaluate(net, held_out, size.context),
            "ema_eval_loss": evaluate(ema.module, held_out, size.context),
            "train_loss": float(loss_sum) / (len(y) * size.context),
            "tokens": seen.tokens,
            "recoveries": session.recoveries,
            "outer_steps": list(session.outer_steps),
        }
        if session.rank == 0:
            print(
                f"finished at step {session.step}: held-out loss {final['eval_loss']:.6f} "
                f"(EMA {final['ema_eval_loss']:.6f}), {seen.tokens} tokens",
                flush=True,
            )
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"final-rank{session.rank}.json")
            with open(path, "w") as f:
                json.dump(final, f)
    session.close()


if __name__ == "__main__":
    main()
