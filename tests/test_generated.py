"""ImageNet-C generated in the stream (data.generators.generated): the release's crop and JPEG step, and, for the
corruptions without randomness, the same pixels as a folder written the release's way and read by the harness's
folder path; per-image keys for the random ones."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from PIL import Image

from pcsr_jax.data import sources, transforms
from pcsr_jax.data.generators import generated
from pcsr_jax.errors import UserError

DETERMINISTIC = ("brightness", "contrast", "defocus_blur", "zoom_blur", "pixelate", "jpeg_compression")
META = dict(img_size=224, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), interpolation="bicubic")


def _photo(w: int, h: int, seed: int) -> Image.Image:
  """A smooth colour gradient with texture, ``w`` x ``h``: enough structure for blurs and JPEG to act on."""
  rng = np.random.default_rng(seed)
  yy, xx = np.mgrid[0:h, 0:w]
  img = np.stack([xx * 255 / w, yy * 255 / h, 128 + 100 * np.sin(xx / 9.0 + yy / 13.0)], -1)
  img = img + rng.normal(0, 12, img.shape)
  return Image.fromarray(np.uint8(np.clip(img, 0, 255)))


@pytest.fixture(scope="module")
def clean_root(tmp_path_factory):
  """``<wnid>/*.JPEG``: four JPEGs of odd sizes (landscape, portrait, short side near 256 and below it)."""
  root = tmp_path_factory.mktemp("val")
  sizes = {"n01440764": [(500, 375), (231, 240)], "n01443537": [(375, 500), (300, 256)]}
  for k, (wnid, shapes) in enumerate(sizes.items()):
    os.makedirs(root / wnid)
    for j, (w, h) in enumerate(shapes):
      _photo(w, h, 10 * k + j).save(root / wnid / f"ILSVRC2012_val_0000{k}{j}.JPEG", quality=90)
  return str(root)


@pytest.mark.torch
def test_release_crop_is_torchvisions_resize_and_center_crop():
  import torchvision.transforms as trn

  ref = trn.Compose([trn.Resize(256), trn.CenterCrop(224)])
  for w, h in ((500, 375), (375, 500), (256, 300), (231, 240), (257, 999), (256, 256)):
    img = _photo(w, h, w + h)
    got = generated.release_crop(img)
    assert got.shape == (224, 224, 3) and got.dtype == np.uint8
    assert np.array_equal(got, np.asarray(ref(img))), (w, h)
  grey = _photo(300, 260, 1).convert("L")  # the release's loader converts to RGB first
  assert np.array_equal(generated.release_crop(grey), np.asarray(ref(grey.convert("RGB"))))


def test_jpeg_round_trip_is_what_the_saved_file_reads_back(tmp_path):
  x = np.asarray(_photo(224, 224, 3), np.float64) * 0.9 + 10.7  # float, as the corruptions return it
  path = tmp_path / "x.JPEG"
  Image.fromarray(np.uint8(x)).save(path, quality=85, optimize=True)  # the release's save
  with Image.open(path) as f:
    want = np.asarray(f.convert("RGB"))
  got = generated.jpeg_round_trip(x)
  assert got.size == (224, 224) and np.array_equal(np.asarray(got.convert("RGB")), want)
  assert not np.array_equal(want, np.uint8(x))  # the JPEG step did change the pixels


@pytest.mark.torch
def test_stream_equals_the_release_folder_bit_for_bit(clean_root, tmp_path):
  """The deterministic corruptions: a folder written as the release did (torchvision + the release's code),
  read by the harness's ImageNet-C path, against `CorruptedSource`, through the same preprocessing."""
  from benchmarks.torch_methods.make_imagenet_c import write_release_folder

  to_uint8 = transforms.imagenet_c_preprocess(META).to_uint8
  clean = sources.FolderSource(clean_root)
  for severity in (3, 5):
    write_release_folder(clean_root, str(tmp_path), DETERMINISTIC, severity)
    for name in DETERMINISTIC:
      folder = sources.imagenet_c_source(str(tmp_path), name, severity)
      stream = generated.CorruptedSource(clean, name, severity)
      assert len(folder) == len(stream) == 4 and folder.names == stream.names
      assert np.array_equal(folder.labels, stream.labels)
      for i in range(len(folder)):
        want, got = to_uint8(folder.load(i)), to_uint8(stream.load(i))
        assert np.array_equal(got, want), (name, severity, folder.names[i], np.abs(got.astype(int) - want).max())


def test_random_corruptions_are_keyed_by_image_name(clean_root):
  clean = sources.FolderSource(clean_root)
  first = generated.CorruptedSource(clean, "gaussian_noise", 2.5, seed=0)
  in_order = [np.asarray(first.load(i)) for i in range(len(clean))]
  # Another process, the other order, one image alone: the same pixels.
  other = pickle.loads(pickle.dumps(generated.CorruptedSource(clean, "gaussian_noise", 2.5, seed=0)))
  assert all(np.array_equal(np.asarray(other.load(i)), in_order[i]) for i in reversed(range(len(clean))))
  assert np.array_equal(np.asarray(generated.CorruptedSource(clean, "gaussian_noise", 2.5).load(2)), in_order[2])
  # Other images, another seed or severity: other draws.
  crops = [generated.release_crop(clean.load(i)) for i in range(len(clean))]
  noise = [x.astype(int) - c for x, c in zip(in_order, crops)]
  assert not np.array_equal(noise[0][:200, :200], noise[1][:200, :200])
  for seed, severity in ((1, 2.5), (0, 2.75)):
    assert not np.array_equal(np.asarray(generated.CorruptedSource(clean, "gaussian_noise", severity,
                                                                   seed=seed).load(0)), in_order[0])
  # Pinned (a changed key changes every random image: bump generated.VERSION then); a folder's relative name
  # and TFDS's bare file name key alike.
  for name in ("n01440764/ILSVRC2012_val_00000293.JPEG", "n01440764\\ILSVRC2012_val_00000293.JPEG",
               "ILSVRC2012_val_00000293.JPEG"):
    assert generated.image_key(name) == 1209097615477148118, name
  assert 0 <= generated.image_key(clean.names[0]) < 2**63 != generated.image_key(clean.names[1])


def test_corrupted_source_is_a_source(clean_root):
  clean = sources.FolderSource(clean_root)
  src = generated.CorruptedSource(clean, "frost", 5, seed=3)
  assert (src.names, src.num_label_classes, src.imagenet_labels) == (clean.names, 1000, True)
  assert np.array_equal(src.labels, clean.labels) and len(src) == 4 and src.paths == clean.paths
  img = src.load(1)
  assert isinstance(img, Image.Image) and img.size == (224, 224) and img.format == "JPEG"
  with pytest.raises(UserError, match="unknown corruption 'rain'"):
    generated.CorruptedSource(clean, "rain", 3)
  with pytest.raises(UserError, match="severity 6: expected a number from 0 to 5"):
    generated.CorruptedSource(clean, "fog", 6)


def test_bad_seeds_and_too_small_severities_are_refused_by_the_sources(clean_root):
  """One line at construction, before any image: a negative seed made numpy's SeedSequence raise in every
  image's corruption, which the loader counted as unreadable images ("no image ... was evaluated (80
  unreadable)"); a severity below the minimum made noise (the device) or a ValueError (the host)."""
  clean = sources.FolderSource(clean_root)
  for kind in (generated.CorruptedSource, generated.CleanCrops):
    for bad in (-1, 2**32, 1.5):
      with pytest.raises(UserError, match=rf"^--corruption-seed: expected an integer from 0 to 4294967295, got "
                                          rf"{bad}$"):
        kind(clean, "gaussian_noise", 3, seed=bad)
    with pytest.raises(UserError, match=r"expected .*0\.01.* 5"):
      kind(clean, "shot_noise", 1e-10)
    assert kind(clean, "gaussian_noise", 3, seed=2**32 - 1).seed == 2**32 - 1
  with pytest.raises(UserError, match="^--corruption-seed"):  # ImageNet-C-bar's corruptions too
    generated.CorruptedSource(clean, "blue_noise_sample", 2, seed=-3)
