"""ETA: EATA without the Fisher regularizer (``make_reference('eta', ...)``): `eata.Reference` with
``fisher_alpha=0``, which needs no source batches."""

from __future__ import annotations

from benchmarks.torch_methods import eata


class Reference(eata.Reference):

  def __init__(self, model, batch_size, fisher_alpha: float = 0.0, **kw):
    super().__init__(model, batch_size, fisher_alpha=fisher_alpha, **kw)
