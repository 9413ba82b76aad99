"""A run's progress on disk, so that an interrupted run resumes exactly where it stopped.

* `UnitProgress` -- where one (method, seed) run stands: stream position and the open segment's tallies;
* `RunProgress` -- everything a run has produced so far: records, curves, finished units, the open unit;
* `Resume` -- ``<output>/resume/progress.json`` (replaced atomically) pointing at an orbax state directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, Optional

import numpy as np

from pcsr_jax import files
from pcsr_jax.errors import UserError


@dataclasses.dataclass
class UnitProgress:
  """Where one (method, seed) run stands: stream position and partial counts; saved in progress.json.

  ``counts`` and ``preds`` hold the open segment's per-domain tallies until `take_domain` closes them;
  ``seen``/``correct`` and ``total_seconds`` run over the whole unit.
  """

  key: str
  segment: int = 0  # the segment being streamed
  batch: int = 0  # the next batch of it
  seen: int = 0  # images scored in this unit
  correct: int = 0
  skipped: int = 0  # unreadable images of the open segment
  seconds: float = 0.0  # step time of the open segment
  total_seconds: float = 0.0  # step time of the closed segments
  counts: dict = dataclasses.field(default_factory=dict)  # domain -> [correct, total, correct known, known]
  preds: dict = dataclasses.field(default_factory=dict)  # domain -> [file names, labels, predictions]

  def account(self, preds: Any, batch, names: list[str], relabel: Optional[np.ndarray], num_classes: int,
              curve: dict) -> None:
    """Scores one batch's predictions (read from the device here, a step after they were dispatched)."""
    n = len(batch.labels)
    p = np.asarray(preds)[:n]
    labels = batch.labels if relabel is None else relabel[batch.labels]
    hit = p == labels
    known = labels < num_classes  # VisDA-2021's label 1000: a sample of no known class, always wrong
    for tag in np.unique(batch.tags):
      m = batch.tags == tag
      c = self.counts.setdefault(names[tag], [0, 0, 0, 0])
      c[0] += int(hit[m].sum())
      c[1] += int(m.sum())
      c[2] += int((hit & known)[m].sum())
      c[3] += int(known[m].sum())
      pr = self.preds.setdefault(names[tag], [[], [], []])
      pr[0] += [batch.names[i] for i in np.flatnonzero(m)]
      pr[1] += labels[m].tolist()
      pr[2] += p[m].tolist()
    self.seen += n
    self.correct += int(hit.sum())
    curve["seen"].append(self.seen)
    curve["accuracy"].append(self.correct / self.seen)

  def add_time(self, seconds: float) -> None:
    self.seconds += seconds

  def take_domain(self, tag: str) -> tuple[Optional[list], Optional[list]]:
    """Removes and returns a domain's ``(counts, preds)`` of the open segment (None if it had no image)."""
    return self.counts.pop(tag, None), self.preds.pop(tag, None)

  def close_segment(self) -> None:
    self.total_seconds += self.seconds
    self.seconds, self.skipped = 0.0, 0
    self.segment, self.batch = self.segment + 1, 0

  @property
  def images_per_s(self) -> float:
    return self.seen / max(self.total_seconds, 1e-9)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @staticmethod
  def from_json(d: dict) -> "UnitProgress":
    return UnitProgress(**{f.name: d[f.name] for f in dataclasses.fields(UnitProgress) if f.name in d})


@dataclasses.dataclass
class RunProgress:
  """Everything a run has produced so far (progress.json): finished records, curves, the open unit."""

  config_key: str
  records: list = dataclasses.field(default_factory=list)
  curves: dict = dataclasses.field(default_factory=dict)
  skipped: list = dataclasses.field(default_factory=list)
  done: list = dataclasses.field(default_factory=list)
  unit: Optional[UnitProgress] = None
  throughput: dict = dataclasses.field(default_factory=dict)
  state_dir: Optional[str] = None
  data_key: str = ""  # a digest of the ordered stream items: resuming over changed data is refused
  # unit key -> what its source statistics were computed from (`harness`): a resume that would give a started
  # unit other statistics is refused, one whose units used none takes another --source-data
  source_keys: dict = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return dict(dataclasses.asdict(self), unit=self.unit.to_json() if self.unit else None)

  @staticmethod
  def from_json(d: Any) -> "RunProgress":
    """Raises TypeError/KeyError/ValueError on anything that is not a progress record of this version."""
    types = dict(config_key=str, records=list, curves=dict, skipped=list, done=list, throughput=dict,
                 data_key=str)
    if not isinstance(d, dict) or not all(isinstance(d[k], t) for k, t in types.items()):
      raise TypeError("not a progress record")
    if not isinstance(d.get("source_keys", {}), dict):
      raise TypeError("source_keys is not an object")
    prog = RunProgress(**{k: d[k] for k in types}, state_dir=d.get("state_dir"), source_keys=d.get("source_keys", {}))
    if d.get("unit") is not None:
      if not isinstance(d["unit"], dict):
        raise TypeError("unit is not an object")
      prog.unit = UnitProgress.from_json(d["unit"])
      if not isinstance(prog.unit.key, str) or not isinstance(prog.unit.counts, dict):
        raise TypeError("unit of the wrong type")
    return prog


def _checkpointer():
  """An orbax checkpointer local to this process: under `jax.distributed` process 0 alone saves (the state is a
  host numpy tree, the same on every process) and each process restores on its own, so no orbax barrier may
  wait for the others."""
  import jax
  import orbax.checkpoint as ocp

  me = jax.process_index()
  local = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
  return ocp.Checkpointer(ocp.StandardCheckpointHandler(), multiprocessing_options=local)


class Resume:
  """Progress on disk: ``resume/progress.json`` (atomic) pointing at an orbax state dir."""

  def __init__(self, out_dir: str):
    self.dir = os.path.join(os.path.abspath(out_dir), "resume")  # orbax needs absolute paths
    self.path = os.path.join(self.dir, "progress.json")

  def load(self) -> Optional[RunProgress]:
    if not os.path.isfile(self.path):
      return None
    try:
      with open(self.path) as f:
        return RunProgress.from_json(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as e:
      raise UserError(f"{self.path}: saved progress is damaged ({type(e).__name__}); rerun without --resume to "
                      f"start over") from None

  def save(self, progress: RunProgress, host_state: Any = None) -> None:
    """Writes the progress (and the adaptation state, if given) so that a crash at any point leaves a
    consistent pair: the state goes to a new directory, then the JSON naming it replaces the old one."""
    import orbax.checkpoint as ocp

    os.makedirs(self.dir, exist_ok=True)
    if host_state is not None:
      name = f"state_{int(time.time() * 1e6)}"
      with _checkpointer() as ck:
        ck.save(os.path.join(self.dir, name), args=ocp.args.StandardSave(host_state))
      progress.state_dir = name
    elif progress.unit is None:
      progress.state_dir = None
    files.write_json(self.path, progress.to_json())  # the switch to the new state is atomic
    for d in os.listdir(self.dir):
      if d.startswith("state_") and d != progress.state_dir:
        shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)

  def restore_state(self, progress: RunProgress, template: Any) -> Any:
    import orbax.checkpoint as ocp

    path = os.path.join(self.dir, progress.state_dir or "state_missing")
    try:
      with _checkpointer() as ck:
        return ck.restore(path, args=ocp.args.StandardRestore(template))
    except Exception as e:  # deleted, truncated or foreign: tensorstore / orbax / ValueError
      raise UserError(f"{path}: saved adaptation state is damaged or missing ({type(e).__name__}); rerun without "
                      f"--resume to start over") from None

  def clear(self) -> None:
    shutil.rmtree(self.dir, ignore_errors=True)
