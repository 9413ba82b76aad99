"""The benchmark harness: checkpoint + data + setting -> online adaptation -> result records.

Streams every (seed, method) pair over the segments of the chosen setting, with
one compiled step per method, decoding in a thread pool ahead of the step and
reading each batch's predictions one step late (so the host never waits on the
step it just dispatched). Long runs save the adaptation state, the stream
position and the partial counts every ``checkpoint_every`` batches and on
SIGINT/SIGTERM (orbax for the state, an atomically replaced JSON for the rest);
``resume=True`` continues from there and gives bit-identical results on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from typing import Any, Optional

import numpy as np

from pcsr_jax import checkpoint, engine, methods, results
from pcsr_jax.data import imagenet, sources, streams, transforms
from pcsr_jax.data.loader import Loader, decode_throughput
from pcsr_jax.errors import UserError

DATASETS = ("imagenet_c", "imagenet_r", "imagenet_a", "visda", "folder", "fmnist_c")


@dataclasses.dataclass
class RunConfig:
  """Everything a run depends on (stored in results.json)."""

  data: str  # a directory, or "tfds" for imagenet2012_corrupted
  checkpoint: str
  output: str
  methods: tuple[str, ...] = ("source", "tent", "sar", "pcsr")
  dataset: str = "imagenet_c"
  corruptions: tuple[str, ...] = imagenet.CORRUPTIONS
  severity: int = 5
  seeds: tuple[int, ...] = (2022, 2023, 2024)
  setting: str = "normal"
  batch_size: int = 64
  limit: Optional[int] = None
  shuffle: bool = True
  eval_order: Optional[str] = None  # None: each method's default
  save_predictions: bool = False
  resume: bool = False
  checkpoint_every: int = 50
  workers: Optional[int] = None
  imbalance_ratio: float = 500000.0
  label_shift_indices: Optional[str] = None
  tfds_data_dir: Optional[str] = None
  image_list: str = "image_list.txt"  # visda: the list file under --data
  method_args: dict = dataclasses.field(default_factory=dict)  # e.g. {"pcsr": {"lr_dsn": 0.05}}
  progress: bool = True
  # fmnist_c (the built-in benchmark): the first N test images of each corruption, and where they live.
  images_per_corruption: Optional[int] = None
  fmnist_dir: Optional[str] = None
  cache_dir: Optional[str] = None
  corruption_seed: int = 0

  def validate(self) -> None:
    for m in self.methods:
      if m not in methods.REGISTRY:
        raise UserError(f"--methods: unknown method '{m}': expected some of {', '.join(methods.REGISTRY)}")
    if self.setting not in streams.SETTINGS:
      raise UserError(f"--setting: unknown setting '{self.setting}': expected one of {', '.join(streams.SETTINGS)}")
    if self.dataset not in DATASETS:
      raise UserError(f"--dataset: unknown dataset '{self.dataset}': expected one of {', '.join(DATASETS)}")
    if self.dataset == "imagenet_c":
      for c in self.corruptions:
        if c not in imagenet.CORRUPTIONS + imagenet.HELDOUT_CORRUPTIONS:
          raise UserError(f"--corruptions: unknown corruption '{c}'")
    if self.dataset == "fmnist_c":
      from pcsr_jax.data import corruptions, fmnist_c

      for c in self.corruptions:
        if c not in corruptions.ALL + (fmnist_c.CLEAN,):
          raise UserError(f"--corruptions: unknown corruption '{c}': expected some of {', '.join(corruptions.ALL)}"
                          f" or clean")
      if self.images_per_corruption is not None and not 1 <= self.images_per_corruption <= 10000:
        raise UserError(f"--images: expected 1 to 10000, got {self.images_per_corruption}")
    if self.dataset in ("imagenet_c", "fmnist_c") and not 1 <= self.severity <= 5:
      raise UserError(f"--severity: expected 1 to 5, got {self.severity}")
    if self.eval_order not in (None,) + engine.EVAL_ORDERS:
      raise UserError(f"--eval-order: expected one of {', '.join(engine.EVAL_ORDERS)}, got '{self.eval_order}'")
    if self.batch_size < 1 or (self.limit is not None and self.limit < 1) or self.checkpoint_every < 1:
      raise UserError("--batch-size, --limit and --checkpoint-every must be positive")
    if self.setting == "bs1" and self.batch_size != 1:
      self.batch_size = 1  # the bs1 setting *is* batch size 1
    unknown = sorted(set(self.method_args) - set(methods.REGISTRY))
    if unknown:
      raise UserError(f"method arguments for unknown methods {unknown}")


def versions() -> dict[str, str]:
  import flax
  import jax
  import optax

  import pcsr_jax

  return dict(pcsr_jax=pcsr_jax.__version__, jax=jax.__version__, flax=flax.__version__, optax=optax.__version__,
              numpy=np.__version__, python=sys.version.split()[0], devices=str(jax.devices()))


def open_domains(cfg: RunConfig, log=print):
  """[(domain name, source)]: one per corruption for ImageNet-C and Fashion-MNIST-C, one for the others."""
  if cfg.dataset == "fmnist_c":
    from pcsr_jax.data import fmnist_c

    return fmnist_c.sources(cfg.corruptions, cfg.severity, cfg.images_per_corruption or 10000, cfg.fmnist_dir,
                            cfg.cache_dir, cfg.corruption_seed, progress=cfg.progress, log=log)
  if cfg.dataset == "imagenet_c":
    if cfg.data == "tfds":
      return [(c, sources.TFDSSource(c, cfg.severity, cfg.tfds_data_dir)) for c in cfg.corruptions]
    return [(c, sources.imagenet_c_source(cfg.data, c, cfg.severity)) for c in cfg.corruptions]
  if not os.path.isdir(cfg.data):
    raise UserError(f"{cfg.data}: data dir not found")
  if not os.listdir(cfg.data):
    raise UserError(f"{cfg.data}: data dir is empty")
  if cfg.dataset == "visda":
    return [("visda", sources.ImageListSource(cfg.data, cfg.image_list))]
  return [(cfg.dataset, sources.FolderSource(cfg.data))]


class _Stop:
  """SIGINT/SIGTERM set a flag; the loop saves its progress at the next batch and exits."""

  def __init__(self):
    self.requested = False

  def __enter__(self):
    self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
    return self

  def _handler(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


class Resume:
  """Progress on disk: ``resume/progress.json`` (atomic) pointing at an orbax state dir."""

  def __init__(self, out_dir: str):
    self.dir = os.path.join(os.path.abspath(out_dir), "resume")  # orbax needs absolute paths
    self.path = os.path.join(self.dir, "progress.json")

  def load(self) -> Optional[dict]:
    if not os.path.isfile(self.path):
      return None
    with open(self.path) as f:
      return json.load(f)

  def save(self, progress: dict, host_state: Any = None) -> None:
    import orbax.checkpoint as ocp

    os.makedirs(self.dir, exist_ok=True)
    progress = dict(progress)
    if host_state is not None:
      name = f"state_{int(time.time() * 1e6)}"
      with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
        ck.save(os.path.join(self.dir, name), args=ocp.args.StandardSave(host_state))
      progress["state_dir"] = name
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(progress, f)
    os.replace(tmp, self.path)  # the switch to the new state is atomic
    keep = progress.get("state_dir")
    for d in os.listdir(self.dir):
      if d.startswith("state_") and d != keep:
        shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)

  def restore_state(self, progress: dict, template: Any) -> Any:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
      return ck.restore(os.path.join(self.dir, progress["state_dir"]), args=ocp.args.StandardRestore(template))

  def clear(self) -> None:
    shutil.rmtree(self.dir, ignore_errors=True)


def run(cfg: RunConfig, log=print) -> dict:
  """Runs the experiment; returns ``{'records', 'curves', 'skipped', ...}`` and writes the outputs."""
  cfg.validate()
  model, params, meta = checkpoint.load(cfg.checkpoint)
  domains = open_domains(cfg, log)
  subset = imagenet.class_subset(cfg.dataset) if cfg.dataset in ("imagenet_r", "imagenet_a") else None
  for name, src in domains:
    sources.check_classes(src, meta["num_classes"], subset,
                          f"{cfg.data}/{name}" if cfg.data not in ("tfds", "builtin") else name)
  relabel = None  # ImageNet-R/-A: labels become positions in the 200-class subset of the logits
  if subset is not None:
    model = model.clone(class_subset=tuple(int(c) for c in subset))
    relabel = np.full(meta["num_classes"], -1, np.int64)
    relabel[subset] = np.arange(len(subset))
  preprocess = transforms.imagenet_c_preprocess(meta) if cfg.dataset == "imagenet_c" else \
      transforms.Preprocess.from_meta(meta)
  srcs = [s for _, s in domains]
  names = [n for n, _ in domains]
  decode_ips = decode_throughput(srcs, preprocess, n=min(256, len(srcs[0])), workers=cfg.workers)
  log(f"data: {cfg.dataset} from {cfg.data}: {len(domains)} domain(s), {sum(len(s) for s in srcs):,} images; "
      f"decode + preprocess {decode_ips:.0f} img/s")

  os.makedirs(cfg.output, exist_ok=True)
  resume = Resume(cfg.output)
  config_json = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
  progress = resume.load() if cfg.resume else None
  if progress is not None and progress.get("config_key") != _config_key(config_json):
    raise UserError(f"{resume.path}: saved progress is from a different configuration; drop --resume or "
                    f"use another --output")
  if progress is None:
    resume.clear()
    for name in ("results.json", "results.csv", "table.md"):  # never leave a stale "complete" result behind
      if os.path.exists(os.path.join(cfg.output, name)):
        os.remove(os.path.join(cfg.output, name))
    progress = dict(config_key=_config_key(config_json), records=[], curves={}, skipped=[], done=[],
                    unit=None, throughput={})
  elif progress["unit"] or progress["done"]:
    log(f"resuming from {resume.path}: {len(progress['done'])} runs done" +
        (f", {progress['unit']['key']} at segment {progress['unit']['segment']} batch {progress['unit']['batch']}"
         if progress["unit"] else ""))

  loader = Loader(srcs, preprocess, cfg.batch_size, workers=cfg.workers)
  labels_per_domain = [s.labels for s in srcs]
  with _Stop() as stop:
    for seed in cfg.seeds:
      segments = streams.build(cfg.setting, [len(s) for s in srcs], labels_per_domain, names, seed,
                               shuffle=cfg.shuffle, imbalance_ratio=cfg.imbalance_ratio,
                               index_file=cfg.label_shift_indices)
      if cfg.limit:
        segments = [dataclasses.replace(s, source_ids=s.source_ids[:cfg.limit], indices=s.indices[:cfg.limit])
                    for s in segments]
      for method_name in cfg.methods:
        key = f"{method_name}/seed{seed}"
        if key in progress["done"]:
          continue
        method = methods.get(method_name, **cfg.method_args.get(method_name, {}))
        adapter = engine.Adapter(method, model, params, batch_size=cfg.batch_size, eval_order=cfg.eval_order,
                                 seed=seed)
        completed = _run_unit(cfg, key, method_name, seed, adapter, segments, names, loader, progress, resume,
                              stop, relabel, log)
        if not completed:
          log(f"interrupted: progress saved to {resume.path}; rerun with --resume to continue")
          raise SystemExit(130)
  records = progress["records"]
  cols = names
  tbl = results.table(records, cols, cfg.methods)
  extra = dict(versions=versions(), skipped=progress["skipped"], decode_images_per_s=decode_ips,
               throughput=progress["throughput"], curves=progress["curves"])
  results.write_json(os.path.join(cfg.output, "results.json"), records, config_json, extra)
  results.write_csv(os.path.join(cfg.output, "results.csv"), records)
  with open(os.path.join(cfg.output, "table.md"), "w") as f:
    f.write(tbl)
  plots = results.plot(cfg.output, records, progress["curves"], cols, cfg.methods)
  resume.clear()
  log(tbl)
  if progress["skipped"]:
    log(f"skipped {len(progress['skipped'])} unreadable images (listed in results.json)")
  log(f"wrote {cfg.output}/results.json, results.csv, table.md, {', '.join(os.path.basename(p) for p in plots)}")
  return dict(records=records, curves=progress["curves"], skipped=progress["skipped"], table=tbl,
              decode_images_per_s=decode_ips, throughput=progress["throughput"])


def _config_key(config_json: dict) -> str:
  keep = {k: v for k, v in config_json.items() if k not in ("resume", "progress", "workers", "checkpoint_every")}
  return json.dumps(keep, sort_keys=True)


def _run_unit(cfg, key, method_name, seed, adapter, segments, names, loader, progress, resume, stop, relabel,
              log) -> bool:
  """One method and seed over all segments. Returns False when interrupted (progress saved)."""
  from tqdm import tqdm

  unit = progress["unit"] if progress["unit"] and progress["unit"]["key"] == key else None
  state = None
  if unit is not None:
    state = adapter.state_from_host(resume.restore_state(progress, adapter.state_to_host(adapter.init_state())))
  else:
    unit = dict(key=key, segment=0, batch=0, counts={}, seen=0, correct=0, seconds=0.0, total_seconds=0.0,
                preds={}, images=0, skipped=0)
  curve = progress["curves"].setdefault(key, {"seen": [], "accuracy": []})
  total_batches = sum(-(-len(s.indices) // cfg.batch_size) for s in segments)
  done_batches = sum(-(-len(s.indices) // cfg.batch_size) for s in segments[:unit["segment"]]) + unit["batch"]
  bar = tqdm(total=total_batches, initial=done_batches, desc=key, disable=not cfg.progress, leave=False,
             file=sys.stderr)
  batches_since_save = 0

  def save():
    progress["unit"] = unit
    resume.save(progress, adapter.state_to_host(state))

  for si in range(unit["segment"], len(segments)):
    seg = segments[si]
    if (seg.reset and unit["batch"] == 0) or state is None:
      state = adapter.init_state()
    t_seg = time.perf_counter()
    pending = None
    for batch in loader.batches(seg.source_ids, seg.indices, start_batch=unit["batch"]):
      progress["skipped"] += [f"{seg.name}/{n}" for n in batch.skipped]
      unit["skipped"] += len(batch.skipped)
      if len(batch.labels):
        state, logits, _ = adapter.step(state, batch.images)
        preds = logits.argmax(-1)  # stays on device; read one step later
        if pending is not None:
          _account(unit, curve, *pending, names, relabel)
        pending = (preds, batch)
      unit["batch"] += 1
      batches_since_save += 1
      bar.update(1)
      if cfg.progress and unit["seen"]:
        elapsed = unit["total_seconds"] + unit["seconds"] + time.perf_counter() - t_seg
        bar.set_postfix(acc=f"{100 * unit['correct'] / unit['seen']:.1f}", img_s=f"{unit['images'] / elapsed:.1f}")
      if stop.requested or batches_since_save >= cfg.checkpoint_every:
        if pending is not None:
          _account(unit, curve, *pending, names, relabel)
          pending = None
        unit["seconds"] += time.perf_counter() - t_seg
        t_seg = time.perf_counter()
        save()
        batches_since_save = 0
        if stop.requested:
          bar.close()
          return False
    if pending is not None:
      _account(unit, curve, *pending, names, relabel)
    unit["seconds"] += time.perf_counter() - t_seg
    _close_segment(cfg, unit, seg, method_name, seed, adapter, names, progress, int(state.resets))
    unit["segment"], unit["batch"] = si + 1, 0
  bar.close()
  progress["throughput"][key] = dict(images=unit["images"], seconds=unit["total_seconds"],
                                     images_per_s=unit["images"] / max(unit["total_seconds"], 1e-9))
  progress["done"].append(key)
  progress["unit"] = None
  resume.save(progress)
  acc = unit["correct"] / max(unit["seen"], 1)
  log(f"{key}: accuracy {100 * acc:.2f}% over {unit['seen']:,} images, "
      f"{unit['images'] / max(unit['total_seconds'], 1e-9):.1f} img/s end to end")
  return True


def _account(unit, curve, preds, batch, names, relabel) -> None:
  n = len(batch.labels)
  p = np.asarray(preds)[:n]
  labels = batch.labels if relabel is None else relabel[batch.labels]
  hit = p == labels
  for tag in np.unique(batch.tags):
    m = batch.tags == tag
    c = unit["counts"].setdefault(names[tag], [0, 0])
    c[0] += int(hit[m].sum())
    c[1] += int(m.sum())
    pr = unit["preds"].setdefault(names[tag], [[], [], []])
    pr[0] += [batch.names[i] for i in np.flatnonzero(m)]
    pr[1] += labels[m].tolist()
    pr[2] += p[m].tolist()
  unit["seen"] += n
  unit["images"] += n
  unit["correct"] += int(hit.sum())
  curve["seen"].append(unit["seen"])
  curve["accuracy"].append(unit["correct"] / unit["seen"])


def _close_segment(cfg, unit, seg, method_name, seed, adapter, names, progress, resets) -> None:
  """Records the segment's per-domain accuracies (for mix_shifts: every corruption in the mix).

  ``resets`` counts the method's in-step recoveries (SAR's EMA reset) since its state was last initialized.
  """
  tags = [seg.name] if seg.name != "mix" else names
  for tag in tags:
    if tag not in unit["counts"]:
      continue
    correct, total = unit["counts"].pop(tag)
    progress["records"].append(dict(method=method_name, setting=cfg.setting, corruption=tag, severity=cfg.severity,
                                    seed=seed, eval_order=adapter.eval_order, accuracy=correct / max(total, 1),
                                    num_samples=total, num_skipped=unit["skipped"], seconds=unit["seconds"],
                                    resets=resets))
    if cfg.save_predictions:
      fn, lab, pred = unit["preds"].pop(tag)
      d = os.path.join(cfg.output, "predictions")
      os.makedirs(d, exist_ok=True)
      np.savez(os.path.join(d, f"{method_name}_{tag}_{cfg.severity}_seed{seed}.npz"), file_names=np.asarray(fn),
               labels=np.asarray(lab, np.int32), predictions=np.asarray(pred, np.int32))
    else:
      unit["preds"].pop(tag, None)
  unit["total_seconds"] += unit["seconds"]
  unit["seconds"], unit["skipped"] = 0.0, 0
