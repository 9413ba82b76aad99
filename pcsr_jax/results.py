"""Result records -> results.json, results.csv, the paper's Table 1 layout (table.md) and the plots (`plots`); a
run's outputs (`write_outputs`) and the removal of an earlier run's (`remove_outputs`)."""

from __future__ import annotations

import csv
import os
import re
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from pcsr_jax import cost, distributed, events, files, plots
from pcsr_jax.data.imagenet import SHORT_NAMES
from pcsr_jax.errors import UserError

FIELDS = ("method", "setting", "corruption", "severity", "seed", "eval_order", "accuracy", "num_samples",
          "num_skipped", "seconds", "resets") + tuple(f for f in cost.FIELDS if f not in ("adapted_batches", "batches"))


def write_json(path: str, records: Sequence[dict], config: dict, extra: dict | None = None,
               complete: bool = True) -> None:
  files.write_json(path, dict(complete=complete, config=config, records=list(records), **(extra or {})), indent=1)


def write_csv(path: str, records: Sequence[dict]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in records:
      w.writerow(r)


def table(records: Sequence[dict], corruptions: Sequence[str], methods: Sequence[str],
          extra: tuple[str, Mapping[str, str]] | None = None) -> str:
  """Markdown in the layout of the paper's Table 1: methods as rows, corruptions + Avg as columns,
  accuracy (%) as mean ± std over seeds (population std). A corruption with several records per seed (the gradual
  setting's severities) counts their mean. ``extra``: one more column after Avg., ``(header, {method: cell})``."""
  cols = list(corruptions)
  head = "| Method | " + " | ".join(SHORT_NAMES.get(c, c) for c in cols) + " | Avg. |"
  head += f" {extra[0]} |" if extra else ""
  lines = [head, "|" + "---|" * (len(cols) + 2 + bool(extra))]
  for m in methods:
    rs = [r for r in records if r["method"] == m]
    if not rs:
      continue
    seeds = sorted({r["seed"] for r in rs})
    per_seed = {s: {c: float(np.mean(v)) for c, v in _by_corruption([r for r in rs if r["seed"] == s]).items()}
                for s in seeds}
    cells = []
    for c in cols:
      v = [per_seed[s][c] for s in seeds if c in per_seed[s]]
      cells.append(fmt_mean_std(v))
    avgs = [np.mean([per_seed[s][c] for c in cols]) for s in seeds if all(c in per_seed[s] for c in cols)]
    more = f" {extra[1][m]} |" if extra else ""
    lines.append(f"| {m} | " + " | ".join(cells) + f" | {fmt_mean_std(avgs)} |" + more)
  return "\n".join(lines) + "\n"


def _by_corruption(records: Sequence[dict]) -> dict[str, list[float]]:
  out: dict[str, list[float]] = {}
  for r in records:
    out.setdefault(r["corruption"], []).append(100.0 * r["accuracy"])
  return out


def fmt_mean_std(v: Sequence[float]) -> str:
  """Accuracies in [0, 100] -> "m" or "m ± s" (population std); "-" when empty."""
  if not v:
    return "-"
  return f"{np.mean(v):.1f}" if len(v) == 1 else f"{np.mean(v):.1f} ± {np.std(v):.1f}"


def versions() -> dict[str, str]:
  """The versions and devices a run ran with (results.json)."""
  import flax
  import jax
  import optax

  import pcsr_jax

  return dict(pcsr_jax=pcsr_jax.__version__, jax=jax.__version__, flax=flax.__version__, optax=optax.__version__,
              numpy=np.__version__, python=sys.version.split()[0], devices=str(jax.devices()))


def caption(records: Sequence[dict], cfg: Any) -> str:
  """What table.md's numbers are: accuracy in %, the stream (severity, setting), the seeds, the images."""
  images = sorted({r["num_samples"] for r in records})
  count = f"{images[0]:,}" if len(images) == 1 else f"{images[0]:,} to {images[-1]:,}"
  stream = ("CCC's walk, " if cfg.setting == "ccc" else "severities 1..5..1, " if cfg.setting == "gradual" else
            f"severity {cfg.severity}, " if any(r.get("severity") is not None for r in records) else "")
  seeds = sorted({r["seed"] for r in records})
  per = "domain (per segment)" if cfg.setting == "gradual" else "domain"
  over = (f"mean ± std over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else
          f"one seed ({seeds[0]}), no std" if seeds else "no seed")
  clock = ""
  if getattr(cfg, "realtime", None) is not None:
    from pcsr_jax import realtime

    clock = (f"; under --realtime {cfg.realtime} (the stream reveals {realtime.describe(cfg.realtime)}: a method "
             f"of relative cost C adapts on one batch in C, the cost table's C)")
  return (f"Online accuracy (%) of each method on each domain and their average ({stream}setting "
          f"{cfg.setting}), {over}; {count} image{'' if images == [1] else 's'} per {per}; {cfg.dataset}, "
          f"checkpoint {cfg.checkpoint}{clock}.\n\n")


_PREDICTIONS = re.compile(r"_.+_(\d+(\.\d+)?|None)_seed\d+\.npz$")  # `predictions_file`'s names after the method's


def predictions_file(out: str, method: str, domain: str, severity: float, seed: int) -> str:
  return os.path.join(out, "predictions", f"{method}_{domain}_{severity}_seed{seed}.npz")


def remove_outputs(out: str, log) -> None:
  """A fresh run owns its output folder's results: it removes those of an earlier run (results, table, plots and
  predictions files), so that none is taken for its own: a stale "complete" result, or the predictions of a
  method it does not run. Only files named as the harness names them go; the user's other files stay."""
  gone = [os.path.join(out, n) for n in ("results.json", "results.csv", "table.md") + plots.PLOTS]
  pred_dir = os.path.join(out, "predictions")
  if os.path.isdir(pred_dir):
    gone += [os.path.join(pred_dir, f) for f in sorted(os.listdir(pred_dir))
             if any(f.startswith(m) and _PREDICTIONS.fullmatch(f[len(m):]) for m in _registry())]
  gone = [p for p in gone if os.path.isfile(p)]
  for p in gone:
    os.remove(p)
  events.remove(out)
  if any(os.path.dirname(p) == pred_dir for p in gone):
    log(f"removed {sum(os.path.dirname(p) == pred_dir for p in gone)} predictions files of an earlier run from "
        f"{pred_dir}")


def _registry():
  from pcsr_jax import methods

  return methods.REGISTRY


def record_segment(setup: Any, records: list, unit: Any, seg, method_name: str, seed: int, eval_order: str,
                   resets: int, source_used: str = "none") -> list[dict]:
  """Appends the segment's per-domain accuracies to its unit's ``records`` (for mix_shifts: every corruption in
  the mix), and writes its predictions files with ``--save-predictions``; returns the new records.

  ``resets`` counts the method's in-step recoveries (SAR's EMA reset) since its state was last initialized.
  On an open-set dataset (VisDA-2021) ``accuracy`` counts every sample, as the papers do, and
  ``accuracy_known`` only those of a known class, the official metric.
  """
  from pcsr_jax.data.streams import split_domain

  cfg, out = setup.cfg, []
  for tag in ([seg.name] if seg.name != "mix" else setup.names):
    counts, preds = unit.take_domain(tag)
    if counts is None:
      continue
    correct, total, correct_known, known = counts
    corruption, severity = split_domain(tag, None if cfg.setting == "ccc" else cfg.severity)
    rec = dict(method=method_name, setting=cfg.setting, corruption=corruption, severity=severity, seed=seed,
               eval_order=eval_order, accuracy=correct / max(total, 1), num_samples=total,
               num_skipped=unit.skipped, seconds=unit.seconds, resets=resets, source_data=source_used)
    stem = corruption
    if tag != corruption:  # gradual: a corruption's severities, each met twice but 5: named by stream segment
      rec.update(domain=tag, segment=unit.segment)
      stem = f"{corruption}-segment{unit.segment}"
    if setup.spec.open_set:
      rec.update(accuracy_known=correct_known / max(known, 1), num_known=known)
    records.append(rec)
    out.append(rec)
    if cfg.save_predictions and distributed.is_main():
      fn, lab, pred = preds
      path = predictions_file(cfg.output, method_name, stem, severity, seed)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      np.savez(path, file_names=np.asarray(fn), labels=np.asarray(lab, np.int32),
               predictions=np.asarray(pred, np.int32))
  return out


def finish(setup: Any, log) -> dict:
  """The run's outputs once every unit is done (`write_outputs`), from the units this process ran and the saved
  records of those its Ray actors ran."""
  from pcsr_jax import progress as prog

  recs = [setup.finished.get(u.key) or setup.resume.load_unit(u.key) for u in setup.units]
  return write_outputs(setup, prog.merge([r for r in recs if r is not None]), log)


def run_costs(setup: Any) -> dict:
  """The run's costs per method (`cost`; ``setup.costs``, or those saved with the progress), with, under
  ``--realtime``, the batches each method adapted on of all its batches (every seed and domain), as its C
  schedules them (`realtime.adapted_batches` per domain)."""
  from pcsr_jax import realtime

  saved = getattr(setup, "costs", None) or cost.load(setup.resume.dir)
  out = {}
  for m in setup.cfg.methods:
    if m not in saved:
      continue
    c = dict(saved[m])
    if c.get("realtime_c"):
      n = [-(-len(seg.indices) // setup.cfg.batch_size) for s in setup.cfg.seeds for seg in setup.segments[s]]
      c.update(batches=sum(n), adapted_batches=sum(realtime.adapted_batches(k, c["realtime_c"]) for k in n))
    out[m] = c
  if "_reveal" in saved:
    out["_reveal"] = saved["_reveal"]
  return out


def write_outputs(setup: Any, progress: Any, log) -> dict:
  """A finished run's outputs from its units' merged progress (`progress.merge`): results.json, results.csv,
  table.md (with its caption) and the plots, by process 0; nothing claims completion unless every planned
  (method, seed, domain) record exists. Returns what `harness.run` returns."""
  import jax

  from pcsr_jax import methods

  cfg = setup.cfg
  costs = run_costs(setup)  # results.json's ``costs``; results.csv's rows carry their method's (`cost.with_costs`)
  records = progress.records
  have = {(r["method"], r["seed"], r.get("domain", r["corruption"])) for r in records}
  missing = [(m, s, d) for s in cfg.seeds for m in cfg.methods for d in setup.names if (m, s, d) not in have]
  if missing:
    m, s, d = missing[0]
    lost = sum(n.startswith(f"{d}/") for n in progress.skipped)
    raise UserError(f"no image of {d} was evaluated for {m} seed {s} ({lost} unreadable, "
                    f"{len(missing)} of {len(cfg.seeds) * len(cfg.methods) * len(setup.names)} planned results "
                    f"missing): nothing written")
  tbl = table(records, setup.columns(), cfg.methods)
  cost_tbl = cost.table(costs, cfg.methods)
  out = dict(complete=True, records=records, curves=progress.curves, skipped=progress.skipped, table=tbl,
             decode_images_per_s=setup.decode_ips, throughput=progress.throughput, costs=costs,
             cost_table=cost_tbl)
  if not distributed.is_main():  # one set of outputs: process 0's
    return out
  kernels = dict(platform=setup.platform, attention=setup.model.attention,
                 cpu_backward=setup.model.cpu_ops)  # what --attention auto and the platform chose
  extra = dict(versions=versions(), method_classes={m: methods.origin(m) for m in cfg.methods}, kernels=kernels,
               skipped=progress.skipped, decode_images_per_s=setup.decode_ips,
               throughput=progress.throughput, costs=costs, curves=progress.curves)
  if distributed.is_multiprocess():
    extra["processes"] = jax.process_count()
  if setup.ccc is not None:
    extra["ccc"] = setup.ccc
  write_json(os.path.join(cfg.output, "results.json"), records, setup.config_json, extra)
  write_csv(os.path.join(cfg.output, "results.csv"), cost.with_costs(records, costs))
  both = caption(records, cfg) + tbl + (f"\n{cost_tbl}" if cost_tbl else "")
  with open(os.path.join(cfg.output, "table.md"), "w") as f:
    f.write(both)
  events.write_results(cfg.output, records, setup.columns(), cfg.methods, both, costs)
  drawn = plots.plot(cfg.output, records, progress.curves, setup.columns(), cfg.methods, costs)
  setup.resume.clear()
  log(tbl)
  if cost_tbl:
    log(cost_tbl)
  if setup.spec.open_set:  # VisDA-2021: the papers count every sample; the official metric known classes only
    for m in cfg.methods:
      recs = [r for r in records if r["method"] == m]
      log(f"{m}: accuracy over all samples {100 * np.mean([r['accuracy'] for r in recs]):.2f}%, over "
          f"known-class samples {100 * np.mean([r['accuracy_known'] for r in recs]):.2f}%")
  if progress.skipped:
    log(f"skipped {len(progress.skipped)} unreadable images (listed in results.json)")
  log(f"wrote {cfg.output}/results.json, results.csv, table.md, {', '.join(os.path.basename(p) for p in drawn)}"
      f"; curves: tensorboard --logdir {events.root(cfg.output)}")
  return out
