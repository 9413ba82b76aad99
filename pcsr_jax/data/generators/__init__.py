"""The corruption generators: ImageNet-C's corruptions on the host (`corruptions`, the release's code) and on the
accelerator (`corrupt_device`), ImageNet-C-bar's (`corruptions_bar`), ImageNet-C made in the stream from clean
images (`generated`), CCC's continuously changing walk (`ccc`), and the built-in benchmark's Fashion-MNIST-C
cache (`fmnist_c`)."""
