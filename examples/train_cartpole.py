"""Reinforcement learning under ringmaster: REINFORCE on gymnasium's CartPole.

Every rank is an agent with its own environment and its own experience
buffer; DDP averages the policy gradients, so all ranks share one policy.
What a rank experiences at a step is fixed by ``(seed, step, rank)``: the
environment is reset with a seed derived from them, and actions are sampled
from a generator seeded the same way.  A replacement that takes over rank
``r`` at step ``s`` therefore collects exactly the episodes the dead node
would have collected, and a run with a node failure ends with the same policy
as a run without one.

Run it with ``ringmaster run examples/cartpole.yaml`` (needs the ``examples``
extra: ``pip install 'ringmaster[examples]'``).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

import gymnasium as gym
import torch
from torch import nn

from agents import runtime

OBSERVATIONS, ACTIONS = 4, 2


@dataclass
class Experience:
    """One rank's buffer for one training step: every episode it played."""

    observations: list[list[float]] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)

    def loss(self, policy: nn.Module) -> torch.Tensor:
        """REINFORCE: log-probabilities of the actions taken, weighted by the
        normalised return-to-go, recomputed in one batch through ``policy``
        (the DDP wrapper, so backward averages the gradients across ranks)."""
        logits = policy(torch.tensor(self.observations, dtype=torch.float32))
        log_probs = torch.log_softmax(logits, dim=-1)
        taken = log_probs.gather(1, torch.tensor(self.actions).unsqueeze(1)).squeeze(1)
        returns = torch.tensor(self.returns)
        weights = (returns - returns.mean()) / (returns.std() + 1e-6)
        return -(taken * weights).mean()


def episode_seed(seed: int, step: int, rank: int, episode: int) -> int:
    """A distinct, reproducible environment seed per (step, rank, episode)."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + episode) % (2**31 - 1)


@torch.no_grad()
def collect(
    env: gym.Env,  # type: ignore[type-arg]
    policy: nn.Module,
    *,
    seed: int,
    step: int,
    rank: int,
    episodes: int,
    max_len: int,
    gamma: float,
) -> Experience:
    """Play ``episodes`` episodes with the current policy; keep what REINFORCE needs."""
    buffer = Experience()
    for e in range(episodes):
        s = episode_seed(seed, step, rank, e)
        sampler = torch.Generator().manual_seed(s)
        obs, _ = env.reset(seed=s)
        rewards: list[float] = []
        for _ in range(max_len):
            probs = torch.softmax(policy(torch.as_tensor(obs, dtype=torch.float32)), dim=-1)
            action = int(torch.multinomial(probs, 1, generator=sampler).item())
            buffer.observations.append([float(v) for v in obs])
            buffer.actions.append(action)
            obs, reward, terminated, truncated, _ = env.step(action)
            rewards.append(float(reward))
            if terminated or truncated:
                break
        running, to_go = 0.0, []
        for r in reversed(rewards):
            running = r + gamma * running
            to_go.append(running)
        buffer.returns.extend(reversed(to_go))
        buffer.episode_lengths.append(len(rewards))
    return buffer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=2, help="episodes per rank per step")
    parser.add_argument("--max-len", type=int, default=200, help="longest episode")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", help="rank 0 writes the final policy here")
    parser.add_argument("--step-log", help="directory: each worker logs the steps it applied")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # the same initial policy everywhere
    session = runtime.init()
    policy = session.wrap(nn.Sequential(nn.Linear(OBSERVATIONS, 32), nn.Tanh(), nn.Linear(32, 2)))
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    session.track(model=policy, optimizer=opt)
    env = gym.make("CartPole-v1")
    log_every = int(os.environ.get("RINGMASTER_LOG_EVERY", "10"))
    mean_len = 0.0
    for step in session.steps():
        with session.guard():
            buffer = collect(
                env,
                policy.module,  # acting needs no gradients; the loss goes through DDP
                seed=args.seed,
                step=step,
                rank=session.rank,
                episodes=args.episodes,
                max_len=args.max_len,
                gamma=args.gamma,
            )
            opt.zero_grad()
            loss = buffer.loss(policy)
            loss.backward()
            opt.step()
            if args.step_time:
                time.sleep(args.step_time)
        if session.step_failed:
            continue  # the step runs again, with the same episodes, in the next generation
        mean_len = sum(buffer.episode_lengths) / len(buffer.episode_lengths)
        session.report(loss=loss.item(), episode_length=mean_len)
        if args.step_log:
            with open(os.path.join(args.step_log, f"{session.worker}-{os.getpid()}.log"), "a") as f:
                f.write(f"{step} {session.generation} {session.rank} {time.time()}\n")
        if session.rank == 0 and step % log_every == 0:
            print(f"step {step} mean episode length {mean_len:.1f}", flush=True)
    if session.finished and session.rank == 0:
        print(f"finished at step {session.step}: mean episode length {mean_len:.1f}", flush=True)
        if args.out:
            torch.save(policy.state_dict(), args.out)
    env.close()
    session.close()


if __name__ == "__main__":
    main()
