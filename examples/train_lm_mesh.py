"""The flagship LM's task with tensor parallel inside replicas: ``wrap(mesh=...)``.

The same data, sizes, optimizer and schedule as ``train_lm.py``, with a model
built the way tensor-parallel stacks build theirs: attention with separate
query, key, value and output projections, a feed-forward ``nn.Sequential``.
``--mesh tensor=2`` splits every block over 2 neighbouring ranks (the
projections by heads, the feed-forward by hidden units: column-wise in,
row-wise out) and replicates over the other nodes; ``--mesh shard=2,tensor=2``
also shards each replica's parameters with FSDP2 (3-D: replicate x shard x
tensor).  Attention finds its local heads from the width it is given, so the
same module runs split or whole.

A lost node's slices come from its twins in another replica (0 steps lost);
with one replica left, from the durable checkpoint.

Run it with ``ringmaster run examples/lm_mesh.yaml`` (2 nodes x 2 workers + 1
spare), and with a node killed: ``--kill-node-at-step 30``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from train_lm import FULL, SHORT, VOCAB, Size, Windows, corpus, warmup_cosine
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


class MeshLM(nn.Module):
    """Byte embeddings and positions, ``layers`` blocks, a norm and an output layer."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, size.width)
        self.position = nn.Parameter(torch.zeros(size.context, size.width))
        self.blocks = nn.ModuleList(Block(size.width, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.out = nn.Linear(size.width, VOCAB)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))


def tensor_plan(layers: int) -> dict[str, ParallelStyle]:
    """Each block's projections split by heads, its feed-forward by hidden units."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(layers):
        for name in ("q", "k", "v"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.2"] = RowwiseParallel()
    return plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", type=parse_mesh, default={"tensor": 2}, help="e.g. tensor=2")
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
    text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    split = int(len(text) * 0.95)
    train_data, held_out = text[:split], text[split:]

    session = runtime.init()
    total = args.steps or session.spec.max_steps
    model = session.wrap(
        MeshLM(size),
        mesh=args.mesh,
        tensor_plan=tensor_plan(size.layers) if args.mesh.get("tensor", 1) > 1 else None,
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
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
            (loss * loader.loss_scale / size.context).backward()
            opt.step()
            sched.step()
            if step + 1 == total:  # the held-out loss needs the group: evaluate in the last step
                final = {"eval_loss": evaluate(model, held_out, size.context)}
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
def evaluate(model: Any, data: torch.Tensor, context: int) -> float:
    """Mean next-byte loss on the held-out windows (every rank computes it alike)."""
    windows = Windows(data, context)
    x = torch.stack([windows[i][0] for i in range(len(windows))])
    y = torch.stack([windows[i][1] for i in range(len(windows))])
    return float(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))


if __name__ == "__main__":
    main()
