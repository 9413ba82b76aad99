"""t-SNE of the last layer's Domain tokens, coloured by corruption (the paper's Fig. 3).

    python experiments/visualize_domain_tokens.py                 # built-in Fashion-MNIST-C
    python experiments/visualize_domain_tokens.py --data /data/imagenet-c --checkpoint ckpt/vit_b16

PCSR adapts online over a continual stream -- the corruptions one after the
other, severity 5, never reset -- with the built-in benchmark's frozen
hyperparameters (or the paper's ViT-B rates with ``--data``). After each step
the Domain tokens of that batch are read from the last layer's DSN with the
updated params. The left panel shows the same images' tokens at step 0 (the
DSN's random init), for contrast: a good DSN should separate the domains
better after adaptation than a random projection does.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from pcsr_jax.errors import ArgumentParser, UserError


def last_domain_tokens(model, params, images):
  """[B, D] Domain tokens of the last PCSR layer."""
  import jax

  _, state = model.apply({"params": params}, images, mutable=["intermediates"])
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]:
    keys = [getattr(k, "key", None) for k in path]
    if "domain_token" in keys:
      layer = next((int(k.split("_")[-1]) for k in keys if isinstance(k, str) and k.startswith("recal_")), 0)
      found.append((layer, getattr(path[-1], "idx", 0), leaf))
  if not found:
    raise UserError("this PCSR config has no DSN (condition 'class' or 'mean'): no Domain tokens to plot")
  return max(found, key=lambda t: (t[0], t[1]))[2]


def collect(domains, model, params, preprocess, images_per_domain: int, batch_size: int, method_args: dict,
            workers=None):
  """Runs PCSR over the continual stream; returns (tokens at init, tokens online, domain index per row)."""
  import jax
  import numpy as np

  from pcsr_jax import engine, methods
  from pcsr_jax.data.loader import Loader

  method = methods.get("pcsr", **method_args)
  adapter = engine.Adapter(method, model, params, batch_size=batch_size, seed=0)
  adapted_model = adapter.prep.model
  tokens_fn = jax.jit(lambda p, x: last_domain_tokens(adapted_model, p, x))
  srcs = [s for _, s in domains]
  loader = Loader(srcs, preprocess, batch_size, workers=workers)
  state = adapter.init_state()
  init_params = jax.device_get(adapter.params(state))  # a host copy: the step donates the state
  before, after, tags = [], [], []
  for d, src in enumerate(srcs):
    n = min(images_per_domain, len(src))
    idx = np.random.default_rng(d).permutation(len(src))[:n]
    for batch in loader.batches(np.full(n, d), idx):
      before.append(np.asarray(tokens_fn(init_params, batch.images)))
      state, _, _ = adapter.step(state, batch.images)
      after.append(np.asarray(tokens_fn(adapter.params(state), batch.images)))
      tags.append(batch.tags)
  return np.concatenate(before), np.concatenate(after), np.concatenate(tags)


def separation(z, tags) -> float:
  """Silhouette score of the corruption labels in the 2-D embedding (higher: domains apart)."""
  from sklearn.metrics import silhouette_score

  return float(silhouette_score(z, tags))


def plot(before, after, tags, names, path: str, title: str) -> dict:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from sklearn.manifold import TSNE

  fig, axes = plt.subplots(1, 2, figsize=(15, 6.5))
  cmap = plt.get_cmap("tab20")
  scores = {}
  for ax, tokens, label in ((axes[0], before, "step 0 (random DSN)"), (axes[1], after, "online, after each update")):
    z = TSNE(n_components=2, init="pca", perplexity=30, random_state=0).fit_transform(tokens)
    scores[label] = separation(z, tags)
    for d, name in enumerate(names):
      m = tags == d
      ax.scatter(z[m, 0], z[m, 1], s=4, color=cmap(d % 20), label=name)
    ax.set_title(f"{label}: silhouette {scores[label]:.2f}")
    ax.set_xticks([])
    ax.set_yticks([])
  axes[1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), markerscale=4, fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return scores


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="visualize_domain_tokens.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--data", help="ImageNet-C root (default: the built-in Fashion-MNIST-C)")
  p.add_argument("--checkpoint", help="checkpoint dir (default with no --data: assets/fmnist_vit)")
  p.add_argument("--corruptions", default="all", help="'all' (the 15) or comma-separated names")
  p.add_argument("--severity", type=int, default=5)
  p.add_argument("--images", type=int, default=256, help="images per corruption")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--method-args", help="JSON of PCSR hyperparameters, e.g. '{\"lr_dsn\": 0.05}'")
  p.add_argument("--out", default="runs/domain_tokens.png", help="the PNG to write")
  p.add_argument("--cache-dir", help="built-in: where Fashion-MNIST-C is cached")
  p.add_argument("--fashion-mnist-dir", help="built-in: dir with the idx(.gz) files")
  a = p.parse_args(argv)
  if a.images < 2 or a.batch_size < 1:
    raise UserError("--images must be at least 2 and --batch-size positive")
  import json

  from pcsr_jax.experiments import builtin
  from pcsr_jax import checkpoint, harness
  from pcsr_jax.data import datasets

  t0 = time.time()
  builtin_mode = a.data is None
  spec = datasets.get("fmnist_c" if builtin_mode else "imagenet_c")
  names = (spec.corruptions if a.corruptions == "all"
           else tuple(c.strip() for c in a.corruptions.split(",") if c.strip()))
  if len(names) < 2:
    raise UserError("--corruptions: need at least 2 to compare domains")
  ckpt = a.checkpoint or (builtin.CHECKPOINT if builtin_mode else None)
  if ckpt is None:
    raise UserError("--checkpoint is required with --data")
  cfg = harness.RunConfig(data=a.data or "builtin", checkpoint=ckpt, output=os.path.dirname(a.out) or ".",
                          dataset=spec.name, corruptions=names,
                          severity=a.severity, images_per_corruption=a.images if builtin_mode else None,
                          fmnist_dir=a.fashion_mnist_dir, cache_dir=a.cache_dir)
  cfg.validate()
  model, params, meta = checkpoint.load(ckpt, kind="vit")
  domains = spec.open(cfg, print)
  method_args = dict(builtin.METHOD_ARGS["pcsr"]) if builtin_mode else {}
  try:
    method_args.update(json.loads(a.method_args) if a.method_args else {})
  except json.JSONDecodeError as e:
    raise UserError(f"--method-args: not valid JSON ({e.msg})") from None
  before, after, tags = collect(domains, model, params, spec.preprocess(meta), a.images, a.batch_size,
                                method_args)
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  scores = plot(before, after, tags, names, a.out,
                f"Last-layer Domain tokens, PCSR online over continual {spec.title} (severity {a.severity})")
  print(f"wrote {a.out}: {len(tags)} tokens, {len(names)} corruptions; silhouette of the corruption labels in the "
        f"t-SNE: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()) + f" ({time.time() - t0:.0f} s)")
  return 0

