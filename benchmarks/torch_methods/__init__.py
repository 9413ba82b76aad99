"""PyTorch references of the baselines, one module per method (``benchmarks/torch_methods/<name>.py``).

Each module defines ``Reference(model, batch_size, **hyperparameters)`` with ``step(x_nchw) -> logits`` (the
prediction the method reports for that batch) and ``adapted_state() -> {timm name: numpy array}``, written from
the official code's semantics. `benchmarks.torch_reference.make_reference` finds them by name. A method with clean-source statistics
takes them from a ``source_batches`` argument: a list of NCHW tensors (or ``(images, labels)`` pairs when it needs
labels), the same images the JAX side's `Method.compute_source_stats` sees.

Four modules are no method, and define no ``Reference``: ``guided_unet.py`` is guided-diffusion's UNet, the
model DDA's reference runs and the one `pcsr_jax.models.unet` is checked against; the corruption stream's
references, written from the official code, are ``make_imagenet_c.py`` (Hendrycks' release: its crop, its
deterministic corruptions and its folder writer), ``imagenet_c_bar.py`` (ImageNet-C-bar's 10 corruptions, numpy)
and ``ccc_walk.py`` (CCC's walk search).
"""
