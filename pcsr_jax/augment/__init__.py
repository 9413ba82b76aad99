"""Seeded, jit-able image augmentations of the baselines, on device.

All functions take a PRNG key and NHWC float32 images, have fixed output shapes and trace under
``jax.jit``. The pipelines work on unnormalised [0, 1] pixels as the official code does; a method that
receives normalised images goes ``denormalize -> augment -> normalize``. SPA's two views work on the
normalised input, as SPA does.

Library choice. dm-pix 0.4.5 and augmax 0.4.1 were compared. Neither reproduces torchvision: dm-pix
follows ``tf.image`` (additive brightness, per-channel contrast mean, saturation in HSV, zero-padded
blur, no equalize/autocontrast/posterize/resized crop) and needs chex; augmax uses its own invertible
colour curves (contrast through a tangent curve, grayscale as the channel mean) and was last released
in 2022. The ops here therefore follow torchvision/PIL directly on plain ``jax.numpy`` (``jnp.fft`` for
SPA); bilinear sampling gathers whole pixels, which compiled and ran faster here than
``jax.scipy.ndimage.map_coordinates`` (that interpolates the channel axis too).
"""

from pcsr_jax.augment.ops import denormalize, normalize
from pcsr_jax.augment.pipelines import (AUGMIX_OPS, COTTA, ROID, TTAAugConfig, adacontrast_strong,
                                        adacontrast_weak, augmix_views, augmix_views_of_keys,
                                        cotta_augment, dept_strong, dept_weak, roid_augment,
                                        tta_augment)
from pcsr_jax.augment.spa import spa_amplitude_mask, spa_patch_noise

__all__ = [
    "AUGMIX_OPS", "COTTA", "ROID", "TTAAugConfig", "adacontrast_strong", "adacontrast_weak",
    "augmix_views", "augmix_views_of_keys", "cotta_augment", "dept_strong", "dept_weak", "denormalize", "normalize",
    "roid_augment", "spa_amplitude_mask",
    "spa_patch_noise", "tta_augment",
]
