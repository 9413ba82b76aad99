"""DePT-G (Gao et al., ICLR 2023, "Visual Prompt Tuning for Test-time Domain Adaptation"), made online.

Official code: ``yhygao/DePT`` (one commit, built on AdaContrast's): ``classifier.py`` (the prompted ViT,
`pcsr_jax.models.prompted`), ``model/dept_dino.py`` (DINO heads, teacher), ``losses.py``, ``source.py`` (the
source stage, `pcsr_jax.experiments.train_prompts`), ``target_dino.py`` (the test-time stage, offline) and
``script/tta/train_VISDA-C_target.sh``. The code is incomplete: ``main.py`` calls ``train_target_dino_online``,
which is defined nowhere, the ImageNet-C target path uses an undefined ``MyFolder``, and the only target script
is VisDA-C's (offline, 15 epochs over a bank of the whole target set). What this online form takes from it:

* Model: prompts + head + DINO heads trained on source (``prompts``: a folder written by
  ``python experiments/train_prompts.py``; the checkpoint's backbone stays as it is unless that folder was
  trained with ``--finetune-backbone``). The student and the teacher both start from the trained student
  (``load_from_checkpoint(same_student_teacher=True)``).
* Trainable (``tune_type='prompt'``, ``get_prompt_params(fix_ss_head=False)``): the prompts, the classifier
  head and the student's DINO heads; SGD Nesterov, momentum 0.9, lr 5e-3 for all (``get_target_optimizer``
  gives both groups the same lr), weight decay 1e-4; per-tensor gradient clipping at 1.0
  (``utils.clip_gradients``: each tensor's gradient times ``min(1, 1 / (||g|| + 1e-6))``) on the student ViT's
  tensors (prompts, head), not on the DINO heads, which lie outside ``model.student``. Each stage's prompts are
  their own tensor there (``classifier.py``'s ``prompt_list[i]``, an ``nn.ParameterList``), so the stacked
  ``prompts`` ``[S, P, D]`` here is clipped per stage: stage ``i``'s gradient by the norm over its ``[P, D]``.
* Per batch (``train_epoch``), views per sample: weak (``Resize((256, 256))`` -> ``RandomCrop(224)`` ->
  h-flip; at other input sizes the resize is ``round(S * 256 / 224)``) and two strong ones
  (``RandomResizedCrop(scale (0.2, 1))``, flip, colour jitter (0.4, 0.4, 0.4, 0.1) p 0.8, greyscale p 0.2,
  Gaussian blur sigma U(0.1, 2) p 0.5; `pcsr_jax.augment.dept_weak` / ``dept_strong``):
  1. the student on the weak view -> feature; pseudo-label = argmax of the mean stored probabilities of its
     ``num_neighbors`` (10) nearest bank entries by cosine distance (``soft_k_nearest_neighbors``);
  2. teacher EMA (momentum 0.99) from the student, then the teacher on strong view 1 and the student on strong
     view 2 (``DePTDino.forward``);
  3. loss = CE(student logits, pseudo-label) + 0.1 DINO-CLS + 0.1 hierarchical prompt consistency + 1.0
     diversity + 0.05 prompt diversity (VisDA's script). DINO-CLS: CE between the teacher's
     ``softmax((t - center) / 0.07)`` and the student's ``log_softmax(s / 0.1)`` on the last stage's DINO head
     of the feature; the center (zeros at start) moves by 0.9 towards the batch mean of ``t`` after the loss.
     Prompt consistency: per stage ``1 - cos`` between the student's and teacher's stage-head outputs of each
     prompt token, weighted by ``softmax((1..S) / tau)`` (``DINOLoss(layerwise_weight=True)``). Prompt
     diversity: minus the mean cosine distance between a sample's student prompt outputs (diagonal zeroed),
     same stage weights. Diversity: ``sum(p_mean * log(p_mean + 1e-8))`` of the batch-mean softmax;
  4. the SGD step; the teacher re-encodes the weak view, and its features and softmax probabilities replace
     the oldest bank entries (``update_labels``).

The online choices the code leaves open (each a field):

* ``queue_size`` 16,384 and ``warmup`` 1,024: the official bank is the whole target set, labelled by a pass
  before training (``queue_size=-1``). Online there is no such pass: the bank is a FIFO ring filled from the
  stream with the teacher's weak-view outputs, and until it holds ``warmup`` samples the pseudo-label is the
  student's weak-view argmax -- AdaContrast's online form (DT's ``first_X_samples``, `adacontrast`, whose
  ``ring_write`` and ``knn_probs`` this uses), the code family DePT is built on.
* ``steps`` 1: ``configs/learn/target.yaml`` names ``iters_per_batch: 4``, which nothing reads; the VisDA
  script makes 15 passes over the data. One step per batch is what every other online method here does and
  what a stream affords; more steps per batch redraw the views each time.
* Prediction: the student on the unaugmented test images after the batch's update (``eval_orders``
  ``("after",)``): the official evaluation is a forward of the student on the test transform after training
  (``eval_and_label_dataset(st_type='student')``), which online is the engine's "after".
* ``adapt_head`` and ``adapt_dino_heads`` True: the official target optimizer holds both.
* Loss weights (``beta`` 0.1, ``beta2`` 0.1, ``eta`` 1.0, ``lam`` 0.05): only VisDA-C's target script exists;
  its values are used for ImageNet-C unchanged.
* Learning rate: constant (the official cosine decay runs over a known number of epochs; a stream has none).
* Teacher temperature 0.07 from the first step (the target script: ``teacher_init_temp`` 0.07, no warm-up).

Other departures: the official student weak forward keeps its graph but never uses it (a pure cost here
dropped); the center is the mean over the batch (the official code divides by the batch size only under
DDP, which its scripts use); the strong crop resamples with PIL's antialiased bilinear filter (the official
uses bicubic) and the views use tensor colour ops and an exact Gaussian blur, as `adacontrast`'s; random
numbers are JAX's. Padded rows (``valid`` False) enter no loss, statistic, center or bank. Cost per step: student
weak + teacher strong + student strong (with backward) + teacher weak + the "after" forward = "5F+1B".

For tests and references: `DePTG.adapt` runs one iteration on given views (``draw_views`` draws them),
`DePTG.pseudo_labels` gives the weak view's labels, `dino_forward` one pass of the prompted model and its DINO
heads; the loss terms are module functions (`dino_cls_loss`, `new_center`, `prompt_consistency`,
`prompt_distances`, `prompt_diversity`, `clip_per_tensor`), which the source stage
(`pcsr_jax.experiments.train_prompts.source_loss`) shares. `save_prompts` / `load_prompts` write and read a
prompts folder; the param names are `pcsr_jax.models.prompted`'s (``prompts`` ``[S, P, D]``, ``dino_<s>``
with ``fc0`` .. and ``last_v``, the timm backbone's, ``head``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
import zlib
from typing import Any, Callable, ClassVar, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from pcsr_jax import augment, files
from pcsr_jax.errors import UserError
from pcsr_jax.methods.adacontrast import knn_probs, ring_write
from pcsr_jax.methods.base import AdaptState, Method, Prepared, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes
from pcsr_jax.models import prompted
from pcsr_jax.models.vit import VisionTransformer

Array = jax.Array
Params = Any

FORMAT = "pcsr-jax dept-g prompts v1"
RECORD = "record.json"
ARRAYS = "params.npz"
MAKE_THEM = ("train them first: python experiments/train_prompts.py --checkpoint CKPT --source-data SRC --out DIR, "
             "then pass --method-args '{\"dept-g\": {\"prompts\": \"DIR\"}}'")


# ---------------------------------------------------------------- the trained prompts on disk

def save_prompts(directory: str, params: Params, prompt: prompted.PromptConfig, record: dict) -> str:
  """Writes the source stage's student params (prompts, DINO heads, head; the backbone too after
  ``--finetune-backbone``) as ``params.npz`` and ``record.json`` (the prompt config, ``record`` and the npz's
  SHA-256); returns the npz's SHA-256. ``record`` must name ``checkpoint_sha256`` (`checkpoint.params_digest`
  of the checkpoint the prompts were trained from)."""
  os.makedirs(directory, exist_ok=True)
  flat = {"/".join(k): np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params).items()}
  path = os.path.join(directory, ARRAYS)
  with files.atomic_path(path) as tmp:
    np.savez(tmp, **flat)
  digest = files.sha256(path)
  files.write_json(os.path.join(directory, RECORD),
                   dict(record, format=FORMAT, prompt_config=prompt.to_dict(), params_npz_sha256=digest), indent=1)
  return digest



def read_record(directory: Optional[str]) -> dict:
  """The prompts folder's ``record.json``, checked (one-line `UserError` for a missing or foreign folder)."""
  if not directory:
    raise UserError(f"dept-g prompts: needs prompts and DINO heads trained on source data; {MAKE_THEM}")
  path = os.path.join(directory, RECORD)
  if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, ARRAYS)):
    raise UserError(f"dept-g prompts {directory}: no {RECORD} and {ARRAYS} there; {MAKE_THEM}")
  try:
    with open(path) as f:
      record = json.load(f)
    if record.get("format") != FORMAT:
      raise ValueError("format")
    prompt = prompted.PromptConfig(**record["prompt_config"])
  except (OSError, ValueError, TypeError, KeyError) as e:
    raise UserError(f"dept-g prompts {path}: not a record of train_prompts.py ({type(e).__name__}: {e})") from None
  record["prompt_config"] = prompt
  return record


def load_prompts(directory: Optional[str]) -> tuple[prompted.PromptConfig, Params, dict]:
  """``(prompt config, params, record)`` of a folder written by `save_prompts`, its npz read whole and checked
  (one-line `UserError`): a readable npz (a truncated one fails to open, damaged array bytes fail the zip's
  CRC-32 as they are read), float arrays, every value finite, and the SHA-256 that ``record.json`` records (last,
  so that a damaged file gets the more telling of the other messages). What the arrays must be for a given model
  is `DePTG.check_inputs`'s."""
  record = read_record(directory)
  path = os.path.join(directory, ARRAYS)
  try:
    with np.load(path, allow_pickle=False) as z:
      flat = {tuple(k.split("/")): np.asarray(z[k]) for k in z.files}
  except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as e:
    raise UserError(f"dept-g prompts {path}: not a readable npz, damaged or cut short ({type(e).__name__}: {e}); "
                    f"train them again") from None
  for k, v in flat.items():
    if not np.issubdtype(v.dtype, np.floating):
      raise UserError(f"dept-g prompts {path}: {'/'.join(k)} holds {v.dtype}, expected float32; train them again")
    if not np.isfinite(v).all():
      raise UserError(f"dept-g prompts {path}: {'/'.join(k)} holds {int(np.size(v) - np.isfinite(v).sum())} "
                      f"non-finite values, expected all finite; train them again")
  if files.sha256(path) != record.get("params_npz_sha256"):
    raise UserError(f"dept-g prompts {path}: its SHA-256 is not the one {RECORD} records (changed or damaged); "
                    f"train them again")
  return record["prompt_config"], traverse_util.unflatten_dict(flat), record


# ---------------------------------------------------------------- the losses (losses.py), shared with the source stage

def stage_weights(stages: int, tau: float = 1.0) -> np.ndarray:
  """``DINOLoss(layerwise_weight=True)``: softmax((1..S) / tau); 4 stages: .03/.09/.24/.64."""
  w = np.exp(np.arange(1, stages + 1) / tau)
  return (w / w.sum()).astype(np.float32)


def masked_mean(x: Array, w: Array) -> Array:
  """Mean of ``x`` ``[B, ...]`` over the rows where ``w`` (``[B]`` of 0/1) is 1 (and over the other axes)."""
  w = w.reshape(w.shape + (1,) * (x.ndim - 1))
  per_row = x.size // x.shape[0]
  return jnp.sum(x * w) / jnp.maximum(jnp.sum(w) * per_row, 1.0)


def dino_cls_loss(student: Array, teacher: Array, center: Array, teacher_temp: Array, student_temp: float,
                  w: Array) -> Array:
  """``DINOLoss`` 'cls' part: CE(softmax((t - center) / Tt), log_softmax(s / Ts)), mean over the valid rows."""
  t = jax.nn.softmax((jax.lax.stop_gradient(teacher) - center) / teacher_temp, axis=-1)
  return masked_mean(jnp.sum(-t * jax.nn.log_softmax(student / student_temp, axis=-1), axis=-1), w)


def new_center(center: Array, teacher: Array, w: Array, momentum: float) -> Array:
  """``DINOLoss.update_center`` (the DDP form: the batch mean of the valid rows)."""
  mean = jnp.sum(teacher * w[:, None], axis=0) / jnp.maximum(jnp.sum(w), 1.0)
  return center * momentum + jax.lax.stop_gradient(mean) * (1.0 - momentum)


def _unit(x: Array) -> Array:
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)  # F.normalize


def prompt_consistency(student: Array, teacher: Array, weights: np.ndarray, w: Array) -> Array:
  """Stage-weighted ``1 - cos`` between student and teacher prompt outputs ``[B, S, P, out]``, mean over the
  valid rows' prompts (``single_consistency(consistency='cos')`` per stage)."""
  cos = jnp.sum(_unit(student) * _unit(jax.lax.stop_gradient(teacher)), axis=-1)  # [B, S, P]
  return sum(weights[s] * masked_mean(1.0 - cos[:, s], w) for s in range(student.shape[1]))


def prompt_distances(prompt_out: Array) -> Array:
  """``cos_distance(prompt, prompt)`` with the diagonal zeroed, averaged over each sample's ``P x P`` pairs:
  ``[B, S, P, out]`` -> ``[B, S]``. Per row, so it is computed inside the row passes (`student_outputs`)."""
  u = _unit(prompt_out)
  dist = 1.0 - jnp.einsum("bspd,bsqd->bspq", u, u)
  p = prompt_out.shape[2]
  return jnp.mean(dist * (1.0 - jnp.eye(p)), axis=(2, 3))


def prompt_diversity(distances: Array, weights: np.ndarray, w: Array) -> Array:
  """Stage-weighted ``prompt_diversity_loss``: minus the mean of `prompt_distances` ``[B, S]`` over the valid
  rows (every row has the same ``P x P`` pairs, so this is the official mean over the batch's pairs)."""
  return sum(weights[s] * -masked_mean(distances[:, s], w) for s in range(distances.shape[1]))


def clip_per_tensor(grads: Params, clip: float, include: Callable[[tuple[str, ...]], bool],
                    stacked: Callable[[tuple[str, ...]], bool] = lambda path: False) -> Params:
  """``utils.clip_gradients``: each included tensor's gradient times ``min(1, clip / (||g|| + 1e-6))``.

  A param for which ``stacked(path)`` holds is a stack of tensors that the official code keeps apart (the
  ``prompts`` ``[S, P, D]``: ``prompt_list[i]``, one ``[1, P, D]`` tensor per stage): each slice along its first
  axis is clipped by its own norm, as the official loop over ``named_parameters()`` clips each stage's."""
  if not clip:
    return grads

  def one(path, g):
    path = tuple(k.key for k in path)
    if not include(path):
      return g
    axes = tuple(range(1, g.ndim)) if stacked(path) else None
    norm = jnp.sqrt(jnp.sum(jnp.square(g), axis=axes, keepdims=True))
    return g * jnp.minimum(clip / (norm + 1e-6), 1.0)

  return jax.tree_util.tree_map_with_path(one, grads)


def is_student_vit(path: tuple[str, ...]) -> bool:
  """The params of ``model.student`` (the prompted ViT), i.e. not the DINO heads."""
  return not path[0].startswith("dino_")


def is_prompts(path: tuple[str, ...]) -> bool:
  """The stacked ``[S, P, D]`` prompts (one official tensor per stage: `clip_per_tensor` clips them per stage)."""
  return path[0] == prompted.EXTRA


def student_outputs(prep: Prepared, params: Params, images: Array
                    ) -> tuple[Array, Array, Array, Array, Array]:
  """``(feature [B, D], logits, DINO-CLS [B, out], DINO prompt outputs [B, S, P, out], prompt distances [B, S])``
  of one forward (in row passes)."""
  return in_row_passes(prep, lambda x: dino_forward(prep.model, params, x), images)


def dino_forward(model: prompted.PromptedViT, params: Params, x: Array) -> tuple[Array, Array, Array, Array, Array]:
  """`student_outputs` of one pass: the prompted model, its DINO heads and the per-row prompt distances."""
  feature, logits, outs = model.apply({"params": params}, x, outputs=True)
  cls, prompt = model.apply({"params": params}, feature, outs, method="dino_outputs")
  prompt = prompt.swapaxes(0, 1)
  return feature, logits, cls, prompt, prompt_distances(prompt)


def feature_logits(prep: Prepared, params: Params, images: Array) -> tuple[Array, Array]:
  """``(feature, logits)`` of the prompted model (the token after the prompts, and the head on it)."""
  return in_row_passes(prep, lambda x: prep.model.apply({"params": params}, x, outputs=True)[:2], images)


# ---------------------------------------------------------------- the method

@flax.struct.dataclass
class DePTState:
  """The teacher (an EMA of the trainable params), the DINO center and the kNN bank (a ring)."""

  teacher: Any
  center: Array  # [out]
  bank_feats: Array  # [K, D] teacher weak-view features
  bank_probs: Array  # [K, C]
  bank_ptr: Array
  bank_filled: Array


@dataclasses.dataclass(frozen=True)
class DePTG(Method):
  name: ClassVar[str] = "dept-g"
  cost: ClassVar[str] = "5F+1B"
  default_eval_order: ClassVar[str] = "after"
  eval_orders: ClassVar[tuple[str, ...]] = ("after",)

  prompts: Optional[str] = field(None)  # the folder train_prompts.py wrote (required to run)
  lr: float = field(5e-3, "> 0")
  momentum: float = field(0.9, "[0, 1)")
  weight_decay: float = field(1e-4, ">= 0")
  nesterov: bool = True
  clip_grad: float = field(1.0, ">= 0")  # per tensor (prompts: per stage), student ViT only; 0: off
  ema: float = field(0.99, "[0, 1]")  # teacher momentum (model.m)
  teacher_temp: float = field(0.07, "> 0")
  student_temp: float = field(0.1, "> 0")
  center_momentum: float = field(0.9, "[0, 1]")
  tau: float = field(1.0, "> 0")  # stage weights softmax((1..S) / tau)
  queue_size: int = field(16384, ">= 1")  # the kNN bank (online choice; the official: the whole target set)
  num_neighbors: int = field(10, ">= 1")
  warmup: int = field(1024, ">= 0")  # bank entries before the kNN labels take over from the argmax (online)
  steps: int = field(1, ">= 1")  # iterations per batch (online choice; iters_per_batch 4 is read by nothing)
  alpha: float = field(1.0, ">= 0")  # CE to the pseudo-labels
  beta: float = field(0.1, ">= 0")  # DINO-CLS
  beta2: float = field(0.1, ">= 0")  # hierarchical prompt consistency
  eta: float = field(1.0, ">= 0")  # diversity
  lam: float = field(0.05, ">= 0")  # prompt diversity
  adapt_head: bool = True
  adapt_dino_heads: bool = True
  crop_scale: tuple[float, ...] = field((0.2, 1.0), "(0, 1]", size=2)  # strong views' RandomResizedCrop
  weak_resize: float = field(256 / 224, ">= 1")  # weak view: Resize(round(S * this)) then RandomCrop(S)
  mean: tuple[float, ...] = field((0.5, 0.5, 0.5), size=3)
  std: tuple[float, ...] = field((0.5, 0.5, 0.5), "> 0", size=3)

  def __post_init__(self):
    super().__post_init__()
    if self.crop_scale[0] > self.crop_scale[1]:
      raise UserError(f"dept-g crop_scale: expected (low, high) with low <= high, got {self.crop_scale}")

  def check_inputs(self, model: VisionTransformer, params: Params, batch_size: int) -> None:
    """Every check of the method's inputs, each a one-line `UserError` naming the folder or file and what was
    expected; the harness calls it before any work, `prepare` before it builds anything. ``queue_size`` at least
    ``batch_size``; the prompts folder train_prompts.py's, its npz complete, finite and the one its record hashes
    (`load_prompts`); the record's ``checkpoint_sha256`` this checkpoint's (`checkpoint.params_digest` of
    ``params``); its prompt config valid for ``model`` (stages dividing the depth); and every array of the npz
    present with the shape that ``model`` under that prompt config needs (the prompts ``[stages, prompts,
    embed_dim]``, the DINO heads, the head; any backbone param after ``--finetune-backbone`` the checkpoint's
    shape), no other key."""
    from pcsr_jax.checkpoint import params_digest

    if self.queue_size < batch_size:
      raise UserError(f"dept-g queue_size: expected at least the batch size ({batch_size}), got {self.queue_size}")
    prompt, trained, record = load_prompts(self.prompts)
    path = os.path.join(self.prompts, ARRAYS)
    if record.get("checkpoint_sha256") != params_digest(params):
      raise UserError(f"dept-g prompts {self.prompts}: trained from another checkpoint (its {RECORD}'s "
                      f"checkpoint_sha256 differs from this checkpoint's params); {MAKE_THEM}")
    prompt.check(model.config.depth, f"dept-g prompts {self.prompts}:")
    shapes = jax.eval_shape(lambda: prompted.init_extra(prompted.create(model, prompt), jax.random.key(0)))
    want = {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(dict(shapes, head=params["head"])).items()}
    backbone = {k: tuple(np.shape(v)) for k, v in traverse_util.flatten_dict(dict(params)).items()}
    config = (f"{prompt.stages} stages x {prompt.prompts} prompts of this model's {model.config.embed_dim} dims "
              f"({RECORD}'s prompt_config)")
    got = traverse_util.flatten_dict(trained)
    for k, shape in sorted(want.items(), key=lambda kv: kv[0][0] != prompted.EXTRA):  # the prompts first
      if k not in got:
        raise UserError(f"dept-g prompts {path}: no {'/'.join(k)}, expected one of shape {shape} for {config}")
      if tuple(got[k].shape) != shape:
        raise UserError(f"dept-g prompts {path}: {'/'.join(k)} has shape {tuple(got[k].shape)}, expected {shape} "
                        f"for {config}")
    for k, v in got.items():
      if k not in want and k not in backbone:
        raise UserError(f"dept-g prompts {path}: {'/'.join(k)} is no param of this model, expected only the "
                        f"prompts, DINO heads, head (and backbone params after --finetune-backbone)")
      if k not in want and tuple(v.shape) != backbone[k]:
        raise UserError(f"dept-g prompts {path}: {'/'.join(k)} has shape {tuple(v.shape)}, expected the "
                        f"checkpoint's {backbone[k]}")

  def is_trainable(self, path: tuple[str, ...]) -> bool:
    if path[0] == prompted.EXTRA:
      return True
    if path[0].startswith("dino_"):
      return self.adapt_dino_heads
    return self.adapt_head and path[0] == "head"

  def prepare(self, model, params, rng, batch_size):
    """The prompted model and the checkpoint's params with the prompts folder's arrays in place. Every check is
    `check_inputs`'s (one code path; it reads the folder, which is read once more here for the arrays: small,
    and the same checks of `load_prompts` run on that read)."""
    del rng
    self.check_inputs(model, params, batch_size)
    prompt, trained, _ = load_prompts(self.prompts)
    full = traverse_util.flatten_dict(dict(params))
    full.update({k: jnp.asarray(v) for k, v in traverse_util.flatten_dict(trained).items()})
    tx = optax.chain(optax.add_decayed_weights(self.weight_decay),  # torch SGD: g + wd * p, then momentum
                     optax.sgd(self.lr, momentum=self.momentum or None, nesterov=self.nesterov))
    return Prepared(prompted.create(model, prompt), traverse_util.unflatten_dict(full),
                    is_trainable=self.is_trainable, tx=tx)

  def init_extra(self, prep, trainable, opt_state):
    c, pc = prep.model.config, prep.model.prompt
    classes = len(prep.model.class_subset) if prep.model.class_subset is not None else c.num_classes
    return DePTState(teacher=jax.tree.map(jnp.copy, trainable), center=jnp.zeros((pc.dino_out,)),
                     bank_feats=jnp.zeros((self.queue_size, c.embed_dim)),
                     bank_probs=jnp.zeros((self.queue_size, classes)),
                     bank_ptr=jnp.zeros((), jnp.int32), bank_filled=jnp.zeros((), jnp.int32))

  def draw_views(self, key: Array, images: Array) -> tuple[Array, Array, Array]:
    """Normalised (weak, strong for the teacher, strong for the student) views of normalised images."""
    x01 = augment.denormalize(images, self.mean, self.std)
    kw, kt, ks = jax.random.split(key, 3)
    norm = lambda v: augment.normalize(v, self.mean, self.std)
    resize = round(images.shape[1] * self.weak_resize)
    return (norm(augment.dept_weak(kw, x01, resize)), norm(augment.dept_strong(kt, x01, self.crop_scale)),
            norm(augment.dept_strong(ks, x01, self.crop_scale)))

  def pseudo_labels(self, prep: Prepared, frozen: Any, state: AdaptState, weak: Array) -> tuple[Array, Array]:
    """``(labels [B], use_knn)``: the student's weak-view argmax until the bank holds ``warmup`` entries (and
    at least ``num_neighbors``), then the argmax of the mean bank probabilities of the nearest entries."""
    ex: DePTState = state.extra
    feats_w, logits_w = feature_logits(prep, merge(frozen, state.trainable), weak)
    use_knn = ex.bank_filled >= max(self.warmup, self.num_neighbors)
    refined = knn_probs(feats_w, ex.bank_feats, ex.bank_probs, ex.bank_filled, self.num_neighbors)
    return jnp.where(use_knn, jnp.argmax(refined, axis=1), jnp.argmax(logits_w, axis=1)), use_knn

  def adapt(self, prep: Prepared, frozen: Any, state: AdaptState, images: Array, valid: Array,
            views: tuple[Array, Array, Array]) -> tuple[AdaptState, Array, dict[str, Array]]:
    """One iteration on given normalised views ``(weak, strong_teacher, strong_student)`` (tests pass fixed ones)."""
    weak, strong_t, strong_s = views
    ex: DePTState = state.extra
    n = jnp.sum(valid.astype(jnp.int32))
    w = valid.astype(jnp.float32)
    weights = stage_weights(prep.model.prompt.stages, self.tau)

    labels, use_knn = self.pseudo_labels(prep, frozen, state, weak)

    teacher = jax.tree.map(lambda t, s: t * self.ema + s * (1.0 - self.ema), ex.teacher, state.trainable)
    _, _, t_cls, t_prompt, _ = student_outputs(prep, merge(frozen, teacher), strong_t)

    def loss_fn(trainable):
      _, logits, s_cls, s_prompt, s_dist = student_outputs(prep, merge(frozen, trainable), strong_s)
      log_p = jax.nn.log_softmax(logits, axis=1)
      loss_cls = masked_mean(-jnp.take_along_axis(log_p, labels[:, None], axis=1)[:, 0], w)
      loss_dino = dino_cls_loss(s_cls, t_cls, ex.center, self.teacher_temp, self.student_temp, w)
      loss_prompt = prompt_consistency(s_prompt, t_prompt, weights, w)
      p_mean = jnp.sum(jnp.exp(log_p) * w[:, None], axis=0) / jnp.maximum(jnp.sum(w), 1.0)
      loss_div = jnp.sum(p_mean * jnp.log(p_mean + 1e-8))
      loss_pdiv = prompt_diversity(s_dist, weights, w)
      loss = (self.alpha * loss_cls + self.beta * loss_dino + self.beta2 * loss_prompt + self.eta * loss_div
              + self.lam * loss_pdiv)
      return loss, (logits, loss_cls, loss_dino, loss_prompt, loss_div, loss_pdiv)

    (loss, (logits, *parts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable)
    grads = clip_per_tensor(grads, self.clip_grad, is_student_vit, is_prompts)
    state = self.apply_gradients(prep, state, grads)

    feats_b, logits_b = feature_logits(prep, merge(frozen, teacher), weak)
    bank_feats, bank_ptr = ring_write(ex.bank_feats, ex.bank_ptr, feats_b, valid)
    bank_probs, _ = ring_write(ex.bank_probs, ex.bank_ptr, jax.nn.softmax(logits_b), valid)
    extra = DePTState(teacher=teacher, center=new_center(ex.center, t_cls, w, self.center_momentum),
                      bank_feats=bank_feats, bank_probs=bank_probs, bank_ptr=bank_ptr,
                      bank_filled=jnp.minimum(ex.bank_filled + n, self.queue_size))
    metrics = dict(zip(("loss_cls", "loss_dino_cls", "loss_prompt", "loss_div", "loss_prompt_div"), parts),
                   loss=loss, knn=use_knn.astype(jnp.int32))
    return state.replace(step=state.step + 1, extra=extra), logits, metrics

  def update(self, prep, frozen, state, images, valid):
    for _ in range(self.steps):
      rng, key = jax.random.split(state.rng)
      state, logits, metrics = self.adapt(prep, frozen, state.replace(rng=rng), images, valid,
                                          self.draw_views(key, images))
    return state, logits, metrics
