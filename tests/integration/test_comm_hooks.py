"""DDP comm hooks in real gloo processes: exactness, convergence, save/restore.

Two spawns of four processes each, emulating two "nodes" of two local ranks:

* exactness and state: the hierarchical all-reduce equals a plain all-reduce
  for awkward bucket sizes and through DDP with many small buckets; and
  every stateful hook, saved after some steps and restored into a fresh DDP
  model, produces exactly the gradients the uninterrupted run produces; and
  every compression kind, past its warm-up in a short run, sends fewer bytes
  and trains a small classifier on a fixed synthetic task well above chance;
* convergence (``long``): every compression kind trains that classifier to
  within one percentage point of uncompressed DDP.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest

from orchestrator.spec.job import CommSpec, CompressionKind, CompressionSpec
from tests.gloo import run_gloo

# One spawn serves several tests, so its fixture may take longer than the default timeout.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORLD = 4
LOCAL = 2
# Tiny, odd, and large enough for the pipelined path (PIPELINE_MIN_NUMEL).
SIZES = (1, 2, 3, 5, 7, 64, 1000, 1001, 4099, (1 << 20) + 3)

# --------------------------------------------------------------------------- task


def _task(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """A fixed 10-class problem: noisy Gaussian clusters through a random tanh map."""
    import torch

    g = torch.Generator().manual_seed(seed)
    means = torch.randn(10, 32, generator=g)
    proj = torch.randn(32, 32, generator=g) / 32**0.5

    def sample(n: int) -> tuple[Any, Any]:
        y = torch.randint(10, (n,), generator=g)
        x = torch.tanh((means[y] + 1.2 * torch.randn(n, 32, generator=g)) @ proj) * 2
        return x, y

    xt, yt = sample(4096)
    xv, yv = sample(4096)
    return xt, yt, xv, yv


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _spec(kind: str, hierarchical: bool = False, **params: Any) -> CommSpec:
    return CommSpec(
        compression=CompressionSpec(type=CompressionKind(kind), **params),
        hierarchical=hierarchical,
    )


def _setup(spec: CommSpec, bucket_cap_mb: float = 25.0) -> tuple[Any, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agents.comm import NodeLayout, build_comm_hook

    ddp = DDP(_model(), bucket_cap_mb=bucket_cap_mb)
    hook = build_comm_hook(spec, ddp, layout=NodeLayout.uniform(WORLD, LOCAL))
    hook.register(ddp)
    return ddp, hook


def _batch(xt: Any, yt: Any, rank: int, world: int, step: int) -> tuple[Any, Any]:
    import torch

    idx = torch.randint(len(xt), (32 * world,), generator=torch.Generator().manual_seed(step))
    mine = idx[rank::world]
    return xt[mine], yt[mine]


def _step(ddp: Any, hook: Any, opt: Any, x: Any, y: Any) -> None:
    import torch

    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    hook.after_optimizer_step(ddp)


def _optimizer(ddp: Any, spec: CommSpec, lr: float = 0.05) -> Any:
    import torch

    c = spec.compression
    # DGC momentum correction replaces the optimizer's momentum.
    dgc = c.type == CompressionKind.TOPK and c.momentum > 0
    return torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.0 if dgc else 0.9)


# --------------------------------------------------------------------------- exactness + state


def _exact_and_restore(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agents.comm import NodeLayout
    from agents.comm.gradient_hook import GradientHook
    from agents.comm.hierarchical import build_groups, hierarchical_average

    out: dict[str, Any] = {}
    groups = build_groups(NodeLayout.uniform(world, LOCAL))
    diffs = {}
    for n in SIZES:
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n))
        expected = x.clone()
        dist.all_reduce(expected)
        expected /= world
        diffs[n] = float((hierarchical_average(x, groups) - expected).abs().max())
    out["sizes"] = diffs

    # Through DDP, with buckets small enough that sizes are odd and buckets rebuild.
    xt, yt, _, _ = _task()
    plain = DDP(_model(), bucket_cap_mb=0.001)
    hier = DDP(_model(), bucket_cap_mb=0.001)
    GradientHook(hier, groups=groups).register(hier)
    ddp_diffs = []
    for step in range(3):
        x, y = _batch(xt, yt, rank, world, step)
        for m in (plain, hier):
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
        ddp_diffs.append(
            max(
                float((a.grad - b.grad).abs().max())
                for a, b in zip(plain.parameters(), hier.parameters(), strict=True)
            )
        )
    out["ddp"] = ddp_diffs

    out["safety"] = _safety_checks(rank, world)

    restore: dict[str, Any] = {}
    for name, spec in _restore_specs().items():
        restore[name] = _save_restore_grads(spec, rank, world, xt, yt)
    out["restore"] = restore
    out["trained"] = _train_all(rank, world, SHORT_STEPS)
    return out


def _safety_checks(rank: int, world: int) -> dict[str, Any]:
    """Drive a compressed exchange with a NaN on one rank, then an explosion on another."""
    import torch
    import torch.distributed as dist

    from agents.comm.api import CommMetrics
    from agents.comm.compressed import CompressedExchange
    from agents.comm.safety import SafetyPolicy
    from agents.comm.topk import TopKCompressor

    n = 4000
    metrics = CommMetrics()
    exchange = CompressedExchange(
        TopKCompressor(ratio=0.01),
        SafetyPolicy(warmup_steps=1, explode_factor=20.0, min_history=3),
        None,
        metrics,
    )
    buffers = {"residual": torch.zeros(n)}
    gen = torch.Generator().manual_seed(rank)
    seen: dict[str, Any] = {"warmup_dense": False}
    for step in range(8):
        grad = torch.randn(n, generator=gen)
        if step == 5 and rank == 1:
            grad[7] = float("nan")
        if step == 6 and rank == 2:
            grad *= 1e4
        before = buffers["residual"].clone()
        exact = grad.clone()
        dist.all_reduce(exact)
        exact /= world
        result = exchange.average(grad, buffers, "bucket", step, gen)
        if step == 0:
            seen["warmup_dense"] = bool(torch.allclose(result, exact, atol=1e-5))
        if step == 5:
            seen["nan_result"] = bool(torch.isnan(result).any())
            seen["nan_buffers_kept"] = bool(torch.equal(before, buffers["residual"]))
        if step == 6:
            # Dense fallback of the corrected gradient: exact average plus flushed residuals.
            flushed = before.clone()
            dist.all_reduce(flushed)
            flushed /= world
            seen["explode_dense"] = bool(torch.allclose(result, exact + flushed, rtol=1e-4))
            seen["explode_flushed"] = float(buffers["residual"].abs().sum())
        if step == 7:
            seen["compressed_after"] = metrics.current.compressed_buckets > 0
    seen["fallbacks"] = metrics.current.fallbacks
    return seen


def _restore_specs() -> dict[str, CommSpec]:
    return {
        "topk": _spec("topk", ratio=0.05, momentum=0.9, warmup_steps=4),
        "topk-inter-node": _spec(
            "topk",
            hierarchical=True,
            ratio=0.05,
            momentum=0.9,
            warmup_steps=4,
            inter_node_only=True,
        ),
        "qsgd": _spec("qsgd", bits=4, warmup_steps=2, dense_sync_every=5),
        "powersgd": _spec("powersgd", rank=2, start_iter=3),
        "localsgd": _spec("localsgd", period=3, start_iter=4),
    }


def _save_restore_grads(spec: CommSpec, rank: int, world: int, xt: Any, yt: Any) -> float:
    """Largest difference between the uninterrupted and the restored run's gradients."""
    import torch

    ddp, hook = _setup(spec)
    opt = _optimizer(ddp, spec)
    for step in range(8):
        _step(ddp, hook, opt, *_batch(xt, yt, rank, world, step))
    buf = io.BytesIO()
    torch.save(
        {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": hook.state_dict()},
        buf,
    )

    def run(ddp: Any, hook: Any, opt: Any) -> list[Any]:
        grads = []
        for step in range(8, 14):
            x, y = _batch(xt, yt, rank, world, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1).clone() for p in ddp.parameters()]))
            opt.step()
            hook.after_optimizer_step(ddp)
        return grads

    expected = run(ddp, hook, opt)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    ddp2, hook2 = _setup(spec)
    ddp2.module.load_state_dict(saved["model"])
    opt2 = _optimizer(ddp2, spec)
    opt2.load_state_dict(saved["opt"])
    hook2.load_state_dict(copy.deepcopy(saved["hook"]))
    got = run(ddp2, hook2, opt2)
    return max(float((a - b).abs().max()) for a, b in zip(expected, got, strict=True))


@pytest.fixture(scope="module")
def exact_results() -> list[dict[str, Any]]:
    return run_gloo(_exact_and_restore, WORLD, timeout=150)


def test_hierarchical_all_reduce_equals_plain_for_any_size(exact_results: Any) -> None:
    for result in exact_results:
        for n, diff in result["sizes"].items():
            assert diff < 1e-5, (n, diff)


def test_hierarchical_hook_gives_ddp_the_same_gradients(exact_results: Any) -> None:
    for result in exact_results:
        assert max(result["ddp"]) < 1e-5


def test_bad_gradients_fall_back_to_dense_on_every_rank(exact_results: Any) -> None:
    for seen in exact_results:
        assert seen["safety"]["warmup_dense"]
        assert seen["safety"]["nan_result"]
        assert seen["safety"]["nan_buffers_kept"]
        assert seen["safety"]["explode_dense"]
        assert seen["safety"]["explode_flushed"] == 0.0
        assert seen["safety"]["compressed_after"]
        assert seen["safety"]["fallbacks"] == 2


@pytest.mark.parametrize("name", sorted(_restore_specs()))
def test_hook_state_survives_save_and_restore(exact_results: Any, name: str) -> None:
    # PowerSGD all-reduces its uncompressed tensors concatenated in bucket order, and
    # the restored process's first bucket has another order: the same sums, with the
    # floating-point additions grouped differently.
    tolerance = 1e-6 if name == "powersgd" else 0.0
    for result in exact_results:
        assert result["restore"][name] <= tolerance, result["restore"]


# --------------------------------------------------------------------------- convergence

STEPS = 300
#: past every warm-up of the specs below (top-k's 30 dense steps the longest)
SHORT_STEPS = 40


def _convergence_specs() -> dict[str, CommSpec]:
    return {
        "none": _spec("none"),
        "fp16": _spec("fp16"),
        "bf16": _spec("bf16"),
        "powersgd": _spec("powersgd", rank=2, start_iter=10),
        "topk": _spec("topk", ratio=0.01, momentum=0.9, warmup_steps=30),
        "topk-inter-node": _spec(
            "topk",
            hierarchical=True,
            ratio=0.01,
            momentum=0.9,
            warmup_steps=30,
            inter_node_only=True,
        ),
        "qsgd8": _spec("qsgd", bits=8, warmup_steps=5),
        "qsgd4": _spec("qsgd", bits=4, warmup_steps=5),
        "qsgd8-inter-node": _spec(
            "qsgd", hierarchical=True, bits=8, warmup_steps=5, inter_node_only=True
        ),
        "localsgd": _spec("localsgd", period=4, start_iter=20),
    }


def _train_all(rank: int, world: int, steps: int) -> dict[str, dict[str, float]]:
    import torch

    xt, yt, xv, yv = _task()
    out: dict[str, dict[str, float]] = {}
    for name, spec in _convergence_specs().items():
        ddp, hook = _setup(spec, bucket_cap_mb=0.004)
        opt = _optimizer(ddp, spec)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
        for step in range(steps):
            _step(ddp, hook, opt, *_batch(xt, yt, rank, world, step))
            sched.step()
        with torch.no_grad():
            acc = float((ddp.module(xv).argmax(1) == yv).float().mean())
        last = hook.metrics.last
        out[name] = {
            "accuracy": acc,
            "ratio_vs_fp32": last.ratio_vs_fp32 if last else 1.0,
            "fallbacks": float(last.fallbacks if last else 0),
        }
    return out


@pytest.fixture(scope="module")
def trained() -> list[dict[str, dict[str, float]]]:
    return run_gloo(_train_all, WORLD, STEPS, timeout=240)


@pytest.fixture(scope="module")
def briefly_trained(exact_results: Any) -> list[dict[str, dict[str, float]]]:
    """Every spec trained :data:`SHORT_STEPS` steps, in the exactness spawn."""
    return [result["trained"] for result in exact_results]


# short form: test_every_compression_kind_trains_in_a_short_run (all specs, 40 steps)
@pytest.mark.long
@pytest.mark.parametrize("name", [n for n in _convergence_specs() if n != "none"])
def test_compressed_training_matches_dense_accuracy(trained: Any, name: str) -> None:
    dense = trained[0]["none"]["accuracy"]
    assert dense > 0.8
    got = trained[0][name]["accuracy"]
    assert abs(got - dense) <= 0.01, {k: v["accuracy"] for k, v in trained[0].items()}


@pytest.mark.parametrize("name", [n for n in _convergence_specs() if n != "none"])
def test_every_compression_kind_trains_in_a_short_run(briefly_trained: Any, name: str) -> None:
    """Past its warm-up every kind learns (10 classes: chance is 0.1), as dense DDP does;
    how close to dense it ends is the long test's above."""
    accuracies = {k: v["accuracy"] for k, v in briefly_trained[0].items()}
    assert accuracies["none"] > 0.8, accuracies
    assert accuracies[name] > 0.5, accuracies


def test_compressed_hooks_send_fewer_bytes(briefly_trained: Any) -> None:
    ratios = {k: v["ratio_vs_fp32"] for k, v in briefly_trained[0].items()}
    assert ratios["none"] == pytest.approx(1.0, rel=0.01)
    assert ratios["fp16"] == pytest.approx(2.0, rel=0.01)
    assert ratios["topk"] > 10
    assert ratios["qsgd8"] > 3
    assert ratios["qsgd4"] > ratios["qsgd8"]
