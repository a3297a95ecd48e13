"""The flagship LM's task with tensor parallel inside replicas: ``wrap(mesh=...)``.

The same data, sizes, optimizer and schedule as ``train_lm.py``, with a model
built the way tensor-parallel stacks build theirs: attention with separate
query, key, value and output projections, a feed-forward ``nn.Sequential``.
``--mesh tensor=2`` splits every block over 2 neighbouring ranks (the
projections by heads, the feed-forward by hidden units: column-wise in,
row-wise out) and replicates over the other nodes; ``--mesh shard=2,tensor=2``
also shards each replica's parameters with FSDP2 (replicate x shard x tensor);
``--mesh pipeline=2,tensor=2`` cuts the model into 2 pipeline stages of 2
tensor-parallel ranks each (3-D: replicate x pipeline x tensor; 1F1B over
``--microbatches``).  The model is an ``nn.Sequential`` (embeddings, blocks,
norm, output layer) so that a pipeline can cut it anywhere; attention finds its
local heads from the width it is given, so the same module runs split or whole.

A lost node's slices come from its twins in another replica (0 steps lost);
with one replica left, from the durable checkpoint.

Run it with ``ringmaster run examples/lm_mesh.yaml`` (2 nodes x 2 workers + 1
spare), and with a node killed: ``--kill-node-at-step 30``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from train_lm import FULL, SHORT, VOCAB, Size, Windows, split_corpus, warmup_cosine
from train_sharded import parse_mesh

from agents import runtime
from agents.runtime.data import ElasticLoader


class Attention(nn.Module):
    """Causal self-attention; its heads are as many as its projections' width holds."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape

        def heads(x: torch.Tensor) -> torch.Tensor:  # (b, t, local width) → (b, heads, t, d)
            return x.view(b, t, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), is_causal=True
        )
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Embed(nn.Module):
    """Byte embeddings plus learnt positions."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, size.width)
        self.position = nn.Parameter(torch.zeros(size.context, size.width))
        nn.init.normal_(self.tokens.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.position[: tokens.shape[1]]


def mesh_lm(size: Size) -> nn.Sequential:
    """Embeddings, ``layers`` blocks, a norm and the output layer, in a row: a pipeline
    cuts it between any two of them."""
    parts: dict[str, nn.Module] = {"embed": Embed(size)}
    parts |= {f"block{i}": Block(size.width, size.heads) for i in range(size.layers)}
    parts |= {"norm": nn.LayerNorm(size.width), "out": nn.Linear(size.width, VOCAB)}
    return nn.Sequential(collections.OrderedDict(parts))


def tensor_plan(layers: int) -> dict[str, ParallelStyle]:
    """Each block's projections split by heads, its feed-forward by hidden units."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(layers):
        for name in ("q", "k", "v"):
            plan[f"block{i}.attn.{name}"] = ColwiseParallel()
        plan[f"block{i}.attn.o"] = RowwiseParallel()
        plan[f"block{i}.mlp.0"] = ColwiseParallel()
        plan[f"block{i}.mlp.2"] = RowwiseParallel()
    return plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", type=parse_mesh, default={"tensor": 2}, help="e.g. tensor=2")
    parser.add_argument("--microbatches", type=int, default=2, help="with mesh pipeline > 1")
    parser.add_argument("--steps", type=int, default=0, help="0: the job's max_steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--short", action="store_true", help="the small form, for tests")
    parser.add_argument("--out", help="directory: each rank writes its final numbers there")
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()
    size = SHORT if args.short or os.environ.get("RINGMASTER_LM_SHORT") == "1" else FULL
    if args.mesh.get("tensor", 1) > size.heads:
        size = dataclasses.replace(size, heads=args.mesh["tensor"])  # a head per rank at least

    torch.manual_seed(0)
    train_data, held_out = split_corpus()

    session = runtime.init()
    total = args.steps or session.spec.max_steps
    pipelined = args.mesh.get("pipeline", 1) > 1
    # a pipeline's loss is per micro-batch, averaged over them: each is weighted so the
    # average is the step's loss (training) or the mean over the held-out tokens
    weight = [1.0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (
            F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1), reduction="sum") * weight[0]
        )

    model = session.wrap(
        mesh_lm(size),
        mesh=args.mesh,
        tensor_plan=tensor_plan(size.layers) if args.mesh.get("tensor", 1) > 1 else None,
        pipeline=runtime.Pipeline(loss_fn, args.microbatches) if pipelined else None,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, total))
    session.track(model=model, optimizer=opt, scheduler=sched)
    # tensor-parallel ranks of a replica read the same share of each step's batch
    loader = ElasticLoader(
        Windows(train_data, size.context), model.data, size.global_batch, seed=1, num_workers=0
    )
    mean, final = float("nan"), {}
    for step in session.steps(total or None):
        with session.guard():
            x, y = loader.batch(step)
            opt.zero_grad()
            scale = loader.loss_scale / size.context  # this share's part of the step's mean
            if pipelined:
                weight[0] = scale * args.microbatches
                loss = model.step(x, y) / scale  # the share's summed loss, as below
            else:
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
                (loss * scale).backward()
            opt.step()
            sched.step()
            if step + 1 == total:  # the held-out loss needs the group: evaluate in the last step
                final = {"eval_loss": evaluate(model, held_out, size.context, weight)}
        if session.step_failed:
            continue  # the step runs again in the next generation
        mean = float(loss) / (len(y) * size.context)
        session.report(loss=mean, samples=len(y))
        if session.rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {mean:.4f} world {session.world_size}", flush=True)
    loader.close()
    if session.finished:
        final.update(step=session.step, train_loss=mean, recoveries=session.recoveries)
        if session.rank == 0 and "eval_loss" in final:  # not when resumed already finished
            print(f"finished at step {session.step}: held-out loss {final['eval_loss']:.6f}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"final-rank{session.rank}.json"), "w") as f:
                json.dump(final, f)
    session.close()


@torch.no_grad()
def evaluate(model: Any, data: torch.Tensor, context: int, weight: list[float]) -> float:
    """Mean next-byte loss on the held-out windows (every rank computes it alike;
    a pipeline through its stages, weighting its micro-batches' sums by ``weight``)."""
    windows = Windows(data, context)
    count = len(windows) - len(windows) % 4  # whole micro-batches for a pipeline of up to 4
    x = torch.stack([windows[i][0] for i in range(count)])
    y = torch.stack([windows[i][1] for i in range(count)])
    if model.runner is not None:
        weight[0] = model.runner.pipeline.microbatches / y.numel()
        return float(model.step(x, y, train=False))
    return float(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))


if __name__ == "__main__":
    main()
