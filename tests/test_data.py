"""Data: preprocessing against a reference PIL transform, folder and list sources, the stream settings."""

from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

from pcsr_jax.data import imagenet, sources, streams, transforms
from pcsr_jax.errors import UserError


def reference_transform(img, size, crop_pct, mean, std, interp):
  """torchvision's Resize(int(size / crop_pct)) + CenterCrop(size) + ToTensor + Normalize, written out."""
  s = int(size / crop_pct)
  w, h = img.size
  if w <= h:
    ow, oh = s, int(s * h / w)
  else:
    ow, oh = int(s * w / h), s
  img = img.resize((ow, oh), interp) if (ow, oh) != (w, h) else img
  top, left = int(round((oh - size) / 2)), int(round((ow - size) / 2))
  x = np.asarray(img, np.float64)[top:top + size, left:left + size] / 255.0
  return ((x - np.asarray(mean)) / np.asarray(std)).astype(np.float32)


@pytest.mark.parametrize("wh", [(50, 40), (40, 57), (36, 36), (32, 32)])
@pytest.mark.parametrize("crop_pct,interp", [(0.875, "bicubic"), (1.0, "bilinear")])
def test_preprocess_matches_reference(wh, crop_pct, interp):
  img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8))
  meta = dict(img_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), interpolation=interp, crop_pct=crop_pct)
  out = transforms.Preprocess.from_meta(meta)(img)
  ref = reference_transform(img, 32, crop_pct, meta["mean"], meta["std"],
                            {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}[interp])
  assert out.shape == (32, 32, 3) and out.dtype == np.float32
  np.testing.assert_allclose(out, ref, atol=1e-6)


def test_imagenet_c_preprocess_is_a_plain_center_crop():
  img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 40, 3), dtype=np.uint8))
  meta = dict(img_size=32, mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bicubic", crop_pct=0.9)
  out = transforms.imagenet_c_preprocess(meta)(img)
  np.testing.assert_allclose(out, (np.asarray(img, np.float32)[4:36, 4:36] / 255.0 - 0.5) / 0.5, atol=1e-6)


def test_wnid_lists():
  w = imagenet.wnids()
  assert len(w) == 1000 and list(w) == sorted(w) and w[0] == "n01440764"
  for name in ("imagenet_r", "imagenet_a"):
    sub = imagenet.class_subset(name)
    assert len(sub) == 200 and (np.diff(sub) > 0).all()


def test_folder_source_labels_follow_imagenet_order(tmp_path):
  for wnid in ("n01443537", "n01440764"):
    os.makedirs(tmp_path / wnid)
    for k in range(2):
      Image.new("RGB", (8, 8)).save(tmp_path / wnid / f"{k}.JPEG")
  src = sources.FolderSource(str(tmp_path))
  assert src.imagenet_labels and src.labels.tolist() == [0, 0, 1, 1]  # sorted wnids: index in the 1000
  assert src.names[0] == os.path.join("n01440764", "0.JPEG")


def test_image_list_source(tmp_path):
  Image.new("RGB", (8, 8)).save(tmp_path / "a.jpg")
  (tmp_path / "list.txt").write_text("a.jpg 7\n\n")
  src = sources.ImageListSource(str(tmp_path), "list.txt")
  assert src.labels.tolist() == [7] and src.load(0).size == (8, 8)
  (tmp_path / "bad.txt").write_text("a.jpg seven\n")
  with pytest.raises(UserError, match=r"bad.txt:1: expected '<relative/path> <label>'"):
    sources.ImageListSource(str(tmp_path), "bad.txt")


SIZES, NAMES = [6, 4], ["gaussian_noise", "fog"]
LABELS = [np.repeat(np.arange(3), 2), np.repeat(np.arange(2), 2)]


def test_normal_and_bs1_streams():
  for setting in ("normal", "bs1"):
    segs = streams.build(setting, SIZES, LABELS, NAMES, seed=0)
    assert [s.name for s in segs] == NAMES and all(s.reset for s in segs)
    assert [sorted(s.indices.tolist()) for s in segs] == [list(range(6)), list(range(4))]
    assert [set(s.source_ids.tolist()) for s in segs] == [{0}, {1}]
  again = streams.build("normal", SIZES, LABELS, NAMES, seed=0)
  other = streams.build("normal", [60, 40], LABELS, NAMES, seed=1)
  assert np.array_equal(again[0].indices, streams.build("normal", SIZES, LABELS, NAMES, seed=0)[0].indices)
  assert not np.array_equal(other[0].indices, np.arange(60))  # shuffled
  plain = streams.build("normal", SIZES, LABELS, NAMES, seed=0, shuffle=False)
  assert plain[0].indices.tolist() == list(range(6))


def test_continual_stream_resets_only_at_start():
  segs = streams.build("continual", SIZES, LABELS, NAMES, seed=0)
  assert [s.reset for s in segs] == [True, False] and [len(s.indices) for s in segs] == SIZES


def test_mix_shifts_is_one_shuffled_stream():
  (seg,) = streams.build("mix_shifts", SIZES, LABELS, NAMES, seed=0)
  pairs = sorted(zip(seg.source_ids.tolist(), seg.indices.tolist()))
  assert pairs == [(0, i) for i in range(6)] + [(1, i) for i in range(4)]
  assert seg.source_ids.tolist() != sorted(seg.source_ids.tolist())


def test_label_shift_phases_are_class_blocks():
  labels = np.repeat(np.arange(5), 7)
  idx = streams.label_shift_indices(labels, np.random.default_rng(0), imbalance_ratio=500000, steps_per_class=20)
  assert len(idx) == 100
  phase_classes = labels[idx].reshape(5, 20)
  assert all(len(set(p)) == 1 for p in phase_classes)  # ir = 500000: effectively pure blocks
  assert sorted(phase_classes[:, 0].tolist()) == list(range(5))  # each class gets one phase
  mixed = streams.label_shift_indices(labels, np.random.default_rng(0), imbalance_ratio=1, steps_per_class=200)
  counts = np.bincount(labels[mixed].reshape(5, 200)[0], minlength=5)
  assert (counts > 0).all()  # ir = 1: uniform over classes within a phase


def test_label_shift_index_file(tmp_path):
  f = tmp_path / "idx.npy"
  np.save(f, np.array([3.0, 0.0, 2.0, 2.0]))  # SAR ships float64 index arrays
  segs = streams.build("label_shifts", SIZES, LABELS, NAMES, seed=0, index_file=str(f))
  assert [s.indices.tolist() for s in segs] == [[3, 0, 2, 2]] * 2 and not any(s.source_ids[0] != i for i, s in
                                                                             enumerate(segs))
  np.save(f, np.array([5.0]))
  with pytest.raises(UserError, match=r"indices must lie in \[0, 4\)"):
    streams.build("label_shifts", SIZES, LABELS, NAMES, seed=0, index_file=str(f))  # too big for fog's 4 images
  np.save(f, np.array([0.5]))
  with pytest.raises(UserError, match="integer-valued"):
    streams.load_index_file(str(f), 10)


def test_unknown_setting():
  with pytest.raises(UserError, match="unknown setting 'wild'"):
    streams.build("wild", SIZES, LABELS, NAMES, seed=0)


def test_visda_preprocess_is_square_resize_then_center_crop():
  meta = dict(img_size=32, mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bicubic", crop_pct=0.9)
  img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 80, 3), dtype=np.uint8))
  ref = img.resize((36, 36), Image.BILINEAR).crop((2, 2, 34, 34))  # Resize((256, 256)) -> CenterCrop(224) at 32 px
  expected = (np.asarray(ref, np.float32) / 255.0 - 0.5) / 0.5
  np.testing.assert_array_equal(transforms.visda_preprocess(meta)(img), expected)


def make_visda(root, rng, known=6, unknown=3):
  """VisDA-2021's release layout: the official list under val_filelists/, paths relative to the unpack folder,
  ImageNet-O images in wnid folders but labelled 1000."""
  lines = []
  for k in range(known + unknown):
    sub = "imagenet_c_and_r" if k < known else "imagenet_o"
    label = (k * 97) % 1000 if k < known else 1000
    d = root / "val_data" / sub / imagenet.wnids()[(k * 97) % 1000]
    d.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(d / f"{k}.jpg")
    lines.append(f"./val_data/{sub}/{d.name}/{k}.jpg {label}")
  (root / "val_filelists").mkdir()
  (root / "val_filelists" / "imagenet_c_r_o_filelist.txt").write_text("\n".join(lines) + "\n")


def test_visda_source_reads_the_official_list(tmp_path):
  make_visda(tmp_path, np.random.default_rng(0))
  src = sources.visda_source(str(tmp_path))
  assert len(src) == 9 and (src.labels == 1000).sum() == 3
  assert src.names[0] == os.path.join("val_data", "imagenet_c_and_r", imagenet.wnids()[0], "0.jpg")
  with pytest.raises(UserError, match="no VisDA-2021 list found"):
    sources.visda_source(str(tmp_path / "val_data"))
  (tmp_path / "other.txt").write_text("val_data/imagenet_o/x.jpg 1000\n")
  with pytest.raises(UserError, match="label 1000 outside 0..999"):  # a plain image list has no open set
    sources.ImageListSource(str(tmp_path), "other.txt")
