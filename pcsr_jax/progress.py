"""A run's progress on disk, so that an interrupted run resumes exactly where it stopped.

* `UnitProgress` -- where one (method, seed) run stands: stream position and the open segment's tallies;
* `RunProgress` -- everything a run has produced so far: records, curves, finished units, the open unit;
* `Resume` -- ``<output>/resume/progress.json`` (replaced atomically) pointing at an orbax state directory;
* what ``--resume`` must find unchanged (`config_key`, `data_key`, `check_resumable`), and every process the
  same saved progress (`check_same_progress`).
"""

from __future__ import annotations

import dataclasses
import hashlib
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


# ---------------------------------------------------------------- what --resume must find unchanged

def config_key(config_json: dict, ckpt_digest: str) -> str:
  """What ``--resume`` must find unchanged in the whole run: the settings that change results, and the
  checkpoint's params (a checkpoint replaced at the same path is another model). ``--source-data`` and
  ``--source-images`` are checked per unit instead (`run_setup.MethodPlan.source_key`): units that used no source
  statistics keep their records when they change."""
  keep = {k: v for k, v in config_json.items()
          if k not in ("resume", "progress", "workers", "loader", "checkpoint_every", "source_data", "source_images")}
  return json.dumps(dict(keep, checkpoint_params=ckpt_digest), sort_keys=True)


def data_key(srcs: list) -> str:
  """A digest of every stream item in order (name and label), and of how generated data is made (the
  generator's version, corruption, severity and seed: `generated.CorruptedSource.describe`): what --resume
  must find unchanged."""
  h = hashlib.sha256()
  for src in srcs:
    h.update(f"{len(src)} {getattr(src, 'describe', '')}\n".encode())
    base = getattr(src, "clean", src)  # generated data: the clean images' names (CCC's 7.5M come from them)
    h.update("\n".join(base.names).encode())
    h.update(np.asarray(base.labels, np.int64).tobytes())
  return h.hexdigest()


def check_resumable(progress: RunProgress, key: str, data_key: str, source_keys: dict[str, str], path: str,
                    checkpoint_dir: str, log) -> None:
  """Saved progress is continued only under the configuration, checkpoint params and data it was made with.

  A unit it holds (finished or open) that would now get other source statistics (``--source-data`` corrected,
  its images repaired, ``--source-images`` changed) runs again from its start, its records dropped: its
  statistics are not the run's any more. Units that used none, or the same, keep their records, so that
  correcting ``--source-data`` loses no other work. ``source_keys``: each method's key of its statistics now."""
  if progress.config_key != key:
    differ = _config_diff(progress.config_key, key)
    if "checkpoint_params" in differ:
      raise UserError(f"{path}: the params of --checkpoint {checkpoint_dir} changed since the progress was saved "
                      f"(replaced or re-converted); rerun without --resume to start over")
    raise UserError(f"{path}: saved progress is from a different configuration"
                    f"{' (' + ', '.join(differ) + ' differ)' if differ else ''}; drop --resume or use another --output")
  if progress.data_key != data_key:
    raise UserError(f"{path}: the data changed since the progress was saved (images added, removed or "
                    f"relabelled); rerun without --resume to start over")
  for unit in progress.done + ([progress.unit.key] if progress.unit else []):
    saved, now = progress.source_keys.get(unit), source_keys[unit.rsplit("/seed", 1)[0]]
    if saved != now:
      why = ("it ran without --source-data" if str(saved).startswith("none") else
             "this run has no --source-data" if now.startswith("none") else
             "--source-data, --source-images or the source images changed")
      log(f"{unit}: its source statistics would differ from those it ran with ({why}); running it again from "
          f"the start")
      _forget_unit(progress, unit)


def _forget_unit(progress: RunProgress, unit: str) -> None:
  """Drops what ``unit`` (``<method>/seed<s>``) produced from ``progress``, so that it runs again."""
  method, seed = unit.rsplit("/seed", 1)
  progress.records = [r for r in progress.records if (r["method"], str(r["seed"])) != (method, seed)]
  progress.curves.pop(unit, None)
  progress.throughput.pop(unit, None)
  progress.source_keys.pop(unit, None)
  progress.done = [u for u in progress.done if u != unit]
  if progress.unit is not None and progress.unit.key == unit:
    progress.unit = None


def _config_diff(saved: str, now: str) -> list[str]:
  """The settings in which two `config_key`s differ (empty if ``saved`` is not one)."""
  try:
    a, b = json.loads(saved), json.loads(now)
  except ValueError:
    return []
  if not isinstance(a, dict):
    return []
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_same_progress(exchange: Any, progress: Optional[RunProgress], path: str) -> None:
  """Every process must resume from the same saved progress: the output folder has to be shared by all hosts."""
  mine = "none" if progress is None else hashlib.sha256(
      json.dumps(progress.to_json(), sort_keys=True).encode()).hexdigest()
  seen = exchange.allgather(mine)
  if len(set(seen)) > 1:
    odd = next(p for p, h in enumerate(seen) if h != seen[0])
    raise UserError(f"{path}: process {odd} sees other saved progress than process 0; --output must be a folder "
                    f"shared by every process")
