"""How far each encoding of the outer syncs moves a pseudo-gradient, measured in one process.

``sync.outer_quantization`` chooses how the sites' pseudo-gradients travel
(:mod:`agents.sync.quantize`): float32, bf16, 8-bit integers, and two 4-bit
forms, the uniform integers (``4bit``) and the 4-bit floats of Streaming
DiLoCo (``e3m0``: a sign and 3 exponent bits), each of the narrow ones with a
float32 scale per block of 256 values.  For each encoding and each data set
this gives the relative L2 error ``|decode(encode(x)) - x| / |x|`` and the
cosine similarity of ``decode(encode(x))`` with ``x``:

* ``lm``: real pseudo-gradients.  The flagship example's byte-level LM
  (``examples/train_lm.py``, widened as the cross-site benchmark widens it:
  ``--width 256 --layers 4``, 3.24 M parameters) trains ``--warmup`` steps
  with AdamW on Python's ``argparse.py``; from there two sites each train
  ``--inner-steps`` steps on their own batches, and each site's pseudo-gradient
  is the parameters before minus after (the whole model, as DiLoCo sends it).
  The figures are the mean over the two sites.
* ``gaussian``: ``--values`` values of a standard normal.
* ``student_t3``: ``--values`` values of a Student t with 3 degrees of freedom
  (heavy tails: a few values far larger than the rest, as in a pseudo-gradient
  where a few parameters moved much more than most).

Deterministic (seeded).  ``python benchmarks/outer_quantization_error.py``;
the last line is one JSON object.  ``--smoke``: a model of width 32 and one
layer, 3 steps each, 65,536 synthetic values.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from agents.sync.outer_step import flatten, write_back  # noqa: E402
from agents.sync.quantize import BLOCK, decode, encode, payload_bytes  # noqa: E402
from benchmarks._smoke import parse, result_line  # noqa: E402
from orchestrator.spec.sync import OuterQuantization  # noqa: E402

__all__ = ["KINDS", "SMOKE", "error", "lm_pseudo_gradients", "synthetic"]

#: The encodings measured (float32 moves nothing).
KINDS = (
    OuterQuantization.BF16,
    OuterQuantization.INT8,
    OuterQuantization.INT4,
    OuterQuantization.E3M0,
)
#: ``--smoke``: the smallest run through every row.
SMOKE = {"width": 32, "layers": 1, "warmup": 3, "inner_steps": 3, "values": 1 << 16}


def error(x: torch.Tensor, kind: OuterQuantization) -> dict[str, float]:
    """Relative L2 error and cosine similarity of ``x`` after ``kind``'s round trip."""
    y = decode(encode(x, kind), kind, x.numel()).double()
    x = x.double()
    rel = float((y - x).norm() / x.norm())
    cosine = float(torch.dot(x, y) / (x.norm() * y.norm()))
    return {"rel_l2": rel, "cosine": cosine}


def synthetic(values: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A standard normal, and a Student t with 3 degrees of freedom (z over the root of
    a chi-square of 3 over 3), each of ``values`` float32 values."""
    g = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(values, generator=g)
    z = torch.randn(values, generator=g)
    chi2 = torch.randn(3, values, generator=g).pow(2).sum(dim=0)
    return {"gaussian": gaussian, "student_t3": z / (chi2 / 3).sqrt()}


def lm_pseudo_gradients(
    width: int, layers: int, warmup: int, inner_steps: int, seed: int = 0
) -> tuple[list[torch.Tensor], int]:
    """Two sites' pseudo-gradients of the example LM, and its parameter count (see the
    module docstring).  Each site reads its own half of each step's windows."""
    import torch.nn.functional as F

    from examples.train_lm import FULL, VOCAB, ByteLM, Windows, split_corpus

    torch.manual_seed(seed)
    size = dataclasses.replace(FULL, width=width, layers=layers)
    windows = Windows(split_corpus()[0], size.context)
    model = ByteLM(size)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    batch = size.global_batch

    def step(k: int, site: int, sites: int) -> None:
        start = (k * batch) % (len(order) - batch)
        share = order[start : start + batch].tensor_split(sites)[site]
        x = torch.stack([windows[int(i)][0] for i in share])
        y = torch.stack([windows[int(i)][1] for i in share])
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for k in range(warmup):
        step(k, 0, 1)
    start_params = flatten(params)
    start_opt = copy.deepcopy(opt.state_dict())
    out = []
    for site in (0, 1):
        with torch.no_grad():
            write_back(params, start_params)
        opt.load_state_dict(start_opt)
        for k in range(warmup, warmup + inner_steps):
            step(k, site, 2)
        out.append(start_params - flatten(params))
    return out, start_params.numel()


def _shape(x: torch.Tensor) -> dict[str, float]:
    """How heavy ``x``'s tails are: its largest magnitude and its 99th percentile over its
    RMS (a Gaussian's: about 4.9 and 2.6 for a million values), and the mean over its
    blocks of 256 of the block's largest magnitude over the block's RMS (what a block's
    scale sees; a Gaussian's: about 2.9)."""
    rms = float(x.pow(2).mean().sqrt())
    sample = x.abs()[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    p99 = float(sample[: 1 << 20].quantile(0.99))
    rows = x[: x.numel() // BLOCK * BLOCK].view(-1, BLOCK)
    block = rows.abs().amax(dim=1) / rows.pow(2).mean(dim=1).sqrt().clamp_min(1e-30)
    return {
        "max_over_rms": float(x.abs().max()) / rms,
        "p99_over_rms": p99 / rms,
        "block_max_over_rms": float(block.mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256, help="the LM's width")
    parser.add_argument("--layers", type=int, default=4, help="the LM's layers")
    parser.add_argument("--warmup", type=int, default=50, help="steps before the sites part")
    parser.add_argument("--inner-steps", type=int, default=30, help="each site's steps (H)")
    parser.add_argument("--values", type=int, default=1 << 20, help="values per synthetic set")
    args = parse(parser, SMOKE)

    began = time.monotonic()
    pseudo, n_params = lm_pseudo_gradients(args.width, args.layers, args.warmup, args.inner_steps)
    trained_s = time.monotonic() - began
    data: dict[str, list[torch.Tensor]] = {"lm": pseudo}
    data.update({name: [x] for name, x in synthetic(args.values).items()})

    figures: dict[str, Any] = {
        "lm_parameters": n_params,
        "lm_warmup_steps": args.warmup,
        "lm_inner_steps": args.inner_steps,
        "lm_train_s": round(trained_s, 1),
        "synthetic_values": args.values,
    }
    for kind in KINDS:
        per_value = payload_bytes(1 << 20, kind) / (1 << 20)
        figures[f"{kind.value}_bytes_per_value"] = round(per_value, 4)
    head = "tails / rms: max, p99, block max"
    print(f"{'data':<12} {head:<34}" + "".join(f"{k.value:>18}" for k in KINDS))
    for name, samples in data.items():
        shape = [_shape(x) for x in samples]
        tails = {k: sum(s[k] for s in shape) / len(shape) for k in shape[0]}
        for k, v in tails.items():
            figures[f"{name}_{k}"] = round(v, 2)
        tail = ", ".join(f"{v:.1f}" for v in tails.values())
        cells = []
        for kind in KINDS:
            errors = [error(x, kind) for x in samples]
            rel = sum(e["rel_l2"] for e in errors) / len(errors)
            cosine = sum(e["cosine"] for e in errors) / len(errors)
            figures[f"{name}_{kind.value}_rel_l2"] = round(rel, 5)
            figures[f"{name}_{kind.value}_cosine"] = round(cosine, 6)
            cells.append(f"{rel:9.4f} / {cosine:6.4f}")
        print(f"{name:<12} {tail:<34}" + "".join(f"{c:>18}" for c in cells))
    print("cells: relative L2 error / cosine similarity, after the encoding's round trip")
    better = {
        name: min(("4bit", "e3m0"), key=lambda k: figures[f"{name}_{k}_rel_l2"]) for name in data
    }
    figures["better_4bit_form"] = better
    assert all(math.isfinite(v) for v in figures.values() if isinstance(v, float))
    print(result_line(figures, args.smoke))


if __name__ == "__main__":
    main()
