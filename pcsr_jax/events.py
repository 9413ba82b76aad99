"""TensorBoard event files of a run, in ``<output>/tensorboard/`` (``tensorboard --logdir <output>/tensorboard``):

* one run per unit (``units/<method>/seed<s>[/<domain>]``): per batch, at the step of the images the unit has
  scored, ``running_accuracy`` (%), the method's ``loss`` and its other scalar metrics (``metrics/<name>``) and
  ``images_per_s``; per domain, ``domain_accuracy/<domain>`` (%);
* once the table is done, ``results/<method>``: ``accuracy/<domain>`` and ``accuracy/avg`` (%, mean over seeds),
  and ``table``: table.md as text.

A unit's events are held in memory and written when its progress is saved (`UnitEvents.flush`), so an event file
holds exactly what ``--resume`` continues from: a resumed unit writes a fresh file (TensorBoard reads every file
of a run) whose steps continue where the saved ones end, never a step twice. Written with TensorBoard's own
event writer and protos (the ``tensorboard`` package, pure Python: no TensorFlow; tensorboardX would import torch
wherever it is installed).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

DIR = "tensorboard"
_lock = threading.Lock()  # executors in threads create writers at once


def root(output: str) -> str:
  return os.path.join(output, DIR)


def _writer(logdir: str) -> Any:
  """A fresh event file in ``logdir`` (TensorBoard's pure-Python writer, imported only when a run writes)."""
  from tensorboard.summary.writer.event_file_writer import EventFileWriter

  with _lock:  # two files of one run created in the same second would share a name
    os.makedirs(logdir, exist_ok=True)
    return EventFileWriter(logdir, filename_suffix=f".{os.getpid()}.{time.time_ns()}")


def _scalars(step: int, values: Mapping[str, float]) -> Any:
  from tensorboard.compat.proto import event_pb2, summary_pb2

  vals = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
  return event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=vals))


def _text(tag: str, text: str, step: int = 0) -> Any:
  """A text summary as TensorBoard's text plugin reads it (a string tensor)."""
  from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

  meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
  tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                  tensor_shape=tensor_shape_pb2.TensorShapeProto())
  value = summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)
  return event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value]))


class UnitEvents:
  """One unit's events, held until `flush` (at each save of its progress and at its end) writes them to one
  event file per attempt at the unit."""

  def __init__(self, output: str, key: str, enabled: bool = True):
    self.logdir = os.path.join(root(output), "units", *key.split("/"))
    self.enabled = enabled
    self._held: list = []
    self._writer: Any = None

  def batch(self, seen: int, correct: int, seconds: float, metrics: Mapping[str, Any]) -> None:
    """After a scored batch: the unit's running accuracy over its ``seen`` images, the step's scalar metrics
    (``finite`` left out: a non-finite step stops the run) and the images per second so far."""
    if not self.enabled or not seen:
      return
    values = {"running_accuracy": 100 * correct / seen}
    for k, v in metrics.items():
      a = np.asarray(v)
      if k != "finite" and a.size == 1 and (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        values["loss" if k == "loss" else f"metrics/{k}"] = float(a)
    if seconds > 0:
      values["images_per_s"] = seen / seconds
    self._held.append(_scalars(seen, values))

  def domain(self, seen: int, records: Sequence[dict]) -> None:
    """A domain closed: its accuracy (%), at the unit's step."""
    if self.enabled:
      self._held.append(_scalars(seen, {f"domain_accuracy/{r.get('domain', r['corruption'])}": 100 * r["accuracy"]
                                        for r in records}))

  def flush(self) -> None:
    """Writes what is held to disk, in this attempt's event file of the unit's run (made at the first flush)."""
    if not (self.enabled and self._held):
      return
    if self._writer is None:
      self._writer = _writer(self.logdir)
    for e in self._held:
      self._writer.add_event(e)
    self._writer.flush()
    self._held = []

  def close(self) -> None:
    """The unit stopped or ended: its file closed; what is still held (after the last save) is dropped."""
    if self._writer is not None:
      self._writer.close()
      self._writer = None
    self._held = []


def write_results(output: str, records: Sequence[dict], domains: Sequence[str], methods: Sequence[str],
                  table: str, costs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
  """A finished table: per method, its accuracy per domain and on average (mean over seeds), its cost
  (``cost/...``: the step's median and 90th-percentile ms, images/s, compile s, peak and step memory in MiB,
  ``--realtime``'s C; `pcsr_jax.cost`), and the table."""
  for m in methods:
    c = (costs or {}).get(m)
    if c:
      values = {"cost/step_ms_median": 1e3 * c["step_s_median"], "cost/step_ms_p90": 1e3 * c["step_s_p90"],
                "cost/images_per_s": c["images_per_s"], "cost/compile_s": c["compile_s"]}
      for k in ("peak_memory_bytes", "step_memory_bytes"):
        if c.get(k) is not None:
          values[f"cost/{k.replace('_bytes', '_mib')}"] = c[k] / 2 ** 20
      if c.get("realtime_c"):
        values["cost/realtime_c"] = c["realtime_c"]
      w = _writer(os.path.join(root(output), "costs", m))
      w.add_event(_scalars(0, values))
      w.close()
    acc = {}
    for d in domains:
      v = [100 * r["accuracy"] for r in records if r["method"] == m and r["corruption"] == d]
      if v:
        acc[f"accuracy/{d}"] = float(np.mean(v))
    if acc:
      acc["accuracy/avg"] = float(np.mean(list(acc.values())))
      w = _writer(os.path.join(root(output), "results", m))
      w.add_event(_scalars(0, acc))
      w.close()
  w = _writer(os.path.join(root(output), "table"))
  w.add_event(_text("table", table))
  w.close()


def remove_unit(output: str, key: str) -> None:
  """A unit that runs again from its start (`progress.keeps_statistics`): its earlier events go."""
  shutil.rmtree(UnitEvents(output, key).logdir, ignore_errors=True)


def remove(output: str) -> None:
  """A fresh run's start: the event files of an earlier run in this folder go."""
  shutil.rmtree(root(output), ignore_errors=True)
