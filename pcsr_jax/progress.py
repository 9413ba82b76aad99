"""A run's progress on disk, so that an interrupted run resumes exactly where it stopped.

* `UnitProgress` -- where one unit stands: stream position and the open segment's tallies;
* `UnitRecord` -- everything a unit has produced so far: its position, records, curve, unreadable images;
* `RunProgress` -- the run's results gathered from its finished units (`merge`);
* `Resume` -- ``<output>/resume/``: the run's manifest (``progress.json``) and one folder per unit, each its
  record (replaced atomically) pointing at an orbax state directory;
* what ``--resume`` must find unchanged (`config_key`, `data_key`, `check_resumable`, `keeps_statistics`), and
  every process the same saved progress (`check_same_progress`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import socket
import time
from typing import Any, Optional, Sequence

import numpy as np

from pcsr_jax import files, lock
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
    curve["correct"].append(self.correct)

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
class UnitRecord:
  """What one unit has produced so far, in its own folder (``resume/units/<unit>/unit.json``): the stream
  position and open tallies (``progress``, None once ``done``), its records, its accuracy curve (running counts),
  the unreadable images it met, its images/s once done, what its source statistics were computed from, and the
  saved adaptation state it continues from."""

  key: str
  source_key: str = "none"
  done: bool = False
  progress: Optional[UnitProgress] = None
  records: list = dataclasses.field(default_factory=list)
  curve: dict = dataclasses.field(default_factory=lambda: {"seen": [], "correct": []})
  skipped: list = dataclasses.field(default_factory=list)
  throughput: Optional[dict] = None
  state_dir: Optional[str] = None
  devices: Optional[int] = None  # how many devices the saved state's batches were split over

  def to_json(self) -> dict:
    return dict(dataclasses.asdict(self), progress=self.progress.to_json() if self.progress else None)

  @staticmethod
  def from_json(d: Any) -> "UnitRecord":
    """Raises TypeError/KeyError/ValueError on anything that is not a unit record of this version."""
    types = dict(key=str, source_key=str, done=bool, records=list, curve=dict, skipped=list)
    if not isinstance(d, dict) or not all(isinstance(d[k], t) for k, t in types.items()):
      raise TypeError("not a unit record")
    if not all(isinstance(d["curve"].get(k), list) for k in ("seen", "correct")):
      raise TypeError("curve of the wrong type")
    rec = UnitRecord(**{k: d[k] for k in types}, throughput=d.get("throughput"), state_dir=d.get("state_dir"),
                     devices=d.get("devices") if isinstance(d.get("devices"), int) else None)
    if d.get("progress") is not None:
      if not isinstance(d["progress"], dict):
        raise TypeError("progress is not an object")
      rec.progress = UnitProgress.from_json(d["progress"])
      if not isinstance(rec.progress.key, str) or not isinstance(rec.progress.counts, dict):
        raise TypeError("progress of the wrong type")
    return rec


@dataclasses.dataclass
class RunProgress:
  """A run's results gathered from its units (`merge`): records, curves and images/s per (method, seed), the
  unreadable images, the finished units."""

  records: list = dataclasses.field(default_factory=list)
  curves: dict = dataclasses.field(default_factory=dict)
  skipped: list = dataclasses.field(default_factory=list)
  done: list = dataclasses.field(default_factory=list)
  throughput: dict = dataclasses.field(default_factory=dict)


def stem(unit: str) -> str:
  """``<method>/seed<s>`` of a unit key (``<method>/seed<s>`` or ``<method>/seed<s>/<domain>``)."""
  return "/".join(unit.split("/")[:2])


def merge(units: Sequence[UnitRecord]) -> RunProgress:
  """The run's results from its finished units in plan order, as one unit over the whole stream would have
  made them: records in order, each (method, seed)'s curve running on over its units, its images and seconds
  summed, each unreadable image once."""
  out = RunProgress()
  totals: dict[str, list] = {}
  for u in units:
    if not u.done:
      continue
    out.done.append(u.key)
    out.records += u.records
    out.skipped += [n for n in u.skipped if n not in out.skipped]
    k = stem(u.key)
    seen0, correct0, images, seconds = totals.setdefault(k, [0, 0, 0, 0.0])
    curve = out.curves.setdefault(k, {"seen": [], "accuracy": []})
    for s, c in zip(u.curve["seen"], u.curve["correct"]):
      curve["seen"].append(seen0 + s)
      curve["accuracy"].append((correct0 + c) / (seen0 + s))
    t = u.throughput or {}
    totals[k] = [seen0 + (u.curve["seen"] or [0])[-1], correct0 + (u.curve["correct"] or [0])[-1],
                 images + t.get("images", 0), seconds + t.get("seconds", 0.0)]
  for k, (_, _, images, seconds) in totals.items():
    out.throughput[k] = dict(images=images, seconds=seconds, images_per_s=images / max(seconds, 1e-9))
  return out


def _checkpointer():
  """An orbax checkpointer local to this process: under `jax.distributed` process 0 alone saves (the state is a
  host numpy tree, the same on every process) and each process restores on its own, so no orbax barrier may
  wait for the others."""
  import jax
  import orbax.checkpoint as ocp

  me = jax.process_index()
  local = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
  return ocp.Checkpointer(ocp.StandardCheckpointHandler(), multiprocessing_options=local)


def unit_folder(key: str) -> str:
  """A unit's folder name: its key made a file name, and a digest that keeps two keys apart."""
  safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key.replace("/", "__"))
  return f"{safe[:80]}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


RESUME_DIR = "resume"  # the progress's folder in the output


class Resume:
  """A run's progress on disk, under ``<output>/resume``: ``progress.json`` (atomic), what the whole run must find
  unchanged (its configuration and data keys, its planned units), and one folder per unit (`UnitRecord` and the
  orbax state it continues from), so that units run one after another, on several device groups at once or by
  several workers, each save and resume alone."""

  def __init__(self, out_dir: str):
    self.dir = os.path.join(os.path.abspath(out_dir), RESUME_DIR)  # orbax needs absolute paths
    self.path = os.path.join(self.dir, "progress.json")
    self.fence: Optional[lock.Fence] = None  # a Ray actor's: its driver's hold on the folder, checked per write

  def load(self) -> Optional[dict]:
    """The run's saved manifest (``config_key``, ``data_key``, ``units``), None when there is none."""
    if not os.path.isfile(self.path):
      return None
    try:
      with open(self.path) as f:
        data = json.load(f)
      if not (isinstance(data, dict) and isinstance(data.get("config_key"), str) and
              isinstance(data.get("data_key"), str) and isinstance(data.get("units"), list)):
        raise TypeError("not a progress record")
    except (OSError, ValueError, TypeError, KeyError) as e:
      raise UserError(f"{self.path}: saved progress is damaged ({type(e).__name__}); rerun without --resume to "
                      f"start over") from None
    return data

  def start(self, manifest: dict) -> None:
    """A fresh run's manifest, every earlier unit's folder removed."""
    self.clear()
    os.makedirs(self.dir, exist_ok=True)
    files.write_json(self.path, manifest)

  def rewrite(self, manifest: dict) -> None:
    """The manifest of a resumed run (its units' source keys as they are now), the units' folders kept."""
    files.write_json(self.path, manifest)

  def unit_dir(self, key: str) -> str:
    return os.path.join(self.dir, "units", unit_folder(key))

  def load_unit(self, key: str) -> Optional[UnitRecord]:
    path = os.path.join(self.unit_dir(key), "unit.json")
    if not os.path.isfile(path):
      return None
    try:
      with open(path) as f:
        rec = UnitRecord.from_json(json.load(f))
      if rec.key != key:
        raise ValueError(f"holds {rec.key}")
    except (OSError, ValueError, TypeError, KeyError) as e:
      raise UserError(f"{path}: saved progress is damaged ({type(e).__name__}); rerun without --resume to start "
                      f"over") from None
    return rec

  def save_unit(self, rec: UnitRecord, host_state: Any = None) -> None:
    """Writes the unit's record (and its adaptation state, if given) so that a crash at any point leaves a
    consistent pair: the state goes to a new directory, then the JSON naming it replaces the old one."""
    import orbax.checkpoint as ocp

    d = self.unit_dir(rec.key)
    if self.fence is not None:
      self.fence.check()  # a stale actor writes nothing, not even its state
    os.makedirs(d, exist_ok=True)
    name = None
    if host_state is not None:
      name = f"state_{time.time_ns()}"
      with _checkpointer() as ck:
        ck.save(os.path.join(d, name), args=ocp.args.StandardSave(host_state))
    # The switch to the new state (atomic), and the old states' removal; a stale actor's new state stays
    # unreferenced, and the unit's next save by a live run removes it.
    with self.fence.writing() if self.fence is not None else contextlib.nullcontext():
      if name is not None:
        rec.state_dir = name
      elif rec.progress is None:
        rec.state_dir = None
      files.write_json(os.path.join(d, "unit.json"), rec.to_json())
      for s in os.listdir(d):
        if s.startswith("state_") and s != rec.state_dir:
          shutil.rmtree(os.path.join(d, s), ignore_errors=True)

  def restore_state(self, rec: UnitRecord, template: Any) -> Any:
    import orbax.checkpoint as ocp

    path = os.path.join(self.unit_dir(rec.key), rec.state_dir or "state_missing")
    try:
      with _checkpointer() as ck:
        return ck.restore(path, args=ocp.args.StandardRestore(template))
    except Exception as e:  # deleted, truncated or foreign: tensorstore / orbax / ValueError
      raise UserError(f"{path}: saved adaptation state is damaged or missing ({type(e).__name__}); rerun without "
                      f"--resume to start over") from None

  def forget_unit(self, key: str) -> None:
    shutil.rmtree(self.unit_dir(key), ignore_errors=True)

  def clear(self) -> None:
    shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- what --resume must find unchanged

# How a run runs, not what it computes: none is part of the resume key. The executor and its device groups
# (``devices_per_unit``, which the threads executor fills in from the host's devices and Ray leaves unset) may
# change between a run and its ``--resume``: finished units keep their records, and a unit under way continues on
# its new devices (`harness.run_unit` says so when their number differs: the batch split over another number of
# devices rounds its sums differently, within float32 rounding).
HOW_IT_RUNS = ("resume", "progress", "workers", "loader", "checkpoint_every", "executor", "ray_address",
               "ray_timeout", "devices_per_unit")


def config_key(config_json: dict, ckpt_digest: str) -> str:
  """What ``--resume`` must find unchanged in the whole run: the settings that change results, and the
  checkpoint's params (a checkpoint replaced at the same path is another model); not `HOW_IT_RUNS`.
  ``--source-data`` and ``--source-images`` are checked per unit instead (`run_setup.MethodPlan.source_key`):
  units that used no source statistics keep their records when they change."""
  keep = {k: v for k, v in config_json.items() if k not in HOW_IT_RUNS + ("source_data", "source_images")}
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


def check_resumable(manifest: dict, key: str, data_key: str, path: str, checkpoint_dir: str,
                    worker: bool = False) -> None:
  """Saved progress is continued only under the configuration, checkpoint params and data it was made with;
  ``worker``: the manifest is the driver's of the table a Ray actor runs units of, which the actor must see
  alike (another checkpoint or data folder on its node is refused)."""
  differ = _config_diff(manifest["config_key"], key) if manifest["config_key"] != key else None
  if worker and (differ is not None or manifest["data_key"] != data_key):
    if differ and "checkpoint_params" in differ:
      what = f"the params of --checkpoint {checkpoint_dir}"
    elif differ:
      what = f"its settings ({', '.join(differ)})"
    elif differ is not None:
      what = "its settings"
    else:
      what = "its data (images added, removed or relabelled)"
    raise UserError(f"{path}: the worker {socket.gethostname()} differs from the driver of this table in {what}; "
                    f"give every node of the cluster the same checkpoint and data")
  if differ is not None:
    if "checkpoint_params" in differ:
      raise UserError(f"{path}: the params of --checkpoint {checkpoint_dir} changed since the progress was saved "
                      f"(replaced or re-converted); rerun without --resume to start over")
    raise UserError(f"{path}: saved progress is from a different configuration"
                    f"{' (' + _differences(manifest['config_key'], key, differ) + ')' if differ else ''}; to "
                    f"continue it, rerun with the saved settings; or give another --output (a run here without "
                    f"--resume starts over and discards the saved progress)")
  if manifest["data_key"] != data_key:
    raise UserError(f"{path}: the data changed since the progress was saved (images added, removed or "
                    f"relabelled); rerun without --resume to start over")


def keeps_statistics(rec: UnitRecord, source_key: str, log) -> bool:
  """Whether a saved unit (finished or open) keeps what it produced: not if it would now get other source
  statistics (``--source-data`` corrected, its images repaired, ``--source-images`` changed): it then runs again
  from its start, its records dropped, its statistics not the run's any more. Units that used none, or the same,
  keep their records, so that correcting ``--source-data`` loses no other work."""
  if rec.source_key == source_key:
    return True
  why = ("it ran without --source-data" if rec.source_key.startswith("none") else
         "this run has no --source-data" if source_key.startswith("none") else
         "--source-data, --source-images or the source images changed")
  log(f"{rec.key}: its source statistics would differ from those it ran with ({why}); running it again from the "
      f"start")
  return False


def _differences(saved: str, now: str, keys: list[str]) -> str:
  """``key saved A, now B`` for each setting that differs (values cut to 40 characters)."""
  a, b = json.loads(saved), json.loads(now)
  show = lambda v: (lambda t: t if len(t) <= 40 else t[:37] + "...")(json.dumps(v))
  return "; ".join(f"{k}: saved {show(a.get(k))}, now {show(b.get(k))}" for k in keys)


def _config_diff(saved: str, now: str) -> list[str]:
  """The settings in which two `config_key`s differ (empty if ``saved`` is not one)."""
  try:
    a, b = json.loads(saved), json.loads(now)
  except ValueError:
    return []
  if not isinstance(a, dict):
    return []
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_same_progress(exchange: Any, resume: Resume) -> None:
  """Every process must resume from the same saved progress (its manifest and its units' records): the output
  folder has to be shared by all hosts."""
  h = hashlib.sha256()
  for path in [resume.path] + sorted(glob.glob(os.path.join(resume.dir, "units", "*", "unit.json"))):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        h.update(os.path.relpath(path, resume.dir).encode() + b"\0" + f.read())
  seen = exchange.allgather(h.hexdigest())
  if len(set(seen)) > 1:
    odd = next(p for p, x in enumerate(seen) if x != seen[0])
    raise UserError(f"{resume.path}: process {odd} sees other saved progress than process 0; --output must be a "
                    f"folder shared by every process")
