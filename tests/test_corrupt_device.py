"""The device corruptions: JPEG bit for bit with PIL, the deterministic ones against the host path, the random
ones in distribution, per-image keys, and one compile for every severity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.device_corruptions import host_corrupt, pil_jpeg, sample_images
from pcsr_jax.data.generators import corrupt_device as cd
from pcsr_jax.data.generators import corruptions, generated
from pcsr_jax.errors import UserError

SIZE = 48


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
  return sample_images(3, size=SIZE, seed=1)


def _device(x, name, severity, keys=None, quality=None, key=0):
  p = cd.params(name, corruptions.params(name, severity, "imagenet"), x.shape[1], x.shape[2])
  keys = np.arange(len(x)) if keys is None else keys
  return np.asarray(cd.corrupt(x, name, p, jax.random.key(key), keys, quality=quality))


def _host(x, name, severity):
  return np.stack([host_corrupt(im, name, severity, i) for i, im in enumerate(x)])


@pytest.mark.parametrize("quality", [85, 25])
def test_jpeg_equals_pil_round_trip(photos, quality):
  """Tolerance 0: libjpeg's integer pipeline, including odd sizes (partial MCUs, edge replication)."""
  odd = np.ascontiguousarray(photos[0, :37, :45])
  for x in (photos, odd[None]):
    got = np.asarray(cd.jpeg(x, quality))
    np.testing.assert_array_equal(got, np.stack([np.asarray(generated.jpeg_round_trip(im, quality)) for im in x]))


@pytest.mark.parametrize("name", ["contrast", "pixelate", "jpeg_compression"])
def test_exact_deterministic_corruptions(photos, name):
  """Bit for bit with the host, before and after the release's quality-85 save."""
  for severity in (1, 5):
    host = _host(photos, name, severity)
    np.testing.assert_array_equal(_device(photos, name, severity), host)
    np.testing.assert_array_equal(_device(photos, name, severity, quality=85),
                                  np.stack([pil_jpeg(im) for im in host]))


@pytest.mark.parametrize("name", ["brightness", "saturate", "defocus_blur", "gaussian_blur", "zoom_blur"])
def test_float_deterministic_corruptions_within_one_level(photos, name):
  """float32 on the device, float64 on the host: where the exact value is (nearly) an integer the release's
  truncation can land one level apart. At most one level, on at most 20% of the values (saturate's
  severity-3 row, whose arithmetic often lands on integers, is the worst measured: ~19% at 224 px)."""
  for severity in (2, 5):
    d = np.abs(_device(photos, name, severity).astype(int) - _host(photos, name, severity))
    assert d.max() <= 1, (name, severity, d.max())
    assert (d > 0).mean() <= 0.2, (name, severity, (d > 0).mean())


@pytest.mark.parametrize("name", ["gaussian_noise", "impulse_noise", "speckle_noise", "shot_noise"])
def test_random_corruptions_match_host_in_distribution(photos, name):
  """Different draws, same strength: mean squared change to the clean image within 10% of the host's."""
  x = np.repeat(photos, 2, axis=0)
  mse = lambda out: np.mean((out.astype(float) - x) ** 2)  # noqa: E731
  dev, host = mse(_device(x, name, 3)), mse(_host(x, name, 3))
  assert abs(dev - host) <= 0.1 * host, (dev, host)


@pytest.mark.parametrize("name", ["gaussian_noise", "fog", "frost", "elastic_transform"])
def test_image_keys_make_each_image_independent(photos, name):
  a, b, c = photos
  big = 2**62 + 3  # the high word matters too
  out = _device(np.stack([a, b]), name, 3, keys=np.array([7, big]))
  np.testing.assert_array_equal(out, _device(np.stack([a, b]), name, 3, keys=np.array([7, big])))
  alone = _device(np.stack([c, b]), name, 3, keys=np.array([5, big]))  # other batch-mate, same key
  np.testing.assert_array_equal(out[1], alone[1])
  assert not np.array_equal(out[1], _device(np.stack([a, b]), name, 3, keys=np.array([7, 3]))[1])
  assert not np.array_equal(out[1], _device(np.stack([a, b]), name, 3, keys=np.array([7, big]), key=1)[1])


def test_one_compile_for_every_severity(photos):
  """The table row is data: five severities (and a fractional row) reuse one program."""
  for name, extra in (("defocus_blur", (5.5, 0.3)), ("zoom_blur", np.arange(1, 1.18, 0.015))):
    outs = [_device(photos, name, 1)]
    before = cd._corrupt._cache_size()  # compiled now (here or by an earlier test)
    outs += [_device(photos, name, s) for s in range(2, 6)]
    p = cd.params(name, extra, SIZE, SIZE)
    cd.corrupt(photos, name, p, jax.random.key(0), np.arange(3), quality=None)
    assert cd._corrupt._cache_size() == before
    assert not np.array_equal(outs[0], outs[4])


def test_host_only_and_unknown_corruptions_are_user_errors():
  with pytest.raises(UserError, match="glass_blur.*host only"):
    cd.params("glass_blur", (0.7, 1, 2), SIZE, SIZE)
  with pytest.raises(UserError, match="unknown corruption 'fgsm'"):
    cd.check_corruption("fgsm")
  with pytest.raises(UserError, match="frost: images of 400x400"):
    cd.params("frost", (1, 0.4), 400, 400)


def _host_row(x, name, severity, row, strength="imagenet"):
  """The host path of table row ``row`` (`corruptions.corrupt`'s functions and seeding), unchecked: rows of
  severities `corruptions.params` refuses."""
  return np.stack([corruptions._corrupt_row(im, name, severity, row, 0, i, strength) for i, im in enumerate(x)])


def _device_row(x, name, row):
  p = cd.params(name, row, x.shape[1], x.shape[2])
  return np.asarray(cd.corrupt(x, name, p, jax.random.key(0), np.arange(len(x)), quality=None))


@pytest.mark.parametrize("severity", [1e-10, 1e-6, corruptions.MIN_FRACTIONAL_SEVERITY])
def test_shot_noise_at_huge_photon_counts_matches_the_host(photos, severity):
  """Severity s's row is 60 / s photons: 6e11 at 1e-10, where `jax.random.poisson`'s int32 counts wrapped and
  the images came out as noise (Source at 10% where the host gave 86%). Rates above `_POISSON_MAX` now draw the
  count's normal limit. Check as for the random corruptions at severity 3: the mean squared change to the clean
  image within 10% of the host's (here ~0.5 level**2 below 1e-6: the truncation of a noise far below a level;
  the device's before the fix: ~1e4)."""
  x = np.repeat(photos, 2, axis=0)
  row = 60 / severity
  mse = lambda out: np.mean((out.astype(float) - x) ** 2)  # noqa: E731
  dev, host = mse(_device_row(x, "shot_noise", row)), mse(_host_row(x, "shot_noise", severity, row))
  assert abs(dev - host) <= 0.1 * host, (dev, host)


def test_shot_noise_keeps_its_draws_below_the_normal_limit(photos, monkeypatch):
  """Rows whose rates all stay at or below `_POISSON_MAX` (every accepted severity: at most 60 / 0.01 = 6000
  photons at ImageNet strength, 50,000 at CIFAR's) draw `jax.random.poisson` as before the limit was added:
  the same pixels as the plain formula compiled the same way."""
  def plain(x, p, key):
    lam = p[0][0]
    return jnp.clip(jax.random.poisson(key, x / 255 * lam, x.shape).astype(jnp.float32) / lam, 0, 1) * 255

  x = np.concatenate([photos, 255 - photos])
  rows = (60, 6000, 5e4)
  now = [_device_row(x, "shot_noise", r) for r in rows]
  monkeypatch.setitem(cd._FUNCTIONS, "shot_noise", plain)
  cd._corrupt.clear_cache()
  try:
    for r, out in zip(rows, now):
      np.testing.assert_array_equal(out, _device_row(x, "shot_noise", r))
  finally:
    monkeypatch.undo()
    cd._corrupt.clear_cache()


def test_every_device_corruption_at_the_minimum_severity_is_within_its_published_distance(photos):
  """`corruptions.MIN_FRACTIONAL_SEVERITY`, the smallest accepted severity, against the module's published
  distances: contrast, pixelate and JPEG bit for bit (before and after the quality-85 save); brightness,
  saturate and the blurs at most 1 level before the JPEG, on at most 20% of the values except defocus_blur
  (below severity 1/3 its disk is one pixel, the host's DFT filtering leaves float64 rounding noise on the
  identity and ``np.uint8`` truncates ~42% of the values a level down, the device none: at most 50%); the
  gaussian, shot and speckle noises' mean squared change to the clean image within 10% of the host's (below
  ~1e-6 float32 could no longer hold gaussian and speckle noise's truncation flips). Impulse noise flips
  ~3e-4 of the values and fog, frost and elastic draw a few numbers per image, too few in 3 small crops to
  compare strengths (``benchmarks/device_small_severity.py`` does, on more images): for them both paths must
  change the image, by at most a quarter of what severity 1 changes it (a NaN or an overflowed draw would move
  it further than severity 1 does)."""
  s = corruptions.MIN_FRACTIONAL_SEVERITY
  for name in cd.DEVICE_CORRUPTIONS:
    # The noises on 6 crops (their strength is a mean over values), the others on 3: the other tests' shapes.
    x = np.repeat(photos, 2, axis=0) if name in ("gaussian_noise", "shot_noise", "speckle_noise") else photos
    mse = lambda out: np.mean((out.astype(float) - x) ** 2)  # noqa: E731
    dev, host = _device(x, name, s), _host(x, name, s)
    d = np.abs(dev.astype(int) - host)
    if name in ("contrast", "pixelate", "jpeg_compression"):
      assert d.max() == 0, name
      np.testing.assert_array_equal(_device(x, name, s, quality=85), np.stack([pil_jpeg(im) for im in host]))
    elif name in ("gaussian_noise", "shot_noise", "speckle_noise"):
      assert abs(mse(dev) - mse(host)) <= 0.1 * mse(host), (name, mse(dev), mse(host))
    elif name in cd.RANDOM:
      change = lambda out: np.abs(out.astype(int) - x).mean()  # noqa: E731
      for small, one in ((dev, _device(x, name, 1)), (host, _host(x, name, 1))):
        assert 0 < change(small) <= 0.25 * change(one), (name, change(small), change(one))
    else:
      assert d.max() <= 1 and (d > 0).mean() <= (0.5 if name == "defocus_blur" else 0.2), (name, (d > 0).mean())


def test_batch_corrupter_refuses_bad_severities_and_seeds_in_one_line():
  """The device path's entry point takes the flag's range: severity 0 too, since the device would apply row 0
  (e.g. 9999 photons) where the host's severity 0 is the clean image; a negative seed made numpy's SeedSequence
  raise a ValueError traceback."""
  low = corruptions.MIN_FRACTIONAL_SEVERITY
  for bad in (1e-10, 0, float("nan"), 6):
    with pytest.raises(UserError, match=rf"^--severity: expected a number in \[{low:g}, 5\], got {bad!r}$"):
      cd.BatchCorrupter("shot_noise", bad, 0, 224)
  for bad in (-1, 2**32):
    with pytest.raises(UserError, match=rf"^--corruption-seed: expected an integer from 0 to 4294967295, got {bad}$"):
      cd.BatchCorrupter("shot_noise", 3, bad, 224)
  corrupter = cd.BatchCorrupter("gaussian_noise", low, 2**32 - 1, 224)
  x = sample_images(2, size=224, seed=2)
  out = np.asarray(corrupter(x, np.array([1, 2])))
  assert out.shape == x.shape and np.abs(out.astype(int) - np.stack([pil_jpeg(im) for im in x])).mean() <= 2


def test_small_severity_benchmark_reports_each_path(capsys):
  """``python -m benchmarks.device_small_severity`` (the figures of the module docstring): the host's numpy
  Poisson failing at 1e-300, the device within the host's distribution at the minimum."""
  from benchmarks import device_small_severity

  low = corruptions.MIN_FRACTIONAL_SEVERITY
  assert device_small_severity.main(["--images", "4", "--strength", "cifar", "--corruptions",
                                     "shot_noise,contrast,motion_blur", "--severities", f"1e-300,{low}"]) == 0
  rows = {tuple(c.strip() for c in r.split("|")[1:3]): r.split("|")[-2].strip()
          for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r}
  assert rows[("shot_noise", "1e-300")] == "host fails"
  assert rows[("shot_noise", f"{low:g}")] == rows[("contrast", f"{low:g}")] == "ok"
  assert ("motion_blur", "1e-300") in rows
  with pytest.raises(UserError, match="--severities"):
    device_small_severity.main(["--severities", "0"])
