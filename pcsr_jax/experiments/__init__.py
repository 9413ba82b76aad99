"""The experiments: configs as code and the command-line jobs behind ``python experiments/<name>.py``.

* `imagenet_c` -- the main job (ImageNet-C tables; the built-in Fashion-MNIST-C benchmark without --data);
* `imagenet_rav`, `wild`, `ablations` -- Table 2, label/mixed shifts, Tables 3-5;
* `builtin` -- the built-in benchmark's frozen configuration; `tune_builtin` -- its held-out sweep;
* `train_source` -- trains the built-in source ViT; `visualize_domain_tokens` -- Fig. 3's t-SNE;
* `common` -- the flags and presets they share.
"""
