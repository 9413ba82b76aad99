"""PyTorch reference of COME's EATA (``BlueWhaleLab/COME:eata_come.py``): EATA's step (`eata.Reference`, as
``forward_and_adapt_eata``) with COME's entropy (`torch_reference.dirichlet_entropy`) for the reliability filter,
the weight and the loss; the redundancy check still on the softmax; the Fisher as EATA's (``main.py``)."""

from __future__ import annotations

from benchmarks.torch_methods import eata
from benchmarks.torch_reference import dirichlet_entropy


class Reference(eata.Reference):
  entropy = staticmethod(dirichlet_entropy)
