"""A frozen model kept in CPU memory and moved to its compute device only while it computes: the reward pool's model
sources and the distillation teacher (one mechanism for both)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Offloadable:
    """Mixin of a holder of ``self.model`` (set after :meth:`init_residency`), ``self.device`` (where it computes) and
    ``self.offload``: :meth:`on_device` puts the model there for a block and, with ``offload``, back in CPU memory
    after it, else it stays resident from its first use. ``n_loads``/``n_offloads`` count the moves and
    ``scored_on`` records the parameters' device at each use (what the tests and the metrics read)."""

    model: torch.nn.Module | None
    device: torch.device
    offload: bool

    def init_residency(self) -> None:
        self.resident = False  # True while the model sits on the compute device (between uses: offload off)
        self.n_loads = self.n_offloads = 0  # moves to the device / back to CPU memory
        self.scored_on: list[str] = []  # the parameters' device at each use

    @property
    def parameter_device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The model on the compute device for the block (and back to CPU memory after it, with offload)."""
        if not self.resident:
            self.model.to(self.device)
            self.resident = True
            self.n_loads += 1
        self.scored_on.append(str(self.parameter_device))
        try:
            yield
        finally:
            if self.offload:
                self.model.to("cpu")  # a no-op copy on CPU-only machines; the bookkeeping is the same
                self.resident = False
                self.n_offloads += 1
