"""Test-time data: ImageNet-C (folders or TFDS), ImageNet-R/-A, image lists; preprocessing; streams."""
