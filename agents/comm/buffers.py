"""Per-parameter hook buffers that survive DDP's bucket rebuild and checkpoints.

Error feedback and momentum correction keep one float32 value per gradient
element.  DDP hands the hook flat buckets whose membership changes once
after the first iteration (DDP rebuilds buckets in gradient-ready order) and
may differ in a restarted process.  Keying buffers by bucket index would then
apply one parameter's residual to another.  :class:`BufferStore` keeps flat
buffers per bucket *signature* (the names of its parameters, in order) for
speed, and splits them into per-parameter pieces whenever a bucket with a
new signature claims one of their parameters, and when saving.  The saved
form is per parameter, so it loads into any bucketing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from agents.comm.api import HookStateError

Signature = tuple[str, ...]


class BufferStore:
    """Named flat float32 buffers per bucket signature, saved per parameter.

    Args:
        names: buffer names (``("residual",)``, ``("momentum", "residual")``).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._flat: dict[Signature, tuple[list[int], dict[str, torch.Tensor]]] = {}
        self._owner: dict[str, Signature] = {}
        self._pieces: dict[str, dict[str, torch.Tensor]] = {}

    def get(
        self, signature: Signature, numels: Sequence[int], length: int | None = None
    ) -> dict[str, torch.Tensor]:
        """The flat buffers of one bucket, created from saved pieces or zeros.

        Args:
            signature: parameter names of the bucket, in bucket order.
            numels: element counts of those parameters.
            length: buffer length when larger than the bucket (zero padding
                that is never saved).
        """
        if not self.names:
            return {}
        total = max(int(sum(numels)), length or 0)
        found = self._flat.get(signature)
        if found is not None:
            if found[1][self.names[0]].numel() == total:
                return found[1]
            self._explode(signature)
        for name in signature:
            owner = self._owner.get(name)
            if owner is not None and owner != signature:
                self._explode(owner)
        flat = {n: torch.zeros(total, dtype=torch.float32) for n in self.names}
        offset = 0
        for pname, count in zip(signature, numels, strict=True):
            saved = self._pieces.pop(pname, None)
            if saved is not None:
                for n in self.names:
                    piece = saved.get(n)
                    if piece is not None and piece.numel() == count:
                        flat[n][offset : offset + count].copy_(piece.reshape(-1))
            self._owner[pname] = signature
            offset += count
        self._flat[signature] = (list(numels), flat)
        return flat

    def _explode(self, signature: Signature) -> None:
        numels, flat = self._flat.pop(signature)
        for pname, piece in self._split(signature, numels, flat).items():
            self._pieces[pname] = piece
            self._owner.pop(pname, None)

    def _split(
        self, signature: Signature, numels: Sequence[int], flat: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        offset = 0
        for pname, count in zip(signature, numels, strict=True):
            out[pname] = {n: flat[n][offset : offset + count].clone() for n in self.names}
            offset += count
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"buffers": {param name: {buffer name: tensor}}}`` (copies)."""
        params: dict[str, dict[str, torch.Tensor]] = {
            p: {n: t.clone() for n, t in bufs.items()} for p, bufs in self._pieces.items()
        }
        for signature, (numels, flat) in self._flat.items():
            params.update(self._split(signature, numels, flat))
        return {"names": list(self.names), "buffers": params}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace all buffers with saved ones (applied lazily as buckets arrive).

        Raises:
            HookStateError: the saved buffers have different names.
        """
        names = tuple(state.get("names", ()))
        if names != self.names:
            raise HookStateError(
                f"saved hook buffers are {list(names)} but this hook keeps {list(self.names)}; "
                "was the checkpoint written with a different compression type?"
            )
        self._flat.clear()
        self._owner.clear()
        self._pieces = {
            str(p): {str(n): t.detach().to(torch.float32).clone() for n, t in bufs.items()}
            for p, bufs in state["buffers"].items()
        }
