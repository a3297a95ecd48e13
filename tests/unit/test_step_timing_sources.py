"""Where a step's compute and wait come from: the host's clock, sharded collectives, the GPU.

* :class:`StepTiming` on the host's clock: a sharded model's collectives (each
  one's duration a wait) and DDP's last bucket, and which steps are timed;
* :class:`DeviceStepTiming`'s bookkeeping, run against a simulated device
  (its only seams: where an event comes from and which stream is current):
  a host that runs ahead of its device reads nothing until the device has
  done the work (never a synchronisation), then every step in order; the last
  bucket's events count; events are reused; a new generation drops what had
  not resolved.  The same class on a real GPU: ``tests/cuda/test_cuda_step_timing.py``.
"""

from __future__ import annotations

import pytest
import torch

from agents.runtime.device_timing import MAX_PENDING, DeviceStepTiming, step_timing_for
from agents.runtime.step_timing import StepTiming

pytestmark = pytest.mark.unit


def test_a_sharded_step_waits_for_as_long_as_its_collectives_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([0.0, 1.0, 1.25, 1.5, 1.6, 2.0, 3.0, 3.5])
    monkeypatch.setattr("agents.runtime.step_timing.time.monotonic", lambda: next(clock))
    timing = StepTiming()
    timing.step_done()  # 0.0: the clock starts
    started = timing.collective_started()  # 1.0: the forward's all-gather
    timing.collective_ended(started)  # 1.25
    started = timing.collective_started()  # 1.5: the backward's reduce-scatter
    timing.collective_ended(started)  # 1.6
    timing.step_done()  # 2.0
    assert (timing.steps, timing.wait_s) == (1, pytest.approx(0.35))
    assert timing.compute_s == pytest.approx(1.65)
    timing.step_done()  # 3.0: no collective in the step: not timed
    assert timing.steps == 1
    timing.reset()
    timing.step_done()  # 3.5: the clock starts again
    assert timing.steps == 1


def test_a_wait_longer_than_its_step_is_the_whole_step() -> None:
    timing = StepTiming()
    timing.add(0.1, 0.3)
    timing.add(0.1, -0.1)
    assert timing.steps == 2
    assert timing.wait_s == pytest.approx(0.1) and timing.compute_s == pytest.approx(0.1)


def test_the_host_clock_times_a_cpu_worker() -> None:
    assert type(step_timing_for(torch.device("cpu"))) is StepTiming
    assert type(step_timing_for(None)) is StepTiming


class _Device:
    """A simulated GPU: each stream runs its queued work in order; the clock says how
    far the device has got (seconds)."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.streams: dict[str, float] = {}  # a stream's queue ends at this device time
        self.current = "compute"

    def run(self, seconds: float, stream: str | None = None) -> None:
        """Queue ``seconds`` of work on a stream (the current one by default)."""
        name = stream or self.current
        self.streams[name] = max(self.streams.get(name, 0.0), self.clock) + seconds


class _Event:
    created = 0

    def __init__(self, device: _Device) -> None:
        self.device, self.at = device, -1.0
        _Event.created += 1

    def record(self, stream: str) -> None:
        self.at = max(self.device.streams.get(stream, 0.0), self.device.clock)

    def query(self) -> bool:
        return self.device.clock >= self.at

    def elapsed_time(self, end: _Event) -> float:
        assert self.query() and end.query(), "elapsed_time of an event not yet completed"
        return (end.at - self.at) * 1000.0


class _Simulated(DeviceStepTiming):
    def __init__(self, device: _Device) -> None:
        super().__init__(torch.device("cuda", 0))
        self.sim = device

    def _new_event(self) -> _Event:  # type: ignore[override]
        return _Event(self.sim)

    def _current_stream(self) -> str:  # type: ignore[override]
        return self.sim.current


def _ddp_step(dev: _Device, timing: DeviceStepTiming, compute: float, wait: float) -> None:
    """One DDP step queued by a host that does not wait for the device: backward's two
    buckets, the last one's all-reduce waiting ``wait`` for a peer, the optimizer."""
    dev.run(compute / 2)
    timing.posted()  # the first bucket
    dev.run(compute / 2)
    timing.posted()  # the last bucket: its gradients are ready here
    dev.streams["nccl"] = dev.streams["compute"] + wait  # the all-reduce ends
    dev.current = "callback"  # the future's callback: its stream waits for the collective
    dev.streams["callback"] = dev.streams["nccl"]
    timing.completed()
    dev.current = "compute"
    dev.streams["compute"] = dev.streams["nccl"]  # the optimizer waits for the gradients
    timing.step_done()


def test_device_timing_reads_each_step_once_the_device_has_run_it() -> None:
    dev = _Device()
    timing = _Simulated(dev)
    timing.step_done()  # the clock starts (an event at device time 0)
    for _ in range(3):  # the host queues 3 steps of 40 ms compute, 10 ms waiting
        _ddp_step(dev, timing, 0.04, 0.01)
    assert (timing.steps, timing.pending) == (0, 3)  # nothing read: no synchronisation
    dev.clock = 0.05  # the device has done the first step only
    timing.resolve()
    assert (timing.steps, timing.pending) == (1, 2)
    assert timing.compute_s == pytest.approx(0.04) and timing.wait_s == pytest.approx(0.01)
    _ddp_step(dev, timing, 0.02, 0.0)  # its step_done resolves what the device has done
    dev.clock = 2.0
    timing.resolve()
    assert (timing.steps, timing.pending) == (4, 0)
    assert timing.compute_s == pytest.approx(0.14) and timing.wait_s == pytest.approx(0.03)


def test_device_timing_counts_a_sharded_model_s_collectives_and_reuses_its_events() -> None:
    dev = _Device()
    timing = _Simulated(dev)
    timing.step_done()
    before = _Event.created
    for _ in range(50):
        dev.run(0.01)  # forward
        dev.current = "all_gather"
        dev.streams["all_gather"] = dev.streams["compute"]
        started = timing.collective_started()
        dev.run(0.005)  # the all-gather, waiting for a peer
        timing.collective_ended(started)
        dev.current = "compute"
        dev.streams["compute"] = dev.streams["all_gather"]
        dev.run(0.02)  # backward and the optimizer
        timing.step_done()
        dev.clock = dev.streams["compute"]  # the device keeps up
    timing.resolve()
    assert timing.steps == 50
    assert timing.wait_s == pytest.approx(50 * 0.005)
    assert timing.compute_s == pytest.approx(50 * 0.03)
    assert _Event.created - before < 10  # a few events, reused step after step


def test_device_timing_forgets_what_a_broken_generation_left_unresolved() -> None:
    dev = _Device()
    timing = _Simulated(dev)
    timing.step_done()
    _ddp_step(dev, timing, 0.04, 0.0)
    assert timing.pending == 1
    timing.reset()  # the group broke: its events may never complete
    assert (timing.pending, timing.steps) == (0, 0)
    dev.clock = 10.0
    timing.step_done()  # the new generation's first step starts the clock only
    _ddp_step(dev, timing, 0.04, 0.0)
    dev.clock = 20.0
    timing.resolve()
    assert timing.steps == 1 and timing.compute_s == pytest.approx(0.04)


def test_a_device_far_behind_its_host_keeps_a_bounded_queue() -> None:
    dev = _Device()
    timing = _Simulated(dev)
    timing.step_done()
    for _ in range(MAX_PENDING + 5):
        _ddp_step(dev, timing, 0.01, 0.0)
    assert timing.pending == MAX_PENDING
    dev.clock = 1e6
    timing.resolve()
    assert timing.steps == MAX_PENDING
