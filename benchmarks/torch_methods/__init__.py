"""PyTorch references of the baselines, one module per method (``benchmarks/torch_methods/<name>.py``).

Each module defines ``Reference(model, batch_size, **hyperparameters)`` with ``step(x_nchw) -> logits`` (the
prediction the method reports for that batch) and ``adapted_state() -> {timm name: numpy array}``, written from
the official code's semantics. `benchmarks.torch_reference.make_reference` finds them by name. A method with clean-source statistics
takes them from a ``source_batches`` argument: a list of NCHW tensors (or ``(images, labels)`` pairs when it needs
labels), the same images the JAX side's `Method.compute_source_stats` sees.

``guided_unet.py`` is no method: it is guided-diffusion's UNet, the model DDA's reference runs and the one
`pcsr_jax.models.unet` is checked against.
"""
